"""Benchmarks: ``python -m bench`` (``make bench``) runs every ``bench/bench_*.py`` module's ``main()``.

Each module prints ratios measured side by side in one run; nothing here asserts a timing.
"""
