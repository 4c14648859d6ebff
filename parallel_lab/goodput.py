"""Goodput of a long job: checkpoints against failures, and the slow rank among thousands.

Pure Python. A job checkpoints every ``interval`` seconds of work, each checkpoint stalls it ``checkpoint``
seconds, and failures arrive at random with mean time between them ``mtbf`` (the job's: one GPU's MTBF over
the number of GPUs, :func:`job_mtbf`). A failure loses on average half an interval of work plus the
``restart`` time. To first order (Young 1974) the wasted fraction of wall time is
``checkpoint / interval + (interval / 2 + restart) / mtbf``, least at ``interval = sqrt(2 checkpoint mtbf)``
(:func:`optimal_interval`; Daly 2006 refines it when the checkpoint is not small against the MTBF).
A synchronous step waits for its slowest rank: if each of ``n`` ranks is slow with probability ``p``, the
step is clean with probability ``(1 - p) ** n`` (:func:`p_no_slow_rank`).

Llama 3's training (Dubey et al. 2024, section 3.3.4): 466 job interruptions in a 54-day snapshot on up to
16,384 H100 GPUs, 419 of them unexpected (:data:`LLAMA3_RELIABILITY`).
"""

from __future__ import annotations

import math

#: Dubey et al. 2024 ("The Llama 3 Herd of Models"), section 3.3.4: the 54-day snapshot of pre-training.
LLAMA3_RELIABILITY = {"days": 54, "interruptions": 466, "unexpected": 419, "gpus": 16384}


def job_mtbf(gpu_mtbf_s: float, n_gpus: int) -> float:
    """Mean time between failures of a job on ``n_gpus`` independent GPUs: any one failing stops it."""
    return gpu_mtbf_s / n_gpus


def llama3_job_mtbf_s() -> float:
    """Seconds between unexpected interruptions in Llama 3's snapshot: 54 days / 419 (about 3.1 h)."""
    r = LLAMA3_RELIABILITY
    return r["days"] * 86400 / r["unexpected"]


def optimal_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Young's optimal seconds of work between checkpoints, ``sqrt(2 checkpoint mtbf)``."""
    return math.sqrt(2 * checkpoint_s * mtbf_s)


def goodput(interval_s: float, checkpoint_s: float, mtbf_s: float, restart_s: float = 0.0) -> float:
    """Useful time over wall time, first order: ``1 - checkpoint/interval - (interval/2 + restart)/mtbf``
    (floored at 0)."""
    return max(0.0, 1 - checkpoint_s / interval_s - (interval_s / 2 + restart_s) / mtbf_s)


def p_no_slow_rank(p_slow: float, n_ranks: int) -> float:
    """Probability that none of ``n_ranks`` ranks, each slow with probability ``p_slow``, is slow."""
    return (1 - p_slow) ** n_ranks


def expected_step(step_s: float, slowdown: float, p_slow: float, n_ranks: int) -> float:
    """Mean step time when the step waits for the slowest rank and a slow rank takes ``slowdown`` x longer."""
    return step_s * (1 + (slowdown - 1) * (1 - p_no_slow_rank(p_slow, n_ranks)))


def bisection_rounds(n_ranks: int) -> int:
    """Test rounds to find one slow rank by halving the suspects (each round times half of them)."""
    return math.ceil(math.log2(n_ranks)) if n_ranks > 1 else 0
