"""trainer.tune: measured on the run's own model, kept apart from the run, cached, never over
what the user gave."""

from __future__ import annotations

import json
import logging
import math
import re
import signal
import time
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf

from runner.config import TUNABLE
from runner.precision.checks import DeviceInfo
from runner.run import recorded, tune, tune_cache, tune_data, tune_decision, tune_measure
from runner.run.build import build
from runner.run.distributed import Comm
from runner.run.measured import measured_plan
from runner.run.plan import make_plan
from runner.run.recorded import Launch
from tests.helpers.held_data import HELD, HELD_DATA, HOLD_AFTER
from tests.helpers.images import write_image_folder
from tests.helpers.resume import last_checkpoint, settings
from tests.helpers.runs import FAST, compose_config, read_until, run_in_process, start_cli
from tests.helpers.store import all_runs, history, runs_by_name

CPU = torch.device("cpu")
ON = [*FAST, "trainer.tune=on"]
WORKERS = tune_data.WORKERS


def images(tmp_path) -> list[str]:
    """A run reading real files (an ImageFolder of PNGs), its loader's workers left to tune."""
    root = tmp_path / "images"
    if not root.exists():
        write_image_folder(root, per_class={"train": 24, "val": 4})
    overrides = [o for o in FAST if not o.startswith(("data", "trainer.batch_size", WORKERS))]
    data = ["data=imagefolder", f"data.root={root}", "data.image_size=16"]
    return [*overrides, *data, "trainer.batch_size=4"]


@pytest.fixture
def cache(tmp_path):
    """trainer.tune's cache folder (tests/conftest.py gives each test its own)."""
    return tmp_path / "tune-cache"


def tuned(*overrides: str):
    """(the run's plan, what tuning decided) for the command `overrides`, as a run makes them."""
    given = make_plan(compose_config(*overrides))
    return measured_plan(given, Comm(), CPU, Launch(tuple(overrides)))


def lasting(steps: int) -> list[str]:
    """The overrides of a run of `steps` training steps (one batch an epoch), for tuning to weigh
    what a compile repays."""
    return ["trainer.limit_train_batches=1", f"trainer.max_epochs={steps}"]


def test_a_given_setting_is_kept_and_a_second_run_reuses_the_decision(cache):
    given = [*ON, "trainer.channels_last=false"]
    plan, first = tuned(*given)
    assert first.source == "measured"
    assert first.reasons["trainer.channels_last"] == "kept: given"
    assert plan.cfg.trainer.channels_last is False
    assert all("trainer.channels_last" not in row.settings for row in first.rows)
    assert "tune.trainer.channels_last" in first.params()
    assert first.reasons[WORKERS] == "kept: given" and first.loader == []  # (FAST gives 0)
    assert len(list(cache.glob("*.json"))) == 1
    again, second = tuned(*given)  # the same configuration: no candidate is built again
    assert second.source == "cache"
    assert [r.steady_ms for r in second.rows] == [r.steady_ms for r in first.rows]
    assert again.config_tree == plan.config_tree
    _, third = tuned(*given[:-1], "trainer.tune=refresh", given[-1])
    assert third.source == "measured"


def test_measuring_says_what_it_times_as_it_goes(tmp_path, cache, caplog):
    """Tuning took a minute on ResNet-18 (CPU) without a word between the precision table and
    its decision: it says what it times, then each candidate's step as it is measured."""
    caplog.set_level("INFO", logger="runner.run")
    _, tuning = tuned(*images(tmp_path), "trainer.tune=on")
    said = caplog.text
    assert (
        "trainer.tune: timing the untuned settings on a copy of the run, then candidates for "
        in said
    )
    assert f"trainer.tune: untuned: {tuning.rows[0].steady_ms:.1f} ms a steady step" in said
    assert said.index("trainer.tune: untuned:") < said.index("trainer.tune (measured")
    candidates = tuning.rows[1:]
    assert candidates
    for row in candidates:  # (one skipped or refused says why, as before)
        told = f" {row.note}" if row.note else f": {row.steady_ms:.1f} ms a steady step"
        assert f"trainer.tune: {tune_decision.named(row.settings)}{told}" in said
    assert "trainer.tune: timing the data loader for trainer.num_workers" in said
    _, again = tuned(*images(tmp_path), "trainer.tune=on")  # from the cache: nothing timed
    assert again.source == "cache" and caplog.text.count("trainer.tune: untuned:") == 1


def test_the_loader_workers_are_measured_where_the_run_reads_files(tmp_path, cache):
    plan, tuning = tuned(*images(tmp_path), "trainer.tune=on")
    assert [r.settings[WORKERS] for r in tuning.loader] == tune_data.counts(2, tune_data.cpus())
    assert all(r.steady_ms > 0 and not r.note for r in tuning.loader)
    step_ms = tuning.rows[tuning.chosen].steady_ms
    best = tune_data.choose(tuning.loader, step_ms, None)
    assert plan.cfg.trainer.num_workers == tuning.settings[WORKERS] == best.settings[WORKERS]
    assert tuning.reasons[WORKERS].startswith(("tuned: ", "kept: "))
    assert "ms a batch against a" in tuning.params()[f"tune.{WORKERS}"]
    assert "| loader | ms/batch | start-up s | chosen |" in tuning.table()
    assert f"| {WORKERS}={best.settings[WORKERS]} | " in tuning.table()
    # a CPU run never pins: nothing to measure
    assert tuning.reasons[tune_data.PIN] == "not tuned: nothing to measure on this device"
    assert tune_data.PIN not in tuning.settings and plan.cfg.trainer.pin_memory is None
    # cached with the model's rows: the second run measures nothing
    again, second = tuned(*images(tmp_path), "trainer.tune=on")
    assert second.source == "cache" and second.loader == tuning.loader
    assert again.cfg.trainer.num_workers == plan.cfg.trainer.num_workers
    _, other = tuned(*images(tmp_path / "other"), "trainer.tune=on")
    assert other.source == "measured"  # other data (data.root): another configuration


def test_data_in_memory_keeps_its_workers_with_the_reason_the_data_wait_advice_gives():
    """Tokens in memory (data=synthetic_text): a batch is its collation alone, so the workers
    are no candidate, and the data-wait advice says what waits instead of adding workers; the
    synthetic images, each drawn and upsampled, are a candidate."""
    from runner.run.step_timing import data_advice

    text = ["model=gpt_tiny", "data=synthetic_text", "data.block_size=32", "data.num_train=4097"]
    overrides = [o for o in ON if not o.startswith((WORKERS, "data", "model"))] + text
    plan, tuning = tuned(*overrides)
    assert tuning.reasons[WORKERS].startswith("kept: data=synthetic_text is sliced from tokens")
    assert "workers gain nothing" in tuning.reasons[WORKERS]
    assert plan.cfg.trainer.num_workers == 2 and tuning.loader == []
    parts = build(plan)
    try:
        advice = data_advice(parts.train_loader, CPU)
    finally:
        parts.close()
    assert "collation" in advice and "gain nothing" in advice and "Raise" not in advice
    images = [o for o in ON if not o.startswith(WORKERS)]
    _, tuning = tuned(*images)  # (data=synthetic: each image made, so workers are measured)
    assert tuning.loader and not tuning.reasons[WORKERS].startswith("kept: data=")


def test_a_corrupted_cache_file_is_ignored_with_a_warning(cache, caplog):
    tuned(*ON)
    (path,) = cache.glob("*.json")
    path.write_text("{not json")
    _, again = tuned(*ON)
    assert again.source == "measured"
    assert "ignoring the unreadable cache file" in caplog.text


@pytest.mark.parametrize(
    ("settings", "said"),
    [
        ({"precision.kernels": "evil"}, "precision.kernels: got 'evil' (allowed: auto, fused"),
        (
            {"trainer.channels_last": "yes please"},
            "trainer.channels_last: got 'yes please' (allowed: a value of type bool)",
        ),
        ({"trainer.num_workers": True}, "trainer.num_workers: got True"),
        ({"trainer.num_workers": -2}, "trainer.num_workers: got -2 (allowed: an integer >= 0)"),
        (
            {"trainer.pin_memory": "true"},
            "trainer.pin_memory: got 'true' (allowed: a value of type bool or null)",
        ),
        ({"model._target_": "builtins.print"}, "model._target_ is not a tunable key"),
    ],
)
def test_a_cache_row_setting_what_no_run_may_is_never_applied(cache, caplog, settings, said):
    """A cache file is input like any other (a damaged file, a shared folder): a row whose
    settings hold a value the key cannot take, made fastest, was chosen and applied
    (precision.kernels=evil: an unexpected error at the build). The file is ignored, with the
    warning naming the setting and what the key allows (the config's own type and rule),
    measured again, and the run keeps values it may have."""
    first_plan, _ = tuned(*ON)
    (path,) = cache.glob("*.json")
    data = json.loads(path.read_text())
    data["rows"].append({**data["rows"][0], "settings": settings, "steady_ms": 1e-3})
    path.write_text(json.dumps(data))
    plan, again = tuned(*ON)
    assert again.source == "measured" and "ignoring the unreadable cache file" in caplog.text
    assert f"a row's setting {said}" in caplog.text, caplog.text
    for key, bad in settings.items():
        value = OmegaConf.select(plan.cfg, key)
        assert value != bad or type(value) is not type(bad)
        if key in TUNABLE:  # (measured again: whichever value was fastest)
            assert tune_cache.setting_problem(key, value) is None
        else:
            assert value == OmegaConf.select(first_plan.cfg, key)


def test_settings_chosen_together_say_so():
    """The fastest row may set two keys: each key's reason names the other, since the gain is
    theirs together (it read as if each alone gave it)."""
    plan = make_plan(compose_config(*ON))
    rows = [
        tune_measure.Row({}, steady_ms=16.0),
        tune_measure.Row({"trainer.channels_last": True}, steady_ms=14.0),
        tune_measure.Row({"trainer.channels_last": True, "precision.kernels": "torch"}, 10.0),
    ]
    free = ["trainer.channels_last", "precision.kernels"]
    tuning = tune._decision(plan, rows, free, set(), 1000, "measured")
    assert tuning.chosen == 2
    assert tuning.reasons["trainer.channels_last"] == (
        "tuned: 1.60x the untuned steady step (together with precision.kernels=torch)"
    )
    assert tuning.reasons["precision.kernels"] == (
        "tuned: 1.60x the untuned steady step (together with trainer.channels_last=true)"
    )


def test_what_tuning_changed_is_named_short_and_the_defaults_are_left_out():
    """benchmarks/peers.py's "trainer.tune picked" column: the settings tuning changed, by
    their keys' last names, as an override writes them."""
    plan = make_plan(compose_config(*ON))
    rows = [
        tune_measure.Row({}, steady_ms=16.0),
        tune_measure.Row({"trainer.channels_last": True, "precision.kernels": "torch"}, 10.0),
    ]
    free = ["trainer.channels_last", "precision.kernels"]
    tuning = tune._decision(plan, rows, free, set(), 1000, "measured")
    assert set(tuning.picked().split(", ")) == {"channels_last=true", "kernels=torch"}
    kept = tune._decision(plan, rows[:1], free, set(), 1000, "measured")
    assert kept.picked() == "the defaults"


def test_tune_md_sets_the_runs_steady_step_beside_the_tuners():
    """Once the run has trained, tune.md says its steady step beside the one the tuner measured
    for the chosen settings, within 20% or apart with where to look; nothing where either is
    unknown."""
    rows = [tune_measure.Row({}, steady_ms=20.0), tune_measure.Row({"x": 1}, steady_ms=10.0)]
    tuning = tune_decision.Tuning({}, {}, rows, chosen=1)
    near = tuning.against_run(11.5, 32)
    assert "11.5 ms a batch of 32" in near and "10.0 ms" in near and "+15%, within 20%" in near
    far = tuning.against_run(7.0, 32)
    assert "-30%, more than 20% apart" in far and "data_wait_frac" in far
    assert tuning.against_run(None, 32) == ""
    assert tune_decision.Tuning({}, {}).against_run(10.0, 32) == ""  # nothing measured (cache)
    unmeasured = tune_decision.Tuning({}, {}, [tune_measure.Row({}, steady_ms=None)])
    assert unmeasured.against_run(10.0, 32) == ""


def test_a_key_without_a_candidate_says_why():
    """A compile a short run would not repay, max-autotune on a CPU: each key's reason says why
    it had no candidate (it read "not a candidate for this run")."""
    plan = make_plan(compose_config(*ON))
    free = ["trainer.compile", "trainer.compile_mode"]
    rows = [tune_measure.Row({}, steady_ms=300.0)]
    reasons = tune._decision(plan, rows, free, set(), 100, "measured").reasons
    assert reasons["trainer.compile"] == (
        "kept: not tried: 100 steps of 300 ms (~30 s) would not repay a compile (~30 s; tried "
        "where 15% of the run's time exceeds it)"
    )
    assert reasons["trainer.compile_mode"] == "kept: max-autotune is tried on a CUDA GPU only"
    unknown = tune._decision(plan, rows, free, set(), None, "measured").reasons
    assert unknown["trainer.compile"] == "kept: not a candidate for this run"  # (steps unknown)


def test_a_candidate_that_changes_the_loss_is_refused():
    model = ["model=custom", "model._target_=tests.helpers.tune_models.LayoutBug"]
    plan, tuning = tuned(*ON, *model, "precision.kernels=torch")
    (row,) = [r for r in tuning.rows if r.settings.get("trainer.channels_last")]
    assert row.note.startswith("refused: first-step loss")
    assert plan.cfg.trainer.channels_last is False
    assert "refused" in tuning.reasons["trainer.channels_last"]
    assert "refused" in tuning.table()


def test_a_candidate_that_runs_out_of_memory_is_refused_and_the_run_goes_on(caplog):
    """The untuned settings fit (measured first); a candidate that needs more memory than there
    is (here channels_last, for a model that asks beyond the machine in that layout) is refused
    with the reason, and the run keeps the setting that fits."""
    caplog.set_level("INFO", logger="runner.run.tune")
    model = ["model=custom", "model._target_=tests.helpers.tune_models.LayoutHog"]
    plan, tuning = tuned(*ON, *model, "precision.kernels=torch")
    (row,) = [r for r in tuning.rows if r.settings.get("trainer.channels_last")]
    assert row.note == "refused: out of memory" and row.steady_ms is None
    assert plan.cfg.trainer.channels_last is False
    assert (
        tuning.reasons["trainer.channels_last"]
        == "kept: the other value ran out of memory (refused)"
    )
    assert "trainer.channels_last=true refused: out of memory" in caplog.text


def test_auto_skips_a_short_run_with_a_message(caplog):
    caplog.set_level("INFO", logger="runner.run.tune")
    plan, tuning = tuned(*FAST)
    assert tuning is None
    assert plan.cfg.trainer.channels_last is False
    assert "trainer.tune=auto: not tuned: 6 training steps are too few" in caplog.text


def test_auto_counts_batches_where_a_step_accumulates_several(caplog):
    """With trainer.accumulate_grad_batches=2 the run's 6 batches are 3 steps; tuning times
    steps of one batch, so it weighs the 6 and says that they are batches (it said "6 training
    steps")."""
    caplog.set_level("INFO", logger="runner.run.tune")
    assert tuned(*FAST, "trainer.accumulate_grad_batches=2")[1] is None
    said = "not tuned: 6 training batches (2 a step, trainer.accumulate_grad_batches) are too few"
    assert said in caplog.text


def test_auto_counts_a_language_models_steps_in_sequences_not_tokens(caplog):
    """data=synthetic_text's num_train counts tokens: 70,000 of them in sequences of 1,024 make
    68 sequences, 2 steps of 64 (not 70,000 samples, 1,094 steps, worth tuning)."""
    caplog.set_level("INFO", logger="runner.run.tune")
    text = [
        "model=gpt_tiny",
        "data=synthetic_text",
        "data.num_train=70000",
        "data.block_size=1024",
        "trainer.batch_size=64",
        "trainer.max_epochs=1",
    ]
    plan = make_plan(compose_config(*text))
    assert plan.estimated_steps() == 2 == math.ceil(((70_000 - 1) // 1024) / 64)
    assert tuned(*text)[1] is None
    assert "trainer.tune=auto: not tuned: 2 training steps are too few" in caplog.text


def test_auto_counts_the_steps_of_one_rank_under_torchrun(caplog):
    """Under torchrun each rank trains on its share of the samples (DistributedSampler's, padded
    to equal shares): 401 samples at batch 1 are 401 steps for one process, 201 for each of two,
    too few to repay tuning (it said 401 for each rank of two)."""
    caplog.set_level("INFO", logger="runner.run.tune")
    text = ["model=tiny", "data=synthetic", "data.num_train=401", "trainer.batch_size=1"]
    text += ["trainer.max_epochs=1"]
    plan = make_plan(compose_config(*text))
    assert plan.estimated_steps() == 401
    assert plan.estimated_steps(world_size=2) == 201
    ranks = Comm(rank=0, world_size=2)  # (rank 0 of two, no process group: tuning's own part)
    assert tune.tuned(plan, ranks, CPU, text) is None
    assert "trainer.tune=auto: not tuned: 201 training steps are too few" in caplog.text


@pytest.mark.parametrize("data", ["synthetic", "files"])
def test_a_tuned_run_trains_as_the_run_given_its_settings_by_hand(tmp_path, monkeypatch, data):
    """The tuning steps leave no trace: the same losses, metrics and data order as a run given
    the chosen settings on the command line (real runs, a real SQLite store). Read from files
    (randomly augmented), the loader's worker count is tuned too: its fetches leave the run's
    worker seeds as they were."""
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run = FAST if data == "synthetic" else images(tmp_path)
    common = [*run, f"mlflow.tracking_uri={uri}", "mlflow.system_metrics_s=0"]
    assert run_in_process(*common, "trainer.tune=on", "mlflow.run_name=tuned") == 0
    tuned_run = runs_by_name(uri)["tuned"]
    params = tuned_run.data.params
    chosen = [  # tune.<key>: "<value> (why)"
        f"{key[len('tune.') :]}={value.split(' (')[0]}"
        for key, value in params.items()
        if key.startswith("tune.trainer.") or key == "tune.precision.kernels"
        if " (" in value
    ]
    assert params["tune.source"] == "measured"
    assert any(c.startswith(f"{WORKERS}=") for c in chosen) == (data == "files")
    assert run_in_process(*common, "trainer.tune=off", *chosen, "mlflow.run_name=by_hand") == 0
    by_hand = runs_by_name(uri)["by_hand"]
    a, b = history(uri, tuned_run.info.run_id), history(uri, by_hand.info.run_id)
    for name in ("train_loss", "val_loss", "val_acc"):
        assert a[name] == b[name], name
    assert "tune_time_s" in tuned_run.data.metrics and "tune_time_s" not in by_hand.data.metrics


def test_a_resumed_run_keeps_its_checkpoints_settings(tmp_path, cache):
    """The decision (here the cache's, which says channels_last is far faster) is in the
    checkpoint's config; resume=auto of the same command keeps it without tuning again."""
    common = [*settings(tmp_path), "trainer.tune=on", "mlflow.run_name=tuned"]
    tuned(*common)
    (path,) = cache.glob("*.json")
    kept = json.loads(path.read_text())
    for row in kept["rows"]:
        row["steady_ms"] = 1.0 if row["settings"] == {"trainer.channels_last": True} else 9.0
        row["note"] = ""
    path.write_text(json.dumps(kept))
    assert run_in_process(*common, "trainer.max_epochs=1") == 0
    first = last_checkpoint(tmp_path, "tuned")
    assert first["config"]["trainer"]["channels_last"] is True
    assert run_in_process(*common, "trainer.max_epochs=2", "resume=auto") == 0
    second = last_checkpoint(tmp_path, "tuned")
    assert second["epoch"] == 2
    assert second["config"]["trainer"]["channels_last"] is True
    params = runs_by_name(f"sqlite:///{tmp_path / 'mlflow.db'}")["tuned"].data.params
    assert params["tune.trainer.channels_last"].startswith("true (tuned")
    assert params["tune.source"] == "cache"


def test_a_sweep_tunes_each_configuration_once(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    sweep = [*FAST, f"mlflow.tracking_uri={uri}", "mlflow.system_metrics_s=0"]
    assert run_in_process("-m", *sweep, "trainer.tune=on", "trainer.seed=1,2") == 0
    jobs = [r for r in all_runs(uri) if "tune.source" in r.data.params]
    assert sorted(r.data.params["tune.source"] for r in jobs) == ["cache", "measured"]


def test_a_setting_an_experiment_file_gives_is_kept_even_at_its_default(tmp_path):
    """channels_last: false in the user's experiment file is the default's value, and still
    the user's: it is kept, not tuned."""
    folder = tmp_path / "conf" / "experiment"
    folder.mkdir(parents=True)
    (folder / "tuned.yaml").write_text(
        "# @package _global_\ntrainer:\n  channels_last: false\n  tune: 'on'\n"
    )
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    common = [*FAST, f"mlflow.tracking_uri={uri}", "mlflow.system_metrics_s=0"]
    config_dir = ["--config-dir", str(tmp_path / "conf")]
    assert run_in_process(*config_dir, "+experiment=tuned", *common, "mlflow.run_name=exp") == 0
    params = runs_by_name(uri)["exp"].data.params
    assert params["tune.trainer.channels_last"] == "kept: given"
    assert params["tune.source"] == "measured"


USER_FILES = {
    # their own primary config (--config-name), over the runner's
    "primary": (
        "mine.yaml",
        "defaults:\n  - config\n  - _self_\ntrainer:\n  channels_last: false\n  tune: 'on'\n",
        ["--config-name", "mine"],
    ),
    # their own option of the trainer group, over the runner's default option
    "group option": (
        "trainer/mine.yaml",
        "defaults:\n  - default\n  - _self_\nchannels_last: false\ntune: 'on'\n",
        ["trainer=mine"],
    ),
}


@pytest.mark.parametrize("layout", USER_FILES, ids=list(USER_FILES))
def test_a_setting_the_users_own_config_file_gives_is_kept_at_its_default(tmp_path, layout):
    """channels_last: false written in a config file of the user's (their primary config, an
    option of theirs in a group) is kept as given, as in an experiment file."""
    name, text, args = USER_FILES[layout]
    path = tmp_path / "conf" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    common = [*FAST, f"mlflow.tracking_uri={uri}", "mlflow.system_metrics_s=0"]
    config_dir = ["--config-dir", str(tmp_path / "conf")]
    assert run_in_process(*config_dir, *args, *common, "mlflow.run_name=mine") == 0
    params = runs_by_name(uri)["mine"].data.params
    assert params["tune.trainer.channels_last"] == "kept: given"
    assert params["trainer.channels_last"] == "False"


def test_a_file_is_read_at_its_package(tmp_path):
    """A group option's keys sit under the group unless its header says otherwise."""
    from runner.run import tune_given

    keys = ["trainer.channels_last", "precision.kernels"]
    plain = tmp_path / "plain.yaml"
    plain.write_text("channels_last: false\n")
    assert tune_given._keys_in(plain, "trainer", keys) == {"trainer.channels_last"}
    glob = tmp_path / "global.yaml"
    glob.write_text("# @package _global_\nprecision:\n  kernels: null\n")
    assert tune_given._keys_in(glob, "trainer", keys) == {"precision.kernels"}
    assert tune_given._keys_in(plain, None, keys) == set()  # (a primary config's keys: global)
    assert tune_given._group_choices(["trainer=mine", "+experiment=x", "a.b=1", "m=a,b"]) == [
        ("trainer", "mine"),
        ("experiment", "x"),
    ]


@pytest.fixture
def paced(monkeypatch):
    """trainer.tune's measurements made instant and paced: each takes PACE_S (a sleep) and
    returns a row of a 10-ms step (the first, the untimed one, a step as slow with no one-time
    work), so what fits a budget is known; the settings each was called with are listed."""
    calls: list[dict] = []

    def measure(plan, settings, device, counts=(2, 5)):
        calls.append(dict(settings))
        time.sleep(PACE_S)
        return tune_measure.Row(dict(settings), 10.0, loss=2.3, spread=0.01, timed=counts[1])

    monkeypatch.setattr(tune, "measure", measure)
    return calls


PACE_S = 0.3  # what one paced measurement takes


@pytest.mark.parametrize(
    "given,steps",
    [(["trainer.tune=on", "trainer.tune_budget_s=0.01"], 10**7), (["trainer.tune=auto"], 300)],
    ids=["given", "auto-share"],
)
def test_a_budget_no_candidate_fits_is_said_at_once(given, steps, caplog):
    """A budget given, or auto's, that cannot hold the untuned settings' timing and one
    candidate's: tuning says so after one untimed pair of steps, rather than time the defaults
    alone, and the run keeps its defaults. Auto's budget is 5% of the run, so it counts in the
    step it measures: 300 steps (the fewest auto tunes) give 15 steps' time, 2 of them spent
    priming, and timing two settings takes 14 steps, however fast a step is (under 0.25 s).
    At 400 steps (20 steps' time) it held only while building took long against a step: CI's
    machine once built fast enough for a candidate to fit."""
    caplog.set_level("INFO", logger="runner.run.tune")
    overrides = [*FAST, *given, *lasting(steps)]
    plan = make_plan(compose_config(*overrides))
    started = time.perf_counter()
    assert tune.tuned(plan, Comm(), CPU, overrides) is None
    took = time.perf_counter() - started
    said = caplog.text
    assert "trainer.tune: not tuned: a step takes ~" in said
    assert "over the" in said and "left of trainer.tune_budget_s" in said
    assert "untuned: " not in said  # (the defaults were not timed)
    started = time.perf_counter()
    tune_measure.measure(plan, {}, CPU, (1, 1))
    assert took < 3 * (time.perf_counter() - started) + 5.0  # (the untimed steps, a load)


def test_a_candidate_that_cannot_fit_what_is_left_is_skipped_saying_why(paced, caplog):
    """Where the budget holds the untuned settings and some candidates but not a compile (30 s
    guessed before one was measured), the compile is skipped, and tune.md and the log say why;
    the candidates that fit are measured."""
    caplog.set_level("INFO", logger="runner.run.tune")
    tuning = tuned(*ON, "trainer.tune_budget_s=6", *lasting(10**7))[1]
    base, *rest = tuning.rows
    assert base.steady_ms is not None and any(r.steady_ms is not None for r in rest)
    (compiled,) = [r for r in rest if r.settings.get("trainer.compile")]
    assert compiled.steady_ms is None and compiled.note.startswith("skipped: compiling would")
    assert "left of trainer.tune_budget_s" in compiled.note
    assert compiled.note in tuning.table() and compiled.note in caplog.text
    assert "over the budget" in tuning.reasons["trainer.compile"]


def test_the_candidates_keep_their_news_out_of_the_log(caplog):
    """Each candidate builds the run and takes steps: its build's news and its first step's layer
    audit ("What ran where", the run's own to say) stay out of the log; a skipped candidate's
    note gives seconds a decimal under 10 (not "~0 s, over the 0 s left")."""
    caplog.set_level("INFO", logger="runner")
    overrides = [*ON, "trainer.tune_budget_s=60"]
    tuning = tune.tuned(make_plan(compose_config(*overrides)), Comm(), CPU, overrides)
    assert "trainer.tune" in caplog.text and "What ran where" not in caplog.text
    assert logging.getLogger("runner").level == logging.INFO  # (given back as it was)
    assert len([r for r in tuning.rows if r.steady_ms is not None]) >= 2
    note = tune_measure.skipped_note("eager", 0.44, -0.2)
    assert re.search(r"~0\.4 s, over the 0\.0 s left", note), note


def test_a_decision_cut_short_by_its_budget_is_measured_again_with_more(cache, caplog, paced):
    """The cache keeps the budget its rows were measured within: the same budget reuses them,
    a larger one measures the skipped candidates."""
    caplog.set_level("INFO", logger="runner.run.tune")
    # (the untimed pair, the defaults and a candidate fit; a compile, guessed at 30 s, does not)
    tight = [*ON, "trainer.tune_budget_s=1.2", *lasting(10**7)]
    _, first = tuned(*tight)
    assert first.source == "measured"
    assert any(r.note.startswith("skipped: ") for r in first.rows), first.table()
    _, again = tuned(*tight)
    assert again.source == "cache"
    _, roomy = tuned(*ON, "trainer.tune_budget_s=600", *lasting(10**7))
    assert roomy.source == "measured" and "measuring again" in caplog.text
    assert all(row.steady_ms is not None for row in roomy.rows)
    assert len(list(cache.glob("*.json"))) == 1


def test_max_autotune_is_estimated_from_the_default_compile_and_the_layers():
    """ResNet-50's plan (53 convolutions, one linear layer) whose default compile candidate took
    50 s: max-autotune, which benchmarks each conv and matmul, is expected to take 50 s and 4 s
    a layer, more than the default budget's cap; before the default compile is measured, a
    compile is expected to take an eager candidate's time and the least guess."""
    plan = make_plan(compose_config("model=resnet50", "data=synthetic", "data.image_size=32"))
    layers = tune_measure.gemm_layers(plan.meta_model())
    assert layers == 54
    cuda = torch.device("cuda")  # (named only: nothing runs on it)
    autotune = {"trainer.compile": True, "trainer.compile_mode": tune_measure.MAX_AUTOTUNE}
    measured = {"eager": 3.0, "compile": 50.0}
    kind, seconds = tune_measure.expected_s(autotune, 60.0, measured, layers, cuda)
    assert (kind, seconds) == ("autotune", 50.0 + 54 * 4.0) and seconds > tune.BUDGET_CAP_S
    kind, seconds = tune_measure.expected_s(
        {"trainer.compile": True}, 60.0, {"eager": 3.0}, 54, cuda
    )
    assert (kind, seconds) == ("compile", 63.0)
    assert tune_measure.skipped_note(kind, 266.4, 100.2) == (
        "skipped: compiling would take ~266 s, over the 100 s left of trainer.tune_budget_s"
    )
    assert tune_measure.skipped_note("autotune", 266.4, -3.0).startswith(
        "skipped: compiling with max-autotune would take ~266 s, over the 0.0 s left"
    )


LM = ["model=gpt_tiny", "data=synthetic_text", "data.num_train=4097", "data.num_val=300"]
LM += ["data.block_size=32", "trainer.batch_size=16"]
EVERY = {  # each level a CPU runs (fp8 needs a GPU: tests/gpu), a classifier and a language model
    **{level: [f"precision={level}"] for level in ["o0", "o1_bf16", "o2_bf16", "o3_bf16"]},
    "o3_bf16_sr": ["precision=o3_bf16_sr"],
    "o2_bf16_int8state": ["precision=o2_bf16_int8state", "optimizer=adamw"],
    "gpt_tiny-o2_bf16": ["precision=o2_bf16", *LM],
}


@pytest.mark.parametrize("case", EVERY, ids=list(EVERY))
def test_each_level_and_task_is_tuned_then_trains(tmp_path, case):
    """trainer.tune=on at every level a CPU runs and for a language model: the candidates are
    measured on the run's own plan, the loss they start from agrees, and the run trains with
    what was picked."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    fast = [o for o in FAST if not (o.startswith("data") and "model=gpt_tiny" in EVERY[case])]
    common = [*fast, "trainer.tune=on", "trainer.max_epochs=1", "trainer.limit_train_batches=3"]
    common += [f"mlflow.tracking_uri={uri}", "mlflow.system_metrics_s=0", "mlflow.run_name=t"]
    assert run_in_process(*common, *EVERY[case]) == 0
    run = runs_by_name(uri)["t"]
    assert run.info.status == "FINISHED"
    params = run.data.params
    assert params["tune.source"] == "measured"
    assert "tune.precision.kernels" in params and "tune.trainer.compile" in params
    path = MlflowClient(uri).download_artifacts(run.info.run_id, "tune.md", str(tmp_path))
    table = Path(path).read_text()
    cells = [[c.strip() for c in line.split("|")[1:-1]] for line in table.splitlines()]
    timed = r"\d+\.\d \(\+\d+%, \d steps\)"  # (ms, the spread of the steps timed, their count)
    candidates = [c for c in cells if len(c) == 5 and re.fullmatch(timed, c[1])]
    assert len(candidates) >= 2, table  # the defaults and at least one candidate, timed
    for name, _, _, delta, note in candidates:  # each started from the defaults' loss
        assert abs(float(delta)) < 0.1 and not note.startswith("refused"), (name, table)
    assert math.isfinite(run.data.metrics["train_loss"])


def test_a_longer_run_measures_again_what_a_shorter_one_did_not_try(cache, caplog, paced):
    """A compile is tried only by a run long enough to repay it: a short run's cached decision
    (no compile row) is measured again for a long run, which then keeps its own rows."""
    overrides = [*ON, "trainer.tune_budget_s=6"]  # (the compile is then skipped, not built)

    def decide(steps):
        return tuned(*overrides, *lasting(steps))[1]

    # (compile is offered where 15% of the run's time, its steps at the measured step time,
    # exceeds the compile's guess, 30 s on a CPU: 40 steps of 10 ms do not, 10**7 do)
    short = decide(40)
    assert short.source == "measured"
    assert not any("trainer.compile" in row.settings for row in short.rows)
    with caplog.at_level("INFO", logger="runner.run.tune"):
        long = decide(10**7)
    assert long.source == "measured", caplog.text
    assert "made for a shorter run" in caplog.text
    assert any("trainer.compile" in row.settings for row in long.rows)
    assert decide(10**7).source == "cache"
    assert decide(40).source == "cache"  # (the long run's rows hold every short-run candidate)


def test_a_compile_skipped_as_not_repaid_is_tried_only_by_a_longer_run():
    """A cached max-autotune row skipped because its run's steps would not repay it counts as
    tried for a run as long (the cache serves it), not for a longer one (measured again)."""
    plan = make_plan(compose_config(*ON))
    cuda = torch.device("cuda")  # (the candidate list only: nothing runs on it)
    free = ["trainer.compile", "trainer.compile_mode"]
    autotune = {"trainer.compile": True, "trainer.compile_mode": tune.MAX_AUTOTUNE}
    rows = [
        {"settings": {}, "steady_ms": 100.0, "steps": 10**6},
        {"settings": {"trainer.compile": True}, "steady_ms": 90.0, "steps": 10**6},
        {"settings": autotune, "note": f"skipped: ... {tune.REPAID}", "steps": 10**6},
    ]
    assert not tune._untried(plan, cuda, free, rows, 10**6)
    assert tune._untried(plan, cuda, free, rows, 10**8)


# ---- trainer.cuda_graphs=step: a candidate on CUDA, where planning would allow it -----------
GRAPH = {"trainer.cuda_graphs": "step", "trainer.compile": False}


def _graph_offered(device: torch.device, *overrides: str) -> bool:
    """Whether tuning the run of `overrides` on `device` tries the whole step as a CUDA graph
    (the candidate list only: nothing runs on the device)."""
    plan = make_plan(compose_config(*ON, *overrides))
    free = [k for k in TUNABLE if k not in tune.given_keys(plan.cfg, list(overrides))]
    base = tune_measure.Row({}, steady_ms=10.0)
    return any(
        tune.GRAPHS in settings
        for settings, _ in tune._alternatives(plan, device, free, 10**6, base)
    )


def test_the_whole_step_graph_is_no_candidate_on_a_cpu(caplog):
    """No CUDA graph on a CPU: the key is not tuned there (nothing to measure), as cuDNN's."""
    assert not _graph_offered(CPU, "scheduler=none")
    _, tuning = tuned(*ON)
    assert tuning.reasons[tune.GRAPHS] == "not tuned: nothing to measure on this device"
    assert not any(tune.GRAPHS in row.settings for row in tuning.rows)


def test_planning_s_refusals_gate_the_whole_step_candidate_on_cuda():
    """On CUDA the candidate is tried, instead of a compile, only where planning would take the
    run given `trainer.cuda_graphs=step` by hand: not with a schedule that sets a new rate at
    every step for torch's own optimizer (O0's SGD), with accumulation, or with a given
    compile."""
    cuda = torch.device("cuda")
    assert _graph_offered(cuda, "scheduler=none")
    assert _graph_offered(cuda, "precision=o2", "scheduler=cosine")  # (the kernels read it)
    assert not _graph_offered(cuda, "scheduler=cosine")  # (O0: torch's SGD holds the rate)
    assert not _graph_offered(cuda, "scheduler=none", "trainer.accumulate_grad_batches=2")
    assert not _graph_offered(cuda, "scheduler=none", "trainer.compile=true")
    plan = make_plan(compose_config(*ON, "precision=o2", "scheduler=none"))
    given = [k for k in TUNABLE if k != tune.GRAPHS]  # (the user gave trainer.cuda_graphs)
    base = tune_measure.Row({}, steady_ms=10.0)
    assert not any(tune.GRAPHS in c for c, _ in tune._alternatives(plan, cuda, given, 10**6, base))
    on_top = {**GRAPH, "precision.kernels": "torch"}  # (over the fastest so far: torch's ops)
    assert tune._graph_refusals(plan, cuda, GRAPH) == []
    (reason,) = tune._graph_refusals(plan, cuda, on_top)
    assert "torch's own optimizer step waits for the overflow flag on the host" in reason


def test_a_graph_candidate_that_cannot_be_captured_keeps_the_default_saying_why():
    plan = make_plan(compose_config(*ON))
    rows = [
        tune_measure.Row({}, steady_ms=16.0),
        tune_measure.Row(GRAPH, note=f"{tune.NOT_CAPTURED}: the model reads a value on the host"),
    ]
    tuning = tune._decision(plan, rows, [tune.GRAPHS, "trainer.compile"], set(), 1000, "measured")
    assert tuning.chosen == 0
    assert tuning.reasons[tune.GRAPHS] == (
        "kept: the step cannot be captured in a CUDA graph here (refused)"
    )
    faster = [rows[0], tune_measure.Row(GRAPH, steady_ms=8.0, compile_s=0.5, loss=2.3)]
    chosen = tune._decision(plan, faster, [tune.GRAPHS, "trainer.compile"], set(), 1000, "m")
    assert chosen.settings[tune.GRAPHS] == "step" and chosen.picked() == "cuda_graphs=step"


def test_the_processs_one_time_work_is_charged_to_no_candidate(monkeypatch):
    """On a GPU the process's one-time work (its first CUDA work, cuDNN's search) falls on the
    first run it times: ResNet-50's untuned settings took 17-21 s on an H200. Here the first
    run's first step is made 5 s slower: that run is untimed, the untuned settings are timed
    after it, warm, and the candidates that redo none of the one-time work are expected to take
    the warm time and are measured within the budget. (Charged the cold time, with as much kept
    to time the untuned settings again, every candidate was skipped.) On a loaded machine (the
    full suite on 2 cores) the two untuned runs can spend the budget whatever it charges: then a
    candidate without a layout search must have been expected to take what the warm (second)
    run of the untuned settings took, not the cold (first) one."""
    from runner import csrc

    csrc.build("cpp")  # (the kernels are a candidate only where they are built)
    real = tune.measure
    slow = 5.0

    def cold_first(plan, settings, device, counts=(2, 5)):
        start = time.perf_counter()
        row = real(plan, settings, device, counts)
        if not cold_first.calls:
            time.sleep(slow)
            row.warmup_s += slow
        cold_first.calls.append(dict(settings))
        cold_first.took.append(time.perf_counter() - start)
        return row

    cold_first.calls, cold_first.took = [], []
    monkeypatch.setattr(tune, "measure", cold_first)
    _, tuning = tuned(*ON, f"trainer.tune_budget_s={slow + 5.0}")
    base, *rest = tuning.rows
    measured = [r for r in rest if r.steady_ms is not None]
    if not measured:  # what each was expected to take: the warm time
        (kernels,) = [r for r in rest if "precision.kernels" in r.settings]
        expected = re.search(r"would take ~([\d.]+) s", kernels.note)
        assert expected is not None, tuning.table()
        warm = cold_first.took[1]  # (the estimate is shown rounded: 5.8 s, 11 s)
        assert float(expected[1]) <= warm * 1.05 + 0.1, (cold_first.took, tuning.table())
    assert base.warmup_s < slow and all(r.warmup_s < slow for r in measured)
    assert cold_first.calls[:2] == [{}, {}] and len(cold_first.calls) == 2 + len(measured)


def test_a_sigterm_while_tuning_says_so_and_exits_143(tmp_path):
    """A scheduler's SIGTERM while trainer.tune measures (before the run's MLflow run exists)
    ends the process in one line with 143, as Ctrl-C would with 130, not silently; no run is
    recorded."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    proc = start_cli(
        *[o for o in ON if not o.startswith("data")],
        *HELD_DATA,
        f"mlflow.tracking_uri={uri}",
        cwd=tmp_path,
        env={HOLD_AFTER: "1"},  # (tuning reads the first training sample: held there)
    )
    seen = "".join(read_until(proc, HELD, timeout=300))
    assert HELD in seen and "trainer.tune: timing" in seen, seen
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=60)
    assert proc.returncode == 143, seen + rest
    assert rest.strip() == "Interrupted: interrupted by SIGTERM", seen + rest
    assert not all_runs(uri)


def test_a_tuned_run_is_planned_as_the_run_given_its_settings_by_hand(cache, monkeypatch):
    """Plan once: trainer.tune's choice is the input of the run's one plan. A run whose tuning
    (a decision in the cache, seeded here) picks torch.compile is named `-compiled` and has the
    params, findings and precision table of the run given trainer.compile=true by hand. With fp8
    layers on a GPU that runs them (planning's view of the device: a Hopper), the untuned
    config's warning "fp8 without torch.compile" is gone from both."""
    hopper = DeviceInfo("cuda", (9, 0), "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(DeviceInfo, "from_torch", classmethod(lambda cls, device: hopper))
    command = [*ON, "precision=o1_fp8", *lasting(10**5)]
    given = make_plan(compose_config(*command))
    assert given.run_name == "tiny-O1-fp8"
    assert any("without torch.compile" in f.message for f in given.resolution.findings)
    # the cached decision: compile is ten times faster, the other candidates gain nothing
    free = [k for k in TUNABLE if k not in tune.given_keys(given.cfg, command)]
    free = [k for k in free if k not in ("trainer.cudnn_benchmark", tune_data.PIN, tune.GRAPHS)]
    facts = tune._facts(given, CPU, free)
    candidates = [{}, {"trainer.channels_last": True}, {"precision.kernels": "torch"}]
    rows = [tune_measure.Row(c, steady_ms=100.0, loss=2.3) for c in candidates]
    rows.append(tune_measure.Row({"trainer.compile": True}, 10.0, compile_s=1.0, loss=2.3))
    kept = [{**row.as_dict(), "budget_s": 120.0, "steps": 10**5} for row in rows]
    tune_cache.write(tune_cache.key(facts), kept, facts)

    plan, tuning = tuned(*command)
    assert tuning.source == "cache" and tuning.settings["trainer.compile"] is True
    by_hand = make_plan(compose_config(*command, "trainer.compile=true"))
    assert plan.run_name == by_hand.run_name == "tiny-O1-fp8-compiled"
    assert plan.resolution.findings == by_hand.resolution.findings
    assert not any("without torch.compile" in f.message for f in plan.resolution.findings)
    assert plan.resolution.findings_table() == by_hand.resolution.findings_table()
    assert plan.properties.table() == by_hand.properties.table()
    assert recorded.config_params(plan) == recorded.config_params(by_hand)
    assert plan.checkpoint_folder == by_hand.checkpoint_folder
