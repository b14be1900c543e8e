"""The ServerApp: FedAvg over ``fraction_train`` of the nodes, central evaluation each round.

The driver sets :data:`SETTINGS` before it starts the simulation (the ServerApp runs in a
thread of the driver's process) and reads :data:`RESULTS` afterwards.
"""

from __future__ import annotations

from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from flower_plain import task

SETTINGS: dict[str, Any] = {
    "model": "mlp",
    "rounds": 20,
    "fraction": 0.1,
    "num_nodes": 100,
    "batch_size": 10,
    "lr": 0.05,
}
"""model, rounds, fraction (of the nodes trained per round), num_nodes, batch_size, lr."""

RESULTS: dict[str, Any] = {}
"""After a run: ``accuracy`` and ``loss`` per round (central test set)."""

app = ServerApp()


def central_evaluation(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
    """Accuracy and loss of the global model on the test set (after every round, not before
    the first: fedplug does not evaluate the initial model either)."""
    if server_round == 0:
        return None
    model = task.cached_model(SETTINGS["model"])
    model.load_state_dict(arrays.to_torch_state_dict())
    accuracy, loss = task.evaluate(model, *task.test_data())
    RESULTS.setdefault("accuracy", []).append(accuracy)
    RESULTS.setdefault("loss", []).append(loss)
    return MetricRecord({"accuracy": accuracy, "loss": loss})


@app.main()
def main(grid: Grid, context: Context) -> None:
    RESULTS.clear()
    initial = task.build_model(SETTINGS["model"], seed=0)
    strategy = FedAvg(
        fraction_train=SETTINGS["fraction"],
        fraction_evaluate=0.0,
        min_train_nodes=1,
        min_available_nodes=SETTINGS["num_nodes"],
    )
    strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(initial.state_dict()),
        num_rounds=SETTINGS["rounds"],
        train_config=ConfigRecord(
            {
                "lr": float(SETTINGS["lr"]),
                "batch-size": int(SETTINGS["batch_size"]),
                "model": SETTINGS["model"],
            }
        ),
        evaluate_fn=central_evaluation,
    )
