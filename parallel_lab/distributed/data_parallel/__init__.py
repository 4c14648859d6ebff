"""Data parallelism (DDP): whole model per rank, gradients averaged by all-reduce (naive and bucketed)."""
