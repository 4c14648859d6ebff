"""Context parallelism: ring (``ring_attention.py``), all-gather and Ulysses attention over a sequence split
across ranks, the blockwise (online-softmax) kernel they compute with, and the zigzag/document load balance."""
