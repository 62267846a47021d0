"""What a training step is measured by: the instruments a step enters once (instruments.py),
time and peak memory (probes.py), memory by kind (memory.py), where a 16-bit or 8-bit format
loses values (diagnostics.py, run_diagnostics.py) and the dtypes each layer computed in
(audit.py). It imports nothing else of the runner, so the trainer, the benchmarks and the
diagnose command use it alike."""
