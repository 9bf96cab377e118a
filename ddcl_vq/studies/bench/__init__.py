"""``ddcl-vq bench``: quantizer speed and memory, side by side with the peers.

What is measured, per shape (N vectors of dimension D, K codes), all in one process so the ratios are side by side:

* one training step of the quantizer alone: forward on a leaf z (N, D) that requires grad, then backward of
  ``quantized`` (a fixed random upstream gradient) plus ``loss`` — for DDCL (``straight_through``, the default mode, and
  ``soft``, the full gradient; each through the ``reference``, ``fused`` and ``chunked`` paths), ``HardVQ``, ``EMAVQ``
  (in training mode, EMA update included) and vector-quantize-pytorch's ``VectorQuantize`` with its defaults;
* the matmul floor: the six bare matmuls the full DDCL gradient needs at these shapes (Z·Wᵀ and Q·W forward; G·Wᵀ, dd·W,
  ddᵀ·Z, Qᵀ·G backward), operands preallocated;
* with ``--e2e`` (default on): one training step (forward, backward, AdamW step) of the default VQ-VAE
  (configs/fashion_ddcl.yaml vs configs/fashion_hard.yaml), batch 128;
* unless ``--no-vqgan``: one VQGAN-recipe training step (configs/vqgan_photos64.yaml: L1 + LPIPS + hinge PatchGAN with
  the adaptive weight, generator and discriminator steps, past ``disc_start``) with DDCL vs configs/study_vqgan.yaml's
  HardVQ arm, 16 crops of 3x64x64, through the training loop's own ``training_step``.

Timing: wall clock, median of the timed repeats after warm-up; within a shape the implementations run round-robin (one
repeat of each, then the next repeat), so a neighbour's load spreads over all of them rather than biasing one.

Peak memory: the resident-set high-water mark (Linux VmHWM, reset before each probe: :class:`~.memory.RssProbe`) above a
baseline with inputs, parameters and upstream gradients allocated, so it counts every page the step touches, torch
tensors and library workspaces alike. ``--memory subprocess`` instead runs each probe in a fresh Python process and
reports the ``ru_maxrss`` growth (slower, independent of this process's heap); ``--memory none`` skips.

What does not fit is skipped, and said so: before running, each measurement's time and memory are estimated from a
calibration matmul and a per-implementation cost model; a measurement whose estimate exceeds ``--max-seconds`` (one run)
or the memory budget is listed as skipped with the reason, and repeats are cut to fit ``--budget-seconds``.

Modules: ``cost`` (the cost model and the plan: what runs, how often, what is skipped), ``memory`` (peak-memory probes),
``steps`` (the measured steps: per implementation, the matmul floor, the VQ-VAE step), ``vqgan`` (the VQGAN-recipe
step), ``run`` (measuring a plan, ratios), ``report``, ``cli``.
"""
