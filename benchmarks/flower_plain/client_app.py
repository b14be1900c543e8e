"""The ClientApp: load the global model, train one local epoch, send the model back."""

from __future__ import annotations

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from flower_plain import task

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Train on this node's partition with the server's ``lr``, ``batch-size`` and ``model``."""
    config = msg.content["config"]
    partition_id = int(context.node_config["partition-id"])
    model = task.cached_model(str(config["model"]))
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    x, y = task.client_data(partition_id)
    seed = int(config["server-round"]) * 100_003 + partition_id
    steps = task.train_epoch(model, x, y, int(config["batch-size"]), float(config["lr"]), seed)
    content = RecordDict(
        {
            "arrays": ArrayRecord(model.state_dict()),
            "metrics": MetricRecord({"num-examples": len(y), "num-steps": steps}),
        }
    )
    return Message(content=content, reply_to=msg)
