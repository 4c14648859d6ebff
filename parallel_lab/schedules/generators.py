"""The named schedules: compute orders (:mod:`.orders`) with their point-to-point batches (:mod:`.p2p`).

``build_schedule(name, p, m, v)`` is the one entry point (``Plan.schedule``: ``gpipe``, ``1f1b``,
``interleaved``, ``zb-h1``; the V schedules ``zb-v``, ``dualpipev``); ``compute_orders`` gives the same
lists without the ``P2P`` batches, all that memory needs. Interleaved 1F1B groups each steady-state
forward with the following backward (Megatron's rounds) and DualPipeV its overlapped (F, B) pairs, so
that their messages are posted together; the V schedules post receives when the sender sends.
"""

from __future__ import annotations

import functools

from ..errors import ParallelLabError
from ..specs import SCHEDULES
from .actions import Action, Placement, Schedule
from .orders import (
    dualpipev_order,
    gpipe_order,
    interleaved_order,
    interleaved_warmup,
    one_f_one_b_order,
    zb_h1_order,
    zb_v_order,
)
from .p2p import with_p2p


def gpipe(p: int, m: int) -> Schedule:
    return with_p2p(gpipe_order(p, m))


def one_f_one_b(p: int, m: int) -> Schedule:
    return with_p2p(one_f_one_b_order(p, m))


def interleaved_1f1b(p: int, m: int, v: int) -> Schedule:
    if v == 1:
        return one_f_one_b(p, m)
    orders = interleaved_order(p, m, v)
    groups = []
    for r in range(p):
        # warm-up forwards one by one, (forward, backward) pairs, then the drain's backwards one by one
        warm = interleaved_warmup(p, m, v, r)
        groups.append([1] * warm + [2] * (m * v - warm) + [1] * warm)
    return with_p2p(orders, v, groups)


def zb_h1(p: int, m: int) -> Schedule:
    return with_p2p(zb_h1_order(p, m))


def zb_v(p: int, m: int) -> Schedule:
    return with_p2p(zb_v_order(p, m), 2, placement=Placement.v_shape(p), recv_at="sender")


def dualpipev(p: int, m: int) -> Schedule:
    orders, pairs = dualpipev_order(p, m)
    groups = []
    for order, mine in zip(orders, pairs, strict=True):
        sizes, i = [], 0
        while i < len(order):                  # an overlapped (F, B) pair is one group: posted together
            n = 2 if i + 1 < len(order) and (order[i], order[i + 1]) in mine else 1
            sizes.append(n)
            i += n
        groups.append(sizes)
    return with_p2p(orders, 2, groups, Placement.v_shape(p), pairs, recv_at="sender")


V_SCHEDULES: tuple[str, ...] = ("zb-v", "dualpipev")
SCHEDULE_NAMES: tuple[str, ...] = SCHEDULES + V_SCHEDULES   # every name build_schedule knows


def chunks_per_rank(name: str, v: int = 1) -> int:
    """Model chunks one rank holds under schedule ``name``: ``v`` for interleaved, 2 for the V schedules."""
    return 2 if name in V_SCHEDULES else v


def _check_name(name: str, v: int) -> None:
    if name not in SCHEDULE_NAMES:
        raise ParallelLabError(f"schedule {name!r} is not known; pick one of {', '.join(SCHEDULE_NAMES)}")
    if name in V_SCHEDULES:
        if v not in (1, 2):
            raise ParallelLabError(f"{name} places exactly 2 chunks per rank in a V; v={v}: pass v=1 or 2")
    elif v != 1 and name != "interleaved":
        raise ParallelLabError(f"v={v} model chunks per rank needs schedule 'interleaved' (got {name!r}); "
                               "or set v=1")


@functools.lru_cache(maxsize=1024)
def compute_orders(name: str, p: int, m: int, v: int = 1) -> tuple[tuple[Action, ...], ...]:
    """Each rank's compute actions (F, B, W) of :func:`build_schedule`, in order, without the point-to-point
    ops it places between them: all that memory needs (``rank_view.block_inflight``), at a fraction of the cost
    (tests/test_schedules.py checks they are ``build_schedule``'s compute actions)."""
    _check_name(name, v)
    if name == "gpipe":
        orders = gpipe_order(p, m)
    elif name == "1f1b" or (name == "interleaved" and v == 1):
        orders = one_f_one_b_order(p, m)
    elif name == "interleaved":
        orders = interleaved_order(p, m, v)
    elif name == "zb-h1":
        orders = zb_h1_order(p, m)
    elif name == "zb-v":
        orders = zb_v_order(p, m)
    else:
        orders = dualpipev_order(p, m)[0]
    return tuple(tuple(order) for order in orders)


def build_schedule(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """The schedule named ``name``: ``Plan.schedule`` (``gpipe``, ``1f1b``, ``interleaved``, ``zb-h1``) or a V
    schedule (``zb-v``, ``dualpipev``: two chunks per rank by construction, ``v`` is 1 or 2)."""
    _check_name(name, v)
    if name in V_SCHEDULES:
        return zb_v(p, m) if name == "zb-v" else dualpipev(p, m)
    if name == "gpipe":
        return gpipe(p, m)
    if name == "1f1b":
        return one_f_one_b(p, m)
    if name == "interleaved":
        return interleaved_1f1b(p, m, v)
    return zb_h1(p, m)
