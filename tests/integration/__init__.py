"""Tests through the CLI, subprocesses, real MLflow stores and servers, Hydra sweeps, torchrun and
end-to-end runs."""
