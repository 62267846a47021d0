"""Model construction: a config section in, a randomly initialised `nn.Module` out.

Every model is built from scratch (`weights=None`): runs measure training under a precision level,
so pretrained weights would only add a download and hide differences. The number of classes comes
from the data, not the model config, so one model option works with every dataset.

ImageNet architectures shrink a 224-pixel image 4x in their stem (7x7/2 conv + 3x3/2 max-pool)
which leaves almost nothing of a 32-pixel CIFAR image; `small_input` swaps that stem for a 3x3/1
conv, the usual CIFAR adaptation. Adding a model is one line in `MODEL_REGISTRY`.

torchvision is imported inside the builders so that importing this module stays cheap.
"""
from __future__ import annotations

import math

from typing import Any, Callable, Dict

from torch import nn

from runner.config import MODEL_NAMES
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
NORMS = ("batch", "group")


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

    def __init__(self, num_classes: int, width: int = 16, small_input: bool = True,
                 norm: str = "batch"):
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


def _build_tiny(cfg: Any, num_classes: int, small_input: bool) -> nn.Module:
    return TinyCNN(num_classes, width=int(getattr(cfg, "width", 16)), small_input=small_input,
                   norm=str(getattr(cfg, "norm", "batch")))


# ---- torchvision ---------------------------------------------------------------------------
def _small_conv(in_ch: int, out_ch: int, mode: str = "fan_out") -> nn.Conv2d:
    """A 3x3/1 stem conv, initialised like the torchvision conv it replaces."""
    conv = nn.Conv2d(in_ch, out_ch, kernel_size=3, stride=1, padding=1, bias=False)
    if mode == "fan_out":
        nn.init.kaiming_normal_(conv.weight, mode="fan_out", nonlinearity="relu")
    else:  # DenseNet uses kaiming_normal_ with its defaults
        nn.init.kaiming_normal_(conv.weight)
    return conv


def _resnet_builder(arch: str) -> Callable[[Any, int, bool], nn.Module]:
    """ResNet and ResNeXt share the stem: conv1 (7x7/2) + maxpool (3x3/2)."""

    def build(cfg: Any, num_classes: int, small_input: bool) -> nn.Module:
        from torchvision import models

        model = getattr(models, arch)(weights=None, num_classes=num_classes)
        if small_input:
            model.conv1 = _small_conv(model.conv1.in_channels, model.conv1.out_channels)
            model.maxpool = nn.Identity()
        return model

    build.__doc__ = f"torchvision {arch}, random init."
    return build


def _build_densenet161(cfg: Any, num_classes: int, small_input: bool) -> nn.Module:
    """DenseNet's stem is features.conv0 (7x7/2) + features.pool0 (3x3/2)."""
    from torchvision import models

    model = models.densenet161(weights=None, num_classes=num_classes)
    if small_input:
        conv0 = model.features.conv0
        model.features.conv0 = _small_conv(conv0.in_channels, conv0.out_channels, mode="default")
        model.features.pool0 = nn.Identity()
    return model


def _vgg_builder(arch: str) -> Callable[[Any, int, bool], nn.Module]:
    """VGG has no stem to change; a 32-px image leaves a 1x1x512 map after the five max-pools.

    torchvision pools that to 7x7 and feeds 25088 features to the classifier (49 copies of the
    same value); pooling to 1x1 and a 512-input first layer is the usual CIFAR VGG.
    """

    def build(cfg: Any, num_classes: int, small_input: bool) -> nn.Module:
        from torchvision import models

        model = getattr(models, arch)(weights=None, num_classes=num_classes)
        if small_input:
            model.avgpool = nn.AdaptiveAvgPool2d(1)
            first = nn.Linear(512, model.classifier[0].out_features)
            nn.init.normal_(first.weight, 0, 0.01)
            nn.init.zeros_(first.bias)
            model.classifier[0] = first
        return model

    build.__doc__ = f"torchvision {arch}, random init (a 1x1 pool for small images)."
    return build


# name -> builder(cfg, num_classes, small_input); keys must equal runner.config.MODEL_NAMES.
MODEL_REGISTRY: Dict[str, Callable[[Any, int, bool], nn.Module]] = {
    "tiny": _build_tiny,
    "resnet18": _resnet_builder("resnet18"),
    "resnet50": _resnet_builder("resnet50"),
    "densenet161": _build_densenet161,
    "vgg16": _vgg_builder("vgg16"),
    "vgg16_bn": _vgg_builder("vgg16_bn"),
    "resnext50_32x4d": _resnet_builder("resnext50_32x4d"),
}


def build_model(cfg: Any, num_classes: int, image_size: int) -> nn.Module:
    """Build `cfg.name` with random weights for `num_classes` outputs and `image_size` inputs.

    `image_size` only decides `small_input: null`; the models themselves accept any size their
    pooling allows. Raises ConfigError for a name not in the registry.
    """
    name = getattr(cfg, "name", None)
    builder = MODEL_REGISTRY.get(name) if isinstance(name, str) else None
    if builder is None:
        raise ConfigError("model.name", f"unknown model {name!r}", allowed=MODEL_NAMES)
    if int(num_classes) < 1:
        raise ConfigError("data.num_classes", f"must be at least 1, got {num_classes}")
    return builder(cfg, int(num_classes), resolve_small_input(cfg, int(image_size)))
