"""Benchmarks: every method on the same prompts in one run, machine-readable results."""
