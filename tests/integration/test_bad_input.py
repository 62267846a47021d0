"""Bad input, table-driven over every config key: a wrong type fails at compose time naming the key
(Hydra and the structured configs), an out-of-range value fails in the app's checks naming the key
and what is allowed, and neither leaves a RUNNING MLflow run or touches an existing checkpoint.

The type table is generated from the composed config itself: every int, float and bool key of
every group option gets a value of the wrong type, so a key added later is covered too.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from mlflow.tracking import MlflowClient
from omegaconf.errors import OmegaConfBaseException

from runner.errors import ConfigError
from runner.run import app
from tests.helpers.images import write_image_folder
from tests.helpers.runs import FAST, compose_config, run_cli

OPTIONS = [
    ("model", "tiny"),
    ("model", "resnet18"),
    ("data", "synthetic"),
    ("data", "cifar10"),
    ("data", "imagefolder"),
    ("optimizer", "sgd"),
    ("optimizer", "adam"),
    ("scheduler", "cosine"),
    ("scheduler", "step"),
    ("scheduler", "onecycle"),
    ("precision", "o2"),
    ("trainer", "default"),
    ("mlflow", "default"),
]
WRONG = {int: "not-an-integer", float: "not-a-number", bool: "maybe"}


def typed_keys() -> list[tuple[str, str, str]]:
    """(group choice, key, wrong value) for every int/float/bool key of every option."""
    cases = []
    for group, option in OPTIONS:
        extra = ["data.root=/tmp"] if option == "imagefolder" else []
        node = compose_config(f"{group}={option}", *extra)[group]
        for key in node:
            ref = node._get_node(key)._metadata.ref_type
            if ref in WRONG:
                cases.append((f"{group}={option}", f"{group}.{key}", WRONG[ref]))
    cases += [("model=tiny", "dry_run", "maybe")]
    return cases


@pytest.mark.parametrize("choice,key,value", typed_keys(), ids=lambda v: str(v))
def test_a_wrong_type_fails_at_compose_time_naming_the_key(choice, key, value):
    with pytest.raises((ConfigCompositionException, OmegaConfBaseException)) as e:
        compose_config(choice, f"{key}={value}")
    text = f"{e.value} {e.value.__cause__}"
    assert key.split(".")[-1] in text and value in text


def test_the_type_table_covers_every_group():
    keys = {k for _, k, _ in typed_keys()}
    assert {k.split(".")[0] for k in keys} >= {
        "model",
        "data",
        "optimizer",
        "scheduler",
        "precision",
        "trainer",
    }
    assert len(keys) > 40  # every numeric and boolean key, not a sample


# ---- out of range: (overrides, key the message names) --------------------------------------------
RANGE = [
    (["optimizer.lr=0"], "optimizer.lr"),
    (["optimizer.lr=-0.1"], "optimizer.lr"),
    (["optimizer.lr=nan"], "optimizer.lr"),
    (["trainer.batch_size=0"], "trainer.batch_size"),
    (["trainer.max_epochs=-1"], "trainer.max_epochs"),
    (["precision=o2", "precision.loss_scale=0"], "precision.loss_scale"),
    (["precision=o2", "precision.loss_scale=-1"], "precision.loss_scale"),
    (["precision=o2", "precision.loss_scale=nan"], "precision.loss_scale"),
    (["precision=o2", "precision.loss_scale=big"], "precision.loss_scale"),
    (["precision=o2", "precision.cast_model_type=float8"], "precision.cast_model_type"),
    (["precision=o1", "precision.autocast_dtype=float64"], "precision.autocast_dtype"),
    (["precision=o2", "precision.keep_batchnorm_fp32=sometimes"], "precision.keep_batchnorm_fp32"),
    (["precision=o2", "precision.growth_factor=1"], "precision.growth_factor"),
    (["precision=o2", "precision.min_loss_scale=1e9"], "precision.min_loss_scale"),
    (["precision.kernels=fast"], "precision.kernels"),
    (["trainer.cuda_graphs=maybe"], "trainer.cuda_graphs"),  # (typed Any: true/false or a mode)
    (["trainer.cuda_graphs=step"], "trainer.cuda_graphs"),  # (no CUDA device here)
    (["precision.layer_plan_steps=0"], "precision.layer_plan_steps"),
    (["precision.layer_plan_max_underflow=1.5"], "precision.layer_plan_max_underflow"),
    (["model.name=resnet1000"], "model.name"),
    (["model=tiny", "model.norm=layer"], "model.norm"),
    (["data.name=mnist"], "data.name"),
    (["trainer.device=tpu"], "trainer.device"),
    (["trainer.collapsed_loss_scale=-1"], "trainer.collapsed_loss_scale"),
    (["trainer.checkpoint_every_n_epochs=-1"], "trainer.checkpoint_every_n_epochs"),
    (["trainer.sync_batchnorm=true", "trainer.device=cpu"], "trainer.sync_batchnorm"),
    (["optimizer=adam", "precision=o3"], "optimizer.eps"),  # 1e-8 underflows in fp16
    (["precision.opt_level=O2"], "precision.opt_level"),
    (["resume=/no/such/checkpoint.pt"], "resume"),
]


@pytest.fixture(scope="module")
def existing(tmp_path_factory):
    """A store with one finished run and a checkpoint: bad input must touch neither (shared by
    the module's cases: any of them that created a run or wrote a checkpoint fails right there)."""
    folder: Path = tmp_path_factory.mktemp("existing")
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    ckpt_dir = folder / "checkpoints"
    base = [
        *FAST,
        "trainer.max_epochs=1",
        f"mlflow.tracking_uri={uri}",
        f"trainer.checkpoint_dir={ckpt_dir}",
    ]
    with pytest.MonkeyPatch.context() as mp:  # the run's own files (mlruns/) go there too
        mp.chdir(folder)
        app.run(compose_config(*base))
    (path,) = ckpt_dir.rglob("last.pt")
    return base, uri, path, path.read_bytes()


def _runs(uri: str):
    client = MlflowClient(uri)
    return client.search_runs([e.experiment_id for e in client.search_experiments()])


@pytest.mark.parametrize("overrides,key", RANGE, ids=lambda v: str(v))
def test_out_of_range_values_fail_before_anything_naming_the_key(existing, overrides, key):
    base, uri, path, before = existing
    cfg = compose_config(*base, *overrides)
    with pytest.raises(ConfigError) as e:
        app.run(cfg)
    assert e.value.key == key and str(e.value).startswith(f"{key}:")
    # what is allowed: a list, or (a precision rule's error) the hint saying what to set
    assert e.value.allowed or "Hint: " in str(e.value)
    runs = _runs(uri)
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"  # no new run, none RUNNING
    assert path.read_bytes() == before  # the checkpoint is untouched


def test_a_numbered_gpu_is_refused_saying_how_to_pick_one():
    """trainer.device=cuda:1 (torch's spelling) is not a value: the runner takes the first GPU
    it sees, so the message says how to make it see the one meant."""
    from runner.run.plan import make_plan

    with pytest.raises(ConfigError) as refused:
        make_plan(compose_config(*FAST, "trainer.device=cuda:1"))
    assert refused.value.key == "trainer.device"
    assert refused.value.problem == "got 'cuda:1'"
    assert "CUDA_VISIBLE_DEVICES=3 python -m runner" in refused.value.allowed
    assert "hydra/launcher=parallel" in refused.value.allowed


@pytest.mark.parametrize(
    "base, key, under, says",
    [
        (["model=tiny", "data=cifar10"], "data.root", "", "a folder"),
        (FAST, "trainer.checkpoint_dir", "", "is not a folder (a file is in the way)"),
        (FAST, "trainer.checkpoint_dir", "sub", "is not a folder (a file is in the way)"),
    ],
)
def test_a_file_where_a_folder_belongs_is_refused_before_any_work(
    existing, tmp_path, base, key, under, says
):
    """data.root, or a trainer.checkpoint_dir (found, before, when the first epoch's checkpoint
    was written: the epoch trained and lost, then a traceback), that is a file, or lies under
    one: refused naming the key, before any run or checkpoint is touched."""
    _, uri, path, before = existing
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    checkpoints = (
        [] if key == "trainer.checkpoint_dir" else [f"trainer.checkpoint_dir={path.parents[3]}"]
    )
    with pytest.raises(ConfigError) as e:
        app.run(
            compose_config(
                *base, f"mlflow.tracking_uri={uri}", *checkpoints, f"{key}={a_file / under}"
            )
        )
    assert e.value.key == key and says in str(e.value) and e.value.allowed
    assert len(_runs(uri)) == 1 and path.read_bytes() == before


def test_unknown_model_and_dataset_options_list_what_exists():
    for override, option in (("model=resnet1000", "resnet18"), ("data=mnist", "cifar10")):
        with pytest.raises(ConfigCompositionException) as e:
            compose_config(override)
        assert option in str(e.value)  # Hydra lists the available options


@pytest.mark.slow
@pytest.mark.parametrize(
    "args,needle",
    [
        (["precision=o2", "precision.loss_scale=big"], "precision.loss_scale"),
        (["trainer.batch_size=0"], "trainer.batch_size"),
        (["trainer.max_epochs=abc"], "trainer.max_epochs"),
    ],
)
def test_the_command_line_exits_2_with_the_key_and_no_traceback(tmp_path, args, needle):
    result = run_cli(
        *args, f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}", cwd=tmp_path, timeout=300
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0 and needle in output and "Traceback" not in output
    assert not (tmp_path / "mlflow.db").exists() or not _runs(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert not list(tmp_path.rglob("last.pt"))  # nothing was trained


def test_a_value_hydra_reads_only_quoted_is_told_how_to_quote_it(tmp_path):
    """An unquoted non-ASCII letter stops Hydra's override grammar ("LexerNoViableAltException"
    and a caret, exit 1 in Hydra's words): the runner says the character and the override
    quoted, and that quoted override, pasted as it is, runs."""
    folder = tmp_path / "runs ü"
    refused = run_cli(f"hydra.run.dir={folder}", "dry_run=true", cwd=tmp_path, timeout=300)
    said = refused.stdout + refused.stderr
    assert refused.returncode == 2 and "Traceback" not in said, said
    quoted = re.search(r"cannot take 'ü' there\); quote it: (.+)$", said.strip())
    assert quoted is not None, said
    (override,) = shlex.split(quoted[1])  # (as a shell reads it)
    ran = run_cli(override, "dry_run=true", cwd=tmp_path, timeout=300)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert (folder / ".hydra" / "config.yaml").is_file()


@pytest.mark.new_store
def test_an_image_folder_with_an_empty_class_is_refused_before_the_store(tmp_path):
    """An ImageFolder's class folder with no image (here only a resource fork, `._0.png`, which
    torchvision took for an image) is refused by the plan: exit 2, one line naming the folder,
    no store made and no run, where the run failed at its first read of the fork."""
    write_image_folder(tmp_path / "data", size=16)
    for split in ("train", "val"):
        (tmp_path / "data" / split / "c").mkdir()
        (tmp_path / "data" / split / "c" / "._0.png").write_bytes(b"\x00\x05\x16\x07Mac OS X")
    result = run_cli(
        "model=tiny",
        "data=imagefolder",
        f"data.root={tmp_path / 'data'}",
        "data.image_size=16",
        "trainer.max_epochs=1",
        cwd=tmp_path,
        timeout=300,
    )
    said = result.stdout + result.stderr
    assert result.returncode == 2 and "Traceback" not in said, said[-3000:]
    assert f"no image in 1 class folder(s) of {tmp_path / 'data' / 'train'}: c (" in said
    assert not (tmp_path / "mlflow.db").exists()


def test_every_refusal_is_one_plain_line_whichever_layer_refuses(tmp_path):
    """A value the planner refuses (optimizer.lr=-1) and an option Hydra's layer refuses (a
    misspelt dataset) are told in one format: exit 2, the first line of stderr the key and what
    was wrong, no logging prefix; the planner's refusal is in the job log too."""
    folder = tmp_path / "run"
    planner = run_cli("optimizer.lr=-1", f"hydra.run.dir={folder}", cwd=tmp_path, timeout=300)
    hydra = run_cli("data=synthetc", cwd=tmp_path, timeout=300)
    for result, start in ((planner, "optimizer.lr: got -1.0"), (hydra, "data: unknown option")):
        assert result.returncode == 2, result.stderr[-2000:]
        first = result.stderr.splitlines()[0]
        assert first.startswith(start) and "[ERROR]" not in first, first
        assert "Traceback" not in result.stderr
    assert "did you mean synthetic" in hydra.stderr
    assert (
        "optimizer.lr: got -1.0 (allowed: a finite number > 0)"
        in (folder / "runner.log").read_text()
    )
