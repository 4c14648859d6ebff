"""parallel_lab: a teaching lab for multi-GPU LLM training.

Layer 1 (this package's top level) is pure Python and never imports torch: specifications
(:mod:`~parallel_lab.specs`, :mod:`~parallel_lab.hardware`), what each rank holds (:mod:`~parallel_lab.sharding`)
on the process grid (:mod:`~parallel_lab.mesh`), the memory ledger (:mod:`~parallel_lab.ledger`), communication
per step (:mod:`~parallel_lab.comm`) and FLOPs (:mod:`~parallel_lab.flops`). The runnable implementations live
in ``parallel_lab.distributed`` (imports torch) and the plots and widgets in ``parallel_lab.viz``. Every name
is imported from its own module:

    >>> from parallel_lab.ledger import memory
    >>> from parallel_lab.specs import ModelSpec, Plan
    >>> led = memory(ModelSpec.from_params(7e9), Plan(dp=8, zero=2))
    >>> round(led.state_bytes / 1e9, 2)
    26.25
"""

__version__ = "0.1.0"
