"""Tensor parallelism (Megatron): column/row-parallel linears with f and g, sequence parallelism, the
vocab-parallel embedding and loss; ``tp_model.py`` applies them to the model."""
