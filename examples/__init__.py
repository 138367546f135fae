"""Runnable examples for lightning_autosp; importable from the repository root as ``examples``."""
