"""`trainer.cuda_graphs=true` where a captured step cannot hold is refused in planning: a
ConfigError naming the key, every reason for this run, and what is allowed; through the command
line, exit 2 before any MLflow run or checkpoint. (On this CPU machine the device is one reason
in every case; each case checks its own reason beside it.)"""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from runner.errors import ConfigError
from runner.run import cuda_graphs
from runner.run.plan import make_plan
from tests.helpers.runs import FAST, compose_config, run_in_process

ON = "trainer.cuda_graphs=true"
BASE = [*FAST, "scheduler=none"]  # (the default cosine schedule is refused at O0: a case below)
CPU_REASON = "the run is on cpu (trainer.device=auto), and a CUDA graph needs a CUDA device"


def _refusal(*overrides: str) -> ConfigError:
    with pytest.raises(ConfigError) as e:
        make_plan(compose_config(*BASE, ON, *overrides))
    return e.value


def test_a_cpu_is_refused_with_what_is_allowed():
    error = _refusal()
    assert error.key == "trainer.cuda_graphs"
    assert error.problem == f"true, but {CPU_REASON}"  # the only reason of this run
    assert error.allowed.startswith("false, or true for one process on a CUDA GPU")
    assert str(error).startswith("trainer.cuda_graphs: true, but ")


@pytest.mark.parametrize(
    "overrides,reason",
    [
        (["trainer.strategy=fsdp"], "the run is one of several processes"),
        (["precision=o1_fp8"], "precision.fp8_linear=tensorwise: torchao's fp8 layers"),
        (["precision=o2_bf16", "+precision.layers={0.*: float32}"], "a format per layer"),
        (["precision=o3_bf16_sr"], "precision.stochastic_rounding=true: each step's random key"),
        (
            ["precision=o2_bf16_int8state", "optimizer=adamw"],
            "precision.optimizer_state=int8: torchao's low-bit",
        ),
        (
            ["precision=o2", "precision.kernels=torch"],
            "optimizer=sgd with precision.kernels=torch at O2 (precision.loss_scale=dynamic): "
            "torch's own optimizer step waits for the overflow flag on the host",
        ),
        (
            ["precision=o2", "optimizer=adam", "optimizer.amsgrad=true"],
            "optimizer=adam with optimizer.amsgrad=true at O2 (precision.loss_scale=dynamic)",
        ),
        (
            ["precision=o2_bf16", "precision.kernels=torch", "optimizer=adam"],
            "optimizer=adam with precision.kernels=torch: the update is torch's own Adam, which "
            "counts its steps on the host",
        ),
        (
            ["precision=o1_bf16", "optimizer=adamw"],
            "optimizer=adamw at O1 (no master weights, no loss scale: no precision work for the "
            "runner's kernels): the update is torch's own Adam",
        ),
        (
            ["trainer.accumulate_grad_batches=2"],
            "trainer.accumulate_grad_batches=2: the captured step reads the gradients of one "
            "backward where they stand",
        ),
        (["scheduler=cosine"], "scheduler=cosine sets a new learning rate at every step"),
        (["scheduler=onecycle"], "scheduler=onecycle sets a new learning rate at every step"),
    ],
    ids=lambda v: v[0] if isinstance(v, list) else "",
)
def test_what_a_capture_cannot_hold_is_refused_naming_it(overrides, reason):
    error = _refusal(*overrides)
    assert error.key == "trainer.cuda_graphs"
    assert CPU_REASON in error.problem and reason in error.problem
    assert "false" in error.allowed


def test_a_run_under_torchrun_is_refused(monkeypatch):
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(name, value)
    error = _refusal()
    assert "the run is one of several processes (torchrun" in error.problem


def test_a_compiled_language_model_on_its_own_dataset_is_refused():
    """Its sequences may be of any length, and a compiled step's graphs hold one shape each."""
    cfg = compose_config(
        "model=gpt_tiny",
        "data=custom",
        "data._target_=tests.helpers.timing_models.sleepy_datasets",
        "data.num_classes=64",
        "task=language_model",
        "scheduler=none",
        "trainer.compile=true",
        ON,
    )
    with pytest.raises(ConfigError) as e:
        make_plan(cfg)
    error = e.value
    assert "a language model's own dataset (data._target_) may yield sequences of any" in (
        error.problem
    )


def test_a_level_without_an_overflow_check_takes_torchs_sgd():
    """bf16 with a loss scale of 1 checks nothing: torch's SGD decides nothing on the host."""
    error = _refusal("precision=o2_bf16", "precision.kernels=torch", "optimizer=sgd")
    assert error.problem == f"true, but {CPU_REASON}"


@pytest.mark.parametrize("level,optimizer", [("o2", "sgd"), ("o2_bf16", "adamw")])
def test_a_cosine_schedule_is_taken_where_the_kernels_read_the_rate_on_the_device(level, optimizer):
    """The runner's kernels read each step's learning rate from the device; torch's optimizer
    step holds the captured one, and onecycle changes the momentum (betas) too."""
    allowed = _refusal(f"precision={level}", f"optimizer={optimizer}", "scheduler=cosine")
    assert allowed.problem == f"true, but {CPU_REASON}"
    torch_step = _refusal(
        f"precision={level}",
        f"optimizer={optimizer}",
        "scheduler=cosine",
        "precision.kernels=torch",
    )
    assert "scheduler=cosine sets a new learning rate at every step, and a captured step of " in (
        torch_step.problem
    )
    cycle = _refusal(f"precision={level}", f"optimizer={optimizer}", "scheduler=onecycle")
    assert "scheduler=onecycle sets a new learning rate at every step, and its momentum" in (
        cycle.problem
    )


def test_off_by_default_and_nothing_is_refused():
    for overrides in ([], ["precision=o3_bf16_sr", "scheduler=cosine"]):
        plan = make_plan(compose_config(*FAST, *overrides))
        assert plan.cfg.trainer.cuda_graphs is False


def test_a_compiled_run_with_graphs_compiles_in_reduce_overhead_mode():
    def mode(*overrides):
        return cuda_graphs.compile_mode(compose_config(*FAST, "trainer.compile=true", *overrides))

    assert mode() == "default"
    assert mode(ON) == "reduce-overhead"  # forward and backward replayed as CUDA graphs too
    assert mode(ON, "trainer.compile_mode=max-autotune") == "max-autotune"  # (uses them already)


def test_the_command_line_exits_2_before_any_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    status = run_in_process(*BASE, ON, "precision=o2", f"mlflow.tracking_uri={uri}")
    output = "".join(capsys.readouterr())
    assert status == 2
    lines = output.splitlines()  # (one plain line, as every refusal: no logging prefix)
    assert any(
        line.startswith(f"trainer.cuda_graphs: true, but {CPU_REASON} (allowed: false")
        for line in lines
    )
    assert "Traceback" not in output
    if (tmp_path / "mlflow.db").exists():
        client = MlflowClient(uri)
        assert not client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert not list(tmp_path.rglob("last.pt"))
