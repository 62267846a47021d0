"""In-process tests of the runner's parts on tiny tensors and models (no CLI, no subprocess)."""
