"""Tests of the tools in tools/ (the runner's own development tools)."""
