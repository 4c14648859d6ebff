"""Files a user names on the command line, read safely: a regular file, of bounded size, within a time.

Every file argument (plan files, ``calibrate --runs``, profiles, schedule CSVs) goes through
:func:`read_bounded`: the path must name a regular file (a directory, a FIFO, a socket or a device such as
``/dev/zero`` is refused before it is read: opening a FIFO waits for a writer forever), of at most
``max_bytes``; it is opened non-blocking and checked again on the open descriptor (the path may change in
between), then read in chunks until end of file, the size bound or the deadline (``timeout_s``, a slow network
file system). Every refusal is a :class:`ParallelLabError` naming the path and the fix.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from time import monotonic

from .errors import ParallelLabError

READ_TIMEOUT_S = 5.0           #: seconds to read one input file
_CHUNK = 64 * 1024


def _kind(mode: int) -> str:
    """What a non-regular file is, in words."""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"


def _check(where: str, what: str, st: os.stat_result, max_bytes: int) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise ParallelLabError(f"{where} is {_kind(st.st_mode)}; give a regular file")
    if st.st_size > max_bytes:
        raise ParallelLabError(f"{where} is {st.st_size:,} bytes; a {what} is at most {max_bytes:,} (is it the "
                               f"right file?)")


def read_bounded(path: str | Path, what: str, max_bytes: int, timeout_s: float = READ_TIMEOUT_S) -> bytes:
    """The bytes of the regular file ``path`` (``what`` names it in messages: "plan file", "runs file"),
    at most ``max_bytes``, read within ``timeout_s`` seconds."""
    text = str(path)
    where = f"{what} {text[:200]}"
    if not text.strip():
        raise ParallelLabError(f"{what} '': no path given; name a file")
    if "\x00" in text:
        raise ParallelLabError(f"{what} {text[:200]!r}: a path cannot contain a NUL byte; name a file")
    deadline = monotonic() + timeout_s
    try:
        _check(where, what, os.stat(text), max_bytes)
        fd = os.open(text, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    except OSError as e:
        raise ParallelLabError(f"{where}: cannot be read ({e.strerror or e}); check the path") from None
    try:
        _check(where, what, os.fstat(fd), max_bytes)          # the path may have been replaced since the stat
        chunks, size = [], 0
        while size <= max_bytes:
            if monotonic() > deadline:
                raise ParallelLabError(f"{where}: reading it took over {timeout_s:g} s; copy it to a local disk")
            chunk = os.read(fd, min(_CHUNK, max_bytes + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as e:
        raise ParallelLabError(f"{where}: cannot be read ({e.strerror or e}); check the file") from None
    finally:
        os.close(fd)
    if size > max_bytes:
        raise ParallelLabError(f"{where} grew past {max_bytes:,} bytes, the most a {what} may have, while it was "
                               f"read; give a file that is not being written")
    return b"".join(chunks)


def read_text(path: str | Path, what: str, max_bytes: int, timeout_s: float = READ_TIMEOUT_S) -> str:
    """:func:`read_bounded`, decoded as UTF-8 (a file that is not is refused, naming the byte)."""
    raw = read_bounded(path, what, max_bytes, timeout_s)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ParallelLabError(f"{what} {str(path)[:200]} is not UTF-8 text (byte {e.start}: "
                               f"{raw[e.start:e.start + 1]!r}); save it as UTF-8") from None


#: Inclusive ranges of the integer flags (the bound keeps every call fast and small; see the docstring).
#: The ledger's cost grows as pp x layers (every stage's parameters, ~0.1 ms per pair here), the planner's
#: with the divisors of the GPU count: 512 layers (published models have <= 126), 64 stages and 2^17 GPUs
#: (Llama 3 405B trained on 16,384) keep each call under a second on a 2-core laptop.
LIMITS: dict[str, tuple[int, int]] = {
    "layers": (1, 512), "hidden": (1, 2**20), "heads": (1, 2**16), "kv_heads": (1, 2**16),
    "ffn": (1, 2**24), "vocab": (1, 2**24), "seq": (1, 2**24), "micro_batch": (1, 2**16),
    "grad_accum": (1, 2**20), "dp": (1, 2**17), "tp": (1, 2**17), "pp": (1, 64), "cp": (1, 2**17),
    "interleave": (1, 512), "gpus": (1, 2**17), "stage": (0, 63), "global_batch": (1, 2**30),
    "stages": (1, 2**20), "microbatches": (1, 2**20), "width": (20, 10_000), "top": (1, 10_000),
    "max_tp": (1, 2**17), "steps": (1, 100_000), "seed": (0, 2**63 - 1), "zero": (0, 3),
    "experts": (1, 2**16), "top_k": (1, 2**16), "expert_ffn": (1, 2**24), "ep": (1, 2**17), "nproc": (1, 64),
}

#: The ranges of the numbers a plan file gives: the command line's (:data:`LIMITS`) for every field a flag also
#: sets (``experts`` from 0: a dense model), and as wide for the rest (a cluster has no flags: its bounds keep
#: sums and products finite, far above any GPU). Integers ``(lo, hi)``, floats ``(lo, hi)``.
PLAN_FILE_LIMITS: dict[str, dict[str, tuple[float, float]]] = {
    "model": {**{k: LIMITS[k] for k in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "top_k",
                                        "expert_ffn")},
              "experts": (0, LIMITS["experts"][1]), "max_positions": (1, 2**24), "shared_experts": (0, 2**16),
              "first_dense": (0, 512), "n_params_override": (1, 10**16), "capacity_factor": (0.0, 1e15),
              "aux_loss_coef": (0.0, 1e15), "dropout": (0.0, 1.0)},
    "plan": {**{k: LIMITS[k] for k in ("dp", "tp", "pp", "cp", "ep", "zero", "micro_batch", "grad_accum", "seq",
                                       "interleave")},
             "loss_chunk": (0, 2**24), "bucket_mb": (0.0, 1e15)},
    "cluster": {"gpus_per_node": (1, 2**17), "hbm_bytes": (0.0, 1e15), "peak_flops": (0.0, 1e18),
                "mfu_achievable": (0.0, 1.0), "hbm_bandwidth": (0.0, 1e15)},
    "link": {"bandwidth": (0.0, 1e15), "latency": (0.0, 60.0)},
    "profile": {"matmul_efficiency": (0.0, 1.0), "half_width": (0.0, 1e15), "attention_efficiency": (0.0, 1.0),
                "overhead_s": (0.0, 60.0), "tp_overlap": (0.0, 1.0),
                "hbm_efficiency": (0.0, 1.0)},
    "gpus": {"gpus": LIMITS["gpus"]},
}
MAX_NAME = 100       #: characters of a name in a plan file (model, cluster, link, profile source)
