"""`python -m runner.diagnose <overrides>`: a pre-flight of a run's numeric range, before choosing a
precision level.

It composes the config exactly as `python -m runner` does (same config tree, same overrides; a bad
override or value exits 2 with the message and no traceback, before anything is built), then
trains a few steps (`--steps`, default 3) of the configured model on the configured data in fp32
(O0, whatever `precision=` says: the point is to see the values before any format rounds them),
with the range probe of `runner.measure.diagnostics` on every step and the judging formats fp16,
bf16,
fp8 e4m3 (activations) and fp8 e5m2 (gradients). It prints:

- per format, the layers whose activations or gradients would underflow (at least 1% of their
  non-zero values below the format's smallest normal) or overflow (any value above its max), with
  the gradients unscaled (loss scale 1);
- the loss scale that keeps every gradient in fp16's range: the largest power of two S with
  max|g| * S < 2^15 (half of fp16's max 65504: one back-off of headroom), from the gradients'
  exponent histogram (the largest gradient is known to its power of two), capped at 2^24 (the
  dynamic scaler's ceiling), and the share of gradients that still underflow at S (exact: the
  histogram's bins and S are powers of two);
- a recommendation: the preset to try first and the layers to keep in fp32.

It writes `diagnostics/layers.csv`, `exponents.csv` and `grad_exponents.png` (also under `--out`)
and the printed text (`diagnostics/report.txt`) into an MLflow run tagged `diagnose` in the
configured store (`mlflow.tracking_uri`, `mlflow.experiment_name`), whose params are the config
with the precision properties actually used (O0); the level asked for is the tag
`diagnose.target_preset`. Exit 0 when the table was printed (whatever it says), 2 for bad input.
"""
