"""What a GPU shows in ``nvidia-smi`` beside what its tensors hold: the caching allocator's reserve over the
ledger's tensors, and the fixed costs no tensor owns.

``allocator_reserved``: the ledger's own allocation list (:func:`ledger_events`: the state, torch's cuBLAS
workspaces, then each moment of :func:`parallel_lab.ledger_peak.peak_moments` allocated and freed in turn)
replayed through :mod:`parallel_lab.allocator`; it is what torch reports as ``max_memory_reserved``
(torchtitan's "max reserved"). Beside it, outside the allocator: the CUDA context (a prior, :data:`CUDA_CONTEXT`)
and NCCL's buffers (``NCCL_BUFFSIZE``, 4 MiB, per channel per ring neighbour per communicator; the channel
count is a prior). ``nvidia_smi_estimate`` is their sum. The verdict of ``memory`` still weighs the tensors
only (``MemoryLedger.need_bytes``). Sources and simplifications: docs/reserve.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from . import activations
from .allocator import AllocatorConfig, Event, MiB, replay
from .hardware import ClusterSpec
from .ledger_peak import peak_moments
from .rank_view import rank_view
from .specs import ModelSpec, Plan

#: The CUDA context per process (driver state, the kernels torch and its libraries load), a PRIOR: commonly
#: reported as a few hundred MB (PyTorch forum threads; CUDA 11.7+ loads modules lazily, which lowers it).
#: (low, point, high) bytes; measure yours: ``nvidia-smi`` after ``torch.cuda.init()`` and one matmul.
CUDA_CONTEXT = (0.3e9, 0.5e9, 0.6e9)
#: NCCL's ``NCCL_BUFFSIZE`` default (NCCL docs, "Environment Variables"): the Simple protocol's buffer of a
#: connection to one peer on one channel.
NCCL_BUFFSIZE = 4 * MiB
#: NCCL's channels per communicator, a PRIOR (NCCL picks it from the topology, bounded by
#: ``NCCL_MIN_NCHANNELS``/``NCCL_MAX_NCHANNELS``; ``NCCL_DEBUG=INFO`` prints it).
NCCL_CHANNELS = 16
#: Threads that run GEMMs, each with its own cuBLAS handle: forward on the main thread, backward on
#: autograd's device thread (torch keeps one workspace per (handle, stream)).
GEMM_THREADS = 2
#: Moment parts that are one tensor per parameter: the weight gradients backward has just made, and the
#: step's temporaries without ZeRO (``MasterAdamW`` casts each gradient to fp32; AdamW's two temporaries).
PER_PARAMETER = ("fresh weight gradients", "optimizer temporaries")


def compute_capability(cluster: ClusterSpec) -> int:
    """The GPU's major compute capability from the preset's name: 9 (Hopper: H100, H200), 8 (A100), else 8."""
    name = cluster.name.lower()
    return 9 if name.startswith(("h100", "h200", "gh200")) else 8


def cublas_workspaces(cluster: ClusterSpec) -> dict[str, int]:
    """torch's default cuBLAS and cuBLASLt workspaces of one handle and stream, allocated through the caching
    allocator (``aten/src/ATen/cuda/CublasHandlePool.cpp``, ``CUDABlas.cpp``): cuBLAS ``:4096:2:16:8``
    (8.125 MiB), 32 MiB on compute capability 9; cuBLASLt 1 MiB, 4 MiB on an A100 (8.x, >= 24 GB), 32 MiB on 9+."""
    cc = compute_capability(cluster)
    blas = 4096 * 8 * 1024 if cc == 9 else 4096 * 1024 * 2 + 16 * 1024 * 8
    lt = 32768 * 1024 if cc >= 9 else (4096 * 1024 if cluster.hbm_bytes >= 24 * 2**30 else 1024 * 1024)
    return {"cublas": blas, "cublaslt": lt}


def nccl_communicators(plan: Plan) -> dict[str, int]:
    """The NCCL communicators a rank of ``plan`` creates: one per parallel dimension of size > 1, its size."""
    return {d: n for d, n in (("dp", plan.dp), ("tp", plan.tp), ("pp", plan.pp), ("cp", plan.cp),
                              ("ep", plan.ep)) if n > 1}


def nccl_buffer_bytes(plan: Plan, channels: int = NCCL_CHANNELS) -> int:
    """``communicators * channels * 2 * NCCL_BUFFSIZE``: a ring channel connects a rank to two neighbours
    (a pair at size 2 counts once). LL/LL128 buffers and proxy memory are not counted."""
    return sum(channels * min(2, n - 1) * NCCL_BUFFSIZE for n in nccl_communicators(plan).values())


def _split(total: float, weights: list[int]) -> list[int]:
    """``total`` bytes in integer pieces proportional to ``weights``."""
    w = sum(weights)
    if total <= 0 or w <= 0:
        return []
    return [int(round(total * x / w)) for x in weights if x > 0]


def ledger_events(model: ModelSpec, plan: Plan, stage: int, *, activation_model: str = "korthikanti",
                  workspaces: list[int] | None = None) -> list[Event]:
    """The ledger's tensors as allocations: parameters and optimizer states (per parameter, per ZeRO unit
    once sharded; one fp32 tensor per 4 bytes of optimizer state per element), the cuBLAS ``workspaces``,
    then the moments of :func:`peak_moments` in order, each part grown (new tensors) or shrunk (its newest
    tensors freed) to its bytes there, frees and allocations interleaved by bytes: gradients per parameter
    (per unit once sharded, the last layers' first), :data:`PER_PARAMETER` parts per parameter, activations
    as the per-op saves of one block repeated, any other part one tensor."""
    pm = peak_moments(model, plan, stage, activation_model=activation_model)
    view = rank_view(model, plan, stage)
    per_param = [p.numel for p in view.params]
    per_unit = list(view.units.values())
    saves = [s.nbytes for s in activations.block_saves(model, plan)]
    events: list[Event] = []

    def put(key: tuple, sizes: list[int]) -> list[tuple[tuple, int]]:
        made = [((*key, i), n) for i, n in enumerate(sizes) if n > 0]
        events.extend(("alloc", k, n) for k, n in made)
        return made

    state = view.state
    put(("parameters",), _split(state["parameters"], per_unit if plan.zero >= 3 else per_param))
    k = max(1, round(plan.optim.optim_bytes / 4))
    shards = _split(state["optimizer_states"], per_unit if plan.zero >= 1 else per_param)
    for j in range(k):
        put(("optimizer_states", j), [n // k for n in shards])
    put(("workspace",), list(workspaces or []))
    full_grads = float(view.elements * plan.optim.grad_bytes)

    def pieces(part: str, nbytes: float) -> list[int]:
        if part == "gradients":
            return _split(nbytes, per_param if nbytes >= full_grads else per_unit)
        if part in PER_PARAMETER and not (part == "optimizer temporaries" and plan.zero >= 1):
            return _split(nbytes, per_param)
        if part == "activations" and sum(saves) > 0:
            whole = int(nbytes // sum(saves))
            return saves * whole + [int(nbytes - whole * sum(saves))]
        return [int(nbytes)]

    live: dict[str, list[tuple[tuple, int]]] = {}          # part -> its tensors, oldest first
    for moment, parts in pm.moments.items():
        want = {p: v for p, v in parts.items() if p not in ("parameters", "optimizer_states") and v > 0}
        frees: list[tuple[str, tuple, int]] = []           # parts that shrink give back their newest tensors
        for part in list(live):
            held = live[part]
            total = sum(n for _, n in held)
            target = want.get(part, 0.0)
            if part == "gradients" and target and target != total:
                target = 0.0                               # another layout (reduced shards): made anew
            while held and total > target:
                key, n = held.pop()
                frees.append((part, key, n))
                total -= n
            if not held:
                del live[part]
        made: list[tuple[str, tuple, int]] = []
        for part, nbytes in want.items():
            have = sum(n for _, n in live.get(part, []))
            if nbytes > have:
                sizes = pieces(part, nbytes - have)
                if part == "gradients":                    # backward makes the last layers' gradients first
                    sizes = sizes[::-1]
                made += [(part, (moment, part, i), n) for i, n in enumerate(sizes) if n > 0]
        # other parts' frees first, then backward's: the saves freed as the gradients are made, interleaved by
        # bytes (a free first while no more is freed than made), then the moment's other tensors
        events.extend(("free", key) for part, key, _ in frees if part != "activations")
        saved = [(key, n) for part, key, n in frees if part == "activations"]
        grads = [(key, n) for part, key, n in made if part == "gradients"]
        freed = grown = i = j = 0
        while i < len(saved) or j < len(grads):
            if i < len(saved) and (j == len(grads) or freed <= grown):
                events.append(("free", saved[i][0]))
                freed += saved[i][1]
                i += 1
            else:
                events.append(("alloc", *grads[j]))
                grown += grads[j][1]
                j += 1
        events.extend(("alloc", key, n) for part, key, n in made if part != "gradients")
        for part, key, n in made:
            live.setdefault(part, []).append((key, n))
    return events


@dataclass
class Reserve:
    """Bytes one GPU of ``stage`` reserves beside its tensors' peak (module docstring); ``priors`` name the
    figures that are priors, not derivations."""

    stage: int
    tensors_peak: float
    allocator_reserved: float
    cublas_workspace: float
    cuda_context: float
    nccl_buffers: float
    segments: int
    config: AllocatorConfig
    priors: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def allocator_overhead(self) -> float:
        """What the allocator reserves beyond the tensors and the workspaces (segments, rounding, caching)."""
        return self.allocator_reserved - self.tensors_peak - self.cublas_workspace

    @property
    def nvidia_smi_estimate(self) -> float:
        return self.allocator_reserved + self.cuda_context + self.nccl_buffers

    def to_json(self) -> dict[str, Any]:
        return {"stage": self.stage, "tensors_peak": self.tensors_peak,
                "allocator_reserved": self.allocator_reserved, "allocator_overhead": self.allocator_overhead,
                "cublas_workspace": self.cublas_workspace, "cuda_context": self.cuda_context,
                "nccl_buffers": self.nccl_buffers, "nvidia_smi_estimate": self.nvidia_smi_estimate,
                "segments": self.segments, "decides_fit": False,
                "allocator_config": {"expandable_segments": self.config.expandable_segments,
                                     "max_split_size": self.config.max_split_size,
                                     "roundup_power2_divisions": self.config.roundup_power2_divisions},
                "priors": dict(self.priors), "notes": list(self.notes)}


def reserve(model: ModelSpec, plan: Plan, cluster: ClusterSpec, stage: int | None = None, *,
            activation_model: str = "korthikanti", config: AllocatorConfig | None = None,
            channels: int = NCCL_CHANNELS) -> Reserve:
    """:class:`Reserve` of the stage where :func:`peak_moments` peaks (or ``stage``)."""
    pm = peak_moments(model, plan, stage, activation_model=activation_model)
    ws = cublas_workspaces(cluster)
    workspaces = [n for n in ws.values() for _ in range(GEMM_THREADS)]
    events = ledger_events(model, plan, pm.stage, activation_model=activation_model, workspaces=workspaces)
    config = config or AllocatorConfig()
    r = replay(events, config)
    comms = nccl_communicators(plan)
    notes = [f"cuBLAS workspaces: {GEMM_THREADS} threads x (cuBLAS {ws['cublas'] / MiB:g} MiB + cuBLASLt "
             f"{ws['cublaslt'] / MiB:g} MiB), inside the allocator's reserve",
             f"NCCL: {len(comms)} communicator(s) ({', '.join(f'{d}={n}' for d, n in comms.items()) or 'none'}) "
             f"x {channels} channels (prior) x up to 2 ring neighbours x NCCL_BUFFSIZE 4 MiB"]
    return Reserve(pm.stage, pm.peak_bytes, float(r.peak_reserved), float(sum(workspaces)), CUDA_CONTEXT[1],
                   float(nccl_buffer_bytes(plan, channels)), r.segments, config,
                   {"cuda_context_range": [CUDA_CONTEXT[0], CUDA_CONTEXT[2]], "nccl_channels": channels}, notes)
