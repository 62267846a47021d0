"""`python -m runner.diagnose`: see runner.diagnose."""

from __future__ import annotations

import sys

from runner.diagnose.cli import main

if __name__ == "__main__":
    sys.exit(main())
