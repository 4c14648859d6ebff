"""The ledger's ``comm_buffers``: the transient communication buffers a rank holds at their peak.

Model-state part (:func:`state_buffer_parts`, Rajbhandari et al. 2020, "ZeRO"; FSDP's units): ZeRO-1/2
the largest unit's flat gradient ``g ceil(n/g)`` and its gathered parameters in the step; ZeRO-3 the
gathered root unit and two block units (prefetch) plus the largest unit's gradient before its
reduce-scatter, or under a pipeline the whole stage gathered with its full gradients held. Activation
part (:func:`activation_buffer_parts`): SP's full-sequence ``s b h`` tensor (Korthikanti et al. 2022),
the P2P messages a pipeline list posts at once, the CP kind's K/V blocks (ring, all-gather, Ulysses)
and EP's all-to-all slots. Each part is checked against ``tracer.buffers`` of the runnable code
(``distributed/instruments/memory.py``). The sizes come from the rank's view (``rank_view``).
"""

from __future__ import annotations

from .comm import ep_dispatch_bytes
from .rank_view import rank_view
from .sharding import kv_replication, padded
from .specs import ModelSpec, Plan


def zero3_gathered_bytes(model: ModelSpec, plan: Plan, stage: int = 0) -> int:
    """Peak bytes of gathered (unsharded) parameters of ZeRO-3 on one rank of ``stage``.

    Per block units: the root unit (gathered when forward starts, kept until its gradient is complete)
    plus the two largest block units (the one computing and the next one, prefetched); with
    ``zero_unit="root"``: the whole padded model. Units padded to ``g * ceil(n / g)`` elements, in the
    gathered dtype (``sharding.param_comm_bytes``). 0 without ZeRO-3. ``distributed/zero/zero.py`` measures this peak.
    """
    view = rank_view(model, plan, stage)
    g = view.group
    if plan.zero != 3 or g == 1:
        return 0
    units = {u: padded(n, g) for u, n in view.units.items()}
    if plan.pp > 1:                          # under a pipeline the whole stage stays gathered through the step
        return sum(units.values()) * view.param_comm_bytes
    blocks = sorted((n for u, n in units.items() if u != "root"), reverse=True)
    return (units.get("root", 0) + sum(blocks[:2])) * view.param_comm_bytes


def zero3_held_gradient_bytes(model: ModelSpec, plan: Plan, stage: int = 0) -> int:
    """Bytes of full (unsharded) gradients that ZeRO-3 under a pipeline holds on one rank of ``stage``.

    With ``pp > 1`` the stage's units stay gathered through the step and each unit's flat gradient is
    summed over the micro-batches in the reduce dtype until the reduce-scatter at the end of the step:
    the whole stage, padded, ``sum_u g ceil(n_u / g) * d_reduce``, plus (when the compute dtype differs)
    one unit's compute-dtype gradient being added in, ``max_u g ceil(n_u / g) * d_param``. This is what
    FSDP2 does under ``torch.distributed.pipelining``: without gradient sync until the last backward it
    accumulates the unsharded gradients in ``reduce_dtype`` (fp32); Meta's Llama 3 run too ("gradients
    accumulated in FP32"). 0 without ZeRO-3 or a pipeline (then one unit's gradient at a time is in
    flight: :func:`zero3_reduce_input_bytes`). ``distributed/zero/fsdp.py`` measures this peak
    (``info["peak_held_gradient_bytes"]``).
    """
    view = rank_view(model, plan, stage)
    g = view.group
    if plan.zero != 3 or g == 1 or plan.pp == 1:
        return 0
    units = [padded(n, g) for n in view.units.values()]
    pb, gb = view.param_comm_bytes, view.grad_comm_bytes
    return sum(units) * gb + (max(units) * pb if pb != gb else 0)


def zero3_reduce_input_bytes(model: ModelSpec, plan: Plan, stage: int = 0) -> int:
    """Bytes of one unit's full gradient on its way to the reduce-scatter (ZeRO-3 without a pipeline).

    When a unit's flat gradient is complete it is cast to the reduce dtype (fp32, ``grad_comm_bytes``):
    for a moment the gathered-dtype gradient and its fp32 copy both exist, ``g ceil(n / g) (d_param +
    d_reduce)`` for the largest unit (one copy when the dtypes agree: fp32 training casts nothing). The
    previous unit's reduce-scatter completes before the next cast (one in flight). 0 without ZeRO-3, or
    under a pipeline (:func:`zero3_held_gradient_bytes`). ``distributed/zero/fsdp.py`` measures this peak
    (``info["peak_reduce_input_bytes"]``).
    """
    view = rank_view(model, plan, stage)
    if plan.zero != 3 or view.group == 1 or plan.pp > 1:
        return 0
    big = view.largest_padded
    pb, gb = view.param_comm_bytes, view.grad_comm_bytes
    return big * (pb + gb if pb != gb else gb)


def comm_buffer_bytes(model: ModelSpec, plan: Plan, stage: int = 0) -> tuple[float | None, list[str]]:
    """Transient communication buffers at the peak, with one note per part: the model-state part
    (:func:`state_buffer_bytes`) plus the activation part (:func:`activation_buffer_bytes`), the sum of
    :func:`comm_buffer_parts`.

    Returns ``(None, notes)`` when the buffers cannot be computed (ZeRO on a bare parameter count).
    """
    state, notes = state_buffer_bytes(model, plan, stage)
    if state is None:
        return None, notes
    return state + (activation_buffer_bytes(model, plan, stage) if model.shape_known else 0.0), notes


def comm_buffer_parts(model: ModelSpec, plan: Plan, stage: int = 0) -> dict[str, float] | None:
    """:func:`comm_buffer_bytes` by part, each at its own peak (the parts the runnable code samples in
    ``tracer.buffers``, ``distributed/instruments/memory.py``; zero parts left out): ``zero_reduce``,
    ``zero_gather``, ``zero3_gathered``, ``zero3_reduce_input``, ``zero3_held_gradients``, ``sp``, ``pp``,
    ``cp``. None where :func:`state_buffer_bytes` is."""
    state, _ = state_buffer_parts(model, plan, stage)
    if state is None:
        return None
    parts = {**state, **(activation_buffer_parts(model, plan, stage) if model.shape_known else {})}
    return {k: v for k, v in parts.items() if v}


def state_buffer_bytes(model: ModelSpec, plan: Plan, stage: int = 0) -> tuple[float | None, list[str]]:
    """The data-parallel buffers of ``stage`` at the peak (they depend on its parameters only), the sum of
    :func:`state_buffer_parts`, with one note per part."""
    parts, notes = state_buffer_parts(model, plan, stage)
    return (None if parts is None else float(sum(parts.values()))), notes


def state_buffer_parts(model: ModelSpec, plan: Plan, stage: int = 0) -> tuple[dict[str, float] | None, list[str]]:
    """The data-parallel buffers of ``stage`` by part, each at its own peak (``S = ceil(n / g)`` elements of
    the largest unit, ``g S`` padded):

    * DDP: none. The bucketed gradients are views into the buckets (torch's ``gradient_as_bucket_view=True``,
      also while accumulating), the naive all-reduce works in place on ``.grad``;
    * ZeRO-1/2, ``zero_reduce``: the largest unit's padded flat gradient ``g S`` (the reduce input) and,
      where the output is a temporary, its shard ``S`` (ZeRO-1's reduce-scatter, whose output is written
      into the full ``.grad``; ZeRO-2 reducing every micro-batch, whose output is added to the shard;
      counted also at ``m = 1``, where it is the shard itself); ``zero_gather``: the step's all-gather of the
      updated unit, its padded output ``g S`` and its input shard ``S`` in the parameter dtype;
    * ZeRO-3: the gathered root unit (kept from the start of forward to the end of backward), plus two
      gathered block units (the one in use and the prefetched next one), plus the largest unit's full
      gradient awaiting its reduce-scatter (:func:`zero3_reduce_input_bytes`); under a pipeline the whole
      stage gathered and its full gradients held (:func:`zero3_held_gradient_bytes`).
    """
    notes: list[str] = []
    parts: dict[str, float] = {}
    view = rank_view(model, plan, stage)
    g = view.group
    gb, pb = view.grad_comm_bytes, view.param_comm_bytes
    if g > 1 and plan.zero == 0 and plan.dp_kind == "bucketed":
        notes.append("comm_buffers: none for DDP's buckets: the gradients are views into them "
                     "(torch's default, gradient_as_bucket_view=False, would keep a second copy)")
    if g > 1 and plan.zero:
        if not model.shape_known:
            notes.append(f"comm_buffers: not computed; a bare parameter count gives no ZeRO-{plan.zero} unit sizes "
                         "(give the shape)")
            if plan.zero == 3 and plan.zero_unit == "block":
                notes.append("ZeRO-3 on a bare count: taken as many small units (one per block, the rest "
                             "negligible), each gathered before its forward and again before its backward "
                             "(comm: 1.5x DDP) and none held gathered (parameters: fully sharded)")
            return None, notes
        big = view.largest_padded
        if plan.zero in (1, 2):
            temp_out = ((plan.zero == 1 and plan.zero1_reduce == "reduce_scatter")
                        or (plan.zero == 2 and plan.zero2_accumulate == "sharded"))
            parts["zero_reduce"] = float(big * gb + (big // g * gb if temp_out else 0))
            parts["zero_gather"] = float((big + big // g) * pb)
            notes.append("comm_buffers: the largest unit's flat gradient" + (" and its reduced shard" if temp_out
                         else "") + "; its gathered parameters and their shard in the step")
        elif plan.pp > 1:
            parts["zero3_gathered"] = float(zero3_gathered_bytes(model, plan, stage))
            parts["zero3_held_gradients"] = float(zero3_held_gradient_bytes(model, plan, stage))
            notes.append("comm_buffers: ZeRO-3 under a pipeline keeps the stage's units gathered through the "
                         "step and their full gradients accumulating until the reduce_scatter at its end "
                         "(FSDP's reshard_after_forward=False with gradient sync on the last backward)")
        else:
            parts["zero3_gathered"] = float(zero3_gathered_bytes(model, plan, stage))
            parts["zero3_reduce_input"] = float(zero3_reduce_input_bytes(model, plan, stage))
            if plan.zero_unit == "root":
                notes.append("comm_buffers: ZeRO-3 with a single root unit gathers the whole model at once "
                             "(no peak saving) + its full gradient before the reduce_scatter")
            else:
                notes.append("comm_buffers: ZeRO-3 gathered root unit + 2 gathered blocks (prefetch) + the "
                             "largest unit's full gradient (and its fp32 copy) before its reduce_scatter")
    return parts, notes


def pp_message_bytes(model: ModelSpec, plan: Plan) -> float:
    """One pipeline message: a micro-batch's activation at a stage boundary, ``s b h`` (``s = seq / cp``),
    split by tp with SP."""
    return plan.seq / plan.cp * plan.micro_batch * model.hidden * plan.dtype_bytes / (plan.tp if plan.sp else 1)


def activation_buffer_bytes(model: ModelSpec, plan: Plan, stage: int = 0) -> float:
    """The activation-sized buffers in flight on ``stage`` (all but ``pp`` the same on every stage), the sum of
    :func:`activation_buffer_parts`."""
    return float(sum(activation_buffer_parts(model, plan, stage).values()))


def activation_buffer_parts(model: ModelSpec, plan: Plan, stage: int = 0) -> dict[str, float]:
    """The activation-sized buffers by part, each at its own peak (``s = seq / cp`` local tokens):

    * ``sp``: one full-sequence ``s b h`` tensor (the all-gather's output, the reduce-scatter's input; the
      activation formula stores only the sharded copy); with ``b > 1`` two, since the batch-first layout
      reorders the rank-major gathered shards into a copy (``tp_communications``);
    * ``pp``: the activations (``s b h``, split by tp with SP) that one P2P action of the stage's list
      posts together at most, ``schedules.messages_at_once``: 1F1B's steady state a send and a receive,
      GPipe's last stage one receive, interleaved 1F1B and DualPipeV up to four;
    * ``cp``: all-gather: backward's reduce-scatter of dK and dV, its input (every rank's blocks, ``seq``
      tokens: the gathered K and V forward are saved for backward, activations) and its output (this rank's
      block), ``2 b kv (seq + s) d``; ring: backward's step, where the K, V block being computed on, the
      next one arriving, the dK, dV block sent on (cast to the compute dtype) and the one arriving are
      alive together, four ``2 s b kv d`` blocks (three with cp = 2: no next block at the last step; the
      fp32 accumulators of dK, dV are working memory, as all-gather's; the forward holds at most two);
      Ulysses: the first all-to-all's input and output, Q, K and V of the local tokens (key/value heads
      repeated :func:`sharding.kv_replication` times), ``2 s b (q + 2 kv f) d`` (backward's last one is as
      large);
    * ``ep``: one all-to-all's input and output, ``2 E b C h d`` (:func:`comm.ep_dispatch_bytes`: the
      dispatched slots going out and the ones arriving), plus ``h d`` in backward's combine, whose
      incoming gradient is a view of the gradient of the buffer padded with the empty slots' zero row.
    """
    d, s, b, h = plan.dtype_bytes, plan.seq / plan.cp, plan.micro_batch, model.hidden
    view = rank_view(model, plan, stage)
    parts: dict[str, float] = {}
    if plan.sp:
        parts["sp"] = s * b * h * d * (2 if b > 1 else 1)
    if plan.pp > 1:
        parts["pp"] = view.messages * pp_message_bytes(model, plan)
    if plan.cp > 1:
        kv = view.kv_width
        if plan.cp_kind == "ring":
            parts["cp"] = (3 if plan.cp == 2 else 4) * 2 * s * b * kv * d
        elif plan.cp_kind == "allgather":
            parts["cp"] = 2 * (plan.seq + s) * b * kv * d
        else:
            f = kv_replication(model.heads // plan.tp, view.kv_heads, plan.cp)
            parts["cp"] = 2 * s * b * (view.q_width + 2 * kv * f) * d
    if plan.ep > 1 and model.is_moe:       # + one row: combine's incoming gradient is a view of the padded
        parts["ep"] = 2.0 * ep_dispatch_bytes(model, plan) + model.hidden * d    # (E b C + 1, h) one
    return parts


