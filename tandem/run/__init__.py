"""What every trainer's run shares: the output directory and its lock, metric trackers, checkpoints
with exact resume, and the epoch sampler."""
