"""FedML's two extension points, filled with fedplug: a ``ClientTrainer``
(:class:`FedplugClientTrainer`) and a ``ServerAggregator`` (:class:`FedplugServerAggregator`).

They run in FedML's cross-silo horizontal flow over MPI, the one flow of FedML 0.9.6 that
calls ``ServerAggregator.aggregate``.
Design: docs/fedml.md, 'Which FedML flow, and why' and 'Design notes: fedml_components'.
"""

from __future__ import annotations

from typing import Any

from fedml.core import ClientTrainer, ServerAggregator
from torch import nn

from fedplug.errors import TrainingError

from .coordinator import Coordinator
from .worker import Worker


class FedplugClientTrainer(ClientTrainer):
    """A FedML ``ClientTrainer`` that runs a fedplug :class:`~.worker.Worker`.

    Args:
        model: the model FedML moves to the device (the worker's model).
        args: FedML's arguments.
        worker: the worker of this rank.
    """

    def __init__(self, model: nn.Module, args: Any, worker: Worker) -> None:
        super().__init__(model, args)
        self.worker = worker

    def get_model_params(self) -> dict[str, Any]:
        """The reply to the last step (a ``dict``, see :func:`.protocol.reply`)."""
        if self.worker.last_reply is None:
            raise TrainingError(
                f"worker {self.worker.slot}: FedML asked for a reply before training"
            )
        return self.worker.last_reply

    def set_model_params(self, model_parameters: Any) -> None:
        """Receive this worker's :class:`~.protocol.WorkerInstructions`."""
        self.worker.receive(model_parameters)

    def train(self, train_data: Any, device: Any, args: Any) -> None:
        """Train the step's tasks. ``train_data`` is FedML's entry of
        ``train_data_local_dict`` for this worker: the ids of the clients it owns, checked
        against the worker's; ``args.round_idx`` is FedML's round, checked against the
        server's step."""
        if list(train_data) != self.worker.clients:
            raise TrainingError(
                f"worker {self.worker.slot}: FedML handed it the data of clients {list(train_data)}, "
                f"but it owns clients {self.worker.clients}"
            )
        self.worker.train(getattr(args, "round_idx", None))

    def test(self, test_data: Any, device: Any, args: Any) -> None:
        """Clients do not evaluate: the server evaluates the global model every round."""


class FedplugServerAggregator(ServerAggregator):
    """A FedML ``ServerAggregator`` that runs a fedplug :class:`~.coordinator.Coordinator`.

    Args:
        model: the global model (the coordinator's).
        args: FedML's arguments.
        coordinator: the server state.
    """

    def __init__(self, model: nn.Module, args: Any, coordinator: Coordinator) -> None:
        super().__init__(model, args)
        self.coordinator = coordinator

    def get_model_params(self) -> dict[int, Any]:
        """The current step's instructions, one per worker slot."""
        return self.coordinator.message

    def set_model_params(self, model_parameters: Any) -> None:
        """FedML stores what :meth:`aggregate` returned; the coordinator already holds it."""
        if model_parameters is not self.coordinator.message:
            raise TrainingError(
                "FedML set a global model that the fedplug coordinator did not produce"
            )

    def aggregate(self, raw_client_model_or_grad_list: list[tuple[float, Any]]) -> dict[int, Any]:
        """Feed the workers' replies to the coordinator; return the next step's
        instructions (after the last round, instructions with no tasks)."""
        replies = [message for _, message in raw_client_model_or_grad_list]
        return self.coordinator.handle_replies(replies)

    def test(self, test_data: Any, device: Any, args: Any) -> dict[str, float] | None:
        """The last finished round's metrics (the coordinator evaluates every round on
        the global test set and every client's local test split, as the simulator does)."""
        history = self.coordinator.result.history
        if not history:
            return None
        record = history[-1]
        return {"round": record.round, "accuracy": record.accuracy, "loss": record.loss}
