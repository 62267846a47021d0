"""Model construction: a config section in, a randomly initialised `nn.Module` out.

Every model is built from scratch (`weights=None`): runs measure training under a precision level,
so pretrained weights would only add a download and hide differences. The number of classes comes
from the data, not the model config, so one model option works with every dataset.

ImageNet architectures shrink a 224-pixel image 4x in their stem (7x7/2 conv + 3x3/2 max-pool)
which leaves almost nothing of a 32-pixel CIFAR image; `small_input` swaps that stem for a 3x3/1
conv, the usual CIFAR adaptation, wherever the architecture has one (`small_stem`: ResNet/ResNeXt,
DenseNet, VGG), for the built-in names and torchvision's zoo alike.

The builders are named by the option specs (`runner.config.options.SPECS`); `model=torchvision` and
`model=timm` build any model of those libraries by name, and a `_target_` builds the user's own
(`runner.config.targets`). torchvision and timm are imported inside the builders so that importing
this
module stays cheap.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any, Optional

import torch
from omegaconf import OmegaConf
from torch import nn
from torch.nn.modules.lazy import LazyModuleMixin

from runner.config import options, targets
from runner.config.options import MODEL_NAMES, NORMS  # noqa: F401  (NORMS: where it was before)
from runner.config.values import divisors, heads_refusal
from runner.errors import ConfigError

# Largest image side for which `small_input: null` picks the small stem.
SMALL_INPUT_MAX_SIZE = 64


def resolve_small_input(cfg: Any, image_size: int) -> bool:
    """`small_input` from the config, or automatic (images of at most 64 px) when it is null."""
    value = getattr(cfg, "small_input", None)
    if value is None:
        return image_size <= SMALL_INPUT_MAX_SIZE
    return bool(value)


# ---- tiny ----------------------------------------------------------------------------------
def _conv_bn_relu(in_ch: int, out_ch: int, stride: int, norm: str = "batch") -> nn.Sequential:
    layer = nn.BatchNorm2d(out_ch) if norm == "batch" else nn.GroupNorm(math.gcd(4, out_ch), out_ch)
    return nn.Sequential(
        nn.Conv2d(in_ch, out_ch, kernel_size=3, stride=stride, padding=1, bias=False),
        layer,
        nn.ReLU(inplace=True),
    )


class TinyCNN(nn.Sequential):
    """Three conv-BN-ReLU blocks (width w, 2w/2, 4w/2), global average pool and a linear head.

    Small enough to train in seconds on a CPU, yet it has BatchNorm, convolutions and a linear
    layer, i.e. every layer kind whose precision handling differs between the Apex opt levels.
    The global pool makes it work for any image size >= 8; for large images (`small_input`
    false) the first block also strides so that a 224-pixel batch stays cheap.
    """

    def __init__(
        self, num_classes: int, width: int = 16, small_input: bool = True, norm: str = "batch"
    ):
        super().__init__(
            _conv_bn_relu(3, width, stride=1 if small_input else 2, norm=norm),
            _conv_bn_relu(width, 2 * width, stride=2, norm=norm),
            _conv_bn_relu(2 * width, 4 * width, stride=2, norm=norm),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(4 * width, num_classes),
        )
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")


def build_tiny(cfg: Any, num_classes: int, small_input: bool) -> nn.Module:
    return TinyCNN(
        num_classes,
        width=int(getattr(cfg, "width", 16)),
        small_input=small_input,
        norm=str(getattr(cfg, "norm", "batch")),
    )


# ---- torchvision ---------------------------------------------------------------------------
def _small_conv(in_ch: int, out_ch: int, mode: str = "fan_out") -> nn.Conv2d:
    """A 3x3/1 stem conv, initialised like the torchvision conv it replaces."""
    conv = nn.Conv2d(in_ch, out_ch, kernel_size=3, stride=1, padding=1, bias=False)
    if mode == "fan_out":
        nn.init.kaiming_normal_(conv.weight, mode="fan_out", nonlinearity="relu")
    else:  # DenseNet uses kaiming_normal_ with its defaults
        nn.init.kaiming_normal_(conv.weight)
    return conv


def small_stem(model: nn.Module) -> bool:
    """Give a torchvision model the CIFAR stem where its architecture has one; False: it has
    none (a ViT, MobileNet, ... keep theirs)."""
    from torchvision import models

    if isinstance(model, models.ResNet):  # ResNet, ResNeXt, Wide ResNet: conv1 (7x7/2) + maxpool
        model.conv1 = _small_conv(model.conv1.in_channels, model.conv1.out_channels)
        model.maxpool = nn.Identity()
    elif isinstance(model, models.DenseNet):  # features.conv0 (7x7/2) + features.pool0 (3x3/2)
        conv0 = model.features.conv0
        model.features.conv0 = _small_conv(conv0.in_channels, conv0.out_channels, mode="default")
        model.features.pool0 = nn.Identity()
    elif isinstance(model, models.VGG):
        # VGG has no stem to change; a 32-px image leaves a 1x1x512 map after the five max-pools.
        # torchvision pools that to 7x7 and feeds 25088 features to the classifier (49 copies of
        # the same value); pooling to 1x1 and a 512-input first layer is the usual CIFAR VGG.
        model.avgpool = nn.AdaptiveAvgPool2d(1)
        first = nn.Linear(512, model.classifier[0].out_features)
        nn.init.normal_(first.weight, 0, 0.01)
        nn.init.zeros_(first.bias)
        model.classifier[0] = first
    else:
        return False
    return True


def _torchvision(arch: str, num_classes: int, small_input: bool, **kwargs: Any) -> nn.Module:
    from torchvision import models

    model = models.get_model(arch, weights=None, num_classes=num_classes, **kwargs)
    if small_input:
        small_stem(model)
    return model


def build_torchvision_named(cfg: Any, num_classes: int, small_input: bool) -> nn.Module:
    """A built-in name (resnet18, densenet161, vgg16, ...): torchvision's model of that name."""
    return _torchvision(str(cfg.name), num_classes, small_input)


def _vit_sizes(cfg: Any) -> dict[str, int]:
    return {
        f.name: int(getattr(cfg, f.name, f.default))
        for f in dataclasses.fields(options.VitTinyConfig)
        if f.name != "name"
    }


def check_vit_tiny(cfg: Any) -> None:
    """ConfigError for sizes torchvision's VisionTransformer asserts on ("Input shape indivisible
    by patch size!", "embed_dim must be divisible by num_heads"), naming the key and the sizes
    that fit, before any data or run exists."""
    sizes = _vit_sizes(cfg)
    image, patch = sizes["image_size"], sizes["patch_size"]
    if image % patch:
        fits = ", ".join(map(str, divisors(image)[:12]))
        raise ConfigError(
            "model.patch_size",
            f"{patch} does not divide the images' {image} px (model.image_size, the data's "
            "data.image_size by default): a ViT cuts each image into whole patches",
            f"a divisor of {image} ({fits}), or an image size that {patch} divides",
        )
    if sizes["hidden_dim"] % sizes["num_heads"]:
        raise heads_refusal("hidden_dim", sizes["hidden_dim"], "num_heads", sizes["num_heads"])


def build_vit_tiny(cfg: Any, num_classes: int, small_input: bool) -> nn.Module:
    """torchvision's VisionTransformer at the sizes of `VitTinyConfig` (vit_tiny.yaml)."""
    from torchvision.models import VisionTransformer

    return VisionTransformer(**_vit_sizes(cfg), num_classes=num_classes)


# ---- the zoos: torchvision and timm by name -----------------------------------------------
ZOO_KEYS = {"torchvision": ("name", "arch", "small_input"), "timm": ("name", "arch", "pretrained")}
DOWNLOADS = (
    "weights",
    "pretrained",
    "pretrained_cfg",
    "pretrained_cfg_overlay",
    "checkpoint_path",
)  # builder arguments that would fetch or load weights


def _zoo_kwargs(zoo: str, cfg: Any) -> dict[str, Any]:
    return targets.arguments(cfg, ZOO_KEYS[zoo])


def _refuse_downloads(zoo: str, cfg: Any) -> None:
    keys = [key for key in DOWNLOADS if key not in ZOO_KEYS[zoo]]
    why = "models are trained from random init here and nothing may be downloaded"
    targets.refuse_given("model", _zoo_kwargs(zoo, cfg), keys, why)


def _unknown_arch(zoo: str, arch: Any, known: list[str], listing: str) -> ConfigError:
    import difflib

    close = difflib.get_close_matches(str(arch), known, n=5, cutoff=0.5)
    hint = f"; closest: {', '.join(close)}" if close else ""
    return ConfigError("model.arch", f"unknown {zoo} model {arch!r}{hint}", f"a name in {listing}")


def torchvision_names() -> list[str]:
    import torchvision

    return torchvision.models.list_models(module=torchvision.models)


def check_torchvision_zoo(cfg: Any) -> None:
    arch = cfg.get("arch")
    if arch not in torchvision_names():
        raise _unknown_arch(
            "torchvision",
            arch,
            torchvision_names(),
            "torchvision.models.list_models(module=torchvision.models)",
        )
    _refuse_downloads("torchvision", cfg)


def build_torchvision_zoo(cfg: Any, num_classes: int, small_input: bool) -> nn.Module:
    """model=torchvision model.arch=NAME: any torchvision classification model, random init;
    every key but name, arch and small_input is the builder's keyword argument."""
    kwargs = _zoo_kwargs("torchvision", cfg)
    return _torchvision(
        str(cfg.arch), kwargs.pop("num_classes", num_classes), small_input, **kwargs
    )


def _timm():
    try:
        import timm
    except ImportError:
        raise ConfigError(
            "model",
            "model=timm needs timm, which is not installed",
            'pip install "amp-runner[timm]"',
        ) from None
    return timm


def check_timm(cfg: Any) -> None:
    timm = _timm()
    if cfg.get("pretrained"):
        raise ConfigError(
            "model.pretrained",
            "pretrained weights would be a download: models are "
            "trained from random init here and nothing may be downloaded",
            "false",
        )
    arch = cfg.get("arch")
    if not isinstance(arch, str) or not timm.is_model(arch):
        raise _unknown_arch("timm", arch, timm.list_models(), "timm.list_models()")
    _refuse_downloads("timm", cfg)


def build_timm(cfg: Any, num_classes: int, small_input: bool) -> nn.Module:
    """model=timm model.arch=NAME: timm.create_model(NAME, pretrained=False, ...), random init;
    every key but name, arch and pretrained is create_model's keyword argument."""
    kwargs = _zoo_kwargs("timm", cfg)
    return _timm().create_model(
        str(cfg.arch),
        pretrained=False,
        num_classes=kwargs.pop("num_classes", num_classes),
        **kwargs,
    )


# ---- the user's own: model._target_ ------------------------------------------------------------
TARGET_KEYS = ("name", "small_input")  # the runner's keys of a `_target_` model, not arguments


def _num_classes_extra(cfg: Any, num_classes: int) -> dict[str, int]:
    target = targets.resolve("model._target_", cfg["_target_"])
    arg = targets.num_classes_arg("model", cfg, target)
    return {arg: num_classes} if arg else {}


def check_target(cfg: Any) -> None:
    if OmegaConf.is_missing(cfg, "_target_"):
        raise ConfigError("model._target_", "is required but not set", targets.HOW)
    targets.check("model", cfg, TARGET_KEYS, _num_classes_extra(cfg, 2))


def build_target(cfg: Any, num_classes: int, small_input: bool) -> nn.Module:
    """The user's callable: `model._target_` with the node's other keys as its arguments, and
    the number of classes as `num_classes` (or the argument `model._num_classes_` names)."""
    model = targets.call("model", cfg, TARGET_KEYS, _num_classes_extra(cfg, num_classes))
    if not isinstance(model, nn.Module):
        raise ConfigError(
            "model._target_",
            f"{cfg['_target_']} returned a {type(model).__name__}, not an nn.Module",
        )
    return model


def build_model(
    cfg: Any, num_classes: int, image_size: int, spec: Optional[options.Spec] = None
) -> nn.Module:
    """Build the model `cfg` describes (its option's builder, `runner.config.options.SPECS`;
    `spec`: the option's, where the caller has it) with random weights for `num_classes` outputs
    and `image_size` inputs.

    `image_size` only decides `small_input: null`; the models themselves accept any size their
    pooling allows. Raises ConfigError for a name that no option has.
    """
    spec = spec or options.spec_for("model", cfg)
    if spec is None:
        name = getattr(cfg, "name", None)
        raise ConfigError("model.name", f"unknown model {name!r}", allowed=MODEL_NAMES)
    if int(num_classes) < 1:
        raise ConfigError("data.num_classes", f"must be at least 1, got {num_classes}")
    return spec.build()(cfg, int(num_classes), resolve_small_input(cfg, int(image_size)))


# name -> builder(cfg, num_classes, small_input) of every model option (from the specs)
MODEL_REGISTRY: dict[str, Callable[[Any, int, bool], nn.Module]] = {
    spec.name: spec.build() for spec in options.SPECS if spec.group == "model"
}


# ---- the output check (planning, and a run whose dataset alone knows its shape) -------------
_CHECKED_OUTPUTS: set[tuple[str, int, tuple[int, ...]]] = set()  # (model yaml, classes, shape)


def _output_key(node: Any) -> str:
    """The key to name when a model's output does not fit the data."""
    for key in (node.get(targets.NUM_CLASSES_ARG), "num_classes"):
        if key is not None and key in node:
            return f"model.{key}"
    if options.has_target(node):
        return "model._target_"
    return "model.arch" if "arch" in node else "model.name"


_SIZE_MISMATCH = ("Wrong image height", "Wrong image width", "doesn't match model")
_SIZE_KEYWORDS = ("image_size", "img_size")  # (torchvision's ViTs; timm's)


def _size_hint(model: nn.Module, exc: BaseException, shape: tuple[int, ...]) -> str:
    """How to build a model made for one image size at the data's, where the error says so
    (torchvision's ViTs assert "Wrong image height! Expected 224 but got 32!", timm's "Input
    height (32) doesn't match model (224)") and the model's class takes the size by a keyword
    it is known by."""
    if not any(words in str(exc) for words in _SIZE_MISMATCH):
        return ""
    for keyword in _SIZE_KEYWORDS:
        if keyword in _init_parameters(model):
            return (
                f"; it is built for one image size: +model.{keyword}={shape[-1]} builds it for "
                "the data's"
            )
    return ""


def _init_parameters(model: nn.Module) -> Mapping[str, Any]:
    """The keywords `model`'s class takes ({} where its signature cannot be read)."""
    try:
        return inspect.signature(type(model).__init__).parameters
    except (TypeError, ValueError):
        return {}


def _shown(out: Any) -> str:
    """A model's output as a message shows it: a shape, or a tuple with its items' shapes."""
    if isinstance(out, torch.Tensor):
        return str(tuple(out.shape))
    if isinstance(out, (tuple, list)):
        items = ", ".join(
            str(tuple(o.shape)) if isinstance(o, torch.Tensor) else type(o).__name__
            for o in out[:4]
        )
        if type(out) in (tuple, list):
            return f"a {type(out).__name__} of {len(out)} ({items})"
        return f"{type(out).__name__} (a tuple of {len(out)}: {items})"
    return type(out).__name__


def _aux_hint(model: nn.Module, out: Any) -> str:
    """'; ...+model.aux_logits=false...' for a model that returns auxiliary logits beside its
    own in training (torchvision's GoogLeNet and Inception v3), where its class takes the switch."""
    if not isinstance(out, (tuple, list)) or "aux_logits" not in _init_parameters(model):
        return ""
    return (
        f": {type(model).__name__} returns auxiliary classifiers' logits beside its own while it "
        "trains; +model.aux_logits=false leaves its logits alone"
    )


def check_output(
    node: Any,
    num_classes: int,
    shape: tuple[int, ...],
    task: Any,
    build: Optional[Callable[[], nn.Module]] = None,
) -> None:
    """Build the model on the meta device (shapes only: no memory, no data) and run one forward
    of a 2-sample batch of `shape`: its output must be what `task` expects (runner.tasks: a
    classifier's logits (2, num_classes) from float inputs, a language model's logits (2, T,
    vocabulary) from integer token ids). `task` is passed in (components sit below tasks, so
    they never import it): anything with `input_dtype`, `output_fits` and `output_description`.
    `build`: how to get that model, where the caller keeps it for its other checks (a run's plan
    builds it once); default: built here. An op without a meta implementation skips the check
    (the real run finds any problem)."""
    dtype = task.input_dtype
    memo = (OmegaConf.to_yaml(node, resolve=True), int(num_classes), tuple(shape), str(dtype))
    if memo in _CHECKED_OUTPUTS:
        return
    label = options.label(node)
    batch = (2, *shape)
    try:
        if build is not None:
            model = build()
        else:
            with torch.device("meta"):
                model = build_model(node, num_classes, shape[-1])
    except ConfigError:
        raise
    except NotImplementedError:
        return
    except Exception as exc:
        rejected = targets.rejected_argument(exc)
        raise ConfigError(
            f"model.{rejected}" if rejected else _output_key(node),
            f"building {label} failed: {type(exc).__name__}: {exc}",
        ) from None
    if build is not None and any(isinstance(m, LazyModuleMixin) for m in model.modules()):
        model = copy.deepcopy(model)  # (a forward would turn the kept lazy modules into others)
    try:
        with torch.no_grad():
            out = model(torch.zeros(batch, dtype=dtype, device="meta"))
    except NotImplementedError:
        return
    except Exception as exc:
        if isinstance(exc, RuntimeError) and "meta" in str(exc):
            return  # a value read on the host (.item()): shapes alone cannot tell
        what = "integer token ids" if not dtype.is_floating_point else "the data's"
        raise ConfigError(
            _output_key(node),
            f"{label} fails on a batch of shape {batch} ({what}): {type(exc).__name__}: {exc}"
            + _size_hint(model, exc, shape),
        ) from None
    got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
    if not task.output_fits(got, batch, num_classes):
        what = "classes" if dtype.is_floating_point else "tokens"
        raise ConfigError(
            _output_key(node),
            f"{label} outputs {_shown(out)} for a batch of shape "
            f"{batch}, but the data has {num_classes} {what}{_aux_hint(model, out)}",
            task.output_description(num_classes),
        )
    _CHECKED_OUTPUTS.add(memo)
