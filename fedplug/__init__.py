"""fedplug: federated learning on non-IID data, one pluggy plugin per paper."""

__version__ = "0.1.0"
