"""Tasks: what a batch is, how the loss and the validation metrics are computed, and what a sweep
optimises. One small class per task, chosen once per run (`task_for`):

- `Classification` (images, and a user's dataset by default): inputs (B, C, H, W) (any floating
  tensor), logits (B, classes), one label per input; val_loss (the criterion's batch mean,
  averaged over the samples), val_acc; a sweep maximises best_val_acc.
- `LanguageModel` (next-token prediction): inputs (B, T) integer token ids, logits (B, T, V),
  targets (B, T) the inputs shifted by one token (the dataset yields them so); the loss is the
  criterion over every token (the mean token cross-entropy, nats per token); val_loss,
  val_perplexity = exp(val_loss), val_token_acc; throughput also in tokens per second; a sweep
  minimises best_val_loss.

The trainer calls only this interface (`Task`, base.py), so a new task is one module here with
its class, registered by name in registry.py, and its name in the task group (conf/task/).
Nothing here casts an input: integer token ids stay integers at every level (the engine casts
floating inputs only, as Apex did).
"""

from runner.tasks.base import EvalSums, Task  # noqa: F401  (re-exported)
from runner.tasks.classification import Classification  # noqa: F401  (re-exported)
from runner.tasks.language_model import LanguageModel  # noqa: F401  (re-exported)
from runner.tasks.registry import TASK_CLASSES, task_for  # noqa: F401  (re-exported)
