"""DualPipe's overlap: the forward chunk of one micro-batch beside the backward chunk of another.

Pure Python. In expert parallelism each chunk of a micro-batch sends its tokens to the experts and back
(the all-to-all's dispatch and combine). Run one after the other, a rank's (forward, backward) pair takes
``f + b + comm_f + comm_b``. DualPipe (DeepSeek-AI, DeepSeek-V3 technical report, 2024, section 3.2.1) runs a
forward chunk of one micro-batch and a backward chunk of another together: while one's all-to-all is on the
wire the other computes, so with the compute stream and the communication stream fully overlapped the pair
takes ``max(f + b, comm_f + comm_b)`` and only the excess communication is exposed. Zero-bubble's split of
the backward into B (input gradient) and W (weight gradient) fills the pipeline's bubble; it does not hide
this communication (:func:`pair_time` with ``overlap=False`` whatever the split).
"""

from __future__ import annotations


def pair_time(f: float, b: float, comm_f: float, comm_b: float, overlap: bool) -> float:
    """Time of one (forward, backward) pair of chunks: serial, or overlapped on two streams (DualPipe)."""
    compute, comm = f + b, comm_f + comm_b
    return max(compute, comm) if overlap else compute + comm


def exposed_comm(f: float, b: float, comm_f: float, comm_b: float, overlap: bool) -> float:
    """Communication time of a pair that no computation hides: all of it serial, the excess overlapped."""
    return pair_time(f, b, comm_f, comm_b, overlap) - (f + b)
