"""`trainer.cuda_graphs=true` (optimizer) or `step` where a captured step cannot hold is refused
in planning: a ConfigError naming the key, every reason for this run, and what is allowed;
through the command line, exit 2 before any MLflow run or checkpoint. The whole step holds the
optimizer step: `step` is refused for every reason `true` is, and for its own (a compiled model,
range diagnostics, a language model's own dataset). (On this CPU machine the device is one
reason in every case; each case checks its own reason beside it.)"""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from runner.errors import ConfigError
from runner.run import cuda_graphs
from runner.run.plan import make_plan
from runner.run.trainer import trainer_config
from tests.helpers.runs import FAST, compose_config, run_in_process

ON = "trainer.cuda_graphs=true"
STEP = "trainer.cuda_graphs=step"
BASE = [*FAST, "scheduler=none"]  # (the default cosine schedule is refused at O0: a case below)
CPU_REASON = "the run is on cpu (trainer.device=auto), and a CUDA graph needs a CUDA device"


def _refusal(*overrides: str, graphs: str = ON) -> ConfigError:
    with pytest.raises(ConfigError) as e:
        make_plan(compose_config(*BASE, graphs, *overrides))
    return e.value


def test_a_cpu_is_refused_with_what_is_allowed():
    error = _refusal()
    assert error.key == "trainer.cuda_graphs"
    assert error.problem == f"true, but {CPU_REASON}"  # the only reason of this run
    assert error.allowed.startswith("false, or true for one process on a CUDA GPU")
    assert str(error).startswith("trainer.cuda_graphs: true, but ")


SHARED = [  # (overrides, reason): what neither a captured optimizer step nor a whole step holds
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
]


@pytest.mark.parametrize("graphs", [ON, STEP])
@pytest.mark.parametrize(
    "overrides,reason", SHARED, ids=lambda v: v[0] if isinstance(v, list) else ""
)
def test_what_a_capture_cannot_hold_is_refused_naming_it(overrides, reason, graphs):
    error = _refusal(*overrides, graphs=graphs)
    assert error.key == "trainer.cuda_graphs"
    assert CPU_REASON in error.problem and reason in error.problem
    assert "false" in error.allowed


@pytest.mark.parametrize("graphs", [ON, STEP])
def test_a_run_under_torchrun_is_refused(monkeypatch, graphs):
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(name, value)
    error = _refusal(graphs=graphs)
    assert "the run is one of several processes (torchrun" in error.problem


# ---- trainer.cuda_graphs=step: the whole step ------------------------------------------------
def test_the_whole_step_on_a_cpu_is_refused_with_what_is_allowed():
    error = _refusal(graphs=STEP)
    assert error.key == "trainer.cuda_graphs"
    assert error.problem == f"step, but {CPU_REASON}"  # the only reason of this run
    assert error.allowed.startswith("false, or step for one process on a CUDA GPU")
    assert "without trainer.compile, range diagnostics or a language model's own" in (error.allowed)


@pytest.mark.parametrize(
    "overrides,reason",
    [
        (
            ["trainer.compile=true"],
            "trainer.compile=true: torch.compile replays forward and backward as CUDA graphs of "
            "its own (compile_mode=reduce-overhead, the other route to a replayed step)",
        ),
        (
            ["trainer.diagnose_every_n_steps=5"],
            "trainer.diagnose_every_n_steps=5: the range diagnostics hook the forward and "
            "backward of the steps they diagnose",
        ),
    ],
    ids=["compile", "diagnostics"],
)
def test_what_only_the_whole_step_cannot_hold_is_refused(overrides, reason):
    """The optimizer step's capture holds these (with compile: reduce-overhead beside it; the
    diagnostics hook an eager forward); the whole step's does not."""
    error = _refusal(*overrides, graphs=STEP)
    assert CPU_REASON in error.problem and reason in error.problem
    optimizer = _refusal(*overrides, graphs=ON)
    assert optimizer.problem == f"true, but {CPU_REASON}"


# a language model on its own dataset (a `_target_`): sequences of any length
LM_OWN_DATA = [
    "model=gpt_tiny",
    "data=custom",
    "data._target_=tests.helpers.timing_models.sleepy_datasets",
    "data.num_classes=64",
    "task=language_model",
    "scheduler=none",
]


def test_a_language_models_own_dataset_is_refused_for_the_whole_step():
    """Its sequences may be of any length: each other shape would run eagerly."""
    lm = LM_OWN_DATA
    with pytest.raises(ConfigError) as e:
        make_plan(compose_config(*lm, STEP))
    assert "a language model's own dataset (data._target_) may yield sequences of any length, " in (
        e.value.problem
    )
    make_plan(compose_config(*lm, "trainer.device=cpu"))  # (the same run without graphs: planned)


def test_every_reason_of_a_run_is_listed_at_once():
    """A run with four problems hears of all four in one line, not one per attempt."""
    error = _refusal(
        "trainer.compile=true",
        "trainer.diagnose_every_n_steps=2",
        "trainer.accumulate_grad_batches=2",
        graphs=STEP,
    )
    reasons = error.problem.removeprefix("step, but ").split("; ")
    assert len(reasons) == 4, error.problem
    for start in (
        "the run is on cpu",
        "trainer.accumulate_grad_batches=2",
        "trainer.compile=true",
        "trainer.diagnose_every_n_steps=2",
    ):
        assert any(r.startswith(start) for r in reasons), error.problem


@pytest.mark.parametrize(
    "value,mode",
    [(False, "false"), (True, "optimizer"), ("optimizer", "optimizer"), ("step", "step")],
)
def test_the_modes_of_the_option(value, mode):
    """true is optimizer's other name; the trainer's settings and the composed config alike."""
    assert cuda_graphs.mode(value) == mode
    typed = "true" if value is True else "false" if value is False else value
    cfg = compose_config(*FAST, f"trainer.cuda_graphs={typed}")
    assert cfg.trainer.cuda_graphs == value and type(cfg.trainer.cuda_graphs) is type(value)
    assert cuda_graphs.mode(cfg) == mode
    assert cuda_graphs.mode(trainer_config(cfg.trainer).cuda_graphs) == mode


def test_a_compiled_language_model_on_its_own_dataset_is_refused():
    """Its sequences may be of any length, and a compiled step's graphs hold one shape each."""
    cfg = compose_config(*LM_OWN_DATA, "trainer.compile=true", ON)
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
    assert mode("trainer.cuda_graphs=optimizer") == "reduce-overhead"
    assert mode(ON, "trainer.compile_mode=max-autotune") == "max-autotune"  # (uses them already)


@pytest.mark.parametrize("graphs,said", [(ON, "true"), (STEP, "step")])
def test_the_command_line_exits_2_before_any_run(tmp_path, monkeypatch, capsys, graphs, said):
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    status = run_in_process(*BASE, graphs, "precision=o2", f"mlflow.tracking_uri={uri}")
    output = "".join(capsys.readouterr())
    assert status == 2
    lines = output.splitlines()  # (one plain line, as every refusal: no logging prefix)
    assert any(
        line.startswith(f"trainer.cuda_graphs: {said}, but {CPU_REASON} (allowed: false")
        for line in lines
    )
    assert "Traceback" not in output
    if (tmp_path / "mlflow.db").exists():
        client = MlflowClient(uri)
        assert not client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert not list(tmp_path.rglob("last.pt"))
