"""Evaluation: ``evaluate`` (one run on a dataset split -> RUN_DIR/eval.json), ``metrics``
(MSE, PSNR, SSIM, LPIPS, codebook geometry) and ``compare`` (several runs -> one table and plots)."""
