"""The optimizer steps the fused kernels are checked on against torch.optim (shared by the kernels'
and the stochastic rounding tests)."""

SGD_CASES = [
    dict(momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.0, maximize=False),
    dict(momentum=0.9, dampening=0.0, nesterov=False, weight_decay=5e-4, maximize=False),
    dict(momentum=0.9, dampening=0.1, nesterov=False, weight_decay=0.0, maximize=True),
    dict(momentum=0.9, dampening=0.0, nesterov=True, weight_decay=1e-2, maximize=False),
]


ADAM_CASES = [
    ("adam", dict(weight_decay=0.0, maximize=False)),
    ("adam", dict(weight_decay=1e-2, maximize=False)),
    ("adamw", dict(weight_decay=1e-2, maximize=False)),
    ("adamw", dict(weight_decay=0.0, maximize=True)),
]


# a dynamic loss scale that reaches both its bounds within a few steps, with hysteresis: the
# scaler's knobs (runner.precision.scaler.LossScaler's keywords)
SCALE_BOUNDED = dict(
    init_scale=8.0,
    growth_interval=2,
    hysteresis=2,
    min_loss_scale=2.0,
    max_loss_scale=32.0,
    backoff_factor=0.25,
)
