"""A plain Flower FedAvg app (Message API), the baseline of ``benchmarks/bench_vs_flower.py``.

It uses no fedplug training code: ``task`` holds the data cache, the model builder and a
plain torch training loop; ``client_app`` and ``server_app`` are the ``ClientApp`` and
``ServerApp`` of Flower's own PyTorch quickstart shape, with
``flwr.serverapp.strategy.FedAvg``. The model comes from :mod:`fedplug.models.zoo` so both
frameworks train the very same architecture from the very same initial weights.

The data cache lives in :mod:`flower_plain.task`, an imported module, and not in the
globals of an app script: Ray re-executes a script's globals for every message, which
reloads the data each time (measured about 10x slower).
"""
