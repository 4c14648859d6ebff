"""Specifications: what is trained (ModelSpec), on what (ClusterSpec), and how it is split (Plan).

Pure Python, no torch. Every other module takes these three dataclasses; nothing else describes a model,
a machine or a parallel plan. Each is validated when it is built, and every violated constraint raises
:class:`ParallelLabError` with a message that names the bad value and says how to fix it.

Parameter shapes. :meth:`ModelSpec.parameter_shapes` lists every parameter of the decoder, by name and
shape, in the order the runnable reference model (``parallel_lab.distributed.model.model``) registers them. The
parameter count, the sharded state memory of ZeRO and the DDP bucket plan are all computed from this one
list, and a test checks that the torch model has exactly these names and shapes.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from typing import TYPE_CHECKING, Any, Literal

from .errors import ParallelLabError, check_choice, check_positive_int, check_real, divisors, fmt_set, lookup_preset
from .optimizers import DTYPE_BYTES, OPTIMIZERS, OptimizerSpec
from .sharding import PP_SPLITS, check_cut, check_ep, is_expert_param

if TYPE_CHECKING:                                   # annotations only
    from .hardware import ClusterSpec

Flavour = Literal["gpt", "llama"]
Recompute = Literal["none", "selective", "full", "op-sac"]
RECOMPUTE: tuple[str, ...] = ("none", "selective", "full", "op-sac")
ROPE_SCALINGS: tuple[str, ...] = ("none", "llama3")
ROPE_THETA = 10000.0                                #: the rotary base of Su et al. (RoFormer)

GB = 10**9
GiB = 2**30


# --------------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer, independent of sequence length.

    Two block flavours:

    * ``gpt``: LayerNorm (weight and bias), GeLU MLP ``ffn = 4 h`` by default, biases on every linear,
      learned position embeddings (``max_positions`` rows), dropout.
    * ``llama``: RMSNorm (weight only), SwiGLU MLP (gate, up, down), rotary positions (no parameters),
      grouped-query attention (``kv_heads`` < ``heads``), no biases, no dropout. Rotary base ``rope_theta``
      (10000, Su et al.; Llama 3: 500000) and ``rope_scaling`` ("none"; "llama3": Llama 3.1's
      long-context frequency scaling, factor 8 above wavelength 8192, as torchtitan's llama3 models use).

    ``n_params_override`` describes a model known only by its parameter count (``ModelSpec.from_params``):
    enough for model-state memory and data-parallel bytes, not for activations or tensor parallelism.

    Mixture of experts (``experts > 0``; Shazeer et al. 2017, GShard, Switch; docs/moe.md): every block
    from ``first_dense`` on replaces its MLP by a router (``experts x hidden``, no bias) and ``experts``
    MLPs of width ``expert_ffn`` (default ``ffn``); each token goes to its ``top_k`` experts, each expert
    takes at most ``capacity = min(seq, ceil(capacity_factor * top_k * seq / experts))`` tokens of a sequence (the
    rest are dropped: they skip the MLP through the residual). ``shared_experts`` MLPs of the same width
    (DeepSeekMoE) see every token; they are stored as one MLP ``shared_experts * expert_ffn`` wide. The
    router's load-balancing loss (Switch form, ``aux_loss_coef * E * sum_e f_e P_e`` per sequence) is
    added to the training loss.
    """

    layers: int
    hidden: int
    heads: int
    kv_heads: int | None = None
    ffn: int | None = None
    vocab: int = 32000
    flavour: Flavour = "gpt"
    tied_embeddings: bool = False
    bias: bool | None = None
    max_positions: int = 2048
    dropout: float | None = None
    name: str = "custom"
    n_params_override: int | None = None
    experts: int = 0
    top_k: int = 2
    expert_ffn: int | None = None
    shared_experts: int = 0
    capacity_factor: float = 1.25
    aux_loss_coef: float = 0.01
    first_dense: int = 0
    rope_theta: float = ROPE_THETA
    rope_scaling: str = "none"

    def __post_init__(self) -> None:
        o = "ModelSpec"
        check_choice(o, "flavour", self.flavour, ("gpt", "llama"))
        for f in ("layers", "hidden", "heads", "vocab", "max_positions"):
            check_positive_int(o, f, getattr(self, f))
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        check_positive_int(o, "kv_heads", self.kv_heads)
        if self.ffn is None:
            ffn = 4 * self.hidden if self.flavour == "gpt" else _llama_ffn(self.hidden)
            object.__setattr__(self, "ffn", ffn)
        check_positive_int(o, "ffn", self.ffn)
        if self.bias is None:
            object.__setattr__(self, "bias", self.flavour == "gpt")
        if self.dropout is None:
            object.__setattr__(self, "dropout", 0.1 if self.flavour == "gpt" else 0.0)
        check_real(o, "dropout", self.dropout)
        check_real(o, "rope_theta", self.rope_theta)
        if not self.rope_theta > 1:
            raise ParallelLabError(f"ModelSpec.rope_theta={self.rope_theta} must be > 1; e.g. 10000 or 500000")
        check_choice(o, "rope_scaling", self.rope_scaling, ROPE_SCALINGS)
        if not 0.0 <= self.dropout < 1.0:
            raise ParallelLabError(f"ModelSpec.dropout={self.dropout} must be in [0, 1); e.g. dropout=0.1")
        if self.hidden % self.heads:
            ok = [d for d in divisors(self.hidden) if d <= 4 * self.hidden][:12]
            raise ParallelLabError(
                f"heads={self.heads} does not divide hidden={self.hidden}; pick heads in {fmt_set(ok)}"
            )
        if self.heads % self.kv_heads:
            raise ParallelLabError(
                f"kv_heads={self.kv_heads} does not divide heads={self.heads}; "
                f"pick kv_heads in {fmt_set(divisors(self.heads))}"
            )
        if self.flavour == "llama" and (self.hidden // self.heads) % 2:
            raise ParallelLabError(
                f"head_dim={self.hidden // self.heads} is odd; rotary embeddings need an even head_dim "
                f"(change hidden={self.hidden} or heads={self.heads})"
            )
        if self.n_params_override is not None:
            check_positive_int(o, "n_params_override", self.n_params_override)
        self._check_moe()

    def _check_moe(self) -> None:
        o = "ModelSpec"
        for f in ("experts", "shared_experts", "first_dense"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ParallelLabError(f"{o}.{f}={v!r} must be an integer >= 0; e.g. {f}=0")
        if not self.experts:
            return
        if self.expert_ffn is None:
            object.__setattr__(self, "expert_ffn", self.ffn)
        check_positive_int(o, "expert_ffn", self.expert_ffn)
        check_positive_int(o, "top_k", self.top_k)
        if self.top_k > self.experts:
            raise ParallelLabError(f"top_k={self.top_k} exceeds experts={self.experts}; "
                                   f"pick top_k in 1..{self.experts}")
        check_real(o, "capacity_factor", self.capacity_factor)
        if not self.capacity_factor > 0:
            raise ParallelLabError(f"capacity_factor={self.capacity_factor} must be > 0; e.g. 1.25 (Switch), "
                                   f"or experts/top_k = {self.experts / self.top_k:g} to drop no token")
        check_real(o, "aux_loss_coef", self.aux_loss_coef)
        if self.aux_loss_coef < 0:
            raise ParallelLabError(f"aux_loss_coef={self.aux_loss_coef} must be >= 0; e.g. 0.01 (Switch)")
        if self.first_dense > self.layers:
            raise ParallelLabError(f"first_dense={self.first_dense} exceeds layers={self.layers}; "
                                   f"pick first_dense in 0..{self.layers}")

    # ---- constructors -----------------------------------------------------------------------------
    @classmethod
    def from_params(cls, n_params: float | int, name: str | None = None) -> ModelSpec:
        """A model known only by its parameter count (e.g. ``7e9``): state memory and DP bytes only."""
        n = int(round(float(n_params)))
        if n < 1:
            raise ParallelLabError(f"params={n_params!r} must be a positive count; e.g. --params 7e9")
        return cls(layers=1, hidden=64, heads=1, vocab=1, name=name or f"{_human_count(n)} (bare count)",
                   n_params_override=n)

    @classmethod
    def preset(cls, name: str) -> ModelSpec:
        """A named model from :data:`MODEL_PRESETS` (e.g. ``"llama3-405b"``, ``"tiny-llama"``)."""
        return lookup_preset("model", name, MODEL_PRESETS)

    def with_(self, **changes: Any) -> ModelSpec:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)

    # ---- derived shape ----------------------------------------------------------------------------
    @property
    def shape_known(self) -> bool:
        """False for a model given only as a parameter count."""
        return self.n_params_override is None

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        """Width of the key (or value) projection: ``kv_heads * head_dim``."""
        return self.kv_heads * self.head_dim

    @property
    def is_moe(self) -> bool:
        """Whether some blocks are mixture-of-experts blocks (``experts > 0``)."""
        return self.experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block ``layer`` routes its tokens to experts (every block from ``first_dense`` on)."""
        return self.experts > 0 and layer >= self.first_dense

    @property
    def moe_layers(self) -> int:
        """Number of mixture-of-experts blocks."""
        return sum(self.is_moe_layer(i) for i in range(self.layers))

    def expert_capacity(self, seq: int) -> int:
        """Tokens of one sequence one expert takes at most: ``min(seq, ceil(capacity_factor * top_k * seq /
        experts))`` (GShard's per-group capacity, a group being one sequence here; never more than the
        sequence's tokens)."""
        return min(seq, math.ceil(self.capacity_factor * self.top_k * seq / self.experts))

    def require_shape(self, what: str) -> None:
        if not self.shape_known:
            raise ParallelLabError(
                f"{what} needs the model's shape, but {self.name!r} was given only as a parameter count; "
                f"give --model PRESET or --layers/--hidden/--heads instead of --params"
            )

    def parameter_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """Every parameter as ``(name, shape)``, in the registration order of ``distributed.model.model.Transformer``.

        Linear weights are ``(out_features, in_features)`` as in ``torch.nn.Linear``.
        """
        self.require_shape("parameter_shapes")
        h, f, v = self.hidden, self.ffn, self.vocab
        q, kv = self.heads * self.head_dim, self.kv_dim
        out: list[tuple[str, tuple[int, ...]]] = [("tok_emb.weight", (v, h))]
        if self.flavour == "gpt":
            out.append(("pos_emb.weight", (self.max_positions, h)))

        def norm(prefix: str) -> None:
            out.append((f"{prefix}.weight", (h,)))
            if self.flavour == "gpt":
                out.append((f"{prefix}.bias", (h,)))

        def linear(prefix: str, fan_out: int, fan_in: int) -> None:
            out.append((f"{prefix}.weight", (fan_out, fan_in)))
            if self.bias:
                out.append((f"{prefix}.bias", (fan_out,)))

        def mlp(prefix: str, width: int) -> None:
            if self.flavour == "gpt":
                linear(f"{prefix}.fc", width, h)
                linear(f"{prefix}.proj", h, width)
            else:
                linear(f"{prefix}.gate", width, h)
                linear(f"{prefix}.up", width, h)
                linear(f"{prefix}.down", h, width)

        for i in range(self.layers):
            b = f"blocks.{i}"
            norm(f"{b}.attn_norm")
            linear(f"{b}.attn.wq", q, h)
            linear(f"{b}.attn.wk", kv, h)
            linear(f"{b}.attn.wv", kv, h)
            linear(f"{b}.attn.wo", h, q)
            norm(f"{b}.mlp_norm")
            if self.is_moe_layer(i):
                out.append((f"{b}.mlp.router.weight", (self.experts, h)))
                for e in range(self.experts):
                    mlp(f"{b}.mlp.experts.{e}", self.expert_ffn)
                if self.shared_experts:
                    mlp(f"{b}.mlp.shared", self.shared_experts * self.expert_ffn)
            else:
                mlp(f"{b}.mlp", f)
        norm("final_norm")
        if not self.tied_embeddings:
            out.append(("lm_head.weight", (v, h)))
        return out

    @property
    def n_params(self) -> int:
        """Exact parameter count (tied embeddings counted once)."""
        if self.n_params_override is not None:
            return self.n_params_override
        return sum(math.prod(s) for _, s in self.parameter_shapes())

    @property
    def n_active_params(self) -> int:
        """Parameters one token uses: the routed experts count ``top_k`` of ``experts`` (``n_params`` for a
        dense model). Mixtral-8x7B: 46.7B total, 12.9B active."""
        if not self.is_moe:
            return self.n_params
        routed = sum(math.prod(s) for n, s in self.parameter_shapes() if is_expert_param(n))
        return self.n_params - routed + routed * self.top_k // self.experts

    @property
    def params_per_layer(self) -> int:
        """Parameters of one transformer block."""
        self.require_shape("params_per_layer")
        return sum(math.prod(s) for n, s in self.parameter_shapes() if n.startswith("blocks.0."))

    def summary(self) -> str:
        if not self.shape_known:
            return f"{self.name}: {self.n_params:,} parameters (shape not given)"
        moe = ""
        if self.is_moe:
            moe = (f", {self.experts} experts (top-{self.top_k}, width {self.expert_ffn}, "
                   f"{self.shared_experts} shared, capacity factor {self.capacity_factor:g}) in "
                   f"{self.moe_layers} blocks, {self.n_active_params:,} active")
        return (f"{self.name}: {self.flavour}, L={self.layers}, h={self.hidden}, heads={self.heads}, "
                f"kv_heads={self.kv_heads}, ffn={self.ffn}, vocab={self.vocab}, {self.n_params:,} parameters{moe}")



def _human_count(n: int) -> str:
    """``7000000000 -> "7B"``, ``6738415616 -> "6.74B"``, ``125000000 -> "125M"``."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}"
    return str(n)


def _llama_ffn(hidden: int, multiple_of: int = 256) -> int:
    """Llama's SwiGLU width: 2/3 of 4h, rounded up to a multiple of 256 (Touvron et al. 2023)."""
    f = int(2 * 4 * hidden / 3)
    return multiple_of * ((f + multiple_of - 1) // multiple_of)


def _llama(name: str, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int) -> ModelSpec:
    return ModelSpec(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn=ffn, vocab=vocab,
                     flavour="llama", name=name)


def _gpt(name: str, layers: int, hidden: int, heads: int, vocab: int, positions: int = 2048,
         tied: bool = False) -> ModelSpec:
    return ModelSpec(layers=layers, hidden=hidden, heads=heads, ffn=4 * hidden, vocab=vocab, flavour="gpt",
                     max_positions=positions, tied_embeddings=tied, name=name)


#: Named models. Published parameter counts are checked in tests/test_specs.py.
MODEL_PRESETS: dict[str, ModelSpec] = {
    # Touvron et al. 2023 (Llama 2): 6.74B, 13.0B, 69.0B.
    "llama2-7b": _llama("llama2-7b", 32, 4096, 32, 32, 11008, 32000),
    "llama2-13b": _llama("llama2-13b", 40, 5120, 40, 40, 13824, 32000),
    "llama2-70b": _llama("llama2-70b", 80, 8192, 64, 8, 28672, 32000),
    # Llama 3 herd (Dubey et al. 2024): 8.03B, 70.6B, 405.9B.
    "llama3-8b": _llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256),
    "llama3-70b": _llama("llama3-70b", 80, 8192, 64, 8, 28672, 128256),
    "llama3-405b": _llama("llama3-405b", 126, 16384, 128, 8, 53248, 128256),
    # Llama 3.2 1B (Meta's released config: 16 layers, 2048 wide, 32 / 8 heads, SwiGLU 8192, tied embeddings):
    # 1.24B; the model bench/gpu_check.py measures on one GPU.
    "llama3.2-1b": ModelSpec(layers=16, hidden=2048, heads=32, kv_heads=8, ffn=8192, vocab=128256, flavour="llama",
                             tied_embeddings=True, name="llama3.2-1b"),
    # Brown et al. 2020: 175B with a 50257-token vocabulary and 2048 learned positions.
    "gpt3-175b": _gpt("gpt3-175b", 96, 12288, 96, 50257),
    # GPT-3 XL (1.3B) as the FlashAttention-2 paper trained it (Dao 2023, Table 1; flash-attention's
    # training/configs gpt3xl): 16 heads of 128, the GPT-2 vocabulary padded to a multiple of 8, tied; no
    # dropout here (the lab's flash core keeps no dropout mask; dropout changes memory, not the FLOPs).
    "gpt3-1.3b": replace(_gpt("gpt3-1.3b", 24, 2048, 16, 50264, tied=True), dropout=0.0),
    # Korthikanti et al. 2022, Table 3 (vocabulary padded to 51200, sequence 2048). Megatron's GPT shares the
    # word embedding with the output layer (a copy on the last pipeline stage, its gradient all-reduced with
    # the first's): Narayanan et al. 2021, Table 1, counts it once, 174.6B, 529.6B and 1008.0B.
    "megatron-22b": _gpt("megatron-22b", 48, 6144, 64, 51200, tied=True),
    "megatron-175b": _gpt("megatron-175b", 96, 12288, 96, 51200, tied=True),
    "megatron-530b": _gpt("megatron-530b", 105, 20480, 128, 51200, tied=True),
    "megatron-1t": _gpt("megatron-1t", 128, 25600, 160, 51200, tied=True),
    # The tiny models the runnable code trains on CPU ranks (tests, notebooks, `parallel-lab run`).
    "tiny-llama": ModelSpec(layers=4, hidden=128, heads=4, kv_heads=2, ffn=344, vocab=512, flavour="llama",
                            name="tiny-llama"),
    # Mixtral of experts (Jiang et al. 2024): 46.7B parameters, 12.9B active (8 experts, top-2).
    "mixtral-8x7b": ModelSpec(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=32000,
                              flavour="llama", name="mixtral-8x7b", experts=8, top_k=2),
    # DeepSeekMoE 16B (Dai et al. 2024): 16.4B parameters, 2.8B active; 64 routed experts of width 1408
    # (top-6) and 2 shared ones, the first block dense (ffn 10944), multi-head attention.
    "deepseekmoe-16b": ModelSpec(layers=28, hidden=2048, heads=16, ffn=10944, vocab=102400, flavour="llama",
                                 name="deepseekmoe-16b", experts=64, top_k=6, expert_ffn=1408,
                                 shared_experts=2, first_dense=1),
    # The tiny mixture of experts of the runnable expert parallelism (4 experts, top-2, one shared).
    "tiny-moe": ModelSpec(layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=256, flavour="llama",
                          name="tiny-moe", experts=4, top_k=2, shared_experts=1, capacity_factor=1.25),
    "tiny-gpt": ModelSpec(layers=4, hidden=128, heads=4, ffn=512, vocab=512, flavour="gpt",
                          max_positions=1024, dropout=0.0, name="tiny-gpt"),
}


SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved", "zb-h1")
CP_KINDS: tuple[str, ...] = ("ring", "allgather", "ulysses")
DP_KINDS: tuple[str, ...] = ("bucketed", "naive")
ZERO_UNITS: tuple[str, ...] = ("block", "root")
#: ZeRO-1's gradient collective: the paper's reduce-scatter (2 Psi per step, as DDP), or the all-reduce of
#: torch's ZeroRedundancyOptimizer under DDP (then the all-gather of the parameters: 3 Psi, 1.5x DDP).
ZERO1_REDUCES: tuple[str, ...] = ("reduce_scatter", "all_reduce")
#: ZeRO-2 with gradient accumulation: hold the full gradients until the last micro-batch and reduce-scatter
#: once ("unsharded": Megatron's distributed optimizer, FSDP's no_sync), or reduce-scatter every micro-batch
#: into the gradient shard ("sharded": DeepSpeed's stage 2, FSDP's default; m times the bytes).
ZERO2_ACCUMULATES: tuple[str, ...] = ("unsharded", "sharded")


def check_zero_variants(zero: int, zero1_reduce: str, zero2_accumulate: str, owner: str = "Plan") -> None:
    """The ZeRO variants and the stages they belong to (one rule for ``Plan`` and the runnable classes)."""
    check_choice(owner, "zero1_reduce", zero1_reduce, ZERO1_REDUCES)
    check_choice(owner, "zero2_accumulate", zero2_accumulate, ZERO2_ACCUMULATES)
    if zero1_reduce != "reduce_scatter" and zero != 1:
        raise ParallelLabError(f"zero1_reduce={zero1_reduce!r} is a ZeRO-1 variant but zero={zero}; "
                               f"set zero=1, or zero1_reduce='reduce_scatter'")
    if zero2_accumulate != "unsharded" and zero != 2:
        raise ParallelLabError(f"zero2_accumulate={zero2_accumulate!r} is a ZeRO-2 variant but zero={zero}; "
                               f"set zero=2, or zero2_accumulate='unsharded'")
#: How the attention core stores what backward needs: ``eager`` materialises the (s x s) probabilities
#: (Korthikanti et al.'s 5as/h term); ``flash`` keeps q, k, v, the output and an fp32 log-sum-exp
#: (Dao et al. 2022). See parallel_lab/activations.py and distributed/model/kernels.py.
ATTENTION_KINDS: tuple[str, ...] = ("eager", "flash")
#: How the MLP stores what backward needs: ``eager`` saves every intermediate (llama 4 ffn, gpt 2 ffn per
#: token); ``fused`` fuses the activation into the second matmul and keeps only the first matmuls' outputs
#: (llama 2 ffn, gpt 1 ffn).
MLP_KINDS: tuple[str, ...] = ("eager", "fused")


# --------------------------------------------------------------------------------------------------
# Plan
# --------------------------------------------------------------------------------------------------

#: The plan fields ``parallel-lab run`` uses unless told otherwise: the tiny model on CPU ranks computes in fp32
#: with AdamW, on short sequences (the analytic subcommands keep Plan's own defaults: seq 2048, bf16, ...).
RUN_DEFAULTS: dict[str, Any] = {"seq": 128, "micro_batch": 4, "dtype": "fp32", "optimizer": "adam-fp32"}


@dataclass(frozen=True)
class Plan:
    """How one training step is split over ``dp * tp * pp * cp`` GPUs.

    The global batch is ``micro_batch * grad_accum * dp`` sequences of ``seq`` tokens. With pipeline
    parallelism, ``grad_accum`` is the number of micro-batches ``m`` that flow through the pipeline.
    Ranks are laid out as ``arange(world).view(dp, pp, cp, tp)``: TP innermost (fastest links), then CP,
    PP, and DP outermost. Expert parallelism ``ep`` borrows its ranks from DP (``ep`` divides ``dp``): the
    data-parallel coordinate ``d`` has expert rank ``d % ep`` (``mesh.ep_coords``, docs/moe.md).

    Runnable-only knobs: ``dp_kind`` (DDP all-reducing every gradient after backward, or bucketed with
    overlap), ``bucket_mb`` (DDP bucket cap in MB of gradient), ``zero_unit`` (ZeRO-3 gathers one block at
    a time, or the whole model at once), ``cp_kind`` (ring, all-gather or Ulysses context parallelism).
    ZeRO variants: ``zero1_reduce`` (:data:`ZERO1_REDUCES`) and ``zero2_accumulate`` (:data:`ZERO2_ACCUMULATES`).
    ``dtype`` is the compute dtype of activations and of the TP/CP/PP messages.

    Activation storage (what the kernels save for backward, :data:`ATTENTION_KINDS`, :data:`MLP_KINDS`):
    ``attention`` ("eager" or "flash") and ``mlp`` ("eager" or "fused"), next to ``recompute`` (Korthikanti's
    "none", "selective" = the attention core recomputed, "full" = the block recomputed) and torchtitan's
    op-level selective checkpointing "op-sac" (every second matmul output kept, all else recomputed).

    ``pp_split`` (:data:`sharding.PP_SPLITS`): "layers" splits the blocks alone over the ``pp * interleave``
    chunks; "embed-head" counts the embedding and the head as one layer slot each (Meta's Llama 3 layout:
    the first and last stages hold one block fewer). Slots need not divide evenly: the first chunks get
    one more (uneven stages, interleaving included).

    ``loss_chunk``: tokens per chunk of a cross-entropy fused with the LM head (the ``s b V`` logits never
    held at once; kept per token: the head input and an fp32 log-sum-exp); 0: eager logits and softmax.
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    zero: int = 0
    sp: bool = False
    micro_batch: int = 1
    grad_accum: int = 1
    seq: int = 2048
    recompute: Recompute = "none"
    optimizer: str = "adam-mixed"
    dtype: str = "bf16"
    schedule: str = "1f1b"
    interleave: int = 1
    cp_kind: str = "ring"
    dp_kind: str = "bucketed"
    bucket_mb: float = 25.0
    zero_unit: str = "block"
    zero1_reduce: str = "reduce_scatter"
    zero2_accumulate: str = "unsharded"
    attention: str = "eager"
    mlp: str = "eager"
    pp_split: str = "layers"
    loss_chunk: int = 0
    ep: int = 1

    def __post_init__(self) -> None:
        o = "Plan"
        for f in ("dp", "tp", "pp", "cp", "micro_batch", "grad_accum", "seq", "interleave", "ep"):
            check_positive_int(o, f, getattr(self, f))
        if self.zero not in (0, 1, 2, 3) or isinstance(self.zero, bool):
            raise ParallelLabError(f"Plan.zero={self.zero!r} is not a ZeRO stage; "
                                   "pick zero in {0, 1, 2, 3}")
        check_choice(o, "recompute", self.recompute, RECOMPUTE)
        check_choice(o, "optimizer", self.optimizer, tuple(OPTIMIZERS))
        check_choice(o, "dtype", self.dtype, tuple(DTYPE_BYTES))
        check_choice(o, "schedule", self.schedule, SCHEDULES)
        check_choice(o, "cp_kind", self.cp_kind, CP_KINDS)
        check_choice(o, "dp_kind", self.dp_kind, DP_KINDS)
        check_choice(o, "zero_unit", self.zero_unit, ZERO_UNITS)
        check_zero_variants(self.zero, self.zero1_reduce, self.zero2_accumulate)
        check_choice(o, "attention", self.attention, ATTENTION_KINDS)
        check_choice(o, "mlp", self.mlp, MLP_KINDS)
        check_choice(o, "pp_split", self.pp_split, PP_SPLITS)
        if isinstance(self.loss_chunk, bool) or not isinstance(self.loss_chunk, int) or self.loss_chunk < 0:
            raise ParallelLabError(f"Plan.loss_chunk={self.loss_chunk!r} must be an integer >= 0 "
                                   "(tokens per cross-entropy chunk; 0: the whole logits at once); e.g. 1024")
        if not isinstance(self.sp, bool):
            raise ParallelLabError(f"Plan.sp={self.sp!r} must be True or False")
        check_real(o, "bucket_mb", self.bucket_mb)
        if not self.bucket_mb > 0:
            raise ParallelLabError(f"Plan.bucket_mb={self.bucket_mb} must be > 0; e.g. bucket_mb=25")
        if self.sp and self.tp == 1:
            raise ParallelLabError("sequence parallelism (sp=True) needs tp > 1; "
                                   "set tp=2 or more, or sp=False")
        if self.dp % self.ep:
            raise ParallelLabError(f"ep={self.ep} does not divide dp={self.dp}: expert parallelism borrows its "
                                   f"ranks from data parallelism (docs/moe.md); "
                                   f"pick ep in {fmt_set(divisors(self.dp))}")
        if self.ep > 1 and self.zero:
            raise ParallelLabError(f"zero={self.zero} with ep={self.ep}: ZeRO over the expert-data-parallel groups "
                                   "is not modelled here; use zero=0 with expert parallelism")
        if self.zero and self.dp == 1:
            raise ParallelLabError(f"zero={self.zero} shards over data-parallel ranks but dp=1; "
                                   "set dp >= 2 or zero=0")
        if self.interleave > 1 and self.schedule != "interleaved":
            raise ParallelLabError(f"interleave={self.interleave} needs schedule='interleaved' "
                                   f"(got {self.schedule!r}); or set interleave=1")
        if self.schedule == "interleaved" and self.pp > 1 and self.grad_accum % self.pp:
            ok = [k * self.pp for k in range(1, 5)]
            raise ParallelLabError(
                f"interleaved 1F1B runs micro-batches in groups of pp={self.pp}; "
                f"grad_accum={self.grad_accum} is not a multiple of it; pick grad_accum in {fmt_set(ok)}"
            )

    # ---- derived ----------------------------------------------------------------------------------
    @property
    def world(self) -> int:
        """Number of GPUs (ranks): ``dp * pp * cp * tp``."""
        return self.dp * self.tp * self.pp * self.cp

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step: ``micro_batch * grad_accum * dp``."""
        return self.micro_batch * self.grad_accum * self.dp

    @property
    def global_batch_tokens(self) -> int:
        return self.global_batch * self.seq

    @property
    def microbatches(self) -> int:
        """Micro-batches per step per pipeline: the same number as ``grad_accum``."""
        return self.grad_accum

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def optim(self) -> OptimizerSpec:
        return OPTIMIZERS[self.optimizer]

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The process-grid shape ``(dp, pp, cp, tp)``, outermost first."""
        return (self.dp, self.pp, self.cp, self.tp)

    def with_(self, **changes: Any) -> Plan:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ParallelLabError(f"unknown plan field(s) {unknown}; known fields: {sorted(known)}")
        return cls(**d)

    # ---- validation against a model and a machine ------------------------------------------------
    def validate(self, model: ModelSpec, gpus: int | None = None, cluster: ClusterSpec | None = None) -> Plan:
        """Check that this plan can split ``model`` (and fill ``gpus`` GPUs of ``cluster``); return self."""
        if gpus is not None and self.world != gpus:
            raise ParallelLabError(
                f"dp*tp*pp*cp = {self.dp}*{self.tp}*{self.pp}*{self.cp} = {self.world} but gpus={gpus}; "
                f"the four degrees must multiply to the number of GPUs"
            )
        if self.tp > 1 or self.cp > 1 or self.pp > 1:
            model.require_shape("tensor, pipeline or context parallelism")
        if self.ep > 1 and not model.is_moe:
            raise ParallelLabError(f"ep={self.ep} needs a mixture-of-experts model, but {model.name!r} has no "
                                   "experts; pick --model tiny-moe / mixtral-8x7b, or ep=1")
        if model.is_moe:
            check_ep(model, self)
        if model.shape_known:
            check_cut(model, self)
        if cluster is not None and self.tp > cluster.gpus_per_node:
            raise ParallelLabError(
                f"tp={self.tp} spans more than one node of {cluster.gpus_per_node} GPUs; tensor parallelism "
                f"all-reduces every layer, keep tp <= {cluster.gpus_per_node}"
            )
        return self
