"""A fedplug experiment on a real Flower deployment on loopback: one ``flower-superlink``,
two ``flower-supernode`` processes and ``flwr run`` of ``examples/flower_app``, set up as
the README's recipe says (its Flower-home lines are taken from README.md and run on a
fresh Flower home).

Every process is started here and stopped here by its PID (with the SuperExec helpers
Flower starts under them). Runtime dependency installation and telemetry are off. One
deployment serves the module's tests.
"""

from __future__ import annotations

import copy
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
import yaml
from conformance_checks import assert_same_state, assert_same_summary
from conftest import SMALL_EXPERIMENT

from fedplug.config import validate_experiment
from fedplug.experiment import run_experiment
from fedplug.run.vectors import model_to_vector

pytestmark = pytest.mark.slow

REPOSITORY = Path(__file__).resolve().parents[1]
APP_DIR = REPOSITORY / "examples" / "flower_app"
BIN = Path(sys.executable).parent
NUM_NODES = 2
README = REPOSITORY / "README.md"
RECIPE_PORT = "9093"
"""The SuperLink port of the README's recipe, replaced by a free one here."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def wait_for_port(port: int, process: subprocess.Popen[bytes], seconds: float, log: Path) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args[0]} exited early:\n{log.read_text()[-3000:]}")
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.5)
    raise RuntimeError(
        f"nothing listens on port {port} after {seconds}s:\n{log.read_text()[-3000:]}"
    )


def stop(processes: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM each process we started and every process it started, by PID; SIGKILL
    what is still alive after 20 seconds."""
    targets: list[psutil.Process] = []
    for process in processes:
        try:
            parent = psutil.Process(process.pid)
            targets += [*parent.children(recursive=True), parent]
        except psutil.NoSuchProcess:
            continue
    for target in targets:
        try:
            os.kill(target.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    _, alive = psutil.wait_procs(targets, timeout=20)
    for target in alive:
        try:
            os.kill(target.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for process in processes:
        process.wait(timeout=10)


def readme_connection() -> tuple[str, str]:
    """``(name, TOML)`` of the SuperLink connection the README's recipe appends to
    ``$FLWR_HOME/config.toml``."""
    recipe = re.search(
        r'cat >> "\$\{FLWR_HOME:-\$HOME/\.flwr\}/config\.toml" <<\'EOF\'\n(.*?)\nEOF\n',
        README.read_text(),
        re.DOTALL,
    )
    assert recipe is not None, "README.md's Flower recipe has no `cat >> .../config.toml` block"
    name = re.search(r"^\[superlink\.([\w-]+)\]", recipe[1], re.MULTILINE)
    assert name is not None, recipe[1]
    return name[1], recipe[1] + "\n"


def fresh_flower_home(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A fresh Flower home in ``tmp_path`` (``flwr config list`` writes its config.toml)
    and the environment that uses it, with telemetry, the update check, runtime
    dependency installation and fedplug's plugin autoload off."""
    home = tmp_path / "flwr-home"  # does not exist yet: a fresh Flower home
    environment = {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "FLWR_HOME": str(home),
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FEDPLUG_DISABLE_PLUGIN_AUTOLOAD": "1",
    }
    subprocess.run(
        [str(BIN / "flwr"), "config", "list"],
        check=True,
        capture_output=True,
        env=environment,
        cwd=tmp_path,
        timeout=120,
    )
    return home, environment


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A SuperLink and two SuperNodes on free loopback ports; a fresh Flower home set up
    with the README's lines (``flwr config list``, then its ``cat >>`` block)."""
    tmp_path = tmp_path_factory.mktemp("deployment")
    link_port = free_port()
    home, environment = fresh_flower_home(tmp_path)
    connection, block = readme_connection()
    with (home / "config.toml").open("a") as config:
        config.write(block.replace(RECIPE_PORT, str(link_port)))
    processes: list[subprocess.Popen[bytes]] = []
    logs = {name: tmp_path / f"{name}.log" for name in ("superlink", "node0", "node1")}
    try:
        link_log = logs["superlink"].open("wb")
        processes.append(
            subprocess.Popen(
                [
                    str(BIN / "flower-superlink"),
                    "--insecure",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(link_port),
                    "--disable-runtime-dependency-installation",
                ],
                stdout=link_log,
                stderr=subprocess.STDOUT,
                env=environment,
                cwd=tmp_path,
            )
        )
        wait_for_port(link_port, processes[0], 120, logs["superlink"])
        for partition in range(NUM_NODES):
            node_log = logs[f"node{partition}"].open("wb")
            processes.append(
                subprocess.Popen(
                    [
                        str(BIN / "flower-supernode"),
                        "--insecure",
                        "--superlink",
                        f"127.0.0.1:{link_port}",
                        "--port",
                        str(free_port()),
                        "--node-config",
                        f"partition-id={partition} num-partitions={NUM_NODES}",
                    ],
                    stdout=node_log,
                    stderr=subprocess.STDOUT,
                    env=environment,
                    cwd=tmp_path,
                )
            )
        yield {
            "environment": environment,
            "logs": logs,
            "processes": processes,
            "connection": connection,
            "cwd": tmp_path,
        }
    finally:
        stop(processes)


def flwr_run(deployment: dict[str, Any], run_config: str) -> subprocess.CompletedProcess[bytes]:
    """``flwr run examples/flower_app <connection> --stream --run-config ...``."""
    return subprocess.run(
        [
            str(BIN / "flwr"),
            "run",
            str(APP_DIR),
            deployment["connection"],
            "--stream",
            "--run-config",
            run_config,
        ],
        capture_output=True,
        check=False,
        env=deployment["environment"],
        cwd=deployment["cwd"],
        timeout=540,
    )


def run_status(deployment: dict[str, Any], output: str) -> str:
    """The status ``flwr ls`` gives the run ``flwr run`` started (its output names it)."""
    started = re.search(r"Successfully started run (\d+)", output)
    assert started is not None, output[-3000:]
    listed = subprocess.run(
        [
            str(BIN / "flwr"),
            "ls",
            deployment["connection"],
            "--run-id",
            started[1],
            "--format",
            "json",
        ],
        capture_output=True,
        check=True,
        env=deployment["environment"],
        cwd=deployment["cwd"],
        timeout=120,
    )
    (run,) = json.loads(listed.stdout)["runs"]
    return str(run["status"])


def test_too_few_nodes_fail_in_one_line_and_mark_the_run_failed(
    deployment: dict[str, Any], tmp_path: Path
) -> None:
    # Prepare: an experiment of 3 clients on the 2 SuperNodes, a 3-second wait.
    data = copy.deepcopy(SMALL_EXPERIMENT)
    data["data"]["num_clients"] = 3
    config_path = tmp_path / "experiment.yaml"
    config_path.write_text(yaml.safe_dump(data))
    run_config = (
        f"fedplug-config='{config_path}' fedplug-out='{tmp_path / 'run'}' "
        "fedplug-node-wait-seconds=3.0"
    )
    # Execute
    completed = flwr_run(deployment, run_config)
    # Assert: one line saying what to fix, no traceback, the run marked failed.
    output = completed.stdout.decode() + completed.stderr.decode()
    lines = [line for line in output.splitlines() if "fedplug stopped the run" in line]
    assert len(lines) == 1, output[-3000:]
    assert "only 2 of the 3 nodes" in lines[0] and "within 3s" in lines[0], lines[0]
    assert "Traceback" not in output, output[-3000:]
    assert run_status(deployment, output) == "finished:failed"
    assert not (tmp_path / "run" / "metrics.json").exists()


DEPLOYED = {
    "scaffold": {"rounds": 2, "client_fraction": 1.0, "aggregator": {"name": "scaffold"}},
    "dropout": {"rounds": 3, "client_fraction": 1.0, "faults": {"dropout": {"probability": 0.5}}},
    "setup_phase": {
        "rounds": 2,
        "client_fraction": 1.0,
        "loss_transform": {
            "name": "feddisk", "made_hidden": 8, "made_max_epochs": 10, "made_batch_size": 32,
            "classifier_epochs": 20, "classifier_lr": 0.5, "made_lr": 0.05, "global_rounds": 3,
        },
    },
}
"""The ``flwr run`` rows: SCAFFOLD (c_k must persist in each SuperNode's ``context.state``
from round to round), injected dropout (rounds where a node sits out), and a setup phase
(FedDisk's phase 1 over ``train.feddisk`` messages to the SuperNodes, its weights kept
there, its report sent to the server)."""


@pytest.mark.parametrize("row", sorted(DEPLOYED))
def test_flwr_run_on_superlink_and_two_supernodes(
    deployment: dict[str, Any], tmp_path: Path, row: str
) -> None:
    # Prepare: the row's experiment over the two nodes.
    data = copy.deepcopy(SMALL_EXPERIMENT)
    data["data"]["num_clients"] = NUM_NODES
    data["train"].update(DEPLOYED[row])
    config_path = tmp_path / "experiment.yaml"
    config_path.write_text(yaml.safe_dump(data))
    out = tmp_path / "run"
    run_config = (
        f"fedplug-config='{config_path}' fedplug-out='{out}'"
    )
    # Execute
    completed = flwr_run(deployment, run_config)
    # Assert: the ServerApp wrote the run's metrics and model, equal to the simulator's.
    logs = "\n".join(
        f"--- {name}\n{path.read_text()[-2000:]}" for name, path in deployment["logs"].items()
    )
    assert completed.returncode == 0, completed.stdout.decode()[-3000:] + logs
    output = completed.stdout.decode()
    rounds = data["train"]["rounds"]
    progress = re.findall(r"fedplug round (\d+): ", output)
    assert progress == [str(number) for number in range(1, rounds + 1)], output[-3000:] + logs
    assert run_status(deployment, output) == "finished:completed"
    assert (out / "metrics.json").exists(), completed.stdout.decode()[-3000:] + logs
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["derived"]["engine"] == "flower"
    # The whole summary but the wall times, the final model and the checkpoint's server
    # state equal the simulator's.
    simulated, simulator = run_experiment(validate_experiment(data), tmp_path / "simulator")
    assert_same_summary(metrics, simulated.summary())
    model = copy.deepcopy(simulator.model)
    model.load_state_dict(torch.load(out / "model.pt"))
    torch.testing.assert_close(model_to_vector(model), simulator.final_vector, rtol=0, atol=1e-5)
    ours = torch.load(out / "checkpoint.pt", weights_only=True)
    theirs = torch.load(tmp_path / "simulator" / "checkpoint.pt", weights_only=True)
    for key in ("global_vector", "aggregator", "grouper", "setup_cost"):
        assert_same_state(ours[key], theirs[key], key)
    if row == "dropout":
        participants = [record["participants"] for record in metrics["history"]]
        assert min(participants) < NUM_NODES, participants

