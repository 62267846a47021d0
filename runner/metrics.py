"""Every metric name a run logs, once (as `runner.tracking.tags` does for tags): the trainer and
its instruments log them (runner.measure), the report, the sweep's summary, the benchmarks and the
docs read them. A bottom-floor module: the instruments, which import nothing else of the runner,
take their names from here too.
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

# the step timer (runner.measure.timing), per epoch: the steady figures, warm-up apart
SAMPLES_PER_S = "samples_per_s"  # the median steady step's rate, every rank's samples
TOKENS_PER_S = "tokens_per_s"  # a language model's, in tokens
# the spread: the rate at the steady steps' 90th percentile time (p10: the slow steps) and at
# their 10th (p90: the fast ones)
SAMPLES_PER_S_P10 = "samples_per_s_p10"
SAMPLES_PER_S_P90 = "samples_per_s_p90"
TOKENS_PER_S_P10 = "tokens_per_s_p10"
TOKENS_PER_S_P90 = "tokens_per_s_p90"
STEP_TIME_MS_P50 = "step_time_ms_p50"  # the steady steps' median time
STEP_TIME_MS_P90 = "step_time_ms_p90"
DATA_WAIT_FRAC = "data_wait_frac"  # the epoch's share of time between steps (waiting for data)
WARMUP_TIME_S = "warmup_time_s"  # once per session: its first warmup_steps steps
TFLOPS = "tflops"  # achieved: FLOPs per sample x steady samples per second, every rank's
MFU = "mfu"  # tflops over the devices' dense peak for the level's format
TIMING = (
    SAMPLES_PER_S,
    SAMPLES_PER_S_P10,
    SAMPLES_PER_S_P90,
    TOKENS_PER_S,
    TOKENS_PER_S_P10,
    TOKENS_PER_S_P90,
    STEP_TIME_MS_P50,
    STEP_TIME_MS_P90,
    DATA_WAIT_FRAC,
    WARMUP_TIME_S,
    TFLOPS,
    MFU,
)


def spread_names(metric: str) -> tuple[str, str]:
    """The names of a rate's spread: (`<rate>_p10`, `<rate>_p90`)."""
    return f"{metric}_p10", f"{metric}_p90"


# memory by kind (runner.measure.memory), once per measurement, in MiB
MEMORY_KINDS = ("weights", "master_weights", "grads", "optimizer_state", "activations")
MEM_TOTAL_MB = "mem_total_mb"


def memory_metric(kind: str) -> str:
    """The metric of one kind: `mem_<kind>_mb`."""
    return f"mem_{kind}_mb"


# the layer audit (runner.measure.audit), at each audited step
LAYERS_OFF_PLAN = "layers_off_plan"  # layers whose observed format differs from the plan's
LAYERS_IN = "layers_"  # + fp32 | bf16 | fp16 | fp8: how many layers computed in each format
# the range diagnostics (runner.measure.diagnostics), at each diagnosed step: these prefixes, then
# what each figure is of (`diag_grad_underflow_frac_fp16`, ...)
DIAG_GRAD, DIAG_ACT = "diag_grad", "diag_act"
