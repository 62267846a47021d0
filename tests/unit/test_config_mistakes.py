"""runner.config.mistakes on real compositions of the config tree: every composition error becomes
one line naming the group or key, what was given, and the nearest right spellings, closest first;
a wrong type of any typed key names the type it takes."""

from __future__ import annotations

import dataclasses
import typing

import pytest
from omegaconf import DictConfig, OmegaConf

from runner.config import mistakes
from runner.errors import ConfigError
from tests.helpers.runs import compose_config


def explained(*overrides: str) -> str:
    with pytest.raises(Exception) as caught:
        compose_config(*overrides)
    assert mistakes.is_composition_error(caught.value)
    message = str(mistakes.explain(caught.value, overrides))
    assert "\n" not in message and "Config search path" not in message
    return message


def test_closest_spellings_come_first():
    assert mistakes.closest("o7", ["o0", "o1", "o1_bf16", "o2", "o3"]) == ["o0", "o1", "o2", "o3"]
    assert mistakes.closest("resnet5", ["densenet161", "resnet18", "resnet50"]) == [
        "resnet50",
        "resnet18",
    ]
    assert mistakes.closest("xyz", ["o0", "o1"]) == []


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["optimizer=adamm"], "optimizer: unknown option 'adamm'; did you mean adam or adamw?"),
        (["precision=O1_BF16"], "did you mean o1_bf16 (a case-insensitive match"),
        (["hydra/launcher=paralel"], "hydra/launcher: unknown option 'paralel'; did you mean"),
        (["scheduler=cosin"], "scheduler: unknown option 'cosin'; did you mean cosine?"),
        (["trainer.batchsize=8"], "batchsize: unknown key; did you mean trainer.batch_size?"),
        (["optimizer.learning_rate=1"], "optimizer.learning_rate: unknown key (allowed: name, lr,"),
        (["dry_runn=true"], "dry_runn: unknown key; did you mean dry_run?"),
        (["trainer.grad_clip_norm=x"], "grad_clip_norm: got 'x', expected a number or null"),
        (["trainer.channels_last=maybe"], "got 'maybe', expected true or false"),
        (["mlflow.tags=abc"], "mlflow.tags: got 'abc', expected a mapping"),
        # a `_target_`'s arguments are open: a new one takes `+`, as Hydra says
        (["model=custom", "model.depth=3"], "model.depth: unknown key; to add it: +model.depth=3"),
        (["experiment=cpu_demo"], "experiment: not in the defaults list; to add it: +experiment="),
        (
            ["trainer.max_epochs=[1"],
            "trainer.max_epochs=[1: Hydra's override grammar cannot read it (no viable "
            "alternative at input '[1'); https://hydra.cc/",
        ),
        # a plain value Hydra reads only quoted: the character, and the override quoted
        (
            ["data.root=ü data/my set"],
            "data.root=ü data/my set: Hydra's override grammar cannot read this value unquoted "
            "(it cannot take 'ü' there); quote it: \"data.root='ü data/my set'\"",
        ),
        (["hydra.run.dir=a=b"], "(it cannot take '=' there); quote it: \"hydra.run.dir='a=b'\""),
    ],
)
def test_each_kind_of_mistake_is_one_line(overrides, message):
    assert message in explained(*overrides)


def test_an_unknown_option_named_in_an_experiment_says_where(tmp_path):
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "mine.yaml").write_text("defaults:\n  - /model: resnet5\n")
    text = explained(f"hydra.searchpath=[file://{tmp_path}]", "+experiment=mine")
    assert text.startswith("model: unknown option 'resnet5' (in the defaults of experiment/mine)")


def _typed_leaves(node: DictConfig, prefix: str = ""):
    """(key, type) of every key a schema types as a bool, an int or a float."""
    schema = OmegaConf.get_type(node)
    hints = typing.get_type_hints(schema) if dataclasses.is_dataclass(schema) else {}
    for key in node:
        if isinstance(node[key], DictConfig):
            yield from _typed_leaves(node[key], f"{prefix}{key}.")
        elif hints.get(key) in (bool, int, float):
            yield f"{prefix}{key}", hints[key]


def test_a_wrong_type_names_the_key_the_value_and_the_type():
    words = {bool: "true or false", int: "an integer", float: "a number"}
    cfg = compose_config()
    leaves = [(k, t) for k, t in _typed_leaves(cfg) if not k.startswith("experiment.")]
    assert len(leaves) > 30  # every group's typed keys
    for key, kind in leaves:
        given = f"not-a-{kind.__name__}"
        error = explained(f"{key}={given}")
        assert error.startswith(f"{key}: got '{given}', expected {words[kind]}"), error


def test_the_runner_s_own_unknown_key_check_says_the_same():
    """`+trainer.max_epoch=1` composes (Hydra adds the key); the runner's check refuses it in the
    same words as Hydra's refusal of `trainer.max_epoch=1`."""
    from runner.config.validation import validate

    with pytest.raises(ConfigError) as caught:
        validate(compose_config("+trainer.max_epoch=1"))
    assert str(caught.value) == explained("trainer.max_epoch=1")
