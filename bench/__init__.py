"""Benchmarks: each `bench_NAME` module exposes `run(...) -> dict`; `python -m bench` runs them all."""
