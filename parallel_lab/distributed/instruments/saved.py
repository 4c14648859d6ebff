"""The saved-tensor meter: activations measured as the bytes autograd saves for backward.

``torch.autograd.graph.saved_tensors_hooks`` sees every tensor an op keeps for its backward. The meter
charges each one its whole *storage* (a saved view keeps its base alive, so a view costs its base's
bytes), each storage once while any saved reference to it lives, and skips storages that belong to
parameters (the weight a linear saves, or a transposed view of it) and storages excluded by the caller
(a gathered parameter buffer). It keeps the live total per ledger category and its peak, so a pipeline
schedule that holds several micro-batches shows its in-flight peak::

    peak["activations"] = max over time of  sum of storage bytes saved by the blocks and still alive

Scopes name where a storage was first saved (``tok_emb``, ``blocks.{i}``, ``final_norm``, ``lm_head``)
and map to the ledger's categories ``activations`` and ``logits_and_loss``; ``activations.per_op_bytes``
predicts ``forward_bytes`` per scope and the tests compare the two byte for byte.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from torch import Tensor, nn
from torch.autograd.graph import saved_tensors_hooks

from parallel_lab.distributed import probe
from parallel_lab.distributed.model.state import storage_key


class _Saved:
    """What the pack hook returns: holds the tensor; its death releases the storage's charge."""

    __slots__ = ("tensor", "key", "meter", "__weakref__")

    def __init__(self, tensor: Tensor, key: tuple[int, str] | None, meter: SavedTensorMeter):
        self.tensor, self.key, self.meter = tensor, key, meter

    def __del__(self) -> None:
        if self.key is not None:
            self.meter._release(self.key)


#: Modules whose forward starts a scope, and the ledger category the scope belongs to.
DEFAULT_SCOPES = {"tok_emb": "activations", "pos_emb": "activations", "blocks.": "activations",
                  "final_norm": "logits_and_loss", "lm_head": "logits_and_loss"}


class SavedTensorMeter:
    """Bytes saved for backward, by storage, charged to the scope (module) that first saves them.

    Usage::

        meter = SavedTensorMeter(model)          # registers forward pre-hooks for the scopes
        with meter:                              # forward (and backward) of one or more micro-batches
            loss = loss_fn(model(x), y); loss.backward()
        meter.peak["activations"], meter.forward_bytes["blocks.1"], meter.peak_total

    ``model``: its parameters are excluded (their storages are looked up again whenever a scope starts and
    at ``__enter__``, after the hooks of other plug-ins that gather parameters, so parameters
    re-materialised by ZeRO-3 are excluded too; looking them up at every save doubled a tiny model's
    forward time); :meth:`exclude` adds other storages that are not activations (the implementations say so
through ``probe.not_activations``: the meter listens to the probe until :meth:`remove`). Scopes:
    a module whose name is in ``scopes`` (exact, or a prefix ending in ".": ``"blocks."`` gives
    ``blocks.0``, ``blocks.1``...) starts a scope when its forward begins; the scope lasts until the next
    one starts. ``forward_bytes[scope]`` counts storages newly charged in that scope (first save wins);
    ``live[category]`` and ``peak[category]`` are the bytes alive now and at the peak.
    """

    def __init__(self, model: nn.Module | None = None, scopes: dict[str, str] | None = None):
        self.model = model
        self.scopes = DEFAULT_SCOPES if scopes is None else scopes
        self._excluded: set[tuple[int, str]] = set()
        self._charged: dict[tuple[int, str], list] = {}   # key -> [nbytes, refs, category]
        self.scope, self.category = "activations", "activations"
        self._param_keys: set[tuple[int, str]] = set()
        self.forward_bytes: Counter = Counter()
        self.live: Counter = Counter()
        self.peak: Counter = Counter()
        self.peak_total = 0
        self._handles: list[Any] = []
        self._hooks: saved_tensors_hooks | None = None
        if model is not None:
            self.watch(model)
        probe.install(self)

    # ---- scopes ----------------------------------------------------------------------------------
    def _category_of(self, name: str) -> str | None:
        for key, cat in self.scopes.items():
            if name == key or (key.endswith(".") and name.startswith(key) and "." not in name[len(key):]):
                return cat
        return None

    def watch(self, model: nn.Module) -> None:
        for name, module in model.named_modules():
            if hasattr(module, "sac_meter"):      # op-level checkpointing keeps outputs outside autograd
                module.sac_meter = self
            cat = self._category_of(name)
            if cat is not None:
                self._handles.append(module.register_forward_pre_hook(self._enter_scope(name, cat)))

    def _enter_scope(self, name: str, category: str):
        def hook(module: nn.Module, args: Any) -> None:
            self.scope, self.category = name, category
            self._refresh_parameters()
        return hook

    def _refresh_parameters(self) -> None:
        if self.model is not None:
            self._param_keys = {storage_key(p) for p in self.model.parameters()}

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        probe.uninstall(self)

    def sample(self, part: str, tensors: Any, nbytes: int | None) -> None:
        """The probe's buffer samples are the comm tracer's."""

    # ---- exclusion -------------------------------------------------------------------------------
    def exclude(self, *tensors: Tensor) -> None:
        """Storages that are not activations (e.g. a gathered flat parameter buffer)."""
        for t in tensors:
            self._excluded.add(storage_key(t))

    def include(self, *tensors: Tensor) -> None:
        """Undo :meth:`exclude`; call it before the storage is freed (its address may be reused)."""
        for t in tensors:
            self._excluded.discard(storage_key(t))

    def _is_excluded(self, key: tuple[int, str]) -> bool:
        return key in self._excluded or key in self._param_keys

    # ---- hooks -----------------------------------------------------------------------------------
    def _pack(self, t: Tensor) -> _Saved:
        # Keep a detached alias (same storage): a tensor an op saves may be that op's own output, and holding
        # it with its grad_fn would make a reference cycle through the autograd graph (node -> saved ->
        # tensor -> node) that Python's gc cannot see, leaking any graph that is not consumed by an ordinary
        # backward (a forward without backward, or the nodes a pipeline's weight-gradient pass skips).
        # Autograd re-attaches the grad_fn on unpack.
        n = t.untyped_storage().nbytes()
        key = storage_key(t)
        t = t.detach()
        if n == 0 or self._is_excluded(key):
            return _Saved(t, None, self)
        entry = self._charged.get(key)
        if entry is None:
            entry = self._charged[key] = [n, 0, self.category]
            self.forward_bytes[self.scope] += n
            self.live[self.category] += n
            self.peak[self.category] = max(self.peak[self.category], self.live[self.category])
            self.peak_total = max(self.peak_total, sum(self.live.values()))
        entry[1] += 1
        return _Saved(t, key, self)

    def hold(self, t: Tensor) -> _Saved:
        """Charge a tensor kept for backward outside autograd's saved tensors (checkpoint's op-level cache,
        ``distributed/kernels.op_sac_context``) to the current scope; the charge lasts while the returned
        token lives."""
        return self._pack(t)

    @staticmethod
    def _unpack(s: _Saved) -> Tensor:
        return s.tensor

    def _release(self, key: tuple[int, str]) -> None:
        entry = self._charged.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del self._charged[key]
            self.live[entry[2]] -= entry[0]

    def reset(self) -> None:
        """Forget the per-scope counts and peaks (live storages stay charged)."""
        self.forward_bytes.clear()
        self.peak = Counter(self.live)
        self.peak_total = sum(self.live.values())

    def __enter__(self) -> SavedTensorMeter:
        self.scope, self.category = "activations", "activations"
        self._refresh_parameters()
        self._hooks = saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._hooks is not None
        self._hooks.__exit__(*exc)
        self._hooks = None

    @property
    def live_total(self) -> int:
        return sum(self.live.values())


