"""The built-in model architectures, registered as a fedplug plugin: ``mlp``, ``logreg``,
``cnn_mnist``, ``cnn_femnist``, ``vgg9`` and ``resnet18``.

Every factory ``factory(config, input_shape, num_classes)`` returns a fresh float32
``torch.nn.Module`` giving ``(B, num_classes)`` logits, initialised from torch's global
generator. Where each architecture comes from: docs/algorithms.md, "Models".
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Annotated, Literal

import torch
from pydantic import Field
from torch import nn

from fedplug.components import ComponentConfig
from fedplug.errors import ConfigError
from fedplug.hookspecs import ModelFactory, RegisterModel, hookimpl
from fedplug.memory import allocation_failed, check_fits, human_bytes

MAX_WIDTH = 65_536
"""Upper bound on any configurable layer width (guards against typos like 2000000)."""

CIFAR_STEM_MAX_SIDE = 32
"""``resnet18`` with ``stem: auto`` uses the CIFAR stem when height and width are at most this."""

Width = Annotated[int, Field(ge=1, le=MAX_WIDTH)]

TRAINING_COPIES = 4
"""Float32 copies of the parameters that training holds at least: the model, its
gradients, the global model's flat vector and the aggregate (optimiser and per-client
state come on top). The memory estimate of :func:`with_memory_check` is this times 4 bytes
per parameter."""


# ----------------------------------------------------------------------------- configs


class MLPConfig(ComponentConfig):
    """Multi-layer perceptron: flatten, then fully connected ReLU layers (McMahan et al.'s 2NN)."""

    name: Literal["mlp"] = "mlp"
    hidden: tuple[Width, ...] = Field(default=(200, 200), max_length=64)
    """Width of each hidden layer, in order (default (200, 200), McMahan et al. 2017's
    "2NN"); an empty list gives logistic regression."""


class LogisticRegressionConfig(ComponentConfig):
    """Multinomial logistic regression: flatten, one linear layer."""

    name: Literal["logreg"] = "logreg"


class CNNMnistConfig(ComponentConfig):
    """McMahan et al. (2017)'s CNN: two 5x5 conv + max-pool blocks (32, 64), fc 512, fc C."""

    name: Literal["cnn_mnist"] = "cnn_mnist"


class CNNFemnistConfig(ComponentConfig):
    """LEAF's FEMNIST CNN: two 5x5 conv + max-pool blocks (32, 64), fc ``hidden``, fc C."""

    name: Literal["cnn_femnist"] = "cnn_femnist"
    hidden: int = Field(default=2048, ge=1, le=MAX_WIDTH)
    """Width of the fully connected hidden layer (default 2048, as LEAF; 512 gives
    McMahan et al.'s CNN)."""


class VGG9Config(ComponentConfig):
    """FedMA's VGG-9, no dropout or BatchNorm: 3x3 convs 32,64|128,128|256,256, fc 512, 512, C."""

    name: Literal["vgg9"] = "vgg9"


class ResNet18Config(ComponentConfig):
    """torchvision's ResNet-18, first convolution adapted to the input channels (has BatchNorm)."""

    name: Literal["resnet18"] = "resnet18"
    stem: Literal["auto", "cifar", "imagenet"] = "auto"
    """First layers (default "auto"): "cifar" is a 3x3 stride-1 convolution without
    max-pool, "imagenet" torchvision's 7x7 stride-2 convolution and 3x3 max-pool; "auto"
    picks "cifar" when height and width are at most 32 pixels, else "imagenet"."""


# ---------------------------------------------------------------------------- checks


def _check_common(name: str, input_shape: tuple[int, ...], num_classes: int) -> None:
    if len(input_shape) == 0 or any(int(side) < 1 for side in input_shape):
        raise ConfigError(
            f"model {name!r} got input shape {tuple(input_shape)}; every dimension must be "
            "at least 1: check the dataset"
        )
    if num_classes < 1:
        raise ConfigError(
            f"model {name!r} got num_classes={num_classes}; it must be at least 1: "
            "check the dataset"
        )


def _image_shape(
    name: str, input_shape: tuple[int, ...], num_classes: int, min_side: int
) -> tuple[int, int, int]:
    """Return ``(C, H, W)`` or explain why ``input_shape`` does not fit model ``name``."""
    _check_common(name, input_shape, num_classes)
    if len(input_shape) != 3:
        raise ConfigError(
            f"model {name!r} needs image inputs (C, H, W); the dataset gives "
            f"{tuple(input_shape)}: use mlp or logreg"
        )
    channels, height, width = (int(side) for side in input_shape)
    if height < min_side or width < min_side:
        raise ConfigError(
            f"model {name!r} needs images of at least {min_side}x{min_side} pixels; the dataset "
            f"gives {height}x{width}: use a smaller model (cnn_mnist, mlp or logreg)"
        )
    return channels, height, width


# ---------------------------------------------------------------------------- builders


def _flat_features(input_shape: tuple[int, ...]) -> int:
    return math.prod(int(side) for side in input_shape)


def _fully_connected(
    in_features: int, hidden: tuple[int, ...], num_classes: int
) -> list[nn.Module]:
    """Linear + ReLU for each hidden width, then the linear classifier."""
    layers: list[nn.Module] = []
    for width in hidden:
        layers += [nn.Linear(in_features, width), nn.ReLU()]
        in_features = width
    layers.append(nn.Linear(in_features, num_classes))
    return layers


def _as_float32(model: nn.Module) -> nn.Module:
    # Guards against a caller's torch.set_default_dtype(torch.float64): the flat vectors
    # the engines exchange are float32.
    return model.to(torch.float32)


def build_mlp(config: MLPConfig, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Flatten, ``config.hidden`` ReLU layers, linear classifier."""
    _check_common(config.name, input_shape, num_classes)
    classifier = _fully_connected(_flat_features(input_shape), config.hidden, num_classes)
    return _as_float32(nn.Sequential(nn.Flatten(), *classifier))


def build_logistic_regression(
    config: LogisticRegressionConfig, input_shape: tuple[int, ...], num_classes: int
) -> nn.Module:
    """Flatten, one linear layer."""
    _check_common(config.name, input_shape, num_classes)
    linear = nn.Linear(_flat_features(input_shape), num_classes)
    return _as_float32(nn.Sequential(nn.Flatten(), linear))


def _two_conv_cnn(
    name: str, input_shape: tuple[int, ...], num_classes: int, hidden: int
) -> nn.Module:
    """conv5x5 32 (pad 2), ReLU, pool 2, conv5x5 64 (pad 2), ReLU, pool 2, fc hidden, ReLU, fc C."""
    channels, height, width = _image_shape(name, input_shape, num_classes, min_side=4)
    flat = 64 * (height // 4) * (width // 4)
    return _as_float32(
        nn.Sequential(
            nn.Conv2d(channels, 32, kernel_size=5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, kernel_size=5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            *_fully_connected(flat, (hidden,), num_classes),
        )
    )


def build_cnn_mnist(
    config: CNNMnistConfig, input_shape: tuple[int, ...], num_classes: int
) -> nn.Module:
    """McMahan et al. (2017)'s CNN, sized from ``input_shape``."""
    return _two_conv_cnn(config.name, input_shape, num_classes, hidden=512)


def build_cnn_femnist(
    config: CNNFemnistConfig, input_shape: tuple[int, ...], num_classes: int
) -> nn.Module:
    """LEAF's FEMNIST CNN, sized from ``input_shape``."""
    return _two_conv_cnn(config.name, input_shape, num_classes, hidden=config.hidden)


def build_vgg9(config: VGG9Config, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """FedMA's VGG-9 (no dropout, no BatchNorm), sized from ``input_shape``."""
    channels, height, width = _image_shape(config.name, input_shape, num_classes, min_side=8)
    layers: list[nn.Module] = []
    in_channels = channels
    for block in ((32, 64), (128, 128), (256, 256)):
        for out_channels in block:
            layers += [nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1), nn.ReLU()]
            in_channels = out_channels
        layers.append(nn.MaxPool2d(2))
    # Three 2x2 pools floor-divide each side by 2 three times, i.e. by 8.
    flat = 256 * (height // 8) * (width // 8)
    layers += [nn.Flatten(), *_fully_connected(flat, (512, 512), num_classes)]
    return _as_float32(nn.Sequential(*layers))


def build_resnet18(
    config: ResNet18Config, input_shape: tuple[int, ...], num_classes: int
) -> nn.Module:
    """torchvision's ResNet-18 with its stem adapted to the input (see ``ResNet18Config.stem``)."""
    channels, height, width = _image_shape(config.name, input_shape, num_classes, min_side=1)
    stem = config.stem
    if stem == "auto":
        stem = "cifar" if max(height, width) <= CIFAR_STEM_MAX_SIDE else "imagenet"
    # Imported here: torchvision.models pulls in torch._dynamo, seconds of start-up that
    # every other model (and every pipeline stage) would pay.
    from torchvision.models import resnet18

    model = resnet18(weights=None, num_classes=num_classes)
    first_conv: nn.Conv2d | None = None
    if stem == "cifar":
        first_conv = nn.Conv2d(channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    elif channels != 3:
        first_conv = nn.Conv2d(channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
    if first_conv is not None:
        # torchvision initialises its own conv1 this way; the replacement gets the same.
        nn.init.kaiming_normal_(first_conv.weight, mode="fan_out", nonlinearity="relu")
        model.conv1 = first_conv
    return _as_float32(model)


def has_batch_norm(model: nn.Module) -> bool:
    """True when ``model`` contains a BatchNorm layer (``BatchNorm1d/2d/3d``, ``SyncBatchNorm``).

    Such a model's output depends on the whole batch and its forward pass updates running
    statistics, so engines that ``vmap`` over clients or pad batches cannot run it.
    """
    return any(isinstance(module, nn.modules.batchnorm._BatchNorm) for module in model.modules())


# ----------------------------------------------------------------- the memory check


def parameter_count(
    factory: Callable[..., nn.Module], config: ComponentConfig, input_shape: tuple[int, ...], num_classes: int
) -> int:
    """The number of parameters ``factory`` builds, counted on torch's ``meta`` device:
    nothing is allocated and no random number is drawn, so the real build that follows
    gets the same weights."""
    with torch.device("meta"):
        model = factory(config, input_shape, num_classes)
    return sum(parameter.numel() for parameter in model.parameters())


def _described(config: ComponentConfig) -> str:
    """``train.model (name: mlp, hidden: [65536, 65536])``: the key and its values."""
    values = config.model_dump(mode="json")
    return "train.model (" + ", ".join(f"{key}: {value}" for key, value in values.items()) + ")"


def with_memory_check(factory: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    """``factory``, refusing first a model whose training needs more memory than the
    machine has (:func:`fedplug.memory.check_fits`, estimate :data:`TRAINING_COPIES` x 4
    bytes a parameter), and turning an allocator's failure into the same one line."""

    @functools.wraps(factory)
    def build(config: ComponentConfig, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
        count = parameter_count(factory, config, input_shape, num_classes)
        what = f"{_described(config)} on inputs {tuple(input_shape)}: {count:.3g} parameters"
        fix = "use a smaller model (fewer or narrower layers)"
        check_fits(count * 4 * TRAINING_COPIES, what, fix)
        try:
            return factory(config, input_shape, num_classes)
        except (MemoryError, RuntimeError) as error:
            if not allocation_failed(error):
                raise
            raise ConfigError(f"{what} ({human_bytes(count * 4)}): the allocation failed; {fix}") from None

    return build


# ------------------------------------------------------------------------ registration

MODELS: tuple[tuple[type[ComponentConfig], ModelFactory], ...] = (
    (MLPConfig, build_mlp),
    (LogisticRegressionConfig, build_logistic_regression),
    (CNNMnistConfig, build_cnn_mnist),
    (CNNFemnistConfig, build_cnn_femnist),
    (VGG9Config, build_vgg9),
    (ResNet18Config, build_resnet18),
)
"""Built-in models: config class (which names the model) and factory."""


@hookimpl
def fedplug_register_models(register: RegisterModel) -> None:
    """Register the built-in models."""
    for config_class, factory in MODELS:
        register(config_class, with_memory_check(factory))
