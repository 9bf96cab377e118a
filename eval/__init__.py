"""The toolkit's jobs beyond training, one subpackage each, and the ``ddcl-vq`` command.

    evaluate     evaluate a run on a dataset split -> RUN_DIR/eval.json
    metrics      reconstruction metrics (MSE, PSNR, SSIM, LPIPS) and codebook geometry
    compare      several runs -> one table and plots
    gap          where a run's error comes from
    study        train, evaluate and compare every arm of a study config
    bench        quantizer speed and memory: cost model, probes, measured steps, the command
    readout      the DDCL readout study (its model is ``ddcl_vq.models.PatchTransformer``)
    cli          the ``ddcl-vq`` dispatcher (also ``python -m ddcl_vq.eval COMMAND``)
    machine      what machine a report was measured on

Installed as ``ddcl_vq.eval``; it may import ddcl_vq, ddcl_vq.models and ddcl_vq.train.
"""
