"""``ddcl-vq bench``: quantizer speed and memory, side by side with the peers. Modules: ``steps`` (the cost model,
the plan, the measured steps), ``run`` (memory probes, measuring a plan, ratios), ``cli`` (the command)."""
