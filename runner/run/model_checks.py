"""Planning's checks of the run's model, before anything is built: the parts the config names
(the model, the data, the loss, a language model's context and vocabulary), the model's output
against the data, a language model's positional table against the data's sequences, the layer
plan and the FSDP units, all on one model built on PyTorch's meta device (`MetaModel`: shapes,
no memory, built at most once per plan). Each raises ConfigError naming the key;
`runner.run.plan.check_config` runs them in this order."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import torch
from omegaconf import DictConfig, OmegaConf

from runner.config import options
from runner.errors import ConfigError
from runner.precision import Properties, layers
from runner.precision.layers import LayerPlan, LayerRule

Declared = tuple[int, tuple[int, ...]]  # (classes, input shape): runner.components.data


class MetaModel:
    """The run's model on PyTorch's meta device (shapes, no memory, no data), made from the data
    config's declared input: built the first time a check asks for it and kept, so that the
    output check, the layer plan, the FSDP units and a dry run's findings share one build."""

    def __init__(self, node: Any, spec: Optional[options.Spec], declared: Optional[Declared]):
        self.node, self.spec, self.declared = node, spec, declared
        self._outcome: Optional[tuple[Optional[torch.nn.Module], Optional[Exception]]] = None

    def build(self) -> torch.nn.Module:
        """The model, built on the first call; raises what building it raised (again on every
        call, without building again). Only where the input is declared."""
        if self._outcome is None:
            from runner.components.models import build_model

            num_classes, shape = self.declared
            try:
                with torch.device("meta"):
                    self._outcome = (
                        build_model(self.node, num_classes, shape[-1], self.spec),
                        None,
                    )
            except Exception as error:  # kept: each caller says what a failed build means
                self._outcome = (None, error)
        model, error = self._outcome
        if error is not None:
            raise error
        return model

    def flops_per_sample(self, dtype: torch.dtype) -> Optional[float]:
        """The model's training FLOPs per sample (forward and backward, for inputs of the
        declared shape and `dtype`: runner.measure.flops), counted the first time asked and
        kept; None where the model cannot be made or run on the meta device."""
        if not hasattr(self, "_flops"):
            from runner.measure.flops import training_flops_per_sample

            model = self.get()
            self._flops = (
                None if model is None else training_flops_per_sample(model, self.declared[1], dtype)
            )
        return self._flops

    def get(self) -> Optional[torch.nn.Module]:
        """The model, or None where the input is not declared or the model cannot be made on the
        meta device (a ConfigError about it is raised)."""
        if self.declared is None:
            return None
        try:
            return self.build()
        except ConfigError:
            raise
        except Exception:  # noqa: BLE001  (the output check has already said what fails)
            return None


# ---- the model, the data and the loss ----------------------------------------------------------
def check_parts(
    cfg: DictConfig, specs: Mapping[str, Optional[options.Spec]], task: str = options.CLASSIFICATION
) -> MetaModel:
    """What the model, data and loss configs name, before anything is built: a zoo's model name,
    the user's `_target_`s (imported, arguments bound to their signatures), a text corpus and
    its tokenizer, and the model's output against the data's classes or vocabulary (built on the
    meta device, one forward of the task's input: float images or integer token ids), so that a
    dry run and a sweep's up-front check find them too. Raises ConfigError naming the key.
    Returns the meta model, with the input the data declares (None: only the dataset can tell);
    the output check builds it, else the first later check that needs it."""
    from runner.components.data import declared_input
    from runner.components.models import check_output
    from runner.tasks import task_for

    for group in ("model", "data"):
        if specs.get(group) is not None:
            specs[group].run_check(cfg[group])
    if "loss" in cfg:
        from runner.components.losses import check_target

        check_target(cfg.loss)
    declared = declared_input(cfg.data, specs.get("data"))
    if task == options.LANGUAGE_MODEL:
        check_context(cfg)
        if declared is not None:
            check_vocabulary(cfg, declared[0])
    meta = MetaModel(cfg.model, specs.get("model"), declared)
    if declared is not None:
        check_output(cfg.model, *declared, task=task_for(task), build=meta.build)
        if task == options.LANGUAGE_MODEL:
            check_positions(cfg, meta)
        check_loss(cfg, task, declared[0])
    return meta


def check_loss(cfg: DictConfig, task: Any, num_outputs: int) -> None:
    """The criterion (`loss._target_`), built and called once on a small batch of random
    outputs (`runner.components.losses.check_criterion`)."""
    from runner.components.losses import build_loss, check_criterion
    from runner.tasks import task_for

    if "loss" not in cfg:
        return
    check_criterion(build_loss(cfg), str(cfg.loss._target_), task_for(task), num_outputs)


def check_vocabulary(cfg: DictConfig, vocab_size: int) -> None:
    """Every token id of the data (0 .. vocab_size - 1) must have a row in the model's embedding:
    a declared `model.vocab_size` below the data's vocabulary is refused."""
    declared = cfg.model.get("vocab_size") if hasattr(cfg.model, "get") else None
    if declared is not None and int(declared) < int(vocab_size):
        raise ConfigError(
            "model.vocab_size",
            f"{declared}, but the data's token ids go up to "
            f"{int(vocab_size) - 1} (a vocabulary of {vocab_size})",
            f"null (the data's) or an integer >= {vocab_size}",
        )


def check_context(cfg: DictConfig) -> None:
    """A language model's context must hold the data's sequences: `data.block_size` against the
    model's `block_size` (the runner's GPT) or its position table (a Hugging Face model's
    `max_position_embeddings` / `n_positions`, where the config sets it)."""
    block = cfg.data.get("block_size") if hasattr(cfg.data, "get") else None
    if block is None:
        return
    for key in ("block_size", "max_position_embeddings", "n_positions"):
        context = cfg.model.get(key) if hasattr(cfg.model, "get") else None
        if context is not None and int(block) > int(context):
            raise ConfigError(
                "data.block_size",
                f"{block} tokens per sequence, but the model's "
                f"context holds {context} (model.{key})",
                f"at most {context}, or a model with a longer context",
            )


# the tables of a segment's id (Hugging Face's token_type_embeddings, BERT's "segment"), looked
# up over every position as positions are, but with a few ids only: the meta device cannot tell
# them from positions by their values, so they are known by name
SEGMENT_TABLES = ("token_type", "segment")


def check_positions(cfg: DictConfig, meta: MetaModel) -> None:
    """A language model's positional table must hold the data's sequences, whatever the model
    calls its size: one forward of a sequence of `data.block_size` tokens on the meta model
    watches every embedding table; one looked up with other indices than the token ids
    themselves (or a view of them), such as the positions `arange(T)`, over T positions but
    with fewer rows than T, is refused, naming both numbers, the table and the keys to change.
    (On the meta device a lookup past a table's end raises nothing: the sizes tell it.)"""
    model = meta.get()
    if model is None:
        return
    block = int(meta.declared[1][-1])
    tokens = torch.zeros((1, block), dtype=torch.long, device="meta")
    short: list[tuple[str, torch.nn.Embedding]] = []

    def watch(name: str, table: torch.nn.Embedding, args: tuple) -> None:
        index = args[0] if args else None
        if not isinstance(index, torch.Tensor) or index is tokens or index._base is tokens:
            return  # the token ids: the vocabulary's table (check_vocabulary)
        if any(word in name.rsplit(".", 1)[-1] for word in SEGMENT_TABLES):
            return  # a segment's table (BERT's token types: zeros), not positions
        if index.ndim and index.shape[-1] == block and table.num_embeddings < block:
            short.append((name, table))

    hooks = [
        module.register_forward_pre_hook(lambda m, args, name=name: watch(name, m, args))
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Embedding)
    ]
    try:
        with torch.no_grad():
            model(tokens)
    except Exception:  # noqa: BLE001  (check_output has run the same forward: the run will tell)
        return
    finally:
        for hook in hooks:
            hook.remove()
    if not short:
        return
    name, table = short[0]
    rows = table.num_embeddings
    keys = [
        f"model.{k}={block}"
        for k, v in OmegaConf.to_container(cfg.model, resolve=True).items()
        if isinstance(v, int) and not isinstance(v, bool) and v == rows
    ]
    raise ConfigError(
        "data.block_size",
        f"{block} tokens per sequence, but the model's positional table {name} holds {rows} "
        f"positions (nn.Embedding({rows}, {table.embedding_dim}), looked up with {block} "
        "positions in a forward on the meta device)",
        f"at most {rows}, or a model with a longer context"
        + (f": {' or '.join(keys)}" if keys else ""),
    )


def check_layers(
    rules: tuple[LayerRule, ...], meta: MetaModel, properties: Properties
) -> Optional[LayerPlan]:
    """The layer plan against the model's module names, before anything is built: the model on
    the meta device (shapes, no memory), each entry matched (ConfigError naming the entry's key
    for a glob that matches no module, fp8 on a layer that cannot run it, ...). Returns the plan,
    or None when there is no entry or the model cannot be made without its data (a user's
    dataset: the build checks it then, still before training)."""
    if not rules:
        return None
    model = meta.get()
    if model is None:
        return None
    return layers.assign(model, rules, properties)


# ---- the strategy under torchrun -------------------------------------------------------------
def check_strategy(
    cfg: DictConfig, properties: Properties, rules: tuple[LayerRule, ...], meta: MetaModel
) -> bool:
    """`trainer.strategy=fsdp` (runner.run.fsdp): a process group to shard over (torchrun), the
    settings a sharded run takes, and `trainer.fsdp_wrap` against the model's modules (on the
    meta device, where the data declares its shape). Returns whether the run shards."""
    if OmegaConf.select(cfg, "trainer.strategy", default="ddp") != "fsdp":
        return False
    from runner.run import distributed, fsdp

    if not distributed.will_join_a_group():
        raise ConfigError(
            fsdp.STRATEGY_KEY,
            "fsdp shards the model over the processes of "
            "torchrun's group, and this run is a single process without one",
            "trainer.strategy=ddp for one process, or start it with torchrun "
            "--nproc_per_node=N -m runner ... (N=1 too)",
        )
    for key, why, fix in fsdp.refusals(cfg, properties, rules):
        raise ConfigError(key, f"{why} (trainer.strategy=fsdp)", fix)
    model = meta.get()
    if model is not None:
        fsdp.units_for(model, OmegaConf.select(cfg, "trainer.fsdp_wrap"))
    return True
