"""The message layout the fedplug Flower server and clients agree on, and its codecs.

A model travels as every Flower PyTorch app sends one (an ``ArrayRecord`` of its
``state_dict()`` under ``"arrays"``); the server turns it back into fedplug's flat vector
by entry name, checking every name and shape.
Layout: docs/flower.md, 'Message layout'; design: 'Design notes: records'.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord
from torch import Tensor, nn

from fedplug.errors import ConfigError

from .decoding import decode_array, parse_integer, parse_number

MODEL_KEY = "arrays"
CONFIG_KEY = "config"
METRICS_KEY = "metrics"
PAYLOAD_KEY = "fedplug.payload"
EXTRAS_KEY = "fedplug.extras"
LOSS_STATE_KEY = "fedplug.loss-state"
LOSS_INFO_KEY = "fedplug.loss-info"

ROUND = "server-round"
"""Flower's own 1-based round key, which stock strategies also send."""
CLIENT_ID = "fedplug.client-id"
NUM_CLIENTS = "fedplug.num-clients"
NUM_CLASSES = "fedplug.num-classes"
CHAIN_POSITION = "fedplug.chain-position"
NUM_EXAMPLES = "num-examples"
"""Flower's weighting key, so stock strategies can aggregate fedplug replies."""
NUM_STEPS = "fedplug.num-steps"
REPLY_METRICS = "fedplug.reply-metrics"
"""In a train message's config: the names of the metrics the server's components read
from every reply (``ClientNeeds.reply_metrics``, e.g. ``["train_loss"]``); absent when
none."""
CLIENT_TIMEOUT = "fedplug.client-timeout-seconds"
"""Train-message config key: ``train.failures.client_timeout_seconds``, after which a
:class:`~.trainer.FedplugTrainer` interrupts its training and replies with the failure."""
SECONDS = "fedplug.seconds"
CLASS_COUNTS = "fedplug.class-counts"
PARTITION_ID = "fedplug.partition-id"
NUM_PARTITIONS = "fedplug.num-partitions"
ACCURACY = "accuracy"
LOSS = "loss"


# ------------------------------------------------------------------------- the model


def vector_layout(model: nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    """``(state_dict name, shape)`` of every entry of the flat vector, in vector order
    (parameters, then floating-point buffers; see :mod:`fedplug.run.vectors`)."""
    layout = [(name, tuple(parameter.shape)) for name, parameter in model.named_parameters()]
    layout += [
        (name, tuple(buffer.shape))
        for name, buffer in model.named_buffers()
        if buffer.is_floating_point()
    ]
    return layout


def model_record(model: nn.Module) -> ArrayRecord:
    """The model's whole ``state_dict()`` (integer buffers included, so that a user's
    ``load_state_dict`` with ``strict=True`` works)."""
    return ArrayRecord({name: tensor.detach().cpu() for name, tensor in model.state_dict().items()})


def record_to_vector(record: ArrayRecord, layout: list[tuple[str, tuple[int, ...]]]) -> Tensor:
    """The flat float32 vector held in ``record``, by entry name.

    Entries of ``record`` outside ``layout`` (integer buffers) are not decoded.

    Raises:
        ValueError: an entry of ``layout`` is missing from ``record``, or is not a
            ``numpy.ndarray`` of a real dtype and that shape
            (:func:`.decoding.decode_array`); the message says which (it becomes the
            logged reason of a rejection).
    """
    pieces = []
    for name, shape in layout:
        if name not in record:
            raise ValueError(f"returned no array {name!r}")
        # Checked before it is converted: stype, a real dtype, this shape, the byte count.
        values = decode_array(record[name], name, shape=shape)
        pieces.append(torch.from_numpy(np.array(values, dtype=np.float32).reshape(-1)))
    return torch.cat(pieces) if pieces else torch.zeros(0)


# ------------------------------------------------------------------------ tensor dicts


def tensors_to_record(tensors: Mapping[str, Tensor]) -> ArrayRecord:
    """A dict of tensors (payload, extras, client state) as an ArrayRecord."""
    return ArrayRecord(
        {
            key: Array(np.ascontiguousarray(value.detach().cpu().numpy()))
            for key, value in tensors.items()
        }
    )


def record_to_tensors(
    record: ArrayRecord | None, device: torch.device | str = "cpu"
) -> dict[str, Tensor]:
    """The inverse of :func:`tensors_to_record` (an empty dict for ``None``)."""
    if record is None:
        return {}
    return {
        key: torch.from_numpy(np.array(array.numpy())).to(device) for key, array in record.items()
    }


# ---------------------------------------------------------------- loss-transform state


def encode_loss_state(
    state: Mapping[str, Any], transform_name: str
) -> tuple[ArrayRecord, ConfigRecord]:
    """Split a loss transform's ``state_dict()`` into arrays and a JSON description.

    Arrays and tensors go to the ArrayRecord; ``None``, numbers, strings and booleans to
    the JSON. The JSON also remembers which entries were tensors, so that
    :func:`decode_loss_state` restores the same types.

    Raises:
        ConfigError: a value of another type (a list of per-client tensors, say): such a
            transform keeps state the server cannot send to one client.
    """
    arrays: dict[str, Array] = {}
    info: dict[str, Any] = {"tensors": [], "numpy": [], "values": {}}
    for key, value in state.items():
        if isinstance(value, Tensor):
            arrays[key] = Array(np.ascontiguousarray(value.detach().cpu().numpy()))
            info["tensors"].append(key)
        elif isinstance(value, np.ndarray):
            arrays[key] = Array(np.ascontiguousarray(value))
            info["numpy"].append(key)
        elif value is None or isinstance(value, (bool, int, float, str)):
            info["values"][key] = value
        else:
            raise ConfigError(
                f"loss transform {transform_name!r} keeps state {key!r} of type "
                f"{type(value).__name__}, which the Flower adapter cannot send to a client "
                "(it sends arrays, numbers and strings); run it with the built-in simulator"
            )
    return ArrayRecord(arrays), ConfigRecord({"json": json.dumps(info)})


def decode_loss_state(
    arrays: ArrayRecord | None, info: ConfigRecord | None
) -> dict[str, Any] | None:
    """The ``state_dict()`` :func:`encode_loss_state` sent, or ``None`` if none was sent."""
    if info is None:
        return None
    description = json.loads(str(info["json"]))
    state: dict[str, Any] = dict(description["values"])
    arrays = arrays if arrays is not None else ArrayRecord()
    for key in description["numpy"]:
        state[key] = np.array(arrays[key].numpy())
    for key in description["tensors"]:
        state[key] = torch.from_numpy(np.array(arrays[key].numpy()))
    return state


# ------------------------------------------------------------------- record values


def number(record: Mapping[str, Any], key: str, default: float | None = None) -> float:
    """The number under ``key`` (``default`` when absent).

    Raises:
        ValueError: absent without a default, or not a number (a list, a string): a
            malformed message, which the server rejects with this reason.
    """
    value = record.get(key, default)
    if value is None:
        raise ValueError(f"sent no {key!r}")
    # One error type for every malformed value, so callers reject a reply in one place.
    return parse_number(value, key)


def integer(
    record: Mapping[str, Any],
    key: str,
    default: int | None = None,
    *,
    low: int = -(2**63),
    high: int = 2**63 - 1,
) -> int:
    """The integer under ``key`` (``default`` when absent), in ``[low, high]`` (default:
    the int64 range).

    Raises:
        ValueError: absent without a default, or not a finite, integral number in range
            (``inf`` or ``2.5``): a malformed message, rejected with this reason.
    """
    value = record.get(key, default)
    if value is None:
        raise ValueError(f"sent no {key!r}")
    return parse_integer(value, key, low, high)
