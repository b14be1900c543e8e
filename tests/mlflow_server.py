"""A real ``mlflow server`` on 127.0.0.1 for one test: started inside the test, stopped by
its own PID (process group), its store and artifacts in the test's folder.

Shared by the tracking tests of every runtime (the main environment and ``.venv-fedml``,
which both have MLflow). Use the context manager, or the fixture in a test module::

    from mlflow_server import mlflow_server  # noqa: F401  (a pytest fixture)

:func:`running_make_ui` starts the UI server exactly as ``make ui`` does, on another
project's store (tests/test_mlflow_ui.py).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

QUIET_ENV = {
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DVC_NO_ANALYTICS": "1",
    "DO_NOT_TRACK": "1",
    "NO_PROXY": "127.0.0.1,localhost",
    "no_proxy": "127.0.0.1,localhost",
    # No job runner (GenAI scoring jobs, unused here), as `make ui`: the server answers
    # in about half the time.
    "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
}
START_SECONDS = 180
REPOSITORY = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _healthy(base: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=1) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def server_command(port: int, folder: Path) -> list[str]:
    """``mlflow server`` (this interpreter's) on ``127.0.0.1:port``, one worker, with its
    sqlite store and artifacts in ``folder``."""
    return [
        str(Path(sys.executable).parent / "mlflow"),
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--backend-store-uri",
        f"sqlite:///{folder}/server.db",
        "--artifacts-destination",
        str(folder / "server-artifacts"),
        "--workers",
        "1",
    ]


@contextmanager
def serving(command: list[str], port: int, log_path: Path, what: str, cwd: Path | None = None) -> Iterator[str]:
    """Run ``command`` (a server on ``127.0.0.1:port``) in its own process group, its output
    to ``log_path``; yield its base URL once ``/health`` answers; stop the group by the
    child's PID (``mlflow server`` starts uvicorn workers, ``make ui`` starts the server:
    this stops exactly what the test started)."""
    with open(log_path, "wb") as log:
        server = subprocess.Popen(
            command,
            cwd=cwd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **QUIET_ENV},
            start_new_session=True,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_SECONDS
        while not _healthy(base):
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not start:\n" + log_path.read_text()[-3000:])
            time.sleep(0.5)
        yield base
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=10)


@contextmanager
def running_mlflow_server(folder: Path) -> Iterator[str]:
    """Start ``mlflow server`` (this interpreter's) on a free loopback port with a sqlite
    store and an artifact folder in ``folder``; yield its base URL; stop it."""
    port = free_port()
    with serving(server_command(port, folder), port, folder / "server.log", "mlflow server") as base:
        yield base


@pytest.fixture()
def mlflow_server(tmp_path: Path) -> Iterator[str]:
    """The base URL of a fresh ``mlflow server`` on 127.0.0.1 (see the module docstring)."""
    folder = tmp_path / "mlflow-server"
    folder.mkdir()
    with running_mlflow_server(folder) as base:
        yield base


@contextmanager
def running_make_ui(project: Path, log_path: Path) -> Iterator[str]:
    """Run ``make ui`` (its recipe as is; ``-o install``: the environment is not rebuilt)
    with ``UI_PROJECT=project`` and a free ``UI_PORT``; yield the base URL once it answers;
    stop make and the server it started (their process group, by make's PID). What make
    prints goes to ``log_path``."""
    port = free_port()
    command = ["make", "--no-print-directory", "-o", "install", "ui", f"UI_PORT={port}", f"UI_PROJECT={project}"]
    with serving(command, port, log_path, "make ui (the MLflow UI)", cwd=REPOSITORY) as base:
        yield base
