"""Which plans a fake-tensor measurement can run, decided without importing torch.

``distributed/instruments/measure.py`` builds one rank of a plan at full size under fake tensors. Two things decide
whether that can run, both plain rules about the plan: the optimizer's layout must be one the runnable code
has (``adam-mixed`` in bf16 with ZeRO 0-2, ``fsdp2-mixed`` with ZeRO-3, or fp32 everything), and ``tp <=
kv_heads`` (key/value replication builds process groups from tensor values). Context parallelism and the
flash kernel can run: they cut their attention tiles from the token positions' values, and the batch a
measurement shards stays real.
They live here, apart from ``measure.py``, so that the app's Memory tab can refuse a plan at once in its
kernel without loading torch (``measure.check_measurable`` adds the runnable code's own checks, in the
child process that measures).
"""

from __future__ import annotations

from parallel_lab.errors import ParallelLabError
from parallel_lab.specs import ModelSpec, Plan

#: The compute dtypes a fake-tensor run can use.
MEASURABLE_DTYPES = ("fp32", "bf16")


def measurable_layout(model: ModelSpec, plan: Plan) -> str:
    """The dtype of the fake model's parameters (``"bf16"`` or ``"fp32"``), or a ParallelLabError naming
    the fix. Mixed precision is allowed with TP and PP, as in ``parallel-lab run``."""
    plan.validate(model)
    model.require_shape("a fake-tensor measurement")
    if plan.optimizer == "adam-mixed" and plan.dtype == "bf16" and plan.zero < 3:
        dtype = "bf16"
    elif plan.optimizer == "fsdp2-mixed" and plan.zero == 3 and plan.dtype in MEASURABLE_DTYPES:
        dtype = "fp32"
    elif plan.optimizer in ("adam-fp32", "sgd-momentum") and plan.dtype == "fp32":
        dtype = "fp32"
    else:
        raise ParallelLabError(
            f"optimizer={plan.optimizer!r} with dtype={plan.dtype!r} and zero={plan.zero} has no runnable layout "
            f"to measure; use --optimizer adam-mixed --dtype bf16 (zero 0-2), --optimizer fsdp2-mixed --zero 3, "
            f"or --optimizer adam-fp32 --dtype fp32")
    if plan.tp > model.kv_heads:
        raise ParallelLabError(f"tp={plan.tp} > kv_heads={model.kv_heads} replicates key/value heads over process "
                               f"groups built from tensors, which fake tensors cannot read; measure with tp <= "
                               f"{model.kv_heads}")
    return dtype
