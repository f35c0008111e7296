"""Package data: per-GPU timing tables (gpus/<gpu>_timing.json, memlens.estimator.timing.tables)."""
