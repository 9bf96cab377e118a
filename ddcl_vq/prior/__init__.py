"""Close the generative loop: a prior over a tokenizer's codes, its samples, and what it costs.

``ddcl-vq prior train`` fits an autoregressive transformer (:class:`ddcl_vq.models.prior.CodePrior`)
to the token files ``ddcl-vq tokenize`` writes; ``sample`` draws code maps and decodes them with the
tokenizer's decoder; ``evaluate`` reports test NLL (bits/token, bits/image) and an offline sample-quality
figure (Fréchet distance in a small classifier's features — not Inception FID — and class accuracy);
``study`` puts several tokenizers through the same prior budget (configs/study_prior.yaml). The prior's
config and training loop are ``ddcl_vq.prior.config`` and ``ddcl_vq.prior.train``.
"""
