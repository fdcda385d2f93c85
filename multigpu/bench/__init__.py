"""Benchmarks behind ``multigpu bench`` and ``multigpu calibrate``: ``runs`` (configurations in fresh
processes), ``worker`` (the per-rank program) and ``models`` (the built-in models and synthetic data)."""
