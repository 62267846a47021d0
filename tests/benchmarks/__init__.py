"""Smoke tests of the scripts in benchmarks/: a tiny budget, the result files' structure, never a
timing."""
