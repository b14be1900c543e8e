"""Tests of the model zoo (fedplug.models.zoo) and the FLOP/size counters (fedplug.models.flops)."""

from __future__ import annotations

import pluggy
import pytest
import torch
from pydantic import ValidationError
from torch import nn
from torch.func import functional_call

from fedplug import hookspecs
from fedplug.errors import ConfigError
from fedplug.models import zoo
from fedplug.models.flops import flops_per_sample, model_num_bytes, training_flops_per_sample
from fedplug.plugins import collect_registry

MNIST = ((1, 28, 28), 10)
CIFAR = ((3, 32, 32), 10)
FEMNIST = ((1, 28, 28), 62)
IMAGE_TASKS = {"mnist": MNIST, "cifar": CIFAR, "femnist": FEMNIST}

ALL_MODELS = ["mlp", "logreg", "cnn_mnist", "cnn_femnist", "vgg9", "resnet18"]
IMAGE_ONLY_MODELS = ["cnn_mnist", "cnn_femnist", "vgg9", "resnet18"]
WITHOUT_BATCH_NORM = ["mlp", "logreg", "cnn_mnist", "cnn_femnist", "vgg9"]


@pytest.fixture(scope="module")
def registry():
    """A registry filled through the real hook path, from the zoo plugin alone."""
    manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    manager.add_hookspecs(hookspecs)
    manager.register(zoo, name="fedplug.models.zoo")
    manager.check_pending()
    return collect_registry(manager)


def build(
    registry, name: str, input_shape: tuple[int, ...], num_classes: int, **params
) -> nn.Module:
    config = registry.get("models", name).config_class.model_validate({"name": name, **params})
    # The simulator seeds torch's global generator before building; fork_rng keeps that
    # seeding from leaking into other tests.
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return registry.build("models", config, input_shape, num_classes)


def num_parameters(model: nn.Module) -> int:
    return sum(parameter.numel() for parameter in model.parameters())


def random_batch(batch_size: int, input_shape: tuple[int, ...], num_classes: int, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.rand((batch_size, *input_shape), generator=generator)
    targets = torch.randint(0, num_classes, (batch_size,), generator=generator)
    return inputs, targets


# --------------------------------------------------------------------------- registry


def test_every_model_is_registered_through_the_hook(registry):
    assert registry.names("models") == sorted(ALL_MODELS)
    for entry in registry.entries("models"):
        assert entry.plugin == "fedplug.models.zoo"
        assert entry.summary, f"{entry.name}: config class needs a docstring"


def test_configs_are_strict(registry):
    with pytest.raises(ValidationError, match="Extra inputs"):
        zoo.MLPConfig.model_validate({"name": "mlp", "hiden": [10]})
    with pytest.raises(ValidationError):
        zoo.MLPConfig(hidden=(0,))
    with pytest.raises(ValidationError):
        zoo.CNNFemnistConfig(hidden=0)
    with pytest.raises(ValidationError):
        zoo.ResNet18Config(stem="tiny")
    assert zoo.MLPConfig().hidden == (200, 200)
    assert zoo.CNNFemnistConfig().hidden == 2048


# ------------------------------------------------------------------- shapes and grads


@pytest.mark.parametrize("task", IMAGE_TASKS)
@pytest.mark.parametrize("name", ALL_MODELS)
def test_forward_shape_gradients_and_dtype(registry, name, task):
    # Prepare
    input_shape, num_classes = IMAGE_TASKS[task]
    model = build(registry, name, input_shape, num_classes)
    inputs, targets = random_batch(2, input_shape, num_classes)

    # Execute
    logits = model(inputs)
    nn.functional.cross_entropy(logits, targets).backward()

    # Assert
    assert logits.shape == (2, num_classes)
    assert logits.dtype == torch.float32
    for parameter_name, parameter in model.named_parameters():
        assert parameter.dtype == torch.float32, parameter_name
        assert parameter.grad is not None, f"{name}: no gradient reaches {parameter_name}"
        assert torch.isfinite(parameter.grad).all(), parameter_name
        assert parameter.grad.abs().sum() > 0, f"{name}: zero gradient on {parameter_name}"


@pytest.mark.parametrize("name", ["mlp", "logreg"])
def test_flat_models_take_flat_inputs(registry, name):
    model = build(registry, name, (20,), 3)
    assert model(torch.zeros(4, 20)).shape == (4, 3)


@pytest.mark.parametrize("name", ALL_MODELS)
def test_no_dropout_so_training_forward_is_deterministic(registry, name):
    input_shape, num_classes = (3, 8, 8), 10  # the smallest images vgg9 takes: fast
    model = build(registry, name, input_shape, num_classes)
    dropout_types = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout)
    assert not any(isinstance(module, dropout_types) for module in model.modules())
    inputs, _ = random_batch(2, input_shape, num_classes)
    model.train()
    # In train mode BatchNorm normalises with the batch's own statistics, so even
    # resnet18 gives the same logits twice although its running statistics move.
    torch.testing.assert_close(model(inputs), model(inputs), rtol=0, atol=0)


# --------------------------------------------------------------- hand-counted params


def test_mlp_parameter_count_by_hand(registry):
    # McMahan's 2NN on MNIST: [784*200 + 200] + [200*200 + 200] + [200*10 + 10]
    expected = (784 * 200 + 200) + (200 * 200 + 200) + (200 * 10 + 10)
    assert expected == 199_210
    assert num_parameters(build(registry, "mlp", *MNIST)) == expected


def test_mlp_with_empty_hidden_is_logistic_regression(registry):
    model = build(registry, "mlp", (1, 28, 28), 10, hidden=[])
    assert num_parameters(model) == 784 * 10 + 10


def test_logreg_parameter_count_by_hand(registry):
    assert num_parameters(build(registry, "logreg", *CIFAR)) == 3 * 32 * 32 * 10 + 10


def test_cnn_mnist_parameter_count_by_hand(registry):
    # McMahan et al. 2017's CNN on 1x28x28, padding 2 keeps 28 -> pool 14 -> pool 7:
    conv1 = 32 * 1 * 5 * 5 + 32  # 832
    conv2 = 64 * 32 * 5 * 5 + 64  # 51,264
    fc1 = 7 * 7 * 64 * 512 + 512  # 1,606,144
    fc2 = 512 * 10 + 10  # 5,130
    assert conv1 + conv2 + fc1 + fc2 == 1_663_370
    assert num_parameters(build(registry, "cnn_mnist", *MNIST)) == 1_663_370


def test_cnn_mnist_is_sized_from_cifar_input(registry):
    # 3x32x32: 32 -> pool 16 -> pool 8
    conv1 = 32 * 3 * 5 * 5 + 32  # 2,432
    conv2 = 64 * 32 * 5 * 5 + 64  # 51,264
    fc1 = 8 * 8 * 64 * 512 + 512  # 2,097,664
    fc2 = 512 * 10 + 10  # 5,130
    expected = conv1 + conv2 + fc1 + fc2
    assert num_parameters(build(registry, "cnn_mnist", *CIFAR)) == expected == 2_156_490


def test_cnn_femnist_parameter_count_by_hand(registry):
    # LEAF's FEMNIST CNN, 62 classes, fc 2048 (FedGSP reports "6.3 million parameters").
    conv1 = 32 * 1 * 25 + 32  # 832
    conv2 = 64 * 32 * 25 + 64  # 51,264
    fc1 = 7 * 7 * 64 * 2048 + 2048  # 6,424,576
    fc2 = 2048 * 62 + 62  # 127,038
    expected = conv1 + conv2 + fc1 + fc2
    assert num_parameters(build(registry, "cnn_femnist", *FEMNIST)) == expected == 6_603_710
    small = build(registry, "cnn_femnist", *FEMNIST, hidden=512)
    assert num_parameters(small) == conv1 + conv2 + (3136 * 512 + 512) + (512 * 62 + 62)


def test_vgg9_parameter_count_by_hand(registry):
    # FedMA's VGG-9 on CIFAR-10 (3,491,530 parameters in Wang et al. 2020).
    convs = [(3, 32), (32, 64), (64, 128), (128, 128), (128, 256), (256, 256)]
    conv = sum(cin * cout * 9 + cout for cin, cout in convs)  # 1,126,080
    fc = (256 * 4 * 4 * 512 + 512) + (512 * 512 + 512) + (512 * 10 + 10)  # 2,365,450
    assert conv + fc == 3_491_530
    assert num_parameters(build(registry, "vgg9", *CIFAR)) == 3_491_530
    # 28x28: 28 -> 14 -> 7 -> 3 after three floor-halving pools
    mnist_fc1 = 256 * 3 * 3 * 512 + 512
    mnist_conv1 = 1 * 32 * 9 + 32
    expected = conv - (3 * 32 * 9 + 32) + mnist_conv1 + fc - (256 * 16 * 512 + 512) + mnist_fc1
    assert num_parameters(build(registry, "vgg9", *MNIST)) == expected


def test_resnet18_uses_cifar_stem_on_small_images(registry):
    # torchvision's ResNet-18 has 11,689,512 parameters (7x7 conv1 on 3 channels: 9,408;
    # fc 512*1000+1000 = 513,000). The CIFAR version swaps conv1 for a 3x3 conv
    # (3*64*9 = 1,728) and the fc for 512*10+10 = 5,130: 11,173,962.
    expected = 11_689_512 - 9_408 + 1_728 - 513_000 + 5_130
    model = build(registry, "resnet18", *CIFAR)
    assert num_parameters(model) == expected == 11_173_962
    assert isinstance(model.maxpool, nn.Identity)
    assert model.conv1.kernel_size == (3, 3) and model.conv1.stride == (1, 1)
    grey = build(registry, "resnet18", *MNIST)
    assert grey.conv1.in_channels == 1
    assert num_parameters(grey) == expected - 2 * 64 * 9


def test_resnet18_imagenet_stem_adapts_channels(registry):
    model = build(registry, "resnet18", (1, 64, 64), 5)
    assert model.conv1.kernel_size == (7, 7) and model.conv1.in_channels == 1
    assert isinstance(model.maxpool, nn.MaxPool2d)
    assert num_parameters(model) == 11_689_512 - 9_408 + 1 * 64 * 49 - 513_000 + 512 * 5 + 5
    forced = build(registry, "resnet18", *CIFAR, stem="imagenet")
    assert forced.conv1.kernel_size == (7, 7)


# --------------------------------------------------------------------- input checks


@pytest.mark.parametrize("name", IMAGE_ONLY_MODELS)
def test_image_models_reject_flat_inputs(registry, name):
    message = rf"model '{name}' needs image inputs \(C, H, W\).*\(20,\).*use mlp or logreg"
    with pytest.raises(ConfigError, match=message):
        build(registry, name, (20,), 2)


def test_image_models_reject_too_small_images(registry):
    with pytest.raises(ConfigError, match="at least 8x8"):
        build(registry, "vgg9", (3, 6, 6), 10)
    with pytest.raises(ConfigError, match="at least 4x4"):
        build(registry, "cnn_mnist", (1, 3, 28), 10)


@pytest.mark.parametrize("name", ALL_MODELS)
def test_bad_class_count_or_empty_dimension_is_a_config_error(registry, name):
    with pytest.raises(ConfigError, match="num_classes"):
        build(registry, name, (1, 28, 28), 0)
    with pytest.raises(ConfigError, match="input shape"):
        build(registry, name, (1, 0, 28), 10)


# ------------------------------------------------------------------------ batch norm


@pytest.mark.parametrize("name", ALL_MODELS)
def test_has_batch_norm_only_for_resnet18(registry, name):
    model = build(registry, name, *CIFAR)
    assert zoo.has_batch_norm(model) is (name == "resnet18")


# -------------------------------------------------------------- vectorised engine fit


@pytest.mark.parametrize("name", WITHOUT_BATCH_NORM)
def test_models_without_batch_norm_vmap_over_stacked_clients(registry, name):
    """The vectorised engine vmaps functional_call over stacked client parameters; that
    must equal running each client's model on its own."""
    # Prepare: two "clients" with different weights and different inputs.
    input_shape, num_classes = CIFAR
    model = build(registry, name, input_shape, num_classes)
    first = {key: value.detach().clone() for key, value in model.named_parameters()}
    second = {key: value + 0.01 * torch.ones_like(value) for key, value in first.items()}
    stacked = {key: torch.stack([first[key], second[key]]) for key in first}
    inputs, _ = random_batch(2 * 3, input_shape, num_classes)
    inputs = inputs.reshape(2, 3, *input_shape)

    # Execute
    forward = torch.vmap(lambda params, x: functional_call(model, params, (x,)))
    vectorised = forward(stacked, inputs)
    one_by_one = torch.stack(
        [functional_call(model, first, (inputs[0],)), functional_call(model, second, (inputs[1],))]
    )

    # Assert
    torch.testing.assert_close(vectorised, one_by_one, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- FLOPs


def test_flops_of_a_linear_model_by_hand():
    model = nn.Sequential(nn.Flatten(), nn.Linear(784, 10))
    assert flops_per_sample(model, (1, 28, 28)) == 2 * 784 * 10
    assert training_flops_per_sample(model, (1, 28, 28)) == 3 * 2 * 784 * 10


def test_flops_of_a_strided_grouped_convolution_by_hand():
    # 4x9x9 input, 3x3 kernel, stride 2, no padding: 4x4 output positions, 8 channels;
    # each output is a dot product over 4/2 = 2 input channels x 9 taps.
    model = nn.Conv2d(4, 8, kernel_size=3, stride=2, groups=2)
    assert flops_per_sample(model, (4, 9, 9)) == 2 * (8 * 4 * 4) * (2 * 9)


def test_flops_of_cnn_mnist_by_hand(registry):
    multiply_adds = (
        28 * 28 * 32 * (1 * 25)  # conv1, "same" padding: 627,200
        + 14 * 14 * 64 * (32 * 25)  # conv2: 10,035,200
        + 7 * 7 * 64 * 512  # fc1: 1,605,632
        + 512 * 10  # fc2: 5,120
    )
    flops = flops_per_sample(build(registry, "cnn_mnist", *MNIST), MNIST[0])
    assert flops == 2 * multiply_adds == 24_546_304


def test_training_flops_of_cnn_femnist_near_fedgsp_cost_model(registry):
    # FedGSP's cost model assumes 96M FLOPs per training sample for its FEMNIST CNN.
    multiply_adds = 28 * 28 * 32 * 25 + 14 * 14 * 64 * 32 * 25 + 3136 * 2048 + 2048 * 62
    flops = training_flops_per_sample(build(registry, "cnn_femnist", *FEMNIST), FEMNIST[0])
    assert flops == 3 * 2 * multiply_adds == 103_271_424
    assert abs(flops - 96e6) / 96e6 < 0.1


def test_flop_count_leaves_batch_norm_and_training_flags_untouched(registry):
    # Prepare
    model = build(registry, "resnet18", *CIFAR)
    model.train()
    model.layer1.eval()
    before = {key: value.clone() for key, value in model.state_dict().items()}

    # Execute
    flops = flops_per_sample(model, CIFAR[0])

    # Assert: ~0.56 G multiply-adds is the known cost of CIFAR ResNet-18.
    assert 0.55e9 < flops / 2 < 0.57e9
    assert model.training and not model.layer1.training and model.layer2.training
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0)


def test_model_num_bytes_counts_float_parameters_and_buffers(registry):
    assert model_num_bytes(build(registry, "mlp", *MNIST)) == 199_210 * 4
    # ResNet-18 also sends BatchNorm running mean and variance (not num_batches_tracked):
    # BatchNorm channels: stem 64, layer1 4*64, layer2 4*128 + 128 (downsample),
    # layer3 4*256 + 256, layer4 4*512 + 512 = 4,800, two float buffers each.
    batch_norm_channels = 64 + 4 * 64 + (4 * 128 + 128) + (4 * 256 + 256) + (4 * 512 + 512)
    expected = (11_173_962 + 2 * batch_norm_channels) * 4
    assert model_num_bytes(build(registry, "resnet18", *CIFAR)) == expected
