"""The documentation's code blocks run: every block of README.md, docs/*.md and the pages beside
the code (runner/<room>/README.md) that a reader could run is run here, the way the reader would
run it, or carries a word saying why it cannot run on a CPU-only test machine.

A block's fence says what it is (its info string: a language, then words):

- ```bash: one command a line (a trailing backslash continues it, `#` starts a comment). The
  blocks of a page run in page order in the page's own folder, so a command sees the files and
  the MLflow store that the page's earlier blocks made.
  - `python -m runner ARGS` (or `amp-runner ARGS`) goes through the real CLI in this process
    with `dry_run=true` appended: Hydra's composition and every check of the plan, no training.
    In a block with the word `real` it trains, shrunk to a few batches (SHRINK, for each key the
    command does not set itself).
  - `python -m runner.<tool> ARGS` (the report, the range pre-flight, the kernels' build, ...)
    runs that tool's CLI in this process; the pre-flight is shrunk as a real run is.
  - `python -c CODE` and `python FILE` run in a process of their own.
  - `<run id>` and `<parent run id>` stand for runs of the page's store (the newest first).
  - `exit=N`: the status each command of the block must end with (default 0).
- ```python: run as a script in a process of its own; with `file=PATH` written to PATH in the
  page's folder (and compiled) for the commands after it.
- ```yaml: parsed; with `file=PATH` written there.
- ```text (a program's output) and ```diff (a patch): shown, not run.
- A word of MARKERS says why a block cannot run here (a GPU, several processes, a server, ...).
  Nothing in it runs, but each runner command in it is still composed (its options and keys
  must exist). A command that none of the above runs fails its page unless its block is marked.
- ```bash ci: what CI runs; each command must be a line of .ci/run.
"""

from __future__ import annotations

import os
import re
import runpy
import shlex
import subprocess
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from tests.helpers.runs import REPO

README = REPO / "README.md"
DOCS = REPO / "docs"
MAX_LINE = 100
MAX_README_LINES = 300

# Why a block cannot run on a CPU-only test machine; a block names one of these words.
MARKERS = {
    "gpu": "needs a CUDA GPU",
    "cluster": "needs several processes or machines (torchrun, SLURM)",
    "server": "needs an MLflow tracking server, or starts one",
    "dataset": "needs data of the reader's own (CIFAR-10 on disk, a corpus, a tokenizer file)",
    "install": "installs packages or runs the whole test suite",
    "long": "trains for minutes to hours (a full experiment, an optimising sweep's trials)",
    "benchmark": "a benchmark: minutes on a quiet machine (tests/benchmarks run each one small)",
    "apex": "needs a clone of NVIDIA Apex (APEX_GIT)",
    "ci": "what CI runs: checked against .ci/run",
}
RUNNABLE = {"bash", "python"}  # run, or marked
SHOWN = {"text", "diff", "yaml"}  # never run (yaml is parsed, and written with file=)
# A real run at the smallest size (for each key its command leaves): one epoch of two small
# batches, no worker processes, no progress bar.
SHRINK = {
    "trainer.max_epochs": "1",
    "trainer.batch_size": "16",
    "trainer.limit_train_batches": "2",
    "trainer.limit_val_batches": "1",
    "trainer.num_workers": "0",
    "trainer.progress_bar": "false",
}
SHRINK_DIAGNOSE = {"trainer.batch_size": "16", "trainer.num_workers": "0"}
NO_DRY_RUN = ("--help", "-h", "--cfg", "--info", "--hydra-help", "dry_run=true")


@dataclass
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    words: list[str]
    text: str
    attrs: dict[str, str] = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"{shown_path(self.page)}:{self.line}"

    @property
    def markers(self) -> list[str]:
        return [w for w in self.words if w in MARKERS]


def shown_path(page: Path) -> str:
    return str(page.relative_to(REPO)) if page.is_relative_to(REPO) else page.name


class DocError(AssertionError):
    """A block that does not run, or is not marked with why."""


def blocks(page: Path) -> list[Block]:
    found, lines = [], page.read_text().splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("```"):
            info = lines[i][3:].split()
            start, body = i + 1, []
            i += 1
            while i < len(lines) and not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            if i == len(lines):
                raise DocError(f"{shown_path(page)}:{start}: a code block is never closed")
            words = info[1:]
            attrs = dict(w.split("=", 1) for w in words if "=" in w)
            found.append(
                Block(page, start, info[0] if info else "", words, "\n".join(body) + "\n", attrs)
            )
        i += 1
    return found


def check_block(block: Block) -> None:
    """The fence's words are known, and a runnable block is run or says why not."""
    if not block.lang:
        raise DocError(f"{block.where}: a code block without a language (bash, python, text, ...)")
    if block.lang not in RUNNABLE | SHOWN:
        raise DocError(f"{block.where}: unknown block language {block.lang!r}")
    for word in block.words:
        key = word.split("=", 1)[0]
        if word not in MARKERS and word != "real" and key not in ("file", "exit"):
            raise DocError(
                f"{block.where}: unknown word {word!r} in the fence; "
                f"a block that cannot run names one of {sorted(MARKERS)}"
            )
    if len(block.markers) > 1:
        raise DocError(f"{block.where}: one reason a block, not {block.markers}")


# ---- commands --------------------------------------------------------------------------------
def commands(block: Block) -> list[tuple[int, str]]:
    """(line, command) for each command of a bash block: continuations joined, blank and
    comment-only lines dropped."""
    out, pending, first = [], "", 0
    for n, raw in enumerate(block.text.splitlines(), start=block.line + 1):
        if not pending:
            first = n
        line = raw.rstrip()
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        if line.strip() and not line.strip().startswith("#"):
            out.append((first, line.strip()))
    return out


def control_operators(command: str) -> list[str]:
    lexer = shlex.shlex(command, posix=True, punctuation_chars=";&|<>")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    try:
        return [t for t in lexer if t and set(t) <= set(";&|<>")]
    except ValueError as error:  # an unclosed quote
        raise DocError(f"{command!r}: {error}") from error


def words_of(command: str, cwd: Path) -> list[str]:
    """The words bash makes of `command` (quotes, `$(...)`, comments; no globbing)."""
    script = "set -f; words() { printf '%s\\0' \"$@\"; }; words " + command
    done = subprocess.run(
        ["bash", "-c", script], cwd=cwd, capture_output=True, text=True, env=_env(), timeout=120
    )
    if done.returncode:
        raise DocError(f"bash could not read {command!r}: {done.stderr}")
    return done.stdout.split("\0")[:-1]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def runner_args(words: list[str]) -> list[str] | None:
    """The runner's own arguments, when `words` start the runner (also under torchrun)."""
    if words[:3] == ["python", "-m", "runner"]:
        return words[3:]
    if words[:1] == ["amp-runner"]:
        return words[1:]
    if words[:1] == ["torchrun"] and "-m" in words and words[words.index("-m") + 1] == "runner":
        return words[words.index("-m") + 2 :]
    return None


def with_defaults(args: list[str], defaults: dict[str, str], before_options=False) -> list[str]:
    """`args` and each of `defaults` the args do not set: at the end, or before the first
    `--option` (for a tool whose overrides come first)."""
    set_keys = {a.split("=", 1)[0].lstrip("+~") for a in args if "=" in a}
    extra = [f"{k}={v}" for k, v in defaults.items() if k not in set_keys]
    at = len(args)
    if before_options:
        at = next((i for i, a in enumerate(args) if a.startswith("--")), at)
    return [*args[:at], *extra, *args[at:]]


# ---- the page's store ------------------------------------------------------------------------
def run_ids(folder: Path) -> dict[str, list[str]]:
    """The runs of the page's store, newest first: sweep parents and the others."""
    from mlflow.tracking import MlflowClient

    if not (folder / "mlflow.db").exists():
        raise DocError("a block names a run, but the page made no MLflow store before it")
    client = MlflowClient(f"sqlite:///{folder / 'mlflow.db'}")
    runs = client.search_runs(
        [e.experiment_id for e in client.search_experiments()], order_by=["start_time DESC"]
    )
    parents = [r.info.run_id for r in runs if "sweep.dir" in r.data.tags]
    return {"parent": parents, "run": [r.info.run_id for r in runs if r.info.run_id not in parents]}


def fill(command: str, folder: Path) -> str:
    if "<run id>" not in command and "<parent run id>" not in command:
        return command
    ids = run_ids(folder)
    for placeholder, kind in (("<parent run id>", "parent"), ("<run id>", "run")):
        for i in range(command.count(placeholder)):
            if i >= len(ids[kind]):
                raise DocError(f"{command!r}: the page's store has too few runs for it")
            command = command.replace(placeholder, ids[kind][i], 1)
    return command


# ---- running ---------------------------------------------------------------------------------
def _in_process(argv0: str, args: list[str], call) -> int:
    import logging

    from hydra.core.global_hydra import GlobalHydra

    root = logging.getLogger()
    saved = sys.argv, root.handlers[:], root.level, os.getcwd()
    sys.argv = [argv0, *args]
    try:
        call()
        return 0
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    finally:
        sys.argv, root.handlers[:], level, cwd = saved
        root.setLevel(level)
        GlobalHydra.instance().clear()
        os.chdir(cwd)


def run_runner(args: list[str], real: bool) -> int:
    from runner.__main__ import cli

    if real:
        args = with_defaults(args, SHRINK)
    elif not any(a in NO_DRY_RUN for a in args):
        args = [*args, "dry_run=true"]
    return _in_process("runner", args, cli)


def run_tool(module: str, args: list[str]) -> int:
    if module == "runner.diagnose":
        args = with_defaults(args, SHRINK_DIAGNOSE, before_options=True)

    def call():
        with warnings.catch_warnings():  # runpy: the module is already imported (by runner)
            warnings.simplefilter("ignore", RuntimeWarning)
            runpy.run_module(module, run_name="__main__", alter_sys=True)

    return _in_process(module, args, call)


def run_process(words: list[str], cwd: Path) -> int:
    done = subprocess.run(
        [sys.executable, *words[1:]], cwd=cwd, env=_env(), capture_output=True, text=True
    )
    print(done.stdout, done.stderr)
    return done.returncode


def run_command(block: Block, line: int, command: str, folder: Path) -> None:
    where = f"{shown_path(block.page)}:{line}: {command}"
    command = fill(command, folder)
    operators = control_operators(command)
    if operators:
        raise DocError(f"{where}: one command a line ({operators} found): split it")
    words = words_of(command, folder)
    env = {}
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    saved_env = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        args = runner_args(words)
        if args is not None and words[0] != "torchrun":
            status = run_runner(args, real="real" in block.words)
        elif words[:2] == ["python", "-m"] and words[2].startswith("runner."):
            status = run_tool(words[2], words[3:])
        elif words[:1] == ["python"] and len(words) > 1 and words[1] != "-m":
            status = run_process(words, folder)
        else:
            raise DocError(
                f"{where}: not a command this test runs; mark its block with why it cannot "
                f"run here, one of {sorted(MARKERS)}"
            )
    finally:
        for k, v in saved_env.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    expected = int(block.attrs.get("exit", 0))
    if status != expected:
        raise DocError(f"{where}: exit status {status}, the page says {expected}")


def compose_only(block: Block, line: int, command: str, folder: Path) -> None:
    """A marked block's runner command: its first job composes (options and keys exist)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser

    import runner.config  # noqa: F401  (registers the schemas)
    from runner.config.finder import config_dir

    if control_operators(command) and "&&" not in command:
        return  # a server started in the background, a pipe: nothing of the runner's to compose
    words = words_of(command.split("&&")[-1], folder)
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
        words.pop(0)
    args = runner_args(words) if words else None
    if args is None or "--config-dir" in args or "..." in args:
        return
    overrides = []
    for override in OverridesParser.create().parse_overrides([a for a in args if a != "-m"]):
        key = override.get_key_element()
        if key.lstrip("+~").startswith("hydra"):
            continue
        if override.is_sweep_override():
            try:
                value = next(iter(override.sweep_string_iterator()))
            except Exception:  # an interval or a tagged sweep: the option's default
                continue
            overrides.append(f"{key}={value}")
        else:
            overrides.append(override.input_line)
    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
            compose("config", overrides=overrides)
    except Exception as error:
        raise DocError(
            f"{shown_path(block.page)}:{line}: {command}: does not compose: {error}"
        ) from error


def run_python(block: Block, folder: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", block.text],
        cwd=folder,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    print(done.stdout, done.stderr)
    if done.returncode != int(block.attrs.get("exit", 0)):
        raise DocError(f"{block.where}: the script exited {done.returncode}: {done.stderr[-2000:]}")


def write_file(block: Block, folder: Path) -> None:
    path = folder / block.attrs["file"]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(block.text)


def run_page(page: Path, folder: Path) -> list[str]:
    """Runs every block of `page` in `folder` (the current directory); returns what it did,
    one line a block."""
    did = []
    for block in blocks(page):
        check_block(block)
        if "file" in block.attrs:
            if block.lang == "python":
                compile(block.text, block.attrs["file"], "exec")
            elif block.lang == "yaml":
                yaml.safe_load(block.text)
            write_file(block, folder)
            did.append(f"{block.where} wrote {block.attrs['file']}")
        elif block.lang == "yaml":
            yaml.safe_load(block.text)
            did.append(f"{block.where} parsed")
        elif block.lang in SHOWN:
            did.append(f"{block.where} shown")
        elif block.markers:
            for line, command in commands(block) if block.lang == "bash" else []:
                compose_only(block, line, command, folder)
            did.append(f"{block.where} not run: {MARKERS[block.markers[0]]}")
        elif block.lang == "python":
            run_python(block, folder)
            did.append(f"{block.where} ran the script")
        else:
            for line, command in commands(block):
                run_command(block, line, command, folder)
            did.append(f"{block.where} ran {len(commands(block))} commands")
    return did


# ---- the pages -------------------------------------------------------------------------------
def pages() -> list[Path]:
    """README.md and docs/: the pages held to the line lengths and links checked below."""
    return [README, *sorted(DOCS.glob("*.md"))]


def pages_beside_the_code() -> list[Path]:
    """The longer explanations beside the code (runner/<room>/README.md): their blocks too."""
    return sorted((REPO / "runner").rglob("README.md"))


@pytest.fixture
def page_folder(tmp_path, monkeypatch):
    """The page's folder: the launch directory of its commands, with its own caches (modules it
    adds, a model of the reader's own, and what its runs set in the environment are forgotten
    by conftest's `_launch_in_tmp_dir`)."""
    monkeypatch.setenv("AMP_RUNNER_TOKEN_CACHE", str(tmp_path / "token-cache"))
    monkeypatch.setenv("PYTHONUNBUFFERED", "1")
    path = sys.path[:]
    yield tmp_path
    sys.path[:] = path


@pytest.mark.slow
@pytest.mark.parametrize(
    "page", [*pages(), *pages_beside_the_code()], ids=lambda p: str(p.relative_to(REPO))
)
def test_every_block_of_the_page_runs_or_says_why_not(page, page_folder):
    run_page(page, page_folder)


def test_the_pages_are_short_lines_and_the_readme_a_short_page():
    long = [
        f"{page.relative_to(REPO)}:{n}"
        for page in pages()
        for n, line in enumerate(page.read_text().splitlines(), 1)
        if len(line) > MAX_LINE
    ]
    assert not long, f"lines over {MAX_LINE} characters: {long}"
    assert len(README.read_text().splitlines()) <= MAX_README_LINES


def test_the_readme_test_command_is_what_ci_runs():
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    shown = [c for b in blocks(README) if "ci" in b.words for _, c in commands(b)]
    assert shown, "README shows no test command (a ```bash ci block)"
    for command in shown:
        assert command.split("#")[0].strip() in ci, command


def test_every_page_is_linked_and_every_link_leads_somewhere():
    linked: set[Path] = set()
    for page in pages():
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        inline = re.findall(r"\]\(([^)\s]+)\)", text)
        for target in inline + re.findall(r"^\[[^\]]+\]:\s+(\S+)", text, flags=re.M):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            assert file.exists(), f"{page.relative_to(REPO)}: broken link {target}"
            linked.add(file)
            if anchor and file.suffix == ".md":
                assert anchor in anchors(file), f"{page.relative_to(REPO)}: no #{anchor} in {path}"
    assert not set(DOCS.glob("*.md")) - linked, "pages no other page links to"


def test_the_readmes_measured_figures_are_in_the_results_they_link_to():
    """The front page's table of GPU results: each figure links (by a reference) to a committed
    result of an H100 or an H200 that holds that number."""
    text = README.read_text()
    refs = dict(re.findall(r"^\[([^\]]+)\]:\s+(\S+)", text, flags=re.M))
    figures = re.findall(r"\[([^\]]*\d[^\]]*)\]\[([^\]]+)\]", text)
    assert {Path(refs[ref]).parent.name for _, ref in figures} == {"h100", "h200"}
    for figure, ref in figures:
        number = re.search(r"[-+]?\d+(?:\.\d+)?", figure).group(0)
        assert number in (REPO / refs[ref]).read_text(), f"{figure} is not in {refs[ref]}"


def anchors(page: Path) -> set[str]:
    """GitHub's ids of the page's headings."""
    out = set()
    for line in re.sub(r"```.*?```", "", page.read_text(), flags=re.S).splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


# ---- the harness catches what it should ------------------------------------------------------
BROKEN = {
    "an unknown option": "```bash\npython -m runner model=no_such_model\n```\n",
    "an unknown key": "```bash\npython -m runner trainer.max_epoch=3\n```\n",
    "a refusal the page does not expect": "```bash\npython -m runner precision.opt_level=O2\n```\n",
    "a script that fails": "```python\nraise SystemExit('broken')\n```\n",
    "a command nothing runs": "```bash\ncurl http://example.com\n```\n",
    "two commands on a line": "```bash\npython -m runner model=tiny; rm -rf data\n```\n",
    "a block without a language": "```\npython -m runner\n```\n",
    "an unknown word in the fence": "```bash needs-coffee\npython -m runner\n```\n",
    "a marked block whose key is gone": "```bash gpu\npython -m runner trainer.no_key=1\n```\n",
    "a tool that fails": "```bash\npython -m runner.report --parent no-such-run\n```\n",
}


@pytest.mark.parametrize("snippet", BROKEN.values(), ids=BROKEN.keys())
def test_the_harness_fails_a_broken_block(snippet, page_folder):
    page = page_folder / "broken.md"
    page.write_text(f"# A page\n\n{snippet}")
    with pytest.raises(DocError):
        run_page(page, page_folder)


def test_the_harness_runs_what_a_page_shows(page_folder):
    page = page_folder / "ok.md"
    page.write_text(
        "```python file=my_pkg/nets.py\nfrom torch import nn\n\n\n"
        "def Net(num_classes):\n"
        "    return nn.Sequential(nn.Flatten(), nn.LazyLinear(num_classes))\n"
        "```\n\n```bash exit=2\npython -m runner precision.opt_level=O2  # refused\n```\n\n"
        "```bash gpu\ntorchrun --nproc_per_node=8 -m runner precision=o2 model=resnet50\n```\n\n"
        "```text\nanything\n```\n"
    )
    did = run_page(page, page_folder)
    assert (page_folder / "my_pkg" / "nets.py").is_file()
    assert [d.split(" ", 1)[1] for d in did] == [
        "wrote my_pkg/nets.py",
        "ran 1 commands",
        f"not run: {MARKERS['gpu']}",
        "shown",
    ]
