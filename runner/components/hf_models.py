"""`model=hf`: Hugging Face transformers' causal language models by model type, with random
weights and nothing downloaded: `model=hf model.arch=llama +model.hidden_size=64 ...`.

`check_hf` refuses, before any data or run exists, the settings that cannot work (transformers
missing, a type that is unknown or has no causal LM, a setting that would download or load
weights, one the config class lacks); `build_hf` builds the model from its config alone, wrapped
as the runner's language model (`runner.components.lm_models.HFCausalLM`). transformers is
optional (`amp-runner[hf]`) and slow to import: it is imported only on use, with the hub forced
offline.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import logging
import os
import re
from typing import Any

import torch

from runner.components.lm_models import HFCausalLM, vocab_size_for
from runner.config import targets
from runner.errors import ConfigError

log = logging.getLogger(__name__)

HF_KEYS = ("name", "arch")  # the runner's keys of model=hf; every other one is a config setting
# settings that would fetch or load weights, or run code from the hub
HF_DOWNLOADS = (
    "pretrained_model_name_or_path",
    "name_or_path",
    "_name_or_path",
    "weights",
    "pretrained",
    "checkpoint_path",
    "auto_map",
    "trust_remote_code",
)
# settings that would give the model its own parameter type, behind the precision option's back
HF_DTYPES = ("dtype", "torch_dtype")
HF_LISTING = "transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"


def _transformers() -> Any:
    """transformers, imported with the Hugging Face hub forced offline (unless the environment
    says otherwise): a model here is built from its config only and nothing may be downloaded."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        import transformers
    except ImportError:
        raise ConfigError(
            "model",
            "model=hf needs transformers, which is not installed",
            'pip install "amp-runner[hf]"',
        ) from None
    return transformers


def _causal_types() -> dict[str, str]:
    """model type -> the name of its causal-LM class."""
    _transformers()
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _config_class(arch: Any) -> Any:
    """The config class of model type `arch`; ConfigError when it is no causal LM type."""
    _transformers()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    causal = _causal_types()
    known = list(CONFIG_MAPPING.keys())
    if not isinstance(arch, str) or arch not in known:
        close = difflib.get_close_matches(
            str(arch), list(causal), n=5, cutoff=0.5
        ) or difflib.get_close_matches(str(arch), known, n=5, cutoff=0.5)
        hint = f"; closest: {', '.join(close)}" if close else ""
        raise ConfigError(
            "model.arch",
            f"unknown Hugging Face model type {arch!r}{hint}",
            f"a key of {HF_LISTING}",
        )
    if arch not in causal:
        close = difflib.get_close_matches(arch, list(causal), n=5, cutoff=0.5)
        hint = f"; causal LM types close to it: {', '.join(close)}" if close else ""
        raise ConfigError(
            "model.arch",
            f"Hugging Face model type {arch!r} "
            f"({CONFIG_MAPPING[arch].__name__}) has no causal language model "
            f"class{hint}",
            f"a key of {HF_LISTING}",
        )
    return CONFIG_MAPPING[arch]


@functools.cache
def _default(config_class: Any) -> Any:
    """A default instance of `config_class`; None for one that needs arguments."""
    try:
        return config_class()
    except Exception:  # a composite config that cannot be built without arguments
        return None


@functools.cache
def _settings(config_class: Any) -> frozenset[str]:
    """The keys a config class knows: its `__init__` arguments (of every class in its MRO, as
    the base class's are passed on through **kwargs), its aliases (`attribute_map`), the
    attributes of a default instance and its settable properties. transformers accepts any
    keyword silently, so this is the only way to catch a misspelt one."""
    names: set[str] = set()
    for cls in config_class.__mro__:
        init = cls.__dict__.get("__init__")
        if init is None:
            continue
        try:
            parameters = inspect.signature(init).parameters.values()
        except (TypeError, ValueError):
            continue
        names.update(
            p.name
            for p in parameters
            if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        )
    names.update(getattr(config_class, "attribute_map", {}) or {})
    if _default(config_class) is not None:
        names.update(vars(_default(config_class)))
    for cls in config_class.__mro__:
        names.update(
            n for n, v in vars(cls).items() if isinstance(v, property) and v.fset is not None
        )
    return frozenset(n for n in names if not n.startswith("_"))


def _hf_kwargs(cfg: Any) -> dict[str, Any]:
    return targets.arguments(cfg, HF_KEYS)


def _refuse_hf_downloads(kwargs: dict[str, Any]) -> None:
    why = "models are trained from random init here and nothing may be downloaded or loaded"
    targets.refuse_given("model", kwargs, HF_DOWNLOADS, why)
    for key in HF_DTYPES:
        if kwargs.get(key) is not None:
            raise ConfigError(
                f"model.{key}",
                f"got {kwargs[key]!r}: the precision option decides the model's types",
                "null (or leave it out)",
            )


_FIELD = re.compile(r"field '(\w+)'")


def _hf_config(arch: str, kwargs: dict[str, Any]) -> Any:
    """`AutoConfig.for_model(arch, **kwargs)`, its validation errors as ConfigErrors."""
    from transformers import AutoConfig

    try:
        return AutoConfig.for_model(arch, **kwargs)
    except Exception as exc:
        match = _FIELD.search(str(exc))
        rejected = match.group(1) if match else targets.rejected_argument(exc)
        message = " ".join(str(exc).split())
        raise ConfigError(
            f"model.{rejected}" if rejected else "model",
            f"the {arch!r} config rejects the settings: {message}",
        ) from None


def check_hf(cfg: Any) -> None:
    """ConfigError, before any data or run exists, for model=hf settings that cannot work:
    transformers missing, a model type that is unknown or has no causal LM, a setting that would
    download or load weights (or set the dtype), one the config class does not have, or values
    the config class rejects. Builds the config only (cheap), not the model. A value's own range
    (`vocab_size`) is a value rule of the option's spec (`runner.config.options`), checked
    before this."""
    _transformers()
    arch = cfg.get("arch")
    config_class = _config_class(arch)
    kwargs = _hf_kwargs(cfg)
    _refuse_hf_downloads(kwargs)
    known = _settings(config_class)
    for key in kwargs:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=5, cutoff=0.6)
            hint = f"; closest: {', '.join(close)}" if close else ""
            raise ConfigError(
                f"model.{key}",
                f"Hugging Face {config_class.__name__} ({arch}) has no setting {key!r}{hint}",
                f"a keyword of {config_class.__name__}",
            )
    for key in _causal_settings(arch, config_class):
        if key in kwargs and not kwargs[key]:
            raise ConfigError(
                f"model.{key}",
                f"got {kwargs[key]!r}: {arch}'s causal LM head then attends both ways and sees "
                "the tokens it predicts",
                "true (the default here), or leave it out",
            )
    _hf_config(arch, kwargs)


SPECIAL_TOKENS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")


def _ids(value: Any) -> list[int]:
    """The token ids a special-token setting holds (an int, a list of them, or None)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def build_hf(cfg: Any, num_classes: int, small_input: bool = False) -> HFCausalLM:
    """model=hf model.arch=TYPE: transformers' causal LM of that model type, random init, built
    from `AutoConfig.for_model(TYPE, **settings)` where the settings are every key but name and
    arch; vocab_size defaults to `num_classes` (the data's vocabulary); use_cache defaults to
    false (training needs no KV cache). Nothing is downloaded."""
    check_hf(cfg)
    from transformers import AutoModelForCausalLM

    arch = str(cfg.get("arch"))
    kwargs = _hf_kwargs(cfg)
    kwargs["vocab_size"] = vocab_size_for(kwargs.get("vocab_size"), num_classes)
    config_class = _config_class(arch)
    if "use_cache" in _settings(config_class):
        kwargs.setdefault("use_cache", False)
    # the special tokens of the pretrained tokenizer (GPT-2's 50256, ...) mean nothing to the
    # data's vocabulary: leave out those outside it (transformers warns about them otherwise)
    default = _default(config_class)
    for key in SPECIAL_TOKENS:
        ids = getattr(default, key, None)
        if key not in kwargs and any(i >= kwargs["vocab_size"] for i in _ids(ids)):
            kwargs[key] = None
    made_causal = [key for key in _causal_settings(arch, config_class) if key not in kwargs]
    if made_causal:
        kwargs.update({key: True for key in made_causal})
        said = log.debug if torch.empty(0).is_meta else log.info  # (planning's build: quiet)
        said(
            "model.arch=%s is an encoder with a causal LM head: built with %s, so that it does "
            "not see the tokens it predicts",
            arch,
            " and ".join(f"{key}=true" for key in made_causal),
        )
    config = _hf_config(arch, kwargs)
    return HFCausalLM(AutoModelForCausalLM.from_config(config))


def _causal_settings(arch: str, config_class: Any) -> list[str]:
    """The settings that make a model type's causal LM attend only backwards: `is_decoder` for
    an encoder's type (one with a masked LM: BERT, RoBERTa, ELECTRA, ... attend both ways
    without it), and XLM's own `causal`."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    keys = ["is_decoder"] if arch in MODEL_FOR_MASKED_LM_MAPPING_NAMES else []
    return keys + (["causal"] if "causal" in _settings(config_class) else [])
