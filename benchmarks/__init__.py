"""Benchmarks for lightning_autosp; run from the repository root, e.g. ``python -m benchmarks.sac``."""
