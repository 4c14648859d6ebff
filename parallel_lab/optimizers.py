"""Bytes of model state per parameter for each optimizer, and bytes per element of each compute dtype.

Pure Python. The ledger splits a parameter's state as the ZeRO paper does (Rajbhandari et al. 2020): the
compute copy (``param_bytes``), the gradient (``grad_bytes``) and everything the optimizer keeps
(``optim_bytes``: fp32 master copy, moments), 2 + 2 + 12 = 16 B for mixed-precision Adam. A
:class:`~parallel_lab.specs.Plan` names its optimizer and dtype from these tables.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OptimizerSpec:
    """Bytes of model state per parameter, split as the ledger reports them.

    ``param_bytes``: the copy used for compute; ``grad_bytes``: gradient buffers;
    ``optim_bytes``: everything the optimizer keeps (fp32 master copy, moments, ...).
    """

    name: str
    param_bytes: int
    grad_bytes: int
    optim_bytes: float
    doc: str

    @property
    def total(self) -> float:
        return self.param_bytes + self.grad_bytes + self.optim_bytes


#: name -> bytes per parameter as (param_bytes, grad_bytes, optim_bytes).
_STATE_BYTES: dict[str, tuple[int, int, float]] = {
    "adam-mixed": (2, 2, 12),
    "adam-mixed-fp32-grad": (2, 6, 12),
    "adam-fp32": (4, 4, 8),
    "sgd-momentum": (4, 4, 4),
    "adam-8bit": (2, 2, 6),
    "adafactor": (2, 2, 4),
    "fsdp2-mixed": (4, 4, 8),
}
#: name -> where its split comes from.
_SOURCES: dict[str, str] = {
    "adam-mixed": ("ZeRO paper (Rajbhandari et al. 2020): bf16 params 2 + bf16 grads 2 + fp32 master, "
        "momentum, variance 4+4+4 = 16 B/param"),
    "adam-mixed-fp32-grad": "as adam-mixed plus an fp32 gradient-accumulation buffer (bf16 2 + fp32 4): 20 B/param",
    "adam-fp32": "plain fp32 Adam: params 4 + grads 4 + momentum and variance 8 = 16 B",
    "sgd-momentum": "fp32 SGD with momentum: 4 + 4 + 4 = 12 B/param",
    "adam-8bit": ("bf16 params and grads, fp32 master 4, 8-bit momentum and variance 1+1 "
        "(Dettmers et al. 2022; block-wise quantisation constants ignored): 10 B/param"),
    "adafactor": ("bf16 params and grads, fp32 master 4, no momentum, factored second moment "
        "(rows + columns per matrix, negligible per parameter): 8 B/param"),
    "fsdp2-mixed": ("FSDP2 MixedPrecisionPolicy: fp32 sharded params 4 + fp32 grads 4 + Adam 8 = 16 B; "
        "bf16 copies are all-gathered per unit for compute (a communication buffer)"),
}
OPTIMIZERS: dict[str, OptimizerSpec] = {n: OptimizerSpec(n, *b, _SOURCES[n]) for n, b in _STATE_BYTES.items()}

DTYPE_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2}
