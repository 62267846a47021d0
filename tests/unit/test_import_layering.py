"""The house by role is a contract: rooms (sub-packages) import downward only, the sibling rooms
are independent of one another, `measure` imports nothing else of the runner but the metric
names' registry (`runner.metrics`, the bottom floor), no module import
cycle exists, at most 8 modules stand at the top of `runner/`, and `import runner.config`
(what Hydra composes with) leaves torch unimported.

The graph is read from the source (every `import`, function-level ones included), so a lazy
import cannot hide an upward edge."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "runner"

# Top to bottom; a module may import its own room and rooms below its layer, never above, and
# never a sibling room of its own layer. `runner` is the package root (its version).
LAYERS: list[tuple[str, ...]] = [  # the first: the entry points users type (report, diagnose and
    # sweep are rooms of their own: each split by job into modules under 500 lines)
    ("runner.__main__", "sweep", "report", "diagnose", "runner.replay"),
    ("run",),
    ("tasks",),  # what a batch, the loss and the metrics are (metric names from tracking)
    ("components", "tracking", "measure", "precision"),  # independent of one another
    ("csrc",),  # the precision engine's kernels
    ("config",),  # never imports torch
    ("runner.errors", "runner.files", "runner.shell", "runner.metrics", "runner"),  # bottom floor
]
ENTRY_POINTS = LAYERS[0]
ROOMS = (
    *("sweep", "report", "diagnose"),
    *("config", "components", "tasks", "run", "tracking", "measure", "precision", "csrc"),
)


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The runner modules `name` imports anywhere in its source (as module names)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "runner")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module.split(".")[0] != "runner":
                continue
            for alias in node.names:
                full = f"{module}.{alias.name}"
                out.add(full if full in known else module)
    return out


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ROOMS else module


def layer_of(module: str) -> int:
    r = room(module)
    return next(i for i, layer in enumerate(LAYERS) if r in layer)


GRAPH = {name: imported(name, path, modules()) for name, path in modules().items()}


def test_every_module_has_a_layer():
    unplaced = [m for m in GRAPH if not any(room(m) in layer for layer in LAYERS)]
    assert unplaced == [], f"modules outside every layer (add a room or an entry point): {unplaced}"


def test_at_most_eight_modules_at_the_top():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 8, top


def test_imports_point_down_only():
    upward = [
        f"{a} -> {b}"
        for a, targets in GRAPH.items()
        for b in targets
        if room(a) != room(b) and layer_of(b) < layer_of(a)
    ]
    assert upward == [], "imports pointing up:\n" + "\n".join(upward)


def test_sibling_rooms_are_independent():
    across = [
        f"{a} -> {b}"
        for a, targets in GRAPH.items()
        for b in targets
        if room(a) != room(b)
        and layer_of(a) == layer_of(b)
        and not (room(a) in ENTRY_POINTS and room(b) in ENTRY_POINTS)
    ]
    assert across == [], "imports between rooms of one layer:\n" + "\n".join(across)


def test_measure_imports_nothing_else_of_the_runner():
    outside = [
        f"{a} -> {b}"
        for a, targets in GRAPH.items()
        if room(a) == "measure"
        for b in targets
        if room(b) != "measure" and b != "runner.metrics"  # (the names it logs under)
    ]
    assert outside == [], outside


def test_no_import_cycle():
    # Tarjan's strongly connected components over the module graph
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in GRAPH.get(node, ()):
            if target not in GRAPH:
                continue
            # a package's __init__ importing its own submodules is how packages re-export
            if target.startswith(node + "."):
                continue
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(GRAPH):
        if module not in index:
            visit(module)
    assert cycles == [], cycles


def test_mlflow_is_imported_only_in_the_tracking_room():
    """MLflow's one door is runner.tracking (its Tracker protocol and MLflow's implementation):
    no other module imports it, at the top or in a function."""
    outside = []
    for name, path in modules().items():
        if room(name) == "tracking":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found = [a.name for a in node.names if a.name.split(".")[0] == "mlflow"]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                found = [node.module] if (node.module or "").split(".")[0] == "mlflow" else []
            else:
                continue
            outside += [f"{name}:{node.lineno} imports {m}" for m in found]
    assert outside == [], outside


def test_the_checks_would_catch_an_upward_import():
    """The contract is not vacuous: an import of the run room from config counts as upward."""
    assert layer_of("runner.run.trainer") < layer_of("runner.config.options")
    assert room("runner.measure.memory") == "measure" and layer_of("runner.report") == 0


@pytest.mark.parametrize(
    "module",
    ["runner.config", "runner.config.validation", "runner.config.targets", "runner.config.finder"],
)
def test_config_imports_no_torch(module):
    code = (
        f"import sys, {module}; "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=PACKAGE.parent,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"{module} imported {out.stdout.strip()}"


def test_no_script_folder_hides_an_installed_package():
    """A script run out of tests/helpers/ has its folder first on sys.path: a module of that folder
    (or a package at the repository's root: benchmarks, tools) named as an installed package hides
    that package from everything imported after it. benchmarks/kernels.py, when benchmarks/ was a
    folder of scripts, hid Hugging Face's `kernels`, which transformers 5.25 imports: every
    Hugging Face model failed to build."""
    import importlib.metadata

    installed = {
        name: dists
        for name, dists in importlib.metadata.packages_distributions().items()
        if "amp-runner" not in dists  # (this project's own `runner`)
    }
    repo = PACKAGE.parent
    ours = {p.stem: p for p in (repo / "tests" / "helpers").glob("*.py")}
    ours |= {p.name: p for p in repo.iterdir() if (p / "__init__.py").is_file()}
    clashes = {
        name: (str(path.relative_to(repo)), installed[name])
        for name, path in ours.items()
        if name in installed
    }
    assert not clashes, f"rename these: {clashes}"
