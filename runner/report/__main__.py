"""`python -m runner.report`: see runner.report."""

from __future__ import annotations

import sys

from runner.report.cli import main

if __name__ == "__main__":
    sys.exit(main())
