"""`python -m runner ...`: the Hydra entry point. Heavy imports wait until the config is valid."""
from __future__ import annotations

import logging
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

import runner.config  # noqa: F401  (registers the schemas before Hydra composes)
from runner import sweep
from runner.errors import RunnerError
from runner.config.finder import config_dir

log = logging.getLogger("runner")


@hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="config")
def main(cfg: DictConfig) -> float | None:
    """One run, or one job of a sweep; returns the best validation accuracy (what an optimising
    sweeper such as Optuna maximises). A failing single run exits non-zero; a failing sweep job is
    recorded and returns NaN so that the sweep goes on (runner.sweep)."""
    hydra_cfg = HydraConfig.get()
    job = {"overrides": list(hydra_cfg.overrides.task), "output_dir": hydra_cfg.runtime.output_dir}
    parent = sweep.job_parent()
    if parent is not None:
        return sweep.run_job(cfg, parent, job_num=int(hydra_cfg.job.num), **job)

    from runner.run.app import run

    try:
        return run(cfg, **job)
    except RunnerError as error:
        log.error("%s", error)
        sys.exit(2)


def cli() -> None:
    """Console-script entry (`amp-runner ...`); Ctrl-C exits 130 and SIGTERM 143 after the run
    (and a sweep's parent run) is marked KILLED (and, from a first signal, checkpointed); a sweep
    that stops early leaves no RUNNING parent behind."""
    sweep.register_resolvers()
    with sweep.launch_scope() as launched:
        try:
            main()
        except KeyboardInterrupt as interrupt:  # Ctrl-C, or SIGTERM after its checkpoint
            launched.close_open("KILLED", str(interrupt) or "interrupted by the user (Ctrl-C)")
            print(f"Interrupted: {interrupt}" if str(interrupt) else "Interrupted.",
                  file=sys.stderr)
            sys.exit(getattr(interrupt, "exit_code", 130))
        except SystemExit as stop:
            if stop.code not in (0, None):
                launched.close_open("FAILED",
                                    f"the sweep stopped early (exit status {stop.code})")
            raise


if __name__ == "__main__":
    cli()
