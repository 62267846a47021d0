"""Bring your own model, data and loss: a package of the test's own in a temporary
folder (a model class, a dataset function, a config dir) trained through the real CLI into a real
SQLite MLflow store, at two levels and as a two-job sweep; timm and torchvision models by name;
ViTs (torchvision's vit_b_16, timm's vit_small_patch16_224, the built-in vit_tiny); and every bad
input a `_target_` or a zoo name can be: exit 2, no traceback, no MLflow run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from runner.components.models import build_model, small_stem
from runner.errors import ConfigError
from runner.run.plan import make_plan
from tests.helpers.runs import compose_config, run_cli, run_in_process
from tests.helpers.store import EPOCH_METRICS, FINAL_METRICS, all_runs

NETS = '''
import torch
from torch import nn


class MyNet(nn.Module):
    """conv-BN-ReLU blocks, a global pool and a Linear head."""

    def __init__(self, num_classes, width=8, depth=1):
        super().__init__()
        layers, ch = [], 3
        for _ in range(depth):
            layers += [nn.Conv2d(ch, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU()]
            ch = width
        self.features = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(width, num_classes)

    def forward(self, x):
        return self.head(self.features(x))


def seven_outputs():
    """A model whose head ignores the data: 7 outputs, whatever the classes."""
    return nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(3, 7))


class Head(nn.Module):
    def __init__(self, n_out):
        super().__init__()
        self.net = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(3, n_out))

    def forward(self, x):
        return self.net(x)
'''

DATA = '''
import torch
from torch.utils.data import Dataset


class Blobs(Dataset):
    """Images whose mean colour channel is the class: learnable in a few steps."""

    classes = ["red", "green", "blue"]

    def __init__(self, n, size, seed):
        g = torch.Generator().manual_seed(seed)
        self.y = torch.randint(0, 3, (n,), generator=g)
        self.x = torch.randn(n, 3, size, size, generator=g) * 0.5
        self.x[torch.arange(n), self.y] += 1.0

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], int(self.y[i])


def make_datasets(num_train=48, num_val=16, size=16):
    return Blobs(num_train, size, 0), Blobs(num_val, size, 1)


def not_a_pair(size=16):
    return Blobs(8, size, 0)
'''

QUICK = [
    "trainer.batch_size=16",
    "trainer.max_epochs=1",
    "trainer.num_workers=0",
    "trainer.progress_bar=false",
    "trainer.log_every_n_steps=1",
    "trainer.device=cpu",
    "trainer.checkpoint_every_n_epochs=0",
    "precision.kernels=torch",
]
SYNTHETIC = [
    "data=synthetic",
    "data.num_train=16",
    "data.num_val=8",
    "data.image_size=32",
    "data.num_classes=4",
]


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """The user's folder: my_pkg (nets, data) and my_conf (model/, data/, loss/ options)."""
    pkg = tmp_path / "my_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "nets.py").write_text(NETS)
    (pkg / "data.py").write_text(DATA)
    conf = tmp_path / "my_conf"
    for group, name, text in [
        ("model", "my_net", "_target_: my_pkg.nets.MyNet\nwidth: 8\ndepth: 2\n"),
        ("model", "seven", "_target_: my_pkg.nets.seven_outputs\n"),
        ("data", "blobs", "_target_: my_pkg.data.make_datasets\nnum_train: 48\nnum_val: 16\n"),
        ("loss", "smooth", "_target_: torch.nn.CrossEntropyLoss\nlabel_smoothing: 0.1\n"),
    ]:
        (conf / group).mkdir(parents=True, exist_ok=True)
        (conf / group / f"{name}.yaml").write_text(text)
    return tmp_path


def finished_runs(uri: str) -> dict[str, object]:
    """{run name: run} of the store's runs (sweep parents left out), each FINISHED with the
    contract's metrics."""
    client = MlflowClient(uri)
    runs = {}
    for run in all_runs(uri):
        if "sweep.dir" in run.data.tags:
            continue
        assert run.info.status == "FINISHED", (run.info.run_name, run.data.tags.get("error"))
        assert set(EPOCH_METRICS + FINAL_METRICS) <= set(run.data.metrics), run.info.run_name
        assert len(client.get_metric_history(run.info.run_id, "val_acc")) == 1
        runs[run.info.run_name] = run
    return runs


def printed(capfd) -> str:
    """What the CLI printed (its log goes to stdout, Python's tracebacks to stderr)."""
    out, err = capfd.readouterr()
    return out + err


def check_output(result) -> None:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_own_model_data_and_loss_from_a_config_dir_and_the_cli(project: Path):
    """The two ways: a config dir of the user's (a two-level sweep) and model=custom from the
    command line (a single run at a third level), into one real SQLite store."""
    uri = f"sqlite:///{project / 'mlflow.db'}"
    sweep = run_cli(
        "-m",
        "--config-dir",
        "my_conf",
        "model=my_net",
        "data=blobs",
        "loss=smooth",
        "precision=o0,o2_bf16",
        f"mlflow.tracking_uri={uri}",
        *QUICK,
        cwd=project,
    )
    check_output(sweep)
    single = run_cli(
        "model=custom",
        "model._target_=my_pkg.nets.MyNet",
        "+model.depth=1",
        "data=custom",
        "data._target_=my_pkg.data.make_datasets",
        "+data.size=8",
        "precision=o1_bf16",
        f"mlflow.tracking_uri={uri}",
        *QUICK,
        cwd=project,
    )
    check_output(single)
    runs = finished_runs(uri)
    assert set(runs) == {"MyNet-O0", "MyNet-O2-bf16", "MyNet-O1-bf16"}
    for name, run in runs.items():
        params, tags = run.data.params, run.data.tags
        assert params["model._target_"] == "my_pkg.nets.MyNet"
        assert params["data._target_"] == "my_pkg.data.make_datasets"
        assert params["data.num_classes"] == "3"  # len(train.classes)
        assert tags["model.class"] == "my_pkg.nets.MyNet" and tags["model"] == "MyNet"
        depth = 1 if name == "MyNet-O1-bf16" else 2
        assert params["model.depth"] == str(depth)
        convs = (3 * 8 * 9 + 8) + (depth - 1) * (8 * 8 * 9 + 8)
        assert params["model.num_parameters"] == str(convs + depth * 16 + 8 * 3 + 3)
    assert runs["MyNet-O0"].data.params["loss.label_smoothing"] == "0.1"
    assert runs["MyNet-O0"].data.params["loss._target_"] == "torch.nn.CrossEntropyLoss"
    assert runs["MyNet-O1-bf16"].data.params["data.train_size"] == "48"
    parents = [r for r in all_runs(uri) if "sweep.dir" in r.data.tags]
    assert len(parents) == 1 and parents[0].data.metrics["jobs"] == 2


@pytest.mark.slow
def test_zoo_models_by_name_train_to_finished_runs(tmp_path: Path):
    """timm's ViT-S/16 (two blocks, at 32 px) and torchvision's MobileNetV3 by name, with
    arguments the zoo option does not know passed through, and vit_tiny."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    common = [*SYNTHETIC, *QUICK, "trainer.limit_train_batches=1", f"mlflow.tracking_uri={uri}"]
    timm_run = run_cli(
        "model=timm",
        "model.arch=vit_small_patch16_224",
        "+model.img_size=32",
        "+model.depth=2",
        "precision=o1_bf16",
        "optimizer=adamw",
        *common,
        cwd=tmp_path,
    )
    check_output(timm_run)
    assert run_in_process("model=torchvision", "model.arch=mobilenet_v3_small", *common) == 0
    # the built-in small ViT trains on a CPU in seconds
    assert run_in_process("model=vit_tiny", "precision=o2_bf16", "optimizer=adamw", *common) == 0
    runs = finished_runs(uri)
    assert set(runs) == {
        "vit_small_patch16_224-O1-bf16",
        "mobilenet_v3_small-O0",
        "vit_tiny-O2-bf16",
    }
    timm = runs["vit_small_patch16_224-O1-bf16"]
    assert timm.data.params["model.arch"] == "vit_small_patch16_224"
    assert timm.data.params["model.img_size"] == "32" and timm.data.params["model.depth"] == "2"
    assert timm.data.tags["model.class"] == "timm.models.vision_transformer.VisionTransformer"
    mobile = runs["mobilenet_v3_small-O0"]
    assert mobile.data.tags["model.class"] == "torchvision.models.mobilenetv3.MobileNetV3"
    assert int(mobile.data.params["model.num_parameters"]) > 10**6


def test_vision_transformers_build_and_run_at_32_px():
    """torchvision's vit_b_16 and timm's vit_small_patch16_224 by name at 32 px (on the meta
    device: shapes only), and the built-in vit_tiny for real."""
    x = torch.randn(2, 3, 32, 32)
    vit_b = compose_config(
        "model=torchvision", "model.arch=vit_b_16", "+model.image_size=32", *SYNTHETIC
    )
    make_plan(vit_b)  # checked, output fitted to the data's 4 classes
    with torch.device("meta"):
        model = build_model(vit_b.model, 4, 32)
    assert type(model).__name__ == "VisionTransformer" and model.image_size == 32
    assert sum(p.numel() for p in model.parameters()) > 85 * 10**6  # ViT-B/16
    assert model(x.to("meta")).shape == (2, 4)
    vit_s = compose_config(
        "model=timm", "model.arch=vit_small_patch16_224", "+model.img_size=32", *SYNTHETIC
    )
    make_plan(vit_s)
    with torch.device("meta"):
        assert build_model(vit_s.model, 4, 32)(x.to("meta")).shape == (2, 4)
    tiny = compose_config("model=vit_tiny", *SYNTHETIC)
    assert tiny.model.image_size == 32  # the data's
    torch.manual_seed(0)
    out = build_model(tiny.model, 4, 32)(x)
    assert out.shape == (2, 4) and torch.isfinite(out).all()


def test_the_number_of_classes_goes_to_the_argument_the_option_names(project: Path):
    cfg = compose_config(
        "model=custom", "model._target_=my_pkg.nets.Head", "+model._num_classes_=n_out", *SYNTHETIC
    )
    make_plan(cfg)  # the output fits: 4 classes went to n_out
    assert build_model(cfg.model, 4, 32).net[-1].out_features == 4


def test_the_torchvision_zoo_gives_resnets_the_cifar_stem():
    small = build_model(
        compose_config("model=torchvision", "model.arch=wide_resnet50_2").model, 10, 32
    )
    assert small.conv1.kernel_size == (3, 3) and isinstance(small.maxpool, torch.nn.Identity)
    large = build_model(compose_config("model=torchvision", "model.arch=resnet18").model, 10, 224)
    assert large.conv1.kernel_size == (7, 7)
    assert not small_stem(torch.nn.Linear(2, 2))  # no stem to change: left as it is


def test_tensor_core_findings_apply_to_user_models():
    """The Tensor Core shape findings see a `_target_` model as they see a built-in one (here
    the dry run's meta-device build, for a CUDA device: a 4-class head is no multiple of 8)."""
    from runner.precision import resolve
    from runner.precision.checks import DeviceInfo
    from runner.run.build import shape_findings

    gpu = DeviceInfo("cuda", (8, 0), "a GPU")
    properties = resolve("O2", device=gpu).properties
    for model in (
        ["model=custom", "model._target_=torchvision.models.resnet18"],
        ["model=resnet18"],
    ):
        findings = shape_findings(compose_config(*model, *SYNTHETIC), properties, gpu)
        assert [f.key for f in findings] == ["model"], findings
        assert "fc" in findings[0].message


# ---- bad input: exit 2, the key named, no traceback, no MLflow run ---------------------------
BAD = [
    (
        ["model=custom", "model._target_=no_such_pkg.nets.Net"],
        "model._target_",
        "no module named 'no_such_pkg'",
    ),
    (
        ["model=custom", "model._target_=my_pkg.nets.NoSuchNet"],
        "model._target_",
        "module 'my_pkg.nets' has no attribute 'NoSuchNet'",
    ),
    (
        ["model=custom", "model._target_=my_pkg.nets.MyNet", "+model.colour=1"],
        "model.colour",
        "takes no argument 'colour'",
    ),
    # a misspelt part of the path or argument: the nearest names (each a test of its own)
    (
        ["model=custom", "model._target_=my_pkg.nets.MyNett"],
        "model._target_",
        "module 'my_pkg.nets' has no attribute 'MyNett'; did you mean my_pkg.nets.MyNet?",
    ),
    (
        ["model=custom", "model._target_=my_pkg.netz.MyNet"],
        "model._target_",
        "module 'my_pkg' has no attribute 'netz'; did you mean my_pkg.nets?",
    ),
    (
        ["model=custom", "model._target_=my_pkg.nets.MyNet", "+model.widht=4"],
        "model.widht",
        "takes no argument 'widht'; did you mean width?",
    ),
    (
        ["model=custom", "model._target_=my_pkg.nets.Head"],
        "model.n_out",
        "needs the argument 'n_out'",
    ),
    (
        ["model=custom", "model._target_=my_pkg.nets.Head", "+model._num_classes_=width"],
        "model._num_classes_",
        "takes no argument 'width'",
    ),
    (
        ["--config-dir", "my_conf", "model=seven"],
        "model._target_",
        "outputs (2, 7) for a batch of shape (2, 3, 32, 32), but the data has 4 classes",
    ),
    (
        ["model=custom", "model._target_=my_pkg.nets.MyNet", "+model.num_classes=5"],
        "model.num_classes",
        "MyNet outputs (2, 5) for a batch of shape (2, 3, 32, 32), but the data has 4 classes",
    ),
    (["model=tiny", "+model.num_classes=3"], "model.num_classes", "unknown key"),
    (
        ["model=torchvision", "model.arch=vit_b16"],
        "model.arch",
        "unknown torchvision model 'vit_b16'; closest: vit_b_16",
    ),
    (
        ["model=torchvision", "model.arch=vit_b_16"],
        "model.arch",
        "Wrong image height! Expected 224 but got 32",
    ),
    (
        ["model=torchvision", "model.arch=resnet18", "+model.weights=IMAGENET1K_V1"],
        "model.weights",
        "nothing may be downloaded",
    ),
    (
        ["model=timm", "model.arch=vit_small_patch16_244"],
        "model.arch",
        "unknown timm model 'vit_small_patch16_244'; closest: vit_small_patch16_224",
    ),
    (
        ["model=timm", "model.arch=resnet18", "model.pretrained=true"],
        "model.pretrained",
        "nothing may be downloaded",
    ),
    (
        ["model=timm", "model.arch=resnet18", "+model.colour=1"],
        "model.colour",
        "unexpected keyword argument 'colour'",
    ),
    (
        ["data=custom", "data._target_=my_pkg.data.make_datasets", "+data.colour=1"],
        "data.colour",
        "takes no argument 'colour'",
    ),
    (
        ["loss=custom", "loss._target_=torch.nn.CrossEntropyLos"],
        "loss._target_",
        "module 'torch.nn' has no attribute 'CrossEntropyLos'; did you mean "
        "torch.nn.CrossEntropyLoss",
    ),
    (["loss.label_smoothing=1.5"], "loss.label_smoothing", "got 1.5"),
    (
        ["loss=custom", "loss._target_=torch.nn.CrossEntropyLoss", "+loss.reduction=none"],
        "loss._target_",
        "torch.nn.CrossEntropyLoss returns a tensor of shape (4,), not one value",
    ),
]


@pytest.mark.parametrize("args,key,needle", BAD, ids=lambda v: v if isinstance(v, str) else None)
def test_bad_input_exits_2_naming_the_key_before_any_run(project: Path, capfd, args, key, needle):
    uri = f"sqlite:///{project / 'mlflow.db'}"
    data = [] if any(a.startswith("data=") for a in args) else SYNTHETIC
    code = run_in_process(*args, *data, *QUICK, f"mlflow.tracking_uri={uri}")
    err = printed(capfd)
    assert code == 2, err[-2000:]
    assert f"{key}: " in err and needle in err, err[-2000:]
    assert "Traceback" not in err
    assert not (project / "mlflow.db").exists() or not all_runs(uri)
    dry = run_in_process(*args, *data, "dry_run=true")  # found by a dry run too
    assert dry == 2 and needle in printed(capfd)


def test_a_precision_file_of_ones_own_takes_its_levels_properties_or_is_refused(
    project: Path, capfd
):
    """`opt_level: O2` and a loss scale, without the level in the defaults list: the other
    properties were the schema's (no cast, no masters), the run logged as O2 without a word."""
    precision = project / "my_conf" / "precision"
    precision.mkdir()
    (precision / "bare.yaml").write_text("opt_level: O2\nloss_scale: 512\n")
    (precision / "mine.yaml").write_text(
        "defaults:\n  - /schema/precision/level/O2@_here_\n  - _self_\n\nloss_scale: 512\n"
    )
    args = ["--config-dir", "my_conf", *SYNTHETIC, "dry_run=true"]
    assert run_in_process(*args, "precision=bare") == 2
    err = printed(capfd)
    assert "precision.opt_level: O2 is named but its properties are not taken: " in err
    assert "cast_model_type=null (the level's: float16)" in err and "Traceback" not in err
    assert run_in_process(*args, "precision=mine") == 0
    out = printed(capfd)
    assert "cast_model_type        float16" in out and "loss_scale             512.0" in out
    # its fp16 on a CPU, too long a run, is refused by its level's name (the file has no preset)
    mission = ["--config-dir", "my_conf", "data=synthetic", "model=densenet161", "precision=mine"]
    assert run_in_process(*mission, "trainer.device=cpu") == 2
    assert "precision.opt_level=O2 computes in fp16" in printed(capfd)


@pytest.mark.parametrize(
    "group,text,needle",
    [
        (
            "trainer",
            "defaults:\n  - /schema/trainer/default@_here_\n  - _self_\n\nmax_epoch: 3\n",
            "trainer.max_epoch: unknown key; did you mean trainer.max_epochs? (in "
            "trainer/mine.yaml)",
        ),
        (
            "precision",
            "defaults:\n  - o2\n  - _self_\n\nloss_scal: 512\n",
            "precision.loss_scal: unknown key; did you mean precision.loss_scale",
        ),
        # no schema in the defaults list: an untyped node, checked against tiny's schema
        ("model", "name: tiny\nwidht: 8\n", "model.widht: unknown key; did you mean model.width?"),
    ],
)
def test_a_misspelt_key_in_an_option_file_of_ones_own_is_named(
    project: Path, capfd, group, text, needle
):
    """Hydra said "In 'trainer/mine': ConfigKeyError raised while composing config: Key
    'max_epoch' not in 'TrainerConfig' full_key: ... reference_type=..." for a typed file, and
    an untyped one kept its misspelt key, never read."""
    (project / "my_conf" / group).mkdir(exist_ok=True)
    (project / "my_conf" / group / "mine.yaml").write_text(text)
    code = run_in_process("--config-dir", "my_conf", f"{group}=mine", *SYNTHETIC, "dry_run=true")
    err = printed(capfd)
    assert code == 2 and needle in err and "Traceback" not in err, err[-2000:]


def test_a_dataset_without_classes_or_a_pair_is_refused_before_any_run(project: Path, capfd):
    uri = f"sqlite:///{project / 'mlflow.db'}"
    code = run_in_process(
        "model=tiny",
        "data=custom",
        "data._target_=my_pkg.data.not_a_pair",
        *QUICK,
        f"mlflow.tracking_uri={uri}",
    )
    err = printed(capfd)
    assert (
        code == 2
        and "data._target_: my_pkg.data.not_a_pair returned a Blobs, not a (train, val) pair" in err
        and "Traceback" not in err
    )
    assert not all_runs(uri)


def test_a_criterion_on_data_of_ones_own_is_checked_once_the_data_is_loaded(project: Path, capfd):
    """Data of one's own declares no shape: the criterion is called once the datasets exist,
    still before any run."""
    uri = f"sqlite:///{project / 'mlflow.db'}"
    code = run_in_process(
        "model=tiny",
        "data=custom",
        "data._target_=my_pkg.data.make_datasets",
        "loss=custom",
        "loss._target_=torch.nn.CrossEntropyLoss",
        "+loss.reduction=none",
        *QUICK,
        f"mlflow.tracking_uri={uri}",
    )
    err = printed(capfd)
    assert code == 2 and "Traceback" not in err, err[-2000:]
    assert "loss._target_: torch.nn.CrossEntropyLoss returns a tensor of shape (4,)" in err
    assert not all_runs(uri)


@pytest.mark.parametrize(
    "kind,needle",
    [
        ("column", "holds class indices of shape (1, 1), where cross-entropy takes 1 dimension"),
        ("names", "holds targets that are no tensor (list of str: 'cat', ...)"),
    ],
)
def test_labels_that_cross_entropy_cannot_take_are_named_before_any_run(
    project: Path, capfd, kind, needle
):
    """A label kept as a tensor of one item (torch.tensor([3]): batches of shape (B, 1)) ended
    in "0D or 1D target tensor expected, multi-target not supported", a label kept as its name
    in "'tuple' object has no attribute 'device'", each an unexpected error after the run had
    started. The first target is read as a batch of one once the data is loaded."""
    uri = f"sqlite:///{project / 'mlflow.db'}"
    (project / "my_pkg" / "odd_labels.py").write_text(
        "import torch\n\n\n"
        "class Odd(torch.utils.data.Dataset):\n"
        "    def __init__(self, kind):\n"
        "        self.kind = kind\n\n"
        "    def __len__(self):\n"
        "        return 16\n\n"
        "    def __getitem__(self, i):\n"
        "        column = self.kind == 'column'\n"
        "        label = torch.tensor([i % 2]) if column else ['cat', 'dog'][i % 2]\n"
        "        return torch.zeros(3, 32, 32), label\n\n\n"
        "def datasets(kind):\n"
        "    return Odd(kind), Odd(kind)\n"
    )
    code = run_in_process(
        "model=tiny",
        "data=custom",
        "data._target_=my_pkg.odd_labels.datasets",
        f"+data.kind={kind}",
        "data.num_classes=2",
        *QUICK,
        f"mlflow.tracking_uri={uri}",
    )
    err = printed(capfd)
    assert code == 2 and needle in err and "Traceback" not in err, err[-2000:]
    assert not all_runs(uri)


@pytest.mark.parametrize("stage", ["training", "validation"])
def test_a_label_outside_the_classes_stops_the_run_naming_it(project: Path, capfd, stage):
    """data.num_classes=2 on data of 3 classes (labels 0, 1, 2): the model's output fits the
    classes it is told of, and cross-entropy met label 2 as "IndexError: Target 2 is out of
    bounds" (an unexpected error, its traceback; on a GPU a device-side assert that ends the
    process's CUDA context). The batch's labels are read on the host before the copy: one line,
    exit 2, the run FAILED with it. A validation set's labels are read the same way."""
    uri = f"sqlite:///{project / 'mlflow.db'}"
    (project / "my_pkg" / "labels.py").write_text(
        "from my_pkg.data import Blobs\n\n\n"
        "def datasets(stage):\n"
        "    train, val = Blobs(48, 16, 0), Blobs(16, 16, 1)\n"
        "    (train if stage == 'training' else val).y[5] = 7\n"
        "    return train, val\n"
    )
    code = run_in_process(
        "model=tiny",
        "data=custom",
        "data._target_=my_pkg.labels.datasets",
        f"+data.stage={stage}",
        "data.num_classes=3",
        *QUICK,
        f"mlflow.tracking_uri={uri}",
    )
    err = printed(capfd)
    said = "a batch of the data holds the target 7, but the model has 3 outputs (one per class"
    assert code == 2 and said in err and "Traceback" not in err, err[-3000:]
    (run,) = all_runs(uri)
    assert run.info.status == "FAILED" and said in run.data.tags["error"]


def test_a_model_output_that_only_the_dataset_can_check_is_refused_before_any_run(
    project: Path, capfd
):
    """Data of the user's without data.num_classes: the model's output is checked once the
    datasets exist (their .classes), still before the MLflow run."""
    uri = f"sqlite:///{project / 'mlflow.db'}"
    code = run_in_process(
        "--config-dir", "my_conf", "model=seven", "data=blobs", *QUICK, f"mlflow.tracking_uri={uri}"
    )
    err = printed(capfd)
    assert code == 2 and "but the data has 3 classes" in err and "Traceback" not in err
    assert not all_runs(uri)


def test_name_lists_are_derived_from_the_specs():
    from runner.config import SCHEMAS, options
    from runner.config.finder import config_dir

    for group in options.GROUPS:
        files = {p.stem for p in (config_dir() / group).glob("*.yaml")}
        assert set(options.names(group)) <= files
    assert set(options.BUILT_IN_MODELS) < set(options.MODEL_NAMES)
    assert {"torchvision", "timm", "custom", "vit_tiny"} <= set(options.MODEL_NAMES)
    assert SCHEMAS["model"]["vit_tiny"] is options.VitTinyConfig
    with pytest.raises(ConfigError, match="model.name: unknown model 'nope'"):
        build_model(compose_config("model=tiny", "model.name=nope").model, 3, 32)


def test_a_checkpoint_from_before_the_loss_group_resumes_with_the_default_loss():
    """Such a checkpoint's config has no `loss`: its runs trained with plain cross-entropy, so
    only a different loss is a difference."""
    from omegaconf import OmegaConf

    from runner.run.checkpoint import config_differences

    current = OmegaConf.to_container(compose_config(*SYNTHETIC), resolve=True)
    before = {k: v for k, v in current.items() if k != "loss"}
    assert config_differences(before, current) == []
    smoothed = OmegaConf.to_container(
        compose_config(*SYNTHETIC, "loss.label_smoothing=0.1"), resolve=True
    )
    assert config_differences(before, smoothed) == ["loss.label_smoothing: 0.0 -> 0.1"]
