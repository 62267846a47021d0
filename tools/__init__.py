"""Tools for working on the runner itself (not part of the package): `python -m tools.behaviour`
compares what two checkouts of the runner do."""
