"""Flower's PyTorch quickstart (tests/flower_quickstart/, its own file layout) with each
fedplug algorithm as the smallest edit of it (tests/flower_quickstart_variants.py),
run with ``flwr run <app> <connection> --stream`` on a local simulation SuperLink of 10
SuperNodes, as a Flower user runs it.

The SuperLink is started here with the flags ``flwr``'s own ``:local:`` connection uses
(simulation, subprocess isolation) on a free port and a fresh Flower home, and stopped
here by its PID. Telemetry and runtime dependency installation are off.

``python tests/test_flower_quickstart.py --write-docs`` renders the variants' table
and diffs into docs/flower.md; a fast test checks that they are current.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from flower_quickstart_variants import (
    MISCONFIGURED,
    VARIANTS,
    Variant,
    docs_block,
    edited_files,
    write_variant,
)
from test_flower_deployment import free_port, fresh_flower_home, run_status, stop, wait_for_port

REPOSITORY = Path(__file__).resolve().parents[1]
DOCS = REPOSITORY / "docs" / "flower.md"
BIN = Path(sys.executable).parent
NUM_SUPERNODES = 10
NUM_ROUNDS = 2
CONNECTION = "quickstart-simulation"
DOCS_BLOCK = re.compile(r"<!-- quickstart-table -->\n(.*?)\n<!-- /quickstart-table -->", re.DOTALL)


# ------------------------------------------------------------------------ the docs


def test_the_quickstart_table_in_the_docs_is_current() -> None:
    found = DOCS_BLOCK.search(DOCS.read_text())
    assert found, "docs/flower.md lost its <!-- quickstart-table --> markers"
    assert found.group(1) == docs_block(), (
        "regenerate it: python tests/test_flower_quickstart.py --write-docs"
    )


def test_every_variant_applies_to_the_base_app_and_compiles() -> None:
    for variant in (*VARIANTS, *MISCONFIGURED):
        for path, text in edited_files(variant).items():
            compile(text, f"{variant.name}:{path}", "exec")


def write_docs() -> None:
    """Replace whatever docs/flower.md holds between the markers by :func:`docs_block`."""
    markers = re.compile(r"<!-- quickstart-table -->\n.*?<!-- /quickstart-table -->", re.DOTALL)
    text = DOCS.read_text()
    if not markers.search(text):
        raise SystemExit("docs/flower.md has no <!-- quickstart-table --> ... markers")
    block = f"<!-- quickstart-table -->\n{docs_block()}\n<!-- /quickstart-table -->"
    DOCS.write_text(markers.sub(lambda _: block, text))


# --------------------------------------------------------------- flwr run, for real


@pytest.fixture(scope="module")
def superlink(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A simulation SuperLink on a free loopback port, registered as the connection
    ``quickstart-simulation`` in a fresh Flower home."""
    tmp_path = tmp_path_factory.mktemp("superlink")
    port = free_port()
    home, environment = fresh_flower_home(tmp_path)
    with (home / "config.toml").open("a") as config:
        config.write(f'\n[superlink.{CONNECTION}]\naddress = "127.0.0.1:{port}"\ninsecure = true\n')
    log = tmp_path / "superlink.log"
    with log.open("wb") as output:
        process = subprocess.Popen(
            [
                str(BIN / "flower-superlink"),
                "--insecure",
                "--simulation",
                "--isolation",
                "subprocess",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--disable-runtime-dependency-installation",
            ],
            stdout=output,
            stderr=subprocess.STDOUT,
            env=environment,
            cwd=tmp_path,
        )
    try:
        wait_for_port(port, process, 120, log)
        yield {"connection": CONNECTION, "environment": environment, "cwd": tmp_path, "log": log}
    finally:
        stop([process])


def flwr_run(superlink: dict[str, Any], app: Path, result_file: Path) -> str:
    """``flwr run <app> <connection> --stream`` on 10 simulated SuperNodes; its output."""
    completed = subprocess.run(
        [
            str(BIN / "flwr"),
            "run",
            str(app),
            CONNECTION,
            "--stream",
            "--federation-config",
            f"num-supernodes={NUM_SUPERNODES} client-resources-num-cpus=1",
            "--run-config",
            f"num-server-rounds={NUM_ROUNDS} result-file='{result_file}'",
        ],
        capture_output=True,
        check=False,
        env=superlink["environment"],
        cwd=superlink["cwd"],
        timeout=300,
    )
    return completed.stdout.decode() + completed.stderr.decode()


def run_variant(superlink: dict[str, Any], variant: Variant, tmp_path: Path) -> tuple[str, Path]:
    """``flwr run`` of the quickstart with ``variant``'s edits, written into ``tmp_path``:
    its output (also kept in ``tmp_path/flwr-run.log``) and where its ServerApp writes
    the result."""
    app = write_variant(variant, tmp_path / "app")
    result_file = tmp_path / "result.json"
    output = flwr_run(superlink, app, result_file)
    (tmp_path / "flwr-run.log").write_text(output)
    return output, result_file


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda variant: variant.name)
def test_each_variant_runs_under_flwr_run(
    superlink: dict[str, Any], tmp_path: Path, variant: Variant
) -> None:
    # Execute: the quickstart with the variant's edits.
    output, result_file = run_variant(superlink, variant, tmp_path)
    # Assert: the ServerApp finished every round with every sampled node's reply and
    # finite metrics, under the strategy the variant names.
    assert result_file.exists(), output[-5000:]
    result = json.loads(result_file.read_text())
    assert result["strategy"] == variant.server, result["strategy"]
    rounds = [str(r) for r in range(1, NUM_ROUNDS + 1)]
    assert sorted(result["train"]) == rounds, (result["train"], output[-5000:])
    assert sorted(result["central"]) == ["0", *rounds], result["central"]
    for round_metrics in (*result["train"].values(), *result["central"].values()):
        assert all(math.isfinite(value) for value in round_metrics.values()), round_metrics
    assert "Traceback" not in output, output[-5000:]
    if variant.server == "FedAvg":
        # Flower's FedAvg logs each aggregation: all 10 nodes replied, none failed.
        replies = re.findall(r"aggregate_train: Received (\d+) results and (\d+) failures", output)
        assert replies == [(str(NUM_SUPERNODES), "0")] * NUM_ROUNDS, output[-5000:]
    else:
        run = result["fedplug_run"]
        assert [record["round"] for record in run["history"]] == list(range(1, NUM_ROUNDS + 1))
        assert [record["participants"] for record in run["history"]] == [NUM_SUPERNODES] * 2
        assert [record["failures"] for record in run["history"]] == [0, 0]
        assert variant.name in json.dumps(result["fedplug_config"]), result["fedplug_config"]
        if variant.name == "feddisk":
            assert run["setup_rounds"] > 0, run  # the density-ratio phase ran before round 1


MISCONFIGURATION_LINE = {
    "scaffold-momentum": ("momentum=0.9", "fedplug stopped the run: node"),
    "fedshift-stock-client": (
        "FedplugLoss(loss_transform={'name': 'fedshift'}, app=app",
        "the ClientApp runs no fedplug client piece",
    ),
}
"""Per misconfigured variant: what its one line names, and a phrase only that line holds."""


@pytest.mark.slow
@pytest.mark.parametrize("variant", MISCONFIGURED, ids=lambda variant: variant.name)
def test_a_misconfigured_quickstart_fails_in_one_line_before_any_client_trains(
    superlink: dict[str, Any], tmp_path: Path, variant: Variant
) -> None:
    # Execute: the quickstart with the misconfigured variant's edits.
    output, result_file = run_variant(superlink, variant, tmp_path)
    print(output)
    # Assert: one fedplug line naming what to fix, no traceback, no round finished,
    # the run marked failed.
    names, phrase = MISCONFIGURATION_LINE[variant.name]
    lines = [line for line in output.splitlines() if names in line]
    assert len(lines) == 1, output[-5000:]
    assert phrase in lines[0], lines[0]
    assert "Traceback" not in output, output[-5000:]
    assert "An exception was raised" not in output, output[-5000:]  # no stray engine line
    assert not result_file.exists(), output[-5000:]
    assert not re.search(r"aggregate_train: Received", output), output[-5000:]
    assert run_status(superlink, output) == "finished:failed", output[-5000:]


if __name__ == "__main__":
    if sys.argv[1:] == ["--write-docs"]:
        write_docs()
    else:
        raise SystemExit("usage: python tests/test_flower_quickstart.py --write-docs")
