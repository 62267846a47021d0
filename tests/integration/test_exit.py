"""Every process ends: with DataLoader workers on (which ignore SIGTERM by design), a finished,
diagnosed, swept, pre-flighted or interrupted run exits within a bound after its last line.

The hang these guard against: a loader kept alive past the run by a reference cycle (range
diagnostics' figure, drawn with matplotlib's mathtext, left one through the whole call stack)
kept its persistent workers; multiprocessing's exit handler terminated them (ignored) and joined
them forever."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
from mlflow.tracking import MlflowClient

from tests.helpers.runs import REPO, read_until, start_cli

EXIT_BOUND_S = 45  # after the last line a run prints, the process must be gone within this

# workers on, as a user runs it (trainer.num_workers defaults to 2), progress bar on
WITH_WORKERS = [
    "model=tiny",
    "data=synthetic",
    "data.num_train=96",
    "data.num_val=32",
    "data.image_size=16",
    "trainer.batch_size=16",
    "trainer.num_workers=2",
]


def _ends_after(proc: subprocess.Popen, last_line: str, what: str) -> str:
    """Read `proc` up to `last_line`, then require it to exit within EXIT_BOUND_S."""
    seen = "".join(read_until(proc, last_line, timeout=600))
    assert last_line in seen, seen
    try:
        rest, _ = proc.communicate(timeout=EXIT_BOUND_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        rest, _ = proc.communicate()
        pytest.fail(f"{what}: still running {EXIT_BOUND_S} s after {last_line!r}\n{seen}{rest}")
    return seen + rest


def test_the_issue_command_exits_with_diagnostics_and_workers(tmp_path):
    """The exact command that hung (diagnostics on every step, two workers per loader)."""
    proc = start_cli(
        *WITH_WORKERS,
        "trainer.max_epochs=1",
        "trainer.limit_train_batches=3",
        "trainer.limit_val_batches=1",
        "trainer.diagnose_every_n_steps=1",
        f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
        cwd=tmp_path,
    )
    output = _ends_after(proc, "Finished", "a diagnosed run")
    assert proc.returncode == 0, output


@pytest.mark.parametrize(
    "feature, name",
    [
        (["trainer.compile=true", "precision=o1_bf16"], "tiny-O1-bf16-compiled"),  # inductor
        (["model=vit_tiny", "precision=o1_fp8"], "vit_tiny-O1-fp8"),  # torchao fp8, emulated
    ],
    ids=["compile", "fp8"],
)
def test_compiled_and_fp8_runs_exit_with_workers(tmp_path, feature, name):
    proc = start_cli(
        *WITH_WORKERS,
        *feature,
        "trainer.max_epochs=1",
        "trainer.limit_train_batches=2",
        "trainer.limit_val_batches=1",
        f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
        cwd=tmp_path,
    )
    output = _ends_after(proc, "Finished", " ".join(feature))
    assert proc.returncode == 0 and f"Finished {name}:" in output, output


def test_a_resumed_run_exits_with_workers(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    first = start_cli(
        *WITH_WORKERS,
        "trainer.max_epochs=1",
        f"mlflow.tracking_uri={uri}",
        "trainer.diagnose_every_n_steps=2",
        cwd=tmp_path,
    )
    _ends_after(first, "Finished", "the first run")
    again = start_cli(
        *WITH_WORKERS,
        "trainer.max_epochs=2",
        "resume=auto",
        f"mlflow.tracking_uri={uri}",
        "trainer.diagnose_every_n_steps=2",
        cwd=tmp_path,
    )
    output = _ends_after(again, "Finished", "the resumed run")
    assert again.returncode == 0 and "Resum" in output, output


def test_a_sweep_of_diagnosed_jobs_exits(tmp_path):
    proc = start_cli(
        "-m",
        *WITH_WORKERS,
        "precision=o0,o1_bf16",
        "trainer.max_epochs=1",
        "trainer.limit_train_batches=2",
        "trainer.diagnose_every_n_steps=1",
        f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
        cwd=tmp_path,
    )
    output = _ends_after(proc, "Sweep finished", "a sweep")
    assert proc.returncode == 0, output


def test_the_preflight_exits_with_workers(tmp_path):
    env = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "runner.diagnose",
            "--steps",
            "2",
            "--out",
            str(tmp_path / "d"),
            *WITH_WORKERS,
            f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    output = _ends_after(proc, "mlflow ui", "the pre-flight")
    assert proc.returncode == 0, output


def test_sigterm_stops_a_run_with_workers_cleanly(tmp_path):
    """The workers' signal policy is kept: the main process alone stops the run (KILLED, with a
    checkpoint), and the process still ends."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    proc = start_cli(
        *WITH_WORKERS,
        "data.num_train=4000",
        "trainer.max_epochs=5",
        "trainer.diagnose_every_n_steps=5",
        f"mlflow.tracking_uri={uri}",
        cwd=tmp_path,
    )
    seen = "".join(read_until(proc, "MLflow run", timeout=600))
    proc.send_signal(signal.SIGTERM)
    try:
        rest, _ = proc.communicate(timeout=EXIT_BOUND_S + 60)
    except subprocess.TimeoutExpired:
        proc.kill()
        rest, _ = proc.communicate()
        pytest.fail(f"SIGTERM did not end the run\n{seen}{rest}")
    output = seen + rest
    assert proc.returncode != 0, output
    (run,) = MlflowClient(uri).search_runs(
        [e.experiment_id for e in MlflowClient(uri).search_experiments()]
    )
    assert run.info.status == "KILLED", output
    assert list((tmp_path / "checkpoints").rglob("last.pt")), output


# (a script's first lines: a small synthetic dataset, as build_datasets makes it)
SYNTHETIC_BUNDLE = textwrap.dedent("""
    from omegaconf import OmegaConf
    from runner.components.data import build_datasets
    BUNDLE = build_datasets(OmegaConf.create(dict(
        name="synthetic", num_classes=10, image_size=8, num_train=64, num_val=16, seed=0,
        noise=1.0)))
""")


def _python(script: str, cwd, timeout: float, **popen) -> subprocess.CompletedProcess:
    """`script` (after SYNTHETIC_BUNDLE) run by this Python with the repository importable."""
    return subprocess.run(
        [sys.executable, "-c", SYNTHETIC_BUNDLE + script],
        cwd=cwd,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=timeout,
        **popen,
    )


def test_the_exit_hook_ends_workers_a_reference_cycle_kept(tmp_path):
    """Below the run: loaders built by build_loaders, iterated (their workers started), then
    kept alive by a reference cycle with the cyclic collector off: the interpreter still exits."""
    script = textwrap.dedent("""
        import gc
        from runner.components.loaders import build_loaders
        gc.disable()
        train, val = build_loaders(BUNDLE, 8, 2, "cpu", seed=0)
        next(iter(train)); next(iter(val))
        cycle = {"loaders": (train, val)}
        cycle["self"] = cycle
        del train, val, cycle
        print("workers started", flush=True)
    """)
    out = _python(script, tmp_path, timeout=EXIT_BOUND_S + 60)
    assert out.returncode == 0 and "workers started" in out.stdout, out.stderr


def test_a_stop_signal_as_the_workers_start_reaches_the_main_process_alone(tmp_path):
    """A Ctrl-C sent to the process group just as the loader's workers are forked (the moment a
    run's first epoch starts): the workers, which inherit the main process's handler, must not
    run it (a second "SIGINT received") before they ignore the signal; the main process takes
    it once its workers have started. Each worker's start here is followed at once by a SIGINT
    to the group, before the worker can reach its init function."""
    script = textwrap.dedent("""
        import multiprocessing.context as mp, os, signal
        from runner.components import loaders

        class Process(mp.ForkProcess):
            def start(self):
                super().start()
                os.killpg(0, signal.SIGINT)

        class Context(mp.ForkContext):
            Process = Process

        signal.signal(signal.SIGINT, lambda *_: print("SIGINT in", os.getpid(), flush=True))
        loaders.worker_context = Context
        train, val = loaders.build_loaders(BUNDLE, 8, 2, "cpu", seed=0)
        assert sum(len(y) for _, y in train) == 64
        loaders.shutdown_workers(train, val)
        print("main", os.getpid(), flush=True)
    """)
    # (in a session of its own: the script's SIGINTs reach its own process group alone)
    out = _python(script, tmp_path, timeout=120, start_new_session=True)
    assert out.returncode == 0, out.stdout + out.stderr
    main = out.stdout.split("main ")[-1].strip()
    handled = [line.split()[-1] for line in out.stdout.splitlines() if line.startswith("SIGINT")]
    assert handled and set(handled) == {main}, out.stdout


@pytest.mark.parametrize(
    "code, status, printed",
    [
        ("raise SystemExit(3)", 3, ""),
        ("raise SystemExit('no such store')", 1, "no such store"),
        ("return None", 0, ""),
        ("raise SystemExit(None)", 0, ""),
    ],
)
def test_the_process_ends_as_python_would_without_the_teardown(tmp_path, code, status, printed):
    """`python -m runner` ends with `process_main`: after `cli`, it joins the threads that are
    not daemons, runs the exit handlers, flushes what is buffered and exits with cli's status (a
    message: printed, status 1), as Python's own exit does, without tearing every module down."""
    script = tmp_path / "probe.py"
    script.write_text(
        textwrap.dedent(f"""
        import atexit, sys, threading, time
        import runner.__main__ as entry

        def fake_cli():
            atexit.register(lambda: print("exit handler ran", flush=True))
            def late():
                time.sleep(0.5)
                print("thread finished", flush=True)
            threading.Thread(target=late).start()
            sys.stdout.write("buffered, no newline")
            {code}

        entry.cli = fake_cli
        entry.process_main()
        print("not reached")
    """)
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("AMP_RUNNER_FULL_EXIT", None)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == status, done
    assert "thread finished" in done.stdout and "exit handler ran" in done.stdout, done
    assert "buffered, no newline" in done.stdout and "not reached" not in done.stdout, done
    assert printed in done.stderr
