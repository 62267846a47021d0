"""benchmarks/results/README.md indexes every committed result: each file of a machine's folder
(its logs apart) is linked from it, every link leads to a file, and a result sits in the folder of
the machine it names (a GPU's model in its file name, or `cpu`)."""

from __future__ import annotations

import re

from benchmarks.common import RESULTS

INDEX = RESULTS / "README.md"


def _linked() -> set:
    targets = re.findall(r"\]\(([^)\s]+)\)", INDEX.read_text())
    return {(RESULTS / t).resolve() for t in targets}


def test_every_result_file_is_in_the_index_and_every_link_leads_to_one():
    linked = _linked()
    files = {
        p.resolve()
        for p in RESULTS.glob("*/*")
        if p.is_file() and p.parent.name != "logs" and p != INDEX
    }
    assert files, "no results found"
    assert not sorted(str(p.relative_to(RESULTS)) for p in files - linked), "not in the index"
    missing = [p for p in linked if not p.exists()]
    assert not missing, f"the index links to no file: {missing}"


def test_results_sit_in_their_machines_folder():
    assert not [p for p in RESULTS.iterdir() if p.is_file() and p != INDEX], "outside a folder"
    for path in RESULTS.glob("*/*"):
        if not path.is_file():
            continue
        named = next((m for m in ("h100", "h200", "cpu") if f"_{m}" in path.stem), None)
        if named is None:  # `_cuda`: a GPU's, named before the files were named for the GPU
            assert "_cuda" in path.stem and path.parent.name in {"h100", "h200"}, path
        else:
            assert path.parent.name == named, path
