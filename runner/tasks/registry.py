"""Every task by its name (`TASK_CLASSES`, one per name the task group offers), and `task_for`,
which picks a run's."""

from __future__ import annotations

from typing import Any

from runner.config.schema import CLASSIFICATION, LANGUAGE_MODEL, TASKS
from runner.tasks.base import Task
from runner.tasks.classification import Classification
from runner.tasks.language_model import LanguageModel

TASK_CLASSES: dict[str, type[Task]] = {
    CLASSIFICATION: Classification,
    LANGUAGE_MODEL: LanguageModel,
}
assert set(TASK_CLASSES) == set(TASKS)


def task_for(name: Any) -> Task:
    """The task of a resolved name (`runner.run.plan` resolves `task=auto`)."""
    return TASK_CLASSES[str(name)]()
