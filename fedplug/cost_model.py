"""Time and traffic of one federated round, after FedGSP's cost model.

Paper: Shenglai Zeng, Zonghang Li, Hongfang Yu, Yihong He, Zenglin Xu, Dusit Niyato and
Han Yu, "Heterogeneous Federated Learning via Grouped Sequential-to-Parallel Training"
(FedGSP), DASFAA 2022, arXiv:2201.12976, section 4.1, eq. 15-17. Defaults are the
paper's; stragglers (:mod:`fedplug.faults`) slow a client by their speed factor.
Design: docs/round.md, 'Design notes: cost model'.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fedplug.errors import ConfigError

FLOAT32_BYTES = 4


@dataclass(frozen=True)
class LinkAndDevice:
    """Compute throughput and link rates of the cost model.

    Attributes:
        device_flops: client FLOP/s (default 567e9, the paper's Snapdragon 835 GPU).
        uplink_bps: client -> server bits per second, the paper's R_in (default 567e6).
        downlink_bps: server -> client bits per second, the paper's R_out (default 567e6).
        server_flops: server FLOP/s for aggregation (default 567e9; the paper uses the
            device figure for both).
    """

    device_flops: float = 567e9
    uplink_bps: float = 567e6
    downlink_bps: float = 567e6
    server_flops: float = 567e9

    def __post_init__(self) -> None:
        for name in ("device_flops", "uplink_bps", "downlink_bps", "server_flops"):
            value = getattr(self, name)
            if not value > 0:
                raise ConfigError(f"cost model: {name} must be positive, got {value}")


@dataclass(frozen=True)
class RoundCost:
    """Estimated cost of one round.

    Attributes:
        compute_seconds: slowest chain's training time plus server aggregation.
        communication_seconds: all transfers through the server link, one after another.
        bytes_up: client -> server bytes (hand-offs included).
        bytes_down: server -> client bytes (hand-offs included).
        handoffs: model hand-offs along chains (sum of chain length - 1).
    """

    compute_seconds: float
    communication_seconds: float
    bytes_up: int
    bytes_down: int
    handoffs: int

    @property
    def total_seconds(self) -> float:
        return self.compute_seconds + self.communication_seconds


def training_seconds(
    chains: Sequence[Sequence[int]],
    samples_per_client: np.ndarray,
    local_epochs: int,
    train_flops_per_sample: int,
    link: LinkAndDevice,
    speed_factors: np.ndarray | None = None,
    timeout_seconds: float | None = None,
) -> float:
    """Local training time of the round: the slowest chain, its members in sequence.

    Args:
        chains: client ids of each chain.
        samples_per_client: training samples of every client, indexed by client id.
        local_epochs: epochs each client trains (the paper's e).
        train_flops_per_sample: forward + backward FLOPs of one sample.
        link: device throughput.
        speed_factors: how many times slower than ``link.device_flops`` each client
            trains, indexed by client id (default: all 1; ``train.faults.stragglers``).
        timeout_seconds: the server stops waiting for a chain with a straggler (a
            member whose speed factor exceeds 1) after this long, so such a chain counts
            for no more (default None: it waits for every chain).
    """
    if not chains:
        return 0.0

    def seconds(chain: Sequence[int]) -> float:
        time = chain_training_seconds(chain, samples_per_client, local_epochs, train_flops_per_sample, link, speed_factors)
        if timeout_seconds is not None and speed_factors is not None and (np.asarray(speed_factors)[list(chain)] > 1).any():
            return min(time, timeout_seconds)
        return time

    return max(seconds(chain) for chain in chains)


def chain_training_seconds(
    chain: Sequence[int],
    samples_per_client: np.ndarray,
    local_epochs: int,
    train_flops_per_sample: int,
    link: LinkAndDevice,
    speed_factors: np.ndarray | None = None,
) -> float:
    """Training time of one chain: its members one after another, each
    ``samples x local_epochs x train_flops_per_sample / device_flops``, times its speed
    factor (default 1)."""
    members = list(chain)
    # Index, then convert: the chain's members only, not all K clients.
    samples = np.asarray(samples_per_client)[members].astype(np.float64)
    if speed_factors is not None:
        samples = samples * np.asarray(speed_factors)[members].astype(np.float64)
    return float(samples.sum()) * local_epochs * train_flops_per_sample / link.device_flops


def aggregation_seconds(num_models: int, num_parameters: int, link: LinkAndDevice) -> float:
    """Server time to sum ``num_models`` models: ``(num_models - 1) x P`` FLOPs."""
    return max(num_models - 1, 0) * num_parameters / link.server_flops


def round_cost(
    chains: Sequence[Sequence[int]],
    samples_per_client: np.ndarray,
    local_epochs: int,
    train_flops_per_sample: int,
    model_bytes: int,
    link: LinkAndDevice = LinkAndDevice(),
    num_parameters: int | None = None,
    speed_factors: np.ndarray | None = None,
    timeout_seconds: float | None = None,
) -> RoundCost:
    """Time and traffic of one round of ``chains`` (paper eq. 15-17).

    Args:
        chains: client ids of each chain that trains this round; a client training
            alone is a chain of one.
        samples_per_client: training samples of every client, indexed by client id.
        local_epochs: epochs each client trains.
        train_flops_per_sample: forward + backward FLOPs of one sample (from
            ``fedplug.models.flops.training_flops_per_sample``).
        model_bytes: size of one model message.
        link: throughputs and rates (default: the paper's, see :class:`LinkAndDevice`).
        num_parameters: parameters summed per model in aggregation (default
            ``model_bytes // 4``, float32 parameters).
        speed_factors, timeout_seconds: see :func:`training_seconds` (default: every
            client at the device's speed, no timeout).
    """
    if num_parameters is None:
        num_parameters = model_bytes // FLOAT32_BYTES
    participants = sum(len(chain) for chain in chains)
    bytes_each_way = participants * model_bytes
    compute = training_seconds(
        chains, samples_per_client, local_epochs, train_flops_per_sample, link, speed_factors, timeout_seconds
    ) + aggregation_seconds(len(chains), num_parameters, link)
    communication = 8 * bytes_each_way / link.downlink_bps + 8 * bytes_each_way / link.uplink_bps
    return RoundCost(
        compute_seconds=compute,
        communication_seconds=communication,
        bytes_up=bytes_each_way,
        bytes_down=bytes_each_way,
        handoffs=sum(max(len(chain) - 1, 0) for chain in chains),
    )
