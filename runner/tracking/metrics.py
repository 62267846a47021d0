"""Every metric name a run logs, once (as `tags.py` does for tags): the trainer logs them, the
report, the sweep and the benchmarks read them. The memory-by-kind figures (`mem_<kind>_mb`) are
named by `runner.measure.memory`, the range diagnostics (`diag_*`) by `runner.measure.diagnostics`,
the layer audit's (`layers_off_plan`, `layers_<format>`) by `runner.measure.audit`, the step
timer's (the steady `samples_per_s` and `tokens_per_s`, `step_time_ms_p50/p90`, `data_wait_frac`,
`warmup_time_s`, `tflops`, `mfu`) by `runner.measure.timing`.
"""

from __future__ import annotations

# per logging step (trainer.log_every_n_steps)
TRAIN_LOSS = "train_loss"  # mean training loss over the steps since the last read
LR = "lr"  # the first parameter group's learning rate

# per epoch (step = the epoch)
VAL_LOSS = "val_loss"  # a language model's: nats per token
VAL_ACC = "val_acc"  # classification
VAL_PERPLEXITY = "val_perplexity"  # language model: exp(val_loss)
VAL_TOKEN_ACC = "val_token_acc"  # language model: next tokens predicted right (argmax)
EPOCH_TIME_S = "epoch_time_s"  # training time of the epoch (validation excluded)
# the epoch's samples (a language model's tokens) over epoch_time_s, every rank's, warm-up and
# compiled steps included (the steady figures, which compare: runner.measure.timing)
EPOCH_SAMPLES_PER_S = "epoch_samples_per_s"
EPOCH_TOKENS_PER_S = "epoch_tokens_per_s"
PEAK_MEM_MB = "peak_mem_mb"  # peak memory of the training state (the tag peak_mem_kind says how)
LOSS_SCALE = "loss_scale"
SKIPPED_STEPS = "skipped_steps"  # overflowing steps skipped so far
RSS_GROWTH_MB = "rss_growth_mb"  # on a CPU: the process's resident-memory growth

# once per run
COMPILE_TIME_S = "compile_time_s"  # torch.compile's first step (not in epoch_time_s)
# on a CUDA device: the share of a few steps after the warm-up in which the GPU ran anything
# (runner.measure.busy; below 0.8 the host's launches bound the step: a finding names the levers)
DEVICE_BUSY_FRAC = "device_busy_frac"
TUNE_TIME_S = "tune_time_s"  # trainer.tune's measuring before the run built its parts (step 0)
BATCHNORM_LAYERS = "model.batchnorm_layers"  # a param: the model's BatchNorm layers, counted once
FLOPS_PER_SAMPLE = "model.flops_per_sample"  # a param: training FLOPs per sample, counted once
BEST_VAL_ACC = "best_val_acc"  # a classifier's objective, maximised (step = max_epochs)
BEST_VAL_LOSS = "best_val_loss"  # a language model's objective, minimised (step = max_epochs)
TRAIN_TIME_S = "train_time_s"  # training time over every session of the run

# once per run, at its end (step = max_epochs): the headline figures again, under one prefix,
# so that MLflow's runs page (its columns listed by name, with a search box) and its compare
# view put them side by side: `summary/` and the name of the metric each is made from:
# summary/best_val_acc (a language model's summary/best_val_loss), summary/train_time_s,
# summary/peak_mem_mb (the highest epoch's), summary/samples_per_s with summary/samples_per_s_p10
# and _p90 (a language model's tokens_per_s too: the epochs' means, as the report averages them),
# at four significant digits (MLflow's table shows them whole).
# The names they repeat are logged as before: nothing that reads them changes.
SUMMARY_PREFIX = "summary/"


def summary(metric: str) -> str:
    """The headline name of `metric`: `summary/<metric>`."""
    return SUMMARY_PREFIX + metric


# a sharded run (runner.run.fsdp), with the memory by kind: the largest unit's gathered parameters
MEM_ALLGATHER_MB = "mem_allgather_mb"
