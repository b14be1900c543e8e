"""Framework bindings, installed as ``fedplug.adapters`` (Flower, FedML)."""
