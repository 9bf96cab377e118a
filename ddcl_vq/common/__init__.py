"""What every command shares: errors, typed settings and YAML, datasets, run directories and
checkpoints, the training skeleton, threads and progress, LPIPS weights, the machine a report ran on."""
