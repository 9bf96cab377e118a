"""Evaluators: reconstruction metrics, evaluate, compare, study, bench, and the ddcl-vq CLI."""
