"""amp-runner: declarative mixed-precision training experiments (Apex O0-O3 on modern PyTorch).

The package is a house of rooms, imports pointing down only (a test holds it so):
- entry points users type: `__main__` (`python -m runner`), `sweep/` (a multirun as one MLflow
  parent run), `report/` (the comparison of a sweep's runs), `diagnose/` (a pre-flight of a
  model's ranges), `replay` (offline records sent to a store);
- `run/`: one run from its config to its record (plan, build, train, checkpoints);
- `tasks/`: what a batch, the loss and the metrics are;
- `components/` (models, data, optimizers), `tracking/` (where runs are recorded), `measure/`
  (what a step is measured by), `precision/` (the levels' properties and the engine), `csrc/`
  (the engine's C++/CUDA kernels);
- `config/`: the typed schema, the property table, the option specs (never imports torch);
- the bottom floor: `errors` (what a user can fix) and `files` (atomic writes, file locks).
"""

__version__ = "0.1.0"


def version_line() -> str:
    """What `--version` prints: this package's version and those of what it runs on, read from
    the installed packages' metadata (nothing imported: torch alone takes seconds)."""
    import platform
    from importlib import metadata

    found = []
    for package, name in (("torch", "torch"), ("hydra-core", "Hydra"), ("mlflow", "MLflow")):
        try:
            found.append(f"{name} {metadata.version(package)}")
        except metadata.PackageNotFoundError:
            pass
    found.append(f"Python {platform.python_version()}")
    return f"amp-runner {__version__} ({', '.join(found)})"
