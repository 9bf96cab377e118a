"""``ddcl-vq study``: train every arm of a study config, evaluate, compare, report.

Modules: ``config`` (the study YAML, documented there, and every arm's training config), ``run`` (training, evaluating
and comparing the arms; interrupted studies resume), ``report`` (report.md), ``cli`` (the command and its options).
"""
