"""Errors fedplug raises for things a user can fix.

The CLI prints these as one clear message and exits non-zero, with no traceback: each
says what is wrong and what to do about it.
"""


class FedplugError(Exception):
    """Base of every error caused by input a user can fix."""


class ConfigError(FedplugError):
    """The experiment config (params.yaml or --set overrides) is invalid."""


class PluginError(FedplugError):
    """A plugin registered something invalid (duplicate name, wrong type)."""


class DataError(FedplugError):
    """A dataset is missing or corrupt, or a partition is impossible for it."""


class TrainingError(FedplugError):
    """Training cannot go on (the global model diverged, too many clients failed)."""


class TrackingError(FedplugError):
    """The experiment tracker (MLflow) cannot be reached or used."""


class OutputError(FedplugError):
    """An output file cannot be written (the disk is full); the previous version is kept."""
