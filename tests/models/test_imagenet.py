"""VGG16, AlexNet, ResNet50: the published parameter counts, PipeDream's layer granularity,
shapes at reduced widths, the papers' optimizer settings."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pl_pipedream.models import VGG16, AlexNet, ResNet50
from pl_pipedream.models.classifier import PipelineClassifier
from pl_pipedream.models.imagenet import Bottleneck
from pl_pipedream.profile.graph import Profile

# The published counts (VGG and ResNet papers; AlexNet as torchvision builds it).
PUBLISHED = [(VGG16, 138_357_544), (AlexNet, 61_100_840), (ResNet50, 25_557_032)]


def parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def on_meta(kind: type[PipelineClassifier], **kwargs: object) -> PipelineClassifier:
    with torch.device("meta"):
        return kind(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(("kind", "count"), PUBLISHED)
def test_the_published_models_have_the_published_parameter_counts(
    kind: type[PipelineClassifier], count: int
) -> None:
    model = on_meta(kind)
    assert model.input_shape == (3, 224, 224) and model.num_classes == 1000
    assert parameters(model) == count
    assert parameters(model.configure_pipeline()) == count  # nothing outside the pipeline


@pytest.mark.parametrize(
    ("kind", "size", "layers"), [(VGG16, 32, 40), (AlexNet, 64, 22), (ResNet50, 32, 18)]
)
def test_a_reduced_build_scores_the_classes_and_the_pipeline_is_forward(
    kind: type[PipelineClassifier], size: int, layers: int
) -> None:
    torch.manual_seed(0)
    model = kind(input_shape=(3, size, size), num_classes=7, width=16).eval()
    assert len(model.configure_pipeline()) == layers
    x = torch.randn(3, 3, size, size)
    out = model(x)
    assert out.shape == (3, 7)
    assert torch.equal(model.configure_pipeline()(x), out)
    y = torch.tensor([0, 3, 6])
    assert torch.equal(model.training_step((x, y), 0), F.cross_entropy(out, y))


def test_width_divides_the_channels_and_hidden_widths() -> None:
    full, quarter = on_meta(VGG16), on_meta(VGG16, width=4)
    widths = [
        (a.out_channels, b.out_channels)
        if isinstance(a, nn.Conv2d)
        else (a.out_features, b.out_features)
        for a, b in zip(full.pipeline, quarter.pipeline, strict=True)
        if isinstance(a, (nn.Conv2d, nn.Linear))
    ]
    assert widths[:-1] == [(w, w // 4) for w, _ in widths[:-1]]
    assert widths[-1] == (1000, 1000)  # the classes stay


def profile_kinds(path: Path) -> list[str]:
    """The profile's layers in order, named as our modules are: PipeDream's flatten is a Size
    and a View node where ours is an adaptive pooling and a Flatten."""
    profile = Profile.load(path)
    names = {"Size": "AdaptiveAvgPool2d", "View": "Flatten"}
    kinds = [profile.node(i).desc.split("(")[0] for i in profile.topological_order()]
    assert kinds[0] == "Input"
    return [names.get(kind, kind) for kind in kinds[1:]]


@pytest.mark.parametrize(("kind", "name"), [(VGG16, "vgg16"), (AlexNet, "alexnet")])
def test_the_layers_are_pipedreams_profiled_layers(
    kind: type[PipelineClassifier], name: str, profiles_dir: Path
) -> None:
    path = profiles_dir / f"{name}.txt"
    pipeline = on_meta(kind).configure_pipeline()
    assert [type(layer).__name__ for layer in pipeline] == profile_kinds(path)
    profile = Profile.load(path)
    described = [profile.node(i).desc for i in profile.topological_order()[1:]]
    for layer, desc in zip(pipeline, described, strict=True):
        if isinstance(layer, (nn.Conv2d, nn.Linear, nn.MaxPool2d)):
            assert repr(layer) == desc  # same shapes, kernels, strides and paddings
        if isinstance(layer, nn.Dropout):
            assert desc == f"Dropout(p={layer.p})"
    assert sum(node.parameter_bytes for node in profile.nodes) == 4 * parameters(pipeline)


def test_resnet50_has_the_profiled_blocks_and_layers(profiles_dir: Path) -> None:
    profile = Profile.load(profiles_dir / "resnet50.txt")
    profiled = Counter(node.desc.split("(")[0] for node in profile.nodes)
    pipeline = on_meta(ResNet50).configure_pipeline()
    ours = Counter(type(module).__name__ for module in pipeline.modules())
    assert profiled["Add"] == ours["Bottleneck"] == 16
    for kind in ("Conv2d", "BatchNorm2d", "ReLU", "Linear", "MaxPool2d"):
        assert ours[kind] == profiled[kind], kind
    assert sum(node.parameter_bytes for node in profile.nodes) == 4 * parameters(pipeline)


def test_resnet50_stages_halve_the_map_and_widen_fourfold() -> None:
    torch.manual_seed(0)
    pipeline = ResNet50(input_shape=(3, 64, 64), num_classes=5, width=16).configure_pipeline()
    x = pipeline[0](torch.randn(2, 3, 64, 64))
    assert x.shape == (2, 4, 16, 16)  # 64 // 16 channels; 7x7 stride 2, then pooling stride 2
    shapes = []
    for block in pipeline[1:-1]:
        x = block(x)
        shapes.append(tuple(x.shape[1:]))
    stages = [(16, 16, 16), (32, 8, 8), (64, 4, 4), (128, 2, 2)]  # 4x bottleneck channels
    assert shapes == [stages[0]] * 3 + [stages[1]] * 4 + [stages[2]] * 6 + [stages[3]] * 3
    projections = [b.shortcut is not None for b in pipeline[1:-1] if isinstance(b, Bottleneck)]
    firsts = {0, 3, 7, 13}  # each stage's first block projects its shortcut, the others do not
    assert projections == [index in firsts for index in range(16)]


def test_alexnet_starts_as_the_paper_says() -> None:
    torch.manual_seed(0)
    model = AlexNet(input_shape=(3, 64, 64), num_classes=5, width=16)
    weighted = [m for m in model.pipeline if isinstance(m, (nn.Conv2d, nn.Linear))]
    assert [float(m.bias.detach().mean()) for m in weighted] == [
        0.0,
        1.0,
        0.0,
        1.0,
        1.0,
        1.0,
        1.0,
        0.0,
    ]
    fourth = weighted[3].weight  # 16 x 24 x 3 x 3 weights: their spread is close to 0.01
    assert float(fourth.detach().std()) == pytest.approx(0.01, rel=0.1)


@pytest.mark.parametrize(
    ("kind", "lr", "weight_decay"),
    [(VGG16, 0.01, 5e-4), (AlexNet, 0.01, 5e-4), (ResNet50, 0.1, 1e-4)],
)
def test_the_optimizer_is_the_papers_sgd(
    kind: type[PipelineClassifier], lr: float, weight_decay: float
) -> None:
    optimizer = kind(input_shape=(3, 32, 32), num_classes=3, width=64).configure_optimizers()
    assert type(optimizer) is torch.optim.SGD
    group = optimizer.param_groups[0]
    assert (group["lr"], group["momentum"], group["weight_decay"]) == (lr, 0.9, weight_decay)


@pytest.mark.parametrize("kind", [VGG16, AlexNet, ResNet50])
def test_bad_widths_and_shapes_are_refused(kind: type[PipelineClassifier]) -> None:
    name = kind.__name__
    with pytest.raises(ValueError, match=rf"{name}'s width must divide 64 \(width: 3\); use one"):
        on_meta(kind, width=3)
    with pytest.raises(ValueError, match=rf"{name} needs image inputs .*\(input_shape: \[784\]\)"):
        on_meta(kind, input_shape=(784,))
