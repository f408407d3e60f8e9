"""Running one model across several processes (tensor parallelism)."""
