"""Hardware figures: GPU peaks, HBM size and bandwidth, the link tiers, attention-kernel speeds, cluster presets.

Pure Python, no torch. A :class:`ClusterSpec` is a homogeneous cluster: nodes of ``gpus_per_node`` GPUs with
two :class:`LinkTier` (intra-node, inter-node) for the alpha-beta model ``t = latency + bytes / bandwidth``.
The datasheets give the peaks (H100 SXM5 989 TFLOP/s, A100 SXM4 312 TFLOP/s dense BF16); the attention
kernels' speeds come from the FlashAttention-2 and -3 papers (Dao 2023; Shah et al. 2024), combined over a
forward and its backward by :func:`flash_efficiency`. :class:`StepProfile` holds the roofline parameters
``parallel-lab calibrate`` fits (``parallel_lab.steptime``). The A100, H100 and H200 presets carry the profiles
fitted to published runs (:data:`FITTED_PROFILES`, sources named there); ``NAME-prior`` keeps the fixed
``mfu_achievable`` model.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .errors import ParallelLabError, check_positive_int, check_real, lookup_preset


@dataclass(frozen=True)
class LinkTier:
    """One tier of the interconnect, for the alpha-beta model ``t = latency + bytes / bandwidth``.

    ``bandwidth`` is bytes per second per GPU per direction (what one GPU can send while it receives).
    """

    name: str
    bandwidth: float
    latency: float

    def __post_init__(self) -> None:
        check_real("LinkTier", "bandwidth", self.bandwidth)
        check_real("LinkTier", "latency", self.latency)
        if not self.bandwidth > 0:
            raise ParallelLabError(f"LinkTier {self.name!r}: bandwidth={self.bandwidth} must be > 0 bytes/s")
        if self.latency < 0:
            raise ParallelLabError(f"LinkTier {self.name!r}: latency={self.latency} must be >= 0 seconds")


#: FlashAttention's benchmark count of its backward: 2.5x the forward's ``4 s k q`` FLOPs (two matmuls to
#: recompute the scores and the probabilities' gradient, three for dQ, dK, dV; Dao et al. 2022, 2023).
#: ``flops.ATTENTION_FWD_BWD["flash"]`` is one plus it.
FLASH_BACKWARD_OVER_FORWARD = 2.5

#: Published speeds of fused attention kernels on one H100 SXM5 (989 TFLOP/s dense BF16), BF16, head dim
#: 128, sequence 16K, in FlashAttention's count: (forward with a causal mask, backward) TFLOP/s, from the
#: FlashAttention-3 paper's benchmark figures (Shah et al. 2024, arXiv 2407.08608): the forward from its
#: causal panel (the masked work the roofline charges), the backward from its one head-dim-128 backward
#: figure, which gives no mask variant (a causal backward usually runs slower per counted FLOP, so these
#: priors lean fast). Measured with the kernels of mid-2024, after Llama 3's pre-training.
ATTENTION_KERNELS_H100: dict[str, tuple[float, float]] = {
    "fa2": (335.0, 322.0),      # FlashAttention-2 (torch SDPA's flash backend)
    "cudnn": (539.0, 516.0),    # cuDNN's fused attention (torch SDPA's cudnn backend)
    "fa3": (616.0, 561.0),      # FlashAttention-3 (Hopper: warp specialisation, TMA)
}
H100_PEAK_FLOPS = 989e12
A100_PEAK_FLOPS = 312e12

#: The same on one A100 SXM4 (312 TFLOP/s dense BF16), from the FlashAttention-2 paper's text (Dao 2023,
#: arXiv 2307.08691, section 1): FlashAttention-2 reaches "up to 73%" of peak in the forward and "up to 63%"
#: in the backward, FlashAttention(-1) 30-50% and 25-35% (its Figs. 6-7; the top of each range here). These
#: are the best of the paper's settings (masks, head dims 64 and 128, 512 to 16K tokens), not one shape:
#: upper bounds. tests/test_calibrate.py checks them against the same paper's end-to-end runs (Table 1).
ATTENTION_KERNELS_A100: dict[str, tuple[float, float]] = {
    "fa2": (0.73 * A100_PEAK_FLOPS / 1e12, 0.63 * A100_PEAK_FLOPS / 1e12),   # FlashAttention-2
    "fa1": (0.50 * A100_PEAK_FLOPS / 1e12, 0.35 * A100_PEAK_FLOPS / 1e12),   # FlashAttention (Dao et al. 2022)
}
#: the published kernel speeds by the peak of the GPU they were measured on (H200 shares H100's die and peak)
ATTENTION_KERNELS: dict[float, tuple[str, dict[str, tuple[float, float]]]] = {
    H100_PEAK_FLOPS: ("H100 SXM5", ATTENTION_KERNELS_H100),
    A100_PEAK_FLOPS: ("A100 SXM4", ATTENTION_KERNELS_A100),
}


def flash_efficiency(fwd: float, bwd: float, peak_flops: float) -> float:
    """The fraction of ``peak_flops`` of a forward and its backward run at ``fwd`` and ``bwd`` FLOP/s in
    FlashAttention's count: ``(1 + r) / (1 / fwd + r / bwd) / peak``, ``r`` =
    :data:`FLASH_BACKWARD_OVER_FORWARD` (the time of one forward plus its backward)."""
    r = FLASH_BACKWARD_OVER_FORWARD
    return (1 + r) / (1 / fwd + r / bwd) / peak_flops


def attention_kernel_efficiency(kernel: str, peak_flops: float = H100_PEAK_FLOPS) -> float:
    """A published kernel's fraction of peak over forward + backward on the GPU of ``peak_flops``
    (:data:`ATTENTION_KERNELS`, :func:`flash_efficiency`). H100: fa2 0.329, cudnn 0.528, fa3 0.582; A100
    (upper bounds): fa2 0.656, fa1 0.383."""
    if peak_flops not in ATTENTION_KERNELS:
        known = ", ".join(f"{gpu} ({peak / 1e12:g})" for peak, (gpu, _) in ATTENTION_KERNELS.items())
        raise ParallelLabError(f"no published attention-kernel speeds for a GPU of {peak_flops / 1e12:g} TFLOP/s "
                               f"peak (known: {known}); time your kernel (parallel-lab calibrate --microbench) "
                               "and give the profile an attention_efficiency")
    gpu, table = ATTENTION_KERNELS[peak_flops]
    if kernel not in table:
        raise ParallelLabError(f"attention kernel {kernel!r} has no published {gpu} rate here; pick one of "
                               f"{', '.join(table)}, or give the profile an attention_efficiency")
    fwd, bwd = table[kernel]
    return flash_efficiency(fwd * 1e12, bwd * 1e12, peak_flops)


def default_attention_efficiency(peak_flops: float) -> float:
    """The attention prior of a GPU with no fitted profile: FlashAttention-2's published rate on it where
    :data:`ATTENTION_KERNELS` has one (A100 0.656, H100 0.329), else H100's fraction (0.329)."""
    return attention_kernel_efficiency("fa2", peak_flops if peak_flops in ATTENTION_KERNELS else H100_PEAK_FLOPS)


#: The fraction of the datasheet HBM bandwidth the memory-bound ops reach: a round prior, not fitted to a
#: published run (streaming kernels such as STREAM's copy reach 80-90% of it; small elementwise kernels less).
#: Measure it on the GPU to replace it; docs/step_time.md, "Memory-bound work".
HBM_EFFICIENCY_PRIOR = 0.8


@dataclass(frozen=True)
class StepProfile:
    """Parameters of the roofline step-time model (``parallel_lab.steptime``, "Roofline compute"), fitted by
    ``parallel-lab calibrate`` from measured runs and saved with the cluster they were measured on.

    ``matmul_efficiency``: the fraction of peak a large GEMM reaches; a GEMM whose smallest dimension is
    ``d`` reaches ``matmul_efficiency * d / (d + half_width)`` (narrow TP shards and short micro-batches run
    slower). ``attention_efficiency``: the fused attention kernel's fraction of peak over forward and
    backward, counting causal FLOPs as FlashAttention's benchmarks do (backward 2.5x forward,
    ``flops.ATTENTION_FWD_BWD``; a prior, not fitted; default FlashAttention-2's published H100 rate, 0.329,
    :func:`attention_kernel_efficiency`; ``parallel-lab calibrate`` starts an A100 from FlashAttention-2's A100
    rate, :func:`default_attention_efficiency`, and ``--attention-kernel`` picks another).
    ``overhead_s``: seconds per micro-batch per model chunk (launches, synchronisation).
    ``tp_overlap``: the fraction of sequence-parallel TP traffic hidden behind the neighbouring GEMMs.
    ``hbm_efficiency``: the fraction of the GPU's ``hbm_bandwidth`` its memory-bound ops reach
    (``parallel_lab.membound``; a prior, :data:`HBM_EFFICIENCY_PRIOR`).
    """

    matmul_efficiency: float = 0.8
    half_width: float = 64.0
    attention_efficiency: float = attention_kernel_efficiency("fa2")
    overhead_s: float = 0.0
    tp_overlap: float = 0.0
    hbm_efficiency: float = HBM_EFFICIENCY_PRIOR
    source: str = "defaults"

    def __post_init__(self) -> None:
        for f in ("matmul_efficiency", "half_width", "attention_efficiency", "overhead_s", "tp_overlap",
                  "hbm_efficiency"):
            check_real("StepProfile", f, getattr(self, f))
        for f in ("matmul_efficiency", "attention_efficiency", "hbm_efficiency"):
            if not 0 < getattr(self, f) <= 1:
                raise ParallelLabError(f"StepProfile.{f}={getattr(self, f)} must be in (0, 1]")
        if self.half_width < 0 or self.overhead_s < 0 or not 0 <= self.tp_overlap <= 1:
            raise ParallelLabError(f"StepProfile: half_width={self.half_width} and overhead_s={self.overhead_s} "
                                   f"must be >= 0 and tp_overlap={self.tp_overlap} in [0, 1]")


@dataclass(frozen=True)
class ClusterSpec:
    """A homogeneous GPU cluster: nodes of ``gpus_per_node`` GPUs, two link tiers (intra/inter node)."""

    name: str
    gpus_per_node: int
    hbm_bytes: float
    peak_flops: float          # dense bf16 FLOP/s per GPU
    intra: LinkTier            # within a node (NVLink / NVSwitch; loopback for cpu-gloo)
    inter: LinkTier            # between nodes (InfiniBand / RoCE), per GPU
    mfu_achievable: float = 0.5  # fraction of peak a well-tuned dense step reaches (planner's compute time)
    profile: StepProfile | None = None   # fitted roofline parameters (parallel-lab calibrate); None: mfu_achievable
    hbm_bandwidth: float = 0.0  # bytes/s of HBM per GPU (datasheet); 0: no memory-bound term (steptime)

    def __post_init__(self) -> None:
        check_positive_int("ClusterSpec", "gpus_per_node", self.gpus_per_node)
        for f in ("hbm_bytes", "peak_flops", "mfu_achievable", "hbm_bandwidth"):
            check_real("ClusterSpec", f, getattr(self, f))
        for f in ("hbm_bytes", "peak_flops"):
            if not getattr(self, f) > 0:
                raise ParallelLabError(f"ClusterSpec.{f}={getattr(self, f)} must be > 0")
        if self.hbm_bandwidth < 0:
            raise ParallelLabError(f"ClusterSpec.hbm_bandwidth={self.hbm_bandwidth} must be >= 0")
        if not 0 < self.mfu_achievable <= 1:
            raise ParallelLabError(f"ClusterSpec.mfu_achievable={self.mfu_achievable} must be in (0, 1]")

    @classmethod
    def preset(cls, name: str) -> ClusterSpec:
        return lookup_preset("cluster", name, CLUSTER_PRESETS)

    def tier(self, group_span: int) -> LinkTier:
        """The link a group uses when its members lie ``group_span`` consecutive ranks apart at most.

        A group whose ranks fit in one node (span <= gpus_per_node) talks over ``intra``; otherwise ``inter``.
        """
        return self.intra if group_span <= self.gpus_per_node else self.inter


#: Hardware presets. Bandwidths are per GPU per direction, the datasheets' peaks with no derating: NCCL's
#: measured bus bandwidth is lower, so collective times are optimistic until a profile is calibrated
#: (``parallel-lab calibrate --microbench`` fits the intra-node tier).
CLUSTER_PRESETS: dict[str, ClusterSpec] = {
    # H100 SXM5: 80 GB HBM3, 989 TFLOP/s dense bf16, NVLink 4 900 GB/s bidirectional (450 per direction),
    # one 400 Gb/s (50 GB/s) NIC per GPU; HBM3 3.35 TB/s (NVIDIA H100 datasheet, SXM).
    "h100-sxm": ClusterSpec("h100-sxm", 8, 80e9, H100_PEAK_FLOPS, LinkTier("nvlink4", 450e9, 3e-6),
                            LinkTier("ib-400g", 50e9, 10e-6), hbm_bandwidth=3.35e12),
    # A100 SXM4 80 GB: 312 TFLOP/s bf16, NVLink 3 600 GB/s bidirectional, 200 Gb/s HDR per GPU; HBM2e
    # 2,039 GB/s (NVIDIA A100 datasheet, 80GB SXM).
    "a100-80gb": ClusterSpec("a100-80gb", 8, 80e9, A100_PEAK_FLOPS, LinkTier("nvlink3", 300e9, 3e-6),
                             LinkTier("ib-200g", 25e9, 10e-6), hbm_bandwidth=2.039e12),
    # H200 SXM: the H100 compute die with 141 GB HBM3e at 4.8 TB/s (NVIDIA H200 datasheet).
    "h200": ClusterSpec("h200", 8, 141e9, H100_PEAK_FLOPS, LinkTier("nvlink4", 450e9, 3e-6),
                        LinkTier("ib-400g", 50e9, 10e-6), hbm_bandwidth=4.8e12),
    # A 2-core laptop-class CPU, gloo over loopback (measured with torch 2.13: all_reduce
    # ~1.4 GB/s at 64 MB, 0.1-1.9 ms for 1 KB). "HBM" is the RAM one rank may use.
    "cpu-gloo": ClusterSpec("cpu-gloo", 2, 12 * 2**30, 20e9, LinkTier("loopback", 1.4e9, 0.5e-3),
                            LinkTier("loopback-remote", 1.0e9, 1.0e-3), mfu_achievable=0.5),
}

#: The default presets' profiles, each fitted on one published set (``parallel-lab calibrate``, memory-bound
#: term on at the prior ``hbm_efficiency``); tests/test_steptime_heldout.py refits them from the sources (starting
#: from the ``-prior`` presets) and holds them against every other set (docs/validation.md, "Held out").
#: A100: the six Megatron-LM PTD-P runs (Narayanan et al. 2021, Table 2; examples/calibration/megatron_2021.csv).
#: H100: Llama 3 405B at 8K on 16,384 GPUs (Dubey et al. 2024, Table 4; examples/calibration/llama3_405b.csv),
#: counted causally with cuDNN's published attention speed (docs/validation.md). H200: no published H200 run is
#: held here; it shares H100's compute die and peak, so it takes H100's fit (its GEMM efficiency and attention
#: speed) untested, with its own HBM bandwidth at the same prior fraction.
_H100_FIT = StepProfile(matmul_efficiency=0.5731, attention_efficiency=attention_kernel_efficiency("cudnn"),
                        source="fitted to 1 run(s): llama3-405b 8K 16384 GPUs (causal; Dubey et al. 2024, "
                               "Table 4); attention prior: cudnn")
FITTED_PROFILES: dict[str, StepProfile] = {
    "a100-80gb": StepProfile(matmul_efficiency=0.7067,
                             attention_efficiency=default_attention_efficiency(A100_PEAK_FLOPS),
                             source="fitted to 6 run(s): examples/calibration/megatron_2021.csv (Narayanan et al. "
                                    "2021, Table 2)"),
    "h100-sxm": _H100_FIT,
    "h200": replace(_H100_FIT, source="H100's fit, untested on H200: " + _H100_FIT.source),
}
#: ``NAME-prior``: the preset as it was before a fit, the fixed ``mfu_achievable`` model (no roofline and no
#: memory-bound term), kept for lessons that teach that model and for comparison.
for _name, _profile in FITTED_PROFILES.items():
    CLUSTER_PRESETS[f"{_name}-prior"] = replace(CLUSTER_PRESETS[_name], name=f"{_name}-prior")
    CLUSTER_PRESETS[_name] = replace(CLUSTER_PRESETS[_name], profile=_profile)
