"""parallel_lab."""
