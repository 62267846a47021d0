"""A user's mistakes on the command line (an unknown option of a group, in any case; an unknown key,
with or without `+`, at the top level too; a value of the wrong type) exit 2 with one line naming
the group or key, what was given and the nearest right spellings, closest first: no traceback, no
Hydra search path, nothing created. HYDRA_FULL_ERROR=1 still shows Hydra's own error. `--help`
lists the groups a user picks from and the launchers and sweepers installed. A language model
whose positional table is shorter than the data's sequences is refused in planning the same way, and
so is a list of options for one of the runner's groups (`precision=[o1,o2]`: Hydra merges them)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.errors import MissingConfigException

from tests.helpers.runs import FAST, REPO, run_cli, run_in_process

UNKNOWN_KEY = "trainer.max_epoch: unknown key; did you mean trainer.max_epochs? (allowed: "
MISTAKES = {
    "precision=o7": "precision: unknown option 'o7'; did you mean o0, o1, o2 or o3? (allowed: o0,",
    "precision=O2": "precision: unknown option 'O2'; did you mean o2 (a case-insensitive match",
    "model=resnet5": (
        "model: unknown option 'resnet5'; did you mean resnet50, resnet18 or resnext50_32x4d?"
    ),
    "data=synthetik": "data: unknown option 'synthetik'; did you mean synthetic or synthetic_text?",
    "trainer.max_epoch=1": UNKNOWN_KEY,
    "+trainer.max_epoch=1": UNKNOWN_KEY,
    # at the top level a new key goes in with `+` and would change nothing: a group's key there
    # is named where it lives, any other is refused with the root's keys
    "+lr=0.5": "lr: unknown key at the top level; did you mean optimizer.lr?",
    "+epochs=3": "epochs: unknown key (allowed: model, data, loss, task, optimizer, scheduler,",
    "trainer.max_epochs=abc": "trainer.max_epochs: got 'abc', expected an integer",
    # a sweep's values without -m: Hydra's three-way message named no key (and showed `\'`)
    "precision=o0,o2": (
        "precision: got o0,o2, the values of a sweep, but the command runs once (it has no -m) "
        "(allowed: one value; to run each in turn, a sweep: python -m runner -m ... "
        "precision=o0,o2)"
    ),
    "optimizer.lr=0.1,2e-3": "to run each in turn, a sweep: python -m runner -m ... optimizer.lr=",
    "+mlflow.tags.note=a,b": "a value that holds a comma, quoted: \"+mlflow.tags.note='a,b'\")",
    "trainer.seed=range(1,3)": "sweep: python -m runner -m ... 'trainer.seed=range(1,3)')",
    # a tag of the runner's own (the liveness check reads it), and a tag's value a list
    "+mlflow.tags.runner.pid=5": "mlflow.tags.runner.pid: is a tag the runner writes itself",
    "+mlflow.tags.model=x": "mlflow.tags.model: is a tag the runner writes itself",
    "+mlflow.tags.k=[1,2]": "mlflow.tags.k: got a list [1, 2]: a tag's value is one string",
    # a list selects each option and merges them, the last winning: O2 ran, named nowhere as such
    # a mapping's new keys are merged in with +; a key with dots, split by a path, goes in braces
    "precision.layers={features.9: float32}": (
        "precision.layers: 'features.9' is a new key of precision.layers, which an override "
        "merges in with +: '+precision.layers={features.9: float32}'"
    ),
    "+precision.layers.features.9=float32": (
        "precision.layers: the key 'features.9' holds dots, where an override's path splits (it "
        "made precision.layers.features a mapping); give the key whole inside braces: "
        "'+precision.layers={features.9: float32}'"
    ),
    "precision=[o1,o2]": (
        "precision: got a list [o1, o2]: Hydra would merge these options, the last one winning, "
        "and run one (allowed: one option; to run each in turn, a sweep: -m precision=o1,o2)"
    ),
}


def created(folder: Path) -> list[str]:
    """What a refused command left in `folder`, Hydra's own outputs/ aside."""
    return sorted(str(p.relative_to(folder)) for p in folder.iterdir() if p.name != "outputs")


@pytest.mark.new_store  # checks that nothing, no store, is created
@pytest.mark.parametrize("mistake", MISTAKES)
def test_a_mistake_exits_2_with_the_nearest_right_spelling(mistake, tmp_path):
    result = run_cli(mistake, cwd=tmp_path, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    assert MISTAKES[mistake] in output
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == 1, output  # one message
    for hydra_text in ("Traceback", "Config search path", "HYDRA_FULL_ERROR", "+trainer.max_epoch"):
        assert hydra_text not in output
    assert created(tmp_path) == []  # no store, no mlruns, no checkpoints
    assert not list(tmp_path.rglob("mlflow.db")) and not list(tmp_path.rglob("checkpoints"))


@pytest.mark.new_store  # checks that nothing, no store, is created
def test_a_sweep_and_cfg_together_say_how_to_see_a_sweep_s_jobs(tmp_path):
    """`-m ... --cfg job`: Hydra refused it with a ValueError traceback, exit 1."""
    result = run_cli("-m", "+experiment=cpu_demo", "--cfg", "job", cwd=tmp_path, timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip().endswith(
        "can be specified: to see each job of a sweep, -m ... dry_run=true (every job's config, "
        "checked); --cfg job shows one job's config, without -m"
    )
    assert result.stdout == "" and created(tmp_path) == []


@pytest.mark.new_store  # checks that nothing, no store, is created
@pytest.mark.parametrize(
    "args,said",
    [
        ([], "Expecting one subcommand from ['install', 'uninstall', 'query'] to be set"),
        (["install=tcsh"], "No completion plugin for 'tcsh' found"),
    ],
    ids=["no-subcommand", "unknown-shell"],
)
def test_shell_completion_without_a_shell_says_how_to_install_it(args, said, tmp_path):
    """`--shell-completion` without install/uninstall/query, or for a shell Hydra has no plugin
    for: Hydra's ValueError and its traceback, exit 1; now one line, exit 2."""
    result = run_cli("--shell-completion", *args, cwd=tmp_path, timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr == (
        f"--shell-completion: {said}; give one of install=SHELL, uninstall=SHELL or query=SHELL, "
        'SHELL one of bash, fish or zsh (e.g. eval "$(python -m runner --shell-completion '
        'install=bash)")\n'
    )
    assert result.stdout == "" and created(tmp_path) == []


def test_a_mistake_in_a_sweep_names_the_job(tmp_path, capsys):
    uri = f"sqlite:///{tmp_path / 'never.db'}"
    status = run_in_process("-m", *FAST, "precision=o0,o7", f"mlflow.tracking_uri={uri}")
    output = "".join(capsys.readouterr())
    assert status == 2, output[-3000:]
    assert "sweep job #1 (" in output and MISTAKES["precision=o7"] in output
    assert "Traceback" not in output and "Config search path" not in output
    assert not (tmp_path / "never.db").exists() and not (tmp_path / "mlruns").exists()


def test_a_list_of_options_in_a_sweep_names_the_job(tmp_path, capsys):
    uri = f"sqlite:///{tmp_path / 'never.db'}"
    args = ["-m", *FAST, "precision=[o0,o2_bf16]", "trainer.seed=1,2"]
    status = run_in_process(*args, f"mlflow.tracking_uri={uri}")
    output = "".join(capsys.readouterr())
    assert status == 2, output[-3000:]
    assert "precision: got a list [o0, o2_bf16]: Hydra would merge" in output
    assert "(in sweep job #0: " in output and "Traceback" not in output
    assert not (tmp_path / "never.db").exists() and not (tmp_path / "mlruns").exists()


def test_the_choices_include_a_config_dir_s_own(tmp_path, capsys):
    (tmp_path / "my_conf" / "model").mkdir(parents=True)
    (tmp_path / "my_conf" / "model" / "my_net.yaml").write_text("_target_: torch.nn.Linear\n")
    status = run_in_process("--config-dir", str(tmp_path / "my_conf"), "model=my_nett")
    output = "".join(capsys.readouterr())
    assert status == 2 and "model: unknown option 'my_nett'; did you mean my_net?" in output


@pytest.mark.parametrize(
    "argv, together",
    [
        (["a=1", "-m", "b=2,3"], ["a=1", "b=2,3", "-m"]),
        (
            ["+experiment=x", "--config-dir", "conf", "c=1"],
            ["+experiment=x", "c=1", "--config-dir", "conf"],
        ),
        (["a=1", "--cfg", "job", "b=2"], ["a=1", "b=2", "--cfg", "job"]),
        (["-m", "a=1", "b=2"], ["-m", "a=1", "b=2"]),  # (one group already: as it was)
        (["a=1", "--cfg", "jobb", "b=2"], ["a=1", "--cfg", "jobb", "b=2"]),  # (Hydra refuses it)
        (["a=1", "--info", "defaults", "b=2"], ["a=1", "b=2", "--info", "defaults"]),
    ],
)
def test_overrides_on_both_sides_of_a_flag_are_taken_together(argv, together):
    """Hydra's parser took the overrides before a flag and refused those after it
    ("unrecognized arguments"; hydra#3053)."""
    from runner.__main__ import overrides_together

    assert overrides_together(argv) == together


@pytest.mark.new_store  # checks that nothing, no store, is created
def test_a_sweep_with_overrides_after_its_m_and_its_config_dir_runs(tmp_path, capsys):
    (tmp_path / "conf" / "experiment").mkdir(parents=True)
    (tmp_path / "conf" / "experiment" / "mine.yaml").write_text(
        "# @package _global_\ntrainer:\n  max_epochs: 3\n"
    )
    args = ["--config-dir", str(tmp_path / "conf"), "precision=o0,o1_bf16", "dry_run=true"]
    status = run_in_process("+experiment=mine", *FAST[:2], "-m", *args)
    output = "".join(capsys.readouterr())
    assert status == 0, output[-3000:]
    assert "#0 : +experiment=mine model=tiny data=synthetic precision=o0 dry_run=True" in output
    assert "#1 : +experiment=mine model=tiny data=synthetic precision=o1_bf16" in output
    assert output.count("  max_epochs: 3") == 2  # (the file's, in each job's config)


@pytest.mark.new_store  # checks that nothing, no store, is created
@pytest.mark.parametrize(
    "body, said",
    [
        (
            "defaults:\n  - override /model: tiny\n",
            "experiment: experiment/mine.yaml overrides /model in its defaults list, but the "
            "file's keys are placed under 'experiment', its group: a file that sets the run's "
            "groups and keys starts with the line `# @package _global_`",
        ),
        (
            "trainer:\n  max_epochs: 1\nhydra:\n  sweeper:\n    params:\n      precision: o0,o2\n",
            "experiment.trainer: an experiment file's setting of trainer was placed under "
            "experiment (its own free-form settings), where nothing reads it: the file's first "
            "line must be `# @package _global_`",
        ),
    ],
)
def test_an_experiment_file_without_its_package_line_is_refused(body, said, tmp_path, capsys):
    """Without `# @package _global_` an experiment file's keys land under `experiment`: its
    defaults' overrides failed in Hydra's words, and its settings (a sweep's params included)
    were kept there unread: the run trained at the defaults."""
    (tmp_path / "conf" / "experiment").mkdir(parents=True)
    (tmp_path / "conf" / "experiment" / "mine.yaml").write_text(body)
    uri = f"sqlite:///{tmp_path / 'never.db'}"
    args = ["--config-dir", str(tmp_path / "conf"), "+experiment=mine", *FAST]
    status = run_in_process(*args, f"mlflow.tracking_uri={uri}")
    output = "".join(capsys.readouterr())
    assert status == 2 and said in output, output[-3000:]
    assert "Traceback" not in output and not (tmp_path / "never.db").exists()


def test_hydra_full_error_shows_hydra_s_own_error(monkeypatch):
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(MissingConfigException, match="Config search path"):
        run_in_process("precision=o7")


def test_help_lists_what_a_user_picks(tmp_path):
    (tmp_path / "my_conf" / "augment").mkdir(parents=True)
    (tmp_path / "my_conf" / "augment" / "strong.yaml").write_text("flip: true\n")
    result = run_cli("--config-dir", str(tmp_path / "my_conf"), "--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    text = result.stdout
    groups = {
        line.split(":")[0].strip(): line.split(":", 1)[1]
        for line in text.split("== Configuration groups ==")[1].split("==")[0].splitlines()
        if line.startswith("  ") and ":" in line
    }
    assert {"model", "data", "precision", "optimizer", "experiment", "augment"} <= set(groups)
    assert "o1_bf16" in groups["precision"] and "gpt_tiny" in groups["model"]
    assert "schema/" not in text and "cifar10_optimizer" not in text
    assert "python -m runner model=gpt_tiny data=synthetic_text precision=o1_bf16" in text
    assert "HYDRA_FULL_ERROR=1" in text
    plugins = text.split("== Launchers and sweepers (with -m) ==")[1].split("==")[0]
    launchers = next(line for line in plugins.splitlines() if "hydra/launcher:" in line)
    sweepers = next(line for line in plugins.splitlines() if "hydra/sweeper:" in line)
    installed = {
        "hydra_joblib_launcher": (launchers, ["joblib", "parallel"]),
        "hydra_submitit_launcher": (launchers, ["slurm", "submitit_local", "submitit_slurm"]),
        "hydra_optuna_sweeper": (sweepers, ["optuna"]),
    }
    for plugin, (line, options) in installed.items():
        present = importlib.util.find_spec(f"hydra_plugins.{plugin}") is not None
        assert all((option in line) == present for option in options), (plugin, line)


@pytest.mark.new_store  # checks that nothing, no store, is created
def test_version_names_the_runner_and_what_it_runs_on(tmp_path):
    """`--version` of every command a user types: amp-runner's version (Hydra's own `--version`
    printed Hydra's alone), with torch's, Hydra's, MLflow's and Python's; nothing created."""
    from importlib import metadata

    import runner

    expected = (
        f"amp-runner {runner.__version__} (torch {metadata.version('torch')}, "
        f"Hydra {metadata.version('hydra-core')}, MLflow {metadata.version('mlflow')}, Python "
    )
    for module in ("runner", "runner.report", "runner.diagnose", "runner.replay"):
        result = subprocess.run(
            [sys.executable, "-m", module, "model=tiny", "--version"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
            env=dict(os.environ, PYTHONPATH=str(REPO)),
        )
        assert result.returncode == 0, (module, result.stderr[-3000:])
        assert result.stdout.startswith(expected) and result.stdout.count("\n") == 1, module
    assert list(tmp_path.iterdir()) == []


# a user's language model whose positional table holds `context` positions, whatever the data's
SHORT_LM = """
import torch
from torch import nn


class ShortGPT(nn.Module):
    def __init__(self, vocab_size=64, context=16, width=16):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, width)
        self.pos = nn.Embedding(context, width)
        self.head = nn.Linear(width, vocab_size)

    def forward(self, idx):
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.head(self.tok(idx) + self.pos(positions))
"""
SHORT_TABLE = (
    "data.block_size: 32 tokens per sequence, but the model's positional table pos holds 16 "
    "positions (nn.Embedding(16, 16), looked up with 32 positions in a forward on the meta "
    "device) (allowed: at most 16, or a model with a longer context"
)


@pytest.mark.new_store  # checks that nothing, no store, is created
@pytest.mark.parametrize("given", [[], ["+model.context=16"]], ids=["default", "given"])
def test_a_language_model_s_short_context_is_refused_in_planning(given, tmp_path):
    """The table's size is the model's own default or an argument of any name: planning finds it
    on the meta model (where an IndexError would come only once training ran), and names the
    argument to change where the config gives it."""
    (tmp_path / "short_lm.py").write_text(SHORT_LM)
    result = run_cli(
        "model=custom",
        "model._target_=short_lm.ShortGPT",
        *given,
        "data=synthetic_text",
        "data.block_size=32",
        "trainer.device=cpu",
        f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
        cwd=tmp_path,
        timeout=300,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    fix = ": model.context=32)" if given else ")"
    assert SHORT_TABLE + fix in output
    assert len([line for line in output.splitlines() if line.strip()]) == 1, output
    assert "Traceback" not in output and "IndexError" not in output
    left = [name for name in created(tmp_path) if name != "__pycache__"]
    assert left == ["short_lm.py"]  # no store, no run, no checkpoint
