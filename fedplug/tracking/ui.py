"""Links into MLflow's UI that open on the runs, not on the GenAI pages.

MLflow 3.17's UI shows every experiment in one of two modes, switched at the top of its
side bar ("GenAI" / "Model training") and remembered by the browser; a new browser starts in
"GenAI", whose experiment page is the traces overview. A link carrying
``?workflowType=machine_learning`` opens in "Model training", an experiment's link on its
runs table (``mlflow/server/js``: ``WorkflowType``, read from the URL before the stored
choice).
"""

from __future__ import annotations

DEFAULT_UI = "http://127.0.0.1:5000"
"""Where ``make ui`` serves the UI (``UI_PORT`` in the Makefile)."""
MODEL_TRAINING = "workflowType=machine_learning"
"""The query that opens a page in the UI's "Model training" mode."""


def experiment_url(base: str, experiment_id: str) -> str:
    """The runs table of experiment ``experiment_id`` in the UI at ``base``."""
    return f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs?{MODEL_TRAINING}"


def run_url(base: str, experiment_id: str, run_id: str) -> str:
    """The page of run ``run_id`` (params, metrics, model) in the UI at ``base``."""
    return f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}?{MODEL_TRAINING}"
