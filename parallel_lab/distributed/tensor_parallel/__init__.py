"""Tensor parallelism (Megatron): column/row-parallel linears with f and g, sequence parallelism, the
vocab-parallel embedding and loss."""
