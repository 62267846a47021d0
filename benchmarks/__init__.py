"""The benchmarks: scripts that measure the runner, run as modules from the repository root
(`python -m benchmarks.levels`); benchmarks/README.md says what each measures."""
