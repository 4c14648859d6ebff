"""parallel_lab: a teaching lab for multi-GPU LLM training.

Layer 1 (this package's top level) is pure Python and never imports torch: specifications
(:mod:`~parallel_lab.specs`), the memory ledger (:mod:`~parallel_lab.ledger`), communication per step
(:mod:`~parallel_lab.comm`) and FLOPs (:mod:`~parallel_lab.flops`). The runnable implementations live in
``parallel_lab.distributed`` (imports torch) and the plots and widgets in ``parallel_lab.viz``.

    >>> from parallel_lab import ModelSpec, Plan, memory
    >>> led = memory(ModelSpec.from_params(7e9), Plan(dp=8, zero=2))
    >>> round(led.state_bytes / 1e9, 2)
    26.25
"""

from .comm import Collective, CommReport, collectives, payload_bytes, per_step_bytes, report
from .flops import FlopsReport, mfu, step_flops
from .ledger import MemoryLedger, memory, state_bytes
from .ledger_activations import activation_bytes_per_layer
from .rank_view import inflight_microbatches
from .specs import (
    CLUSTER_PRESETS,
    MODEL_PRESETS,
    OPTIMIZERS,
    ClusterSpec,
    LinkTier,
    ModelSpec,
    ParallelLabError,
    Plan,
)

__version__ = "0.1.0"

__all__ = [
    "CLUSTER_PRESETS", "MODEL_PRESETS", "OPTIMIZERS", "ClusterSpec", "Collective", "CommReport",
    "FlopsReport",
    "LinkTier", "MemoryLedger", "ModelSpec", "ParallelLabError", "Plan", "activation_bytes_per_layer",
    "collectives", "inflight_microbatches", "memory", "mfu", "payload_bytes", "per_step_bytes", "report",
    "state_bytes", "step_flops",
]
