"""What watches a training step: the instruments a step enters once (memory by kind, range
diagnostics, the layer audit), the time and memory probes. Imports nothing else of the runner."""
