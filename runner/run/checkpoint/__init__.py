"""Checkpoints: everything a run needs to continue exactly where it stopped, written atomically,
read back only when they are intact, hold nothing but data, and fit the run that resumes them.

A run writes `<trainer.checkpoint_dir>/<experiment>/<run name>/<MLflow run id>/last.pt` (relative
to the launch directory, not Hydra's timestamped output folder) after every
`trainer.checkpoint_every_n_epochs` epochs and when it is interrupted. Each run has its own folder,
so a new run never overwrites another's checkpoint, and `resume=auto` takes the most recent one
under the experiment and run name. A file is written to a temporary name
(`.last.pt.<pid>.<thread>.tmp`), flushed to disk, renamed into place and the folder flushed too
(`runner.files.atomic_write`), so a crash or a power loss while writing leaves the previous
checkpoint intact; a temporary file left by a process that is gone is removed at the next save
into the same folder.

Contents: the model's state (fp32: the O2 masters' exact values), the optimizer's (its state for
the masters), the precision engine's (every loss scaler), the scheduler's, the position (epoch,
batch within it, global step), the divergence counters, the metric history, the RNG states of
torch, CUDA, Python and NumPy (tensors and plain types), the MLflow run id, the world size and the
resolved config.

File format (FORMAT 2): the `torch.save` archive (a zip file) of that dict, whose zip comment
holds `amp-runner checkpoint format 2 sha256:<hex>`, the SHA-256 of every byte before the
comment. The comment is part of the zip format, so the file is still an ordinary PyTorch file;
the digest sits inside the one file it covers (no sidecar to lose or to get out of step). Open one
in Python with `runner.run.checkpoint.load(path)`: it checks the digest before anything is
unpickled, unpickles with torch's safe unpickler and checks the contents' types.
`torch.load(path, weights_only=True)` reads it as well, without those checks.

What loading checks, in this order (each refusal a ConfigError naming the file, so the CLI exits
2 with the message and no traceback, before any MLflow run is reopened):

1. integrity: the digest matches (a flipped byte, a truncated or foreign file: "checkpoint
   <path> is corrupted"). FORMAT 1 files (amp-runner before the digest) carry none: they load
   with a warning that they cannot be verified.
2. safety: `torch.load(weights_only=True)`, so nothing in the file can run code; a file that
   needs any other class or function is refused, naming it. The digest guards against damage, not
   against a crafted file (anyone can compute a SHA-256): the safe unpickler does that. A FORMAT 1
   file also gets NumPy's array reconstruction allowed by name (its NumPy RNG state was an array),
   and that array is converted to a tensor on loading.
3. contents (`load`): every key known, the trainer's keys present, each value of its type
   (tensors where tensors belong, plain numbers and strings elsewhere), the RNG states accepted by
   fresh generators of their kind, every loss scaler's entry valid.
4. the run (`check_resumable`, `check_structure`): the config is the checkpoint's (but a grown
   `trainer.max_epochs`); the model state has this run's keys, shapes and dtypes; the optimizer
   has this run's number of parameter groups and parameters and is of its kind; the engine has one
   loss scaler per loss of this run (a static scale equal to this run's); the scheduler is of this
   run's kind (or both none); the world size is this run's. Each difference names the key, the
   checkpoint's side and this run's.

A sharded run (trainer.strategy=fsdp) writes `<run id>/last.dcp/` instead: its shards through
torch.distributed.checkpoint and `trainer.pt` in the format above, listing every shard file's
SHA-256 (`runner.run.checkpoint.sharded`). A write that fails (a full disk, the folder gone) stops
the run with one line (`unwritable`: the file, the cause, the room left, what is kept).

Modules: folders.py (where a run's checkpoint lives), format.py (the file: digest, atomic write,
safe read), contents.py (the schema of what a checkpoint holds), fit.py (whether it fits the run
that resumes it), sharded.py (a sharded run's checkpoint) and loading.py (`load`); the names
below are what callers use.
"""

# the checkpoint's API, in one place
from runner.run.checkpoint import sharded  # noqa: F401
from runner.run.checkpoint.contents import RUN_KEYS  # noqa: F401
from runner.run.checkpoint.fit import (  # noqa: F401
    IMPLIED_BEFORE,
    RESUMABLE_CHANGES,
    check_resumable,
    check_structure,
    config_differences,
)
from runner.run.checkpoint.folders import FILENAME, find, own, path_for, run_folder  # noqa: F401
from runner.run.checkpoint.format import FORMAT, LEGACY_FORMAT, save, unwritable  # noqa: F401
from runner.run.checkpoint.loading import load  # noqa: F401
