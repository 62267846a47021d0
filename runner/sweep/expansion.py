"""What a sweep's jobs are: every job's overrides as Hydra's basic sweeper expands them
(`sweep_jobs`), the overrides that make the sweep (`sweep_overrides`), the keys whose values
differ between its jobs (`varying_keys`) and what tells a job's run apart from the others'
(`job_label`); and what to say where a config defines a sweep the command does not run
(`unswept`)."""

from __future__ import annotations

from collections.abc import Sequence

from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"


def sweep_jobs(config: DictConfig) -> list[list[str]] | None:
    """Every job's overrides, expanded as Hydra's basic sweeper will (`hydra.sweeper.params`, then
    the command line); None for another sweeper (Optuna, ...), whose jobs are known only later."""
    if OmegaConf.select(config, "hydra.sweeper._target_") != BASIC_SWEEPER:
        return None
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    params = OmegaConf.select(config, "hydra.sweeper.params") or {}
    arguments = [f"{key}={value}" for key, value in params.items()]
    arguments += list(config.hydra.overrides.task)
    parsed = OverridesParser.create().parse_overrides(arguments)
    return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


def sweep_overrides(config: DictConfig) -> list[str]:
    """The overrides that make this a sweep (`precision=o0,o1`, `+experiment=...`), for naming."""
    arguments = list(config.hydra.overrides.task)
    parsed = OverridesParser.create().parse_overrides(arguments)
    return [
        text
        for text, o in zip(arguments, parsed)
        if o.is_sweep_override() or o.get_key_element().lstrip("+~") == "experiment"
    ]


def unswept(hydra_config: DictConfig, cfg: DictConfig, command: str) -> str | None:
    """What to say where the config defines a sweep (`hydra.sweeper.params`: an experiment
    file's) but the command has no `-m`: Hydra then runs one job with the config's own values,
    silently (`+experiment=gpt_precisions` trained O0 alone). None where it defines none.
    `command`: the command line with `-m` added, to paste."""
    from hydra.types import RunMode

    params = OmegaConf.select(hydra_config, "sweeper.params") or {}
    if not params or hydra_config.mode != RunMode.RUN:  # (a job of a sweep: -m was given)
        return None
    choices = OmegaConf.select(hydra_config, "runtime.choices") or {}
    swept, runs = [], []
    for key, values in params.items():
        swept.append(f"{key} over {values}")
        name = str(key).lstrip("+~")
        value = choices[name] if name in choices else OmegaConf.select(cfg, name, default=None)
        if value is None and str(key).startswith("+"):  # (a group or key the sweep adds)
            runs.append(f"without {key}")
        else:
            runs.append(f"{name}={'null' if value is None else value}")
    jobs = sweep_jobs(OmegaConf.create({"hydra": hydra_config}))
    count = f" ({len(jobs)} jobs)" if jobs else ""
    return (
        f"The config defines a sweep{count}: {'; '.join(swept)} (hydra.sweeper.params), but "
        f"without -m Hydra runs one job, {', '.join(runs)}. To run the sweep: {command}"
    )


# the keys a run's name tells already (`<model>-<level>`): not repeated after it
NAMED_KEYS = ("model", "model._target_", "model.arch", "model.name", "precision")


def varying_keys(config: DictConfig) -> list[str]:
    """The keys (as the overrides spell them, without `+` or `~`) whose values differ between the
    jobs of the basic sweeper's expansion, in the order they are given, but those a run's name
    tells already (the model and the precision preset); [] for another sweeper (Optuna), whose
    jobs are known only as they run."""
    jobs = sweep_jobs(config) or []
    values: dict[str, list[str | None]] = {}
    for number, job in enumerate(jobs):
        for key, value in _assignments(job).items():
            values.setdefault(key, [None] * len(jobs))[number] = value
    return [k for k, v in values.items() if len(set(v)) > 1 and k not in NAMED_KEYS]


def _assignments(overrides: Sequence[str]) -> dict[str, str]:
    """{key: value} of `key=value` overrides (`+` and `~` dropped; the last of a key wins)."""
    out: dict[str, str] = {}
    for text in overrides:
        key, sign, value = text.partition("=")
        if sign:
            out[key.lstrip("+~")] = value
    return out


def job_label(
    overrides: Sequence[str], varying: Sequence[str], job_num: int, sweeper: str = BASIC_SWEEPER
) -> str:
    """What tells a sweep job's run apart from the other jobs' (added to its `<model>-<level>`
    name): the job's values of the `varying` keys, `lr=0.1 seed=2` (each key by its last part
    where no other varying key shares it, else in full); under another sweeper than the basic
    one (Optuna), whose values are drawn as it goes, the trial's number, `trial 3`."""
    if sweeper and sweeper != BASIC_SWEEPER:
        return f"trial {job_num}"
    last = [key.rsplit(".", 1)[-1] for key in varying]
    given = _assignments(overrides)
    return " ".join(
        f"{short if last.count(short) == 1 else key}={given[key]}"
        for key, short in zip(varying, last)
        if key in given
    )
