"""The one error type of parallel_lab.

Every invalid model, cluster, plan or file raises :class:`ParallelLabError` (a ``ValueError``) with a message
that names the bad value and says how to fix it: ``tp=3 does not divide heads=32; pick tp in {1, 2, 4, 8, 16,
32}``. It lives in its own module so that the lowest layer (``layout``) can raise it without importing specs.
"""

from __future__ import annotations


class ParallelLabError(ValueError):
    """The one error type of parallel_lab: an invalid model, cluster or plan, named with its fix."""
