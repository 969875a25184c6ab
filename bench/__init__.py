"""Benchmarks: each prints JSON, warms up first, and compares against its anchor in one run."""
