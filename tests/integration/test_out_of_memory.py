"""A run that does not fit its device's memory: one line that says where it ran out, at which
sizes and what to change (no traceback), the MLflow run FAILED with that line, exit 2; a sweep
records the job FAILED and goes on. On a CPU the allocator refuses where the operating system
does (here: an address-space limit, as `ulimit -v` sets, below what one step's logits need); on a
GPU torch raises its OutOfMemoryError."""

from __future__ import annotations

import signal

import psutil
import pytest
import torch
from mlflow.tracking import MlflowClient

from tests.helpers.runs import FAST, read_until, run_cli, start_cli

LIMIT = 6 * 1024**3  # a tiny run needs under 4 GiB of address space (measured)
# gpt_tiny over a vocabulary of 2^16 tokens: 64 x 1024 x 2^16 fp32 logits are 16 GiB, one tensor
TOO_BIG = [
    "model=gpt_tiny",
    "data=synthetic_text",
    "data.block_size=1024",
    "data.num_train=70000",
    "data.num_val=2100",
    "trainer.batch_size=64",
    "trainer.max_epochs=1",
]
SAID = (
    "Out of memory on {device} in a training step (gpt_tiny at O0, trainer.batch_size={batch}, "
    "data.block_size=1024, at the start): "
)


def _runs(uri: str) -> dict[str, object]:
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("amp-runner")
    return {
        r.data.params.get("data.vocab_size"): r
        for r in client.search_runs([experiment.experiment_id])
    }


def test_a_step_too_big_for_the_machine_is_one_line_and_a_failed_run(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    result = run_cli(
        *TOO_BIG,
        "data.vocab_size=65536",
        f"mlflow.tracking_uri={uri}",
        cwd=tmp_path,
        address_limit=LIMIT,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    assert "Traceback" not in output
    (told,) = [line for line in output.splitlines() if "Out of memory" in line]  # (plain)
    assert told.startswith(SAID.format(device="cpu", batch=64)), told
    assert "the CPU allocator could not get 16.0 GiB (the machine has " in told
    assert "this process may address 6.0 GiB: ulimit -v)" in told
    assert told.endswith(
        "To fit: a smaller trainer.batch_size (activations grow with it; "
        "trainer.accumulate_grad_batches raised as much keeps the samples a step learns from); "
        "a 16-bit level "
        "(precision=o2_bf16: weights, gradients and activations in half the bytes); Adam's "
        "moments in 8 bits (precision.optimizer_state=int8)."
    )
    (run,) = _runs(uri).values()
    assert run.info.status == "FAILED"
    assert run.data.tags["error"] == f"OutOfMemory: {told}"
    artifacts = [a.path for a in MlflowClient(uri).list_artifacts(run.info.run_id)]
    assert "logs" in artifacts and "traceback.txt" not in artifacts  # the user's sizes: no bug


def test_a_sweep_records_the_job_that_ran_out_and_goes_on(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    result = run_cli(
        "-m",
        *TOO_BIG,
        "data.vocab_size=65536,64",
        f"mlflow.tracking_uri={uri}",
        cwd=tmp_path,
        address_limit=LIMIT,
    )
    output = result.stdout + result.stderr
    assert "Traceback" not in output, output[-3000:]
    assert "Sweep job #0 failed: " + SAID.format(device="cpu", batch=64) in output, output[-3000:]
    runs = _runs(uri)
    assert runs["65536"].info.status == "FAILED"
    assert runs["64"].info.status == "FINISHED"  # the next job ran, its memory free


def test_the_range_preflight_says_so_too(tmp_path):
    """python -m runner.diagnose trains a few fp32 steps of the run: the same line, exit 2."""
    result = run_cli(
        *TOO_BIG,
        "data.vocab_size=65536",
        f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
        cwd=tmp_path,
        address_limit=LIMIT,
        module="runner.diagnose",
    )
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    assert "Traceback" not in output
    said = "Error: " + SAID.format(device="cpu", batch=64).replace(", at the start", "")
    assert said in output, output[-3000:]
    assert "a 16-bit level" not in output  # (the pre-flight is fp32 whatever the level)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_step_too_big_for_the_gpu_is_one_line_and_the_memory_is_handed_back(tmp_path):
    """The same on a GPU: 1024 x 1024 x 2^16 fp32 logits are 256 GiB. The next job of the
    sweep, in the same process, trains on the memory the failed step held."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    result = run_cli(
        "-m",
        *TOO_BIG,
        "trainer.device=cuda",
        "trainer.batch_size=1024",
        "data.num_train=1100000",
        "data.vocab_size=65536,64",
        f"mlflow.tracking_uri={uri}",
        cwd=tmp_path,
    )
    output = result.stdout + result.stderr
    assert "Traceback" not in output, output[-3000:]
    said = [
        "Sweep job #0 failed: " + SAID.format(device=device, batch=1024) + "CUDA out of memory."
        for device in ("cuda:0", "cuda")
    ]
    assert any(line in output for line in said), output[-3000:]
    assert "To fit: a smaller trainer.batch_size" in output
    assert "trainer.strategy=fsdp over several GPUs" in output
    runs = _runs(uri)
    assert runs["65536"].info.status == "FAILED"
    assert runs["64"].info.status == "FINISHED"


@pytest.mark.slow
@pytest.mark.parametrize(
    "signum, said, advice",
    [
        (signal.SIGBUS, "crashed with a bus error", "--shm-size"),
        (signal.SIGKILL, "was killed (SIGKILL) from outside the run", "resume=auto continues"),
    ],
)
def test_a_worker_killed_or_out_of_shared_memory_is_one_line_and_a_failed_run(
    tmp_path, signum, said, advice
):
    """A DataLoader worker that dies of a bus error (what a container's 64 MB /dev/shm gives when
    the batches in flight outgrow it; here a real SIGBUS to a real worker) ended the run with
    torch's "killed by signal: Bus error" and a traceback, exit 1; one killed by another process
    (kill -9, no OOM kill counted) with "The run failed with an unexpected error" and a
    traceback. Now one line says what it most likely is and what to do; the run is FAILED with
    it, exit 2."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    args = [*FAST, "data.num_train=20000", "trainer.num_workers=2", f"mlflow.tracking_uri={uri}"]
    proc = start_cli(*args, "trainer.max_epochs=1", cwd=tmp_path)
    seen = read_until(proc, "What ran where, step 1")  # the workers are up and feeding
    workers = psutil.Process(proc.pid).children()
    assert workers, "".join(seen)
    workers[0].send_signal(signum)
    rest, _ = proc.communicate(timeout=180)
    output = "".join(seen) + rest
    assert proc.returncode == 2, output[-3000:]
    said = f"A DataLoader worker (pid {workers[0].pid}) {said}"
    assert said in output and advice in output and "Traceback" not in output, output[-3000:]
    # the sizes it ran at (after step 1 or, where the death is seen inside it, "at the start")
    assert " (tiny at O0, trainer.batch_size=32, " in output
    (run,) = MlflowClient(uri).search_runs(["1"])
    assert run.info.status == "FAILED" and run.data.tags["error"].startswith(
        f"WorkerKilled: {said}"
    )
