"""`python -m runner.report`: the precision levels of a sweep side by side, from MLflow.

Reads the runs back from any MLflow store (a SQLite file or a tracking server) and writes the
comparison (Markdown and CSV) and figures (PNG). The Markdown opens with a headline of at most
ten columns (headline.py: a row per configuration, its seeds pooled), each figure with what says
how much of it is noise (runner.measure.spread): the speed-up over O0 with its 95% interval from
the runs' steady step times and "within noise" where it holds 1.0, the throughput with its
p10-p90 spread, the accuracy difference with the seeds' std; then every column, a row per run
(tables.py), and the notes as short bullets (notes.py). The figures (plots.py): bars of
throughput (whiskers: p10-p90, labelled with the speed-up), peak memory and best validation
(points on an axis zoomed to them, O0 dashed), a panel of bars per kind of memory (weights, fp32
masters, gradients, optimizer state, activations: `mem_*_mb`, each panel its own scale), and the
validation curve of every run. The params that differ between the runs (an lr, a seed, a
schedule swept beside the levels) get a column each, and each run is compared with the O0 (fp32)
run of its group (the same model and the same values of those params, seeds apart): speedup =
the run's steady rate / O0's, memory ratio = the run's peak memory / O0's; the table names that
baseline. The files are also logged as artifacts of
the sweep's parent run (under `report/`), so they show in the MLflow UI beside the runs. Runs that
did not finish are listed under the table, by the name their row shows and their run id, with the
reason: their `error` tag (a failure, an interrupt, or "process vanished: ..." for a run whose
process was killed outright and that a later run ended KILLED: runner.tracking.liveness), or for a
run still RUNNING its last heartbeat.

    python -m runner.report                                  # the newest sweep in ./mlflow.db
    python -m runner.report --parent <run id> --out report   # one sweep, by its parent run
    python -m runner.report --tracking-uri http://127.0.0.1:5000 --sweep
    multirun/2026-01-01/10-00-00
    python -m runner.report --diff <run id> <run id>         # the params that differ, printed

Exit status: 0 when the report was written, 1 when there is nothing to report (no such
store, experiment, sweep or runs: the message says which), 2 for bad arguments.
"""
