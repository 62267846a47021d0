"""The benchmarks' smoke tests run each script on tiny sizes; a test that let one write its default
--out (a refusal that no longer refuses, an --out forgotten) would overwrite the committed figures
in benchmarks/results/. Each test here fails if any file there changed while it ran."""

from __future__ import annotations

import pytest

from benchmarks.common import RESULTS  # where the benchmarks write without an --out


def _files() -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(RESULTS)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in RESULTS.rglob("*")
        if p.is_file()
    }


@pytest.fixture(autouse=True)
def committed_results_untouched():
    before = _files()
    yield
    after = _files()
    changed = sorted(n for n in before.keys() | after.keys() if before.get(n) != after.get(n))
    assert not changed, (
        f"the test wrote into benchmarks/results/ (give the benchmark an --out of its own): "
        f"{', '.join(changed)}; `git checkout benchmarks/results` restores the committed files"
    )
