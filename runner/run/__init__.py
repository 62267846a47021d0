"""One run, from its config to its finished record: the plan (plan.py: everything decided before
anything is built, computed once and carried on the plan, plan.md; model_checks.py: its checks of
the model on the meta device; autoplan.py and layer_ranges.py: a layer plan from measured ranges,
autoplan.md), the settings tuned by measuring them (tune.py, tune_measure.py, tune_cache.py), the
build of its parts (build.py), the training loop (trainer.py), its checkpoints
and resuming (checkpoint/, resume.py, rng.py), a clean stop on a signal (interrupts.py), an
unexpected error's traceback kept in the run's log and record (failure.py), data-parallel and
sharded runs (distributed.py, fsdp.py), a folder of its own for each launch (output_folder.py),
and app.py, which does them in order for `python -m runner`."""
