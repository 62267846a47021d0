"""Where the config tree lives, so `python -m runner` works from a checkout and from a wheel.

A wheel installs `conf/` (with `experiments/` as its `experiment` group) as `runner/conf`; a
source checkout or editable install keeps them beside the package.
"""

from __future__ import annotations

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent.parent  # runner/


def config_dir() -> Path:
    for candidate in (PACKAGE_DIR / "conf", PACKAGE_DIR.parent / "conf"):
        if (candidate / "config.yaml").is_file():
            return candidate
    raise FileNotFoundError(
        f"amp-runner's config tree was not found in {PACKAGE_DIR / 'conf'} or "
        f"{PACKAGE_DIR.parent / 'conf'}: reinstall the package (pip install amp-runner)."
    )
