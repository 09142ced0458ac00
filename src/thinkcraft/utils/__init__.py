"""Side-effect helpers shared by every loop: atomic files, metrics, timing, progress, retries, plots."""
