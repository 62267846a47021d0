"""runner.components.models: every configured model builds offline, with the right head and stem."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from runner.components.models import MODEL_REGISTRY, TinyCNN, build_model
from runner.config import BUILT_IN_MODELS, MODEL_NAMES, ModelConfig, TinyModelConfig, options
from runner.errors import ConfigError


def model_cfg(name: str, **kw):
    schema = TinyModelConfig if name == "tiny" else ModelConfig
    return OmegaConf.structured(schema(name=name, **kw))


def test_registry_matches_config_names():
    assert set(MODEL_REGISTRY) == set(MODEL_NAMES)


IMAGE_MODELS = [
    name
    for name in BUILT_IN_MODELS
    if options.spec_for("model", {"name": name}).task != options.LANGUAGE_MODEL
]


def test_the_image_models_are_the_built_in_ones_less_the_language_models():
    assert set(BUILT_IN_MODELS) - set(IMAGE_MODELS) == {"gpt", "gpt_tiny", "gpt2_small"}


# (the zoos and custom: test_open_config; the language models: test_lm_models)
@pytest.mark.parametrize("name", IMAGE_MODELS)
def test_every_model_builds_for_small_images(name):
    torch.manual_seed(0)
    model = build_model(model_cfg(name), num_classes=7, image_size=32).eval()
    with torch.no_grad():
        out = model(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 7)
    assert torch.isfinite(out).all()


def test_small_input_auto_replaces_the_stems():
    resnet = build_model(model_cfg("resnet18"), 10, 32)
    assert resnet.conv1.kernel_size == (3, 3) and resnet.conv1.stride == (1, 1)
    assert resnet.conv1.bias is None
    assert isinstance(resnet.maxpool, nn.Identity)

    resnext = build_model(model_cfg("resnext50_32x4d"), 10, 64)  # 64 is still "small"
    assert resnext.conv1.kernel_size == (3, 3)

    densenet = build_model(model_cfg("densenet161"), 10, 32)
    assert densenet.features.conv0.kernel_size == (3, 3)
    assert densenet.features.conv0.stride == (1, 1)
    assert isinstance(densenet.features.pool0, nn.Identity)

    for name in ("vgg16", "vgg16_bn"):
        vgg = build_model(model_cfg(name), 10, 32)
        assert vgg.avgpool.output_size in (1, (1, 1))
        assert vgg.classifier[0].in_features == 512
        assert vgg.classifier[-1].out_features == 10
        assert any(isinstance(m, nn.BatchNorm2d) for m in vgg.modules()) == (name == "vgg16_bn")


def test_small_input_false_keeps_the_torchvision_stem():
    model = build_model(model_cfg("resnet18", small_input=False), 10, 32)
    assert model.conv1.kernel_size == (7, 7) and model.conv1.stride == (2, 2)
    assert isinstance(model.maxpool, nn.MaxPool2d)


def test_small_input_true_forces_the_small_stem_for_large_images():
    model = build_model(model_cfg("resnet18", small_input=True), 10, 224)
    assert model.conv1.kernel_size == (3, 3)


def test_large_images_keep_the_stem_and_run():
    model = build_model(model_cfg("resnet18"), num_classes=7, image_size=224).eval()
    assert model.conv1.kernel_size == (7, 7)
    with torch.no_grad():
        assert model(torch.randn(1, 3, 224, 224)).shape == (1, 7)


@pytest.mark.parametrize("size", [8, 16, 224])
def test_tiny_model_any_size_and_width(size):
    model = build_model(model_cfg("tiny", width=4), num_classes=3, image_size=size).eval()
    assert isinstance(model, TinyCNN)
    assert any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    assert model[-1].in_features == 16  # 4 * width
    with torch.no_grad():
        assert model(torch.randn(2, 3, size, size)).shape == (2, 3)


def test_works_with_plain_objects():
    class Cfg:
        name = "tiny"
        width = 8
        small_input = None

    assert build_model(Cfg(), 5, 32)(torch.randn(2, 3, 32, 32)).shape == (2, 5)


def test_unknown_name_is_a_config_error():
    with pytest.raises(ConfigError) as info:
        build_model(OmegaConf.create({"name": "resnet1000", "small_input": None}), 10, 32)
    assert info.value.key == "model.name"
    message = str(info.value)
    assert "model.name" in message and "resnet1000" in message
    assert all(name in message for name in MODEL_NAMES)


class WithAuxiliary(nn.Module):
    """A classifier that returns auxiliary logits beside its own while it trains, as
    torchvision's GoogLeNet and Inception v3 do (and take `aux_logits` to stop it)."""

    def __init__(self, num_classes: int = 10, aux_logits: bool = True):
        super().__init__()
        self.head = nn.Linear(3, num_classes)
        self.aux = nn.Linear(3, num_classes) if aux_logits else None

    def forward(self, x):
        h = x.mean(dim=(2, 3))
        return (self.head(h), self.aux(h)) if self.aux is not None else self.head(h)


def test_an_output_with_auxiliary_logits_says_how_to_leave_them_out():
    from runner.components.models import check_output
    from runner.tasks import task_for

    node = OmegaConf.create({"name": "custom", "_target_": "tests.unit.test_models.WithAuxiliary"})
    with pytest.raises(ConfigError) as bad:
        check_output(node, 10, (3, 8, 8), task_for("classification"))
    message = str(bad.value)
    assert "outputs a tuple of 2 ((2, 10), (2, 10)) for a batch of shape (2, 3, 8, 8)" in message
    assert "+model.aux_logits=false leaves its logits alone" in message
    check_output(
        OmegaConf.merge(node, {"aux_logits": False}), 10, (3, 8, 8), task_for("classification")
    )


@pytest.mark.parametrize(
    "overrides,key,needle",
    [
        (["data.image_size=30"], "model.patch_size", "4 does not divide the images' 30 px"),
        (["model.num_heads=3"], "model.num_heads", "hidden_dim=128 is split into num_heads=3"),
    ],
)
def test_vit_sizes_torchvision_asserts_on_are_named_in_planning(overrides, key, needle):
    """torchvision's VisionTransformer asserts ("Input shape indivisible by patch size!"): the
    refusal named model.name and torchvision's words."""
    from runner.run.plan import make_plan
    from tests.helpers.runs import compose_config

    with pytest.raises(ConfigError) as bad:
        make_plan(compose_config("model=vit_tiny", "data=synthetic", *overrides))
    assert bad.value.key == key and needle in str(bad.value) and bad.value.allowed
    make_plan(compose_config("model=vit_tiny", "data=synthetic", "data.image_size=36"))  # 4 | 36


def test_a_zoo_vit_built_for_another_image_size_says_how_to_build_it_for_the_datas():
    from runner.components.models import check_output
    from runner.tasks import task_for

    node = OmegaConf.create({"name": "torchvision", "arch": "vit_b_16"})
    with pytest.raises(ConfigError) as bad:
        check_output(node, 10, (3, 32, 32), task_for("classification"))
    assert "Wrong image height! Expected 224 but got 32!" in str(bad.value)
    assert "+model.image_size=32 builds it for the data's" in str(bad.value)


def test_a_timm_vit_built_for_another_image_size_says_timms_keyword():
    """timm's ViTs take the size as img_size and assert in their own words."""
    pytest.importorskip("timm")
    from runner.components.models import check_output
    from runner.tasks import task_for

    node = OmegaConf.create({"name": "timm", "arch": "vit_tiny_patch16_224", "pretrained": False})
    with pytest.raises(ConfigError) as bad:
        check_output(node, 10, (3, 32, 32), task_for("classification"))
    assert "Input height (32) doesn't match model (224)" in str(bad.value)
    assert "+model.img_size=32 builds it for the data's" in str(bad.value)
    node.img_size = 32
    check_output(node, 10, (3, 32, 32), task_for("classification"))
