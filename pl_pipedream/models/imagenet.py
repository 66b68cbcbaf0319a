"""The paper's three ImageNet classifiers: ``VGG16``, ``AlexNet`` and ``ResNet50``.

Each is written from its paper's description and pipelined at the granularity PipeDream profiled
(SOSP 2019, section 5): VGG-16 and AlexNet one layer per convolution, ReLU, pooling, dropout and
fully connected layer, in the order of PipeDream's published profiles (``vgg16.txt``,
``alexnet.txt``); ResNet-50 one layer per residual block, plus the stem and the head. With
``width=1`` and ImageNet shapes (3x224x224 in, 1000 classes) the parameter counts are the
published ones: VGG-16 138,357,544; AlexNet 61,100,840 (torchvision's single-tower variant);
ResNet-50 25,557,032. ``width`` divides every channel count and hidden width, for small builds.

Each trains with SGD and momentum, the learning rate, momentum and weight decay of its paper by
default. Every model ends its convolutions with an adaptive average pooling, so smaller images
than 224x224 also fit (at 224x224 VGG's pooling to 7x7 changes nothing).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

from pl_pipedream.models.classifier import PipelineClassifier

__all__ = ["VGG16", "AlexNet", "Bottleneck", "ResNet50"]

IMAGENET_SHAPE = (3, 224, 224)
WIDTHS = (1, 2, 4, 8, 16, 32, 64)  # the divisors of 64, so every channel count stays whole

# VGG-16 (configuration D): 3x3 convolutions, "M" a 2x2 max pooling of stride 2
VGG16_CONVS: tuple[int | str, ...] = (
    64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M",
)  # fmt: skip
# AlexNet: (out channels, kernel, stride, padding, max pooling after it)
ALEXNET_CONVS = ((64, 11, 4, 2, True), (192, 5, 1, 2, True), (384, 3, 1, 1, False),
                 (256, 3, 1, 1, False), (256, 3, 1, 1, True))  # fmt: skip
# ResNet-50: (blocks, bottleneck channels, stride of the stage's first block)
RESNET50_STAGES = ((3, 64, 1), (4, 128, 2), (6, 256, 2), (3, 512, 2))


def check_image_model(name: str, input_shape: Sequence[int], width: int) -> None:
    """Refuse inputs that are not images and widths that would not divide the channels."""
    if len(input_shape) != 3:
        raise ValueError(
            f"{name} needs image inputs shaped (channels, height, width) (input_shape: "
            f"{list(input_shape)}); give the data an input_shape of three numbers, e.g. "
            "[3, 224, 224]"
        )
    if width not in WIDTHS:
        raise ValueError(
            f"{name}'s width must divide 64 (width: {width}); use one of "
            f"{', '.join(map(str, WIDTHS))} (1 is the published model)"
        )


class VGG16(PipelineClassifier):
    """VGG-16 (Simonyan and Zisserman, 2015, configuration D): thirteen 3x3 convolutions in five
    groups, each group closed by max pooling, then 4096-4096-classes fully connected layers with
    dropout 0.5 after the first two.

    Every convolution, ReLU, pooling, dropout and Linear is its own pipeline layer (40 in all,
    as PipeDream's profile lists them: its ``Size`` and ``View`` stand where our adaptive pooling
    and ``Flatten`` do). Weights start as Glorot and Bengio's, biases at zero, which the paper
    says trains the deep configurations without pre-training.

    Args:
        width: divides every channel count and the hidden width (1: the published model).
        lr, momentum, weight_decay: SGD's, the paper's by default (0.01, 0.9, 5e-4).
        lr_milestones, lr_gamma and other arguments: see ``PipelineClassifier``.
    """

    def __init__(
        self,
        input_shape: Sequence[int] = IMAGENET_SHAPE,
        num_classes: int = 1000,
        width: int = 1,
        optimizer: str = "sgd",
        lr: float = 0.01,
        momentum: float = 0.9,
        weight_decay: float = 5e-4,
        lr_milestones: Sequence[int] = (),
        lr_gamma: float = 0.1,
    ) -> None:
        super().__init__(
            input_shape, num_classes, optimizer, lr, momentum, weight_decay, lr_milestones, lr_gamma
        )
        self.save_hyperparameters()
        check_image_model("VGG16", self.input_shape, width)
        depth = self.input_shape[0]
        layers: list[nn.Module] = []
        for entry in VGG16_CONVS:
            if entry == "M":
                layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
                continue
            out = int(entry) // width
            layers += [nn.Conv2d(depth, out, kernel_size=3, padding=1), nn.ReLU()]
            depth = out
        hidden = 4096 // width
        layers += [
            nn.AdaptiveAvgPool2d(7),
            nn.Flatten(),
            nn.Linear(depth * 7 * 7, hidden),
            nn.ReLU(),
            nn.Dropout(0.5),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Dropout(0.5),
            nn.Linear(hidden, self.num_classes),
        ]
        for layer in layers:
            if isinstance(layer, (nn.Conv2d, nn.Linear)):
                nn.init.xavier_uniform_(layer.weight)
                if layer.bias is not None:
                    nn.init.zeros_(layer.bias)
        self.pipeline = nn.Sequential(*layers)


class AlexNet(PipelineClassifier):
    """AlexNet (Krizhevsky, Sutskever and Hinton, 2012) as one tower, with torchvision's channel
    counts 64-192-384-256-256: five convolutions (max pooling 3x3, stride 2 after the first,
    second and fifth), pooling to 6x6, then dropout 0.5 before each of the two 4096-wide layers
    and a Linear scoring the classes.

    Every convolution, ReLU, pooling, dropout and Linear is its own pipeline layer (22 in all,
    as PipeDream's profile lists them). Weights start from N(0, 0.01); biases at one in the
    second, fourth and fifth convolutions and the hidden Linear layers, zero elsewhere, as the
    paper initialises them.

    Args:
        width: divides every channel count and the hidden width (1: the published model).
        lr, momentum, weight_decay: SGD's, the paper's by default (0.01, 0.9, 5e-4).
        lr_milestones, lr_gamma and other arguments: see ``PipelineClassifier``.
    """

    def __init__(
        self,
        input_shape: Sequence[int] = IMAGENET_SHAPE,
        num_classes: int = 1000,
        width: int = 1,
        optimizer: str = "sgd",
        lr: float = 0.01,
        momentum: float = 0.9,
        weight_decay: float = 5e-4,
        lr_milestones: Sequence[int] = (),
        lr_gamma: float = 0.1,
    ) -> None:
        super().__init__(
            input_shape, num_classes, optimizer, lr, momentum, weight_decay, lr_milestones, lr_gamma
        )
        self.save_hyperparameters()
        check_image_model("AlexNet", self.input_shape, width)
        depth = self.input_shape[0]
        layers: list[nn.Module] = []
        ones: list[nn.Module] = []  # the layers whose biases start at one
        for index, (out, kernel, stride, padding, pool) in enumerate(ALEXNET_CONVS):
            conv = nn.Conv2d(depth, out // width, kernel, stride=stride, padding=padding)
            layers += [conv, nn.ReLU()]
            if pool:
                layers.append(nn.MaxPool2d(kernel_size=3, stride=2))
            if index in (1, 3, 4):
                ones.append(conv)
            depth = out // width
        hidden = 4096 // width
        first, second = nn.Linear(depth * 6 * 6, hidden), nn.Linear(hidden, hidden)
        layers += [
            nn.AdaptiveAvgPool2d(6),
            nn.Flatten(),
            nn.Dropout(0.5),
            first,
            nn.ReLU(),
            nn.Dropout(0.5),
            second,
            nn.ReLU(),
            nn.Linear(hidden, self.num_classes),
        ]
        ones += [first, second]
        for layer in layers:
            if isinstance(layer, (nn.Conv2d, nn.Linear)):
                nn.init.normal_(layer.weight, std=0.01)
                if layer.bias is not None:
                    nn.init.constant_(layer.bias, 1.0 if layer in ones else 0.0)
        self.pipeline = nn.Sequential(*layers)


def conv_bn(depth: int, out: int, kernel: int, stride: int = 1) -> list[nn.Module]:
    """A convolution without bias (the batch normalisation after it has one), then that BN."""
    conv = nn.Conv2d(depth, out, kernel, stride=stride, padding=kernel // 2, bias=False)
    nn.init.kaiming_normal_(conv.weight, mode="fan_out", nonlinearity="relu")
    return [conv, nn.BatchNorm2d(out)]


class Bottleneck(nn.Module):
    """ResNet's bottleneck block: 1x1 reduce, 3x3, 1x1 expand (4x), each followed by batch
    normalisation, added to the shortcut, then ReLU.

    The shortcut is the identity, or a 1x1 projection with BN where the shape changes (the
    paper's option B). The 3x3 convolution carries the stride, as in the torchvision model
    PipeDream profiled (the paper puts it on the first 1x1; the parameters are the same).
    """

    expansion = 4

    def __init__(self, depth: int, channels: int, stride: int) -> None:
        super().__init__()
        out = channels * self.expansion
        self.residual = nn.Sequential(
            *conv_bn(depth, channels, 1),
            nn.ReLU(),
            *conv_bn(channels, channels, 3, stride),
            nn.ReLU(),
            *conv_bn(channels, out, 1),
        )
        changes = stride != 1 or depth != out
        self.shortcut = nn.Sequential(*conv_bn(depth, out, 1, stride)) if changes else None
        self.relu = nn.ReLU()

    def forward(self, x: Tensor) -> Tensor:
        shortcut = x if self.shortcut is None else self.shortcut(x)
        return self.relu(self.residual(x) + shortcut)


class ResNet50(PipelineClassifier):
    """ResNet-50 (He, Zhang, Ren and Sun, 2016): a 7x7 stride-2 convolution and 3x3 max pooling,
    then 3, 4, 6 and 3 bottleneck blocks of 64, 128, 256 and 512 channels (each stage after the
    first halving the map), global average pooling and a Linear scoring the classes.

    Pipeline layers: the stem, each of the 16 blocks, and the head (18 in all).

    Args:
        width: divides every channel count (1: the published model).
        lr, momentum, weight_decay: SGD's, the paper's by default (0.1, 0.9, 1e-4).
        lr_milestones, lr_gamma and other arguments: see ``PipelineClassifier``.
    """

    def __init__(
        self,
        input_shape: Sequence[int] = IMAGENET_SHAPE,
        num_classes: int = 1000,
        width: int = 1,
        optimizer: str = "sgd",
        lr: float = 0.1,
        momentum: float = 0.9,
        weight_decay: float = 1e-4,
        lr_milestones: Sequence[int] = (),
        lr_gamma: float = 0.1,
    ) -> None:
        super().__init__(
            input_shape, num_classes, optimizer, lr, momentum, weight_decay, lr_milestones, lr_gamma
        )
        self.save_hyperparameters()
        check_image_model("ResNet50", self.input_shape, width)
        depth = 64 // width
        stem = nn.Sequential(
            *conv_bn(self.input_shape[0], depth, 7, stride=2),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=3, stride=2, padding=1),
        )
        blocks: list[nn.Module] = []
        for count, channels, stride in RESNET50_STAGES:
            for index in range(count):
                blocks.append(Bottleneck(depth, channels // width, stride if index == 0 else 1))
                depth = channels // width * Bottleneck.expansion
        head = nn.Sequential(
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(depth, self.num_classes)
        )
        self.pipeline = nn.Sequential(stem, *blocks, head)
