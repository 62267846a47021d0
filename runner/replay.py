"""`python -m runner.replay FOLDER`: deliver what a run could not log while its tracking server was
away (the command a run prints when it saved to its offline store); see `runner.tracking.replay`."""

from __future__ import annotations

import sys

from runner.tracking.replay import main

if __name__ == "__main__":
    sys.exit(main())
