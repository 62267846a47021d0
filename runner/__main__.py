"""`python -m runner ...`: the Hydra entry point. Heavy imports wait until the config is valid."""
from __future__ import annotations

import logging
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

import runner.config  # noqa: F401  (registers the schemas before Hydra composes)
from runner.errors import RunnerError
from runner.paths import config_dir

log = logging.getLogger("runner")


@hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="config")
def main(cfg: DictConfig) -> float | None:
    from runner.app import run

    hydra_cfg = HydraConfig.get()
    try:
        return run(
            cfg,
            overrides=list(hydra_cfg.overrides.task),
            output_dir=hydra_cfg.runtime.output_dir,
        )
    except RunnerError as error:
        log.error("%s", error)
        sys.exit(2)


def cli() -> None:
    """Console-script entry (`amp-runner ...`); Ctrl-C exits 130 after the run is marked KILLED."""
    try:
        main()
    except KeyboardInterrupt:
        print("Interrupted.", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    cli()
