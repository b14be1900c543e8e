"""Issue 43, build item 5: the small things a new user tripped over, each checked here.

(1) ``fedplug list`` shows each component's whole first docstring sentence (it showed the
docstring's first *line*: "... Gaussian noise whose std"); (2) ``fedplug run``'s MLflow
run names keep the config hash within the columns the UI shows (three
``fedavg-seed0-synthetic-...`` rows looked the same); (3) docs/pipeline.md's command for
the metrics prints a line per metric that fits a terminal (``dvc metrics show`` prints all
of them in one row of about 840 characters); (4) ``FedplugStrategy(fraction_evaluate=...)``,
Flower's quickstart with only the class name changed, runs FedAvg (it raised
``TypeError: missing ... 'train_config'``).
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
LISTED = re.compile(r"^  (\S+)\s+(\S.*)$")
"""A component's first row in ``fedplug list``: two spaces, the name, its summary."""
SENTENCE_END = (".", "?", "!", ".)", ".``", ".)``")
"""How a whole sentence may end."""
NAME_COLUMNS = 23
"""Characters of a run name that MLflow's runs table showed in its default column
(issue 43: ``fedavg-seed0-synthetic-``, 23 characters, then the cut)."""


# ------------------------------------------------------------- (1) fedplug list


def listed_summaries(text: str) -> dict[str, str]:
    """Component name -> its summary in ``fedplug list``'s overview, continuation rows
    joined (they are indented under the summary)."""
    summaries: dict[str, str] = {}
    name = None
    for line in text.splitlines():
        row = LISTED.match(line)
        if row and not line.startswith("   "):
            name = row.group(1)
            summaries[name] = row.group(2).strip()
        elif name is not None and line.startswith(" " * 19):
            summaries[name] += " " + line.strip()
        else:
            name = None
    return summaries


def test_fedplug_list_shows_each_components_whole_first_sentence() -> None:
    from fedplug.cli import describe_components
    from fedplug.plugins import default_registry
    from fedplug.registry import KINDS

    # Execute
    summaries = listed_summaries(describe_components())
    # Assert: every registered component is listed with a summary that ends a sentence,
    # feature_noise's whole first sentence among them.
    registry = default_registry()
    names = {entry.name for kind in KINDS for entry in registry.entries(kind)}
    assert names <= set(summaries), sorted(names - set(summaries))
    cut = {name: text for name, text in summaries.items() if not text.endswith(SENTENCE_END)}
    assert not cut, cut
    assert summaries["feature_noise"] == (
        "Feature skew (FedDisk): IID labels, each client's inputs get Gaussian noise whose std "
        "ramps linearly over the clients up to sigma (:func:`feature_noise_std`)."
    )


def test_fedplug_list_kind_shows_the_whole_first_sentence_too() -> None:
    from fedplug.cli import describe_components

    text = " ".join(describe_components("partitioners").split())
    assert "whose std ramps linearly over the clients up to sigma" in text


@pytest.mark.parametrize(
    ("doc", "sentence"),
    [
        ("One line.\n    Second sentence.", "One line."),
        ("Spans\n    two lines. Then more.\n\n    Details.", "Spans two lines."),
        ("FedAvg (McMahan et al. 2017): the mean. More.", "FedAvg (McMahan et al. 2017): the mean."),
        ("A loss, e.g. CE or i.e. Focal, at lr 0.1. More.", "A loss, e.g. CE or i.e. Focal, at lr 0.1."),
        ("By J. Smith and K. Lee. More.", "By J. Smith and K. Lee."),
        ("Why? Because.", "Why?"),
        ("No full stop at all", "No full stop at all"),
        ("", ""),
    ],
)
def test_first_sentence_keeps_abbreviations_initials_and_decimals(doc: str, sentence: str) -> None:
    from fedplug.cli import first_sentence

    assert first_sentence(doc) == sentence


# ---------------------------------------------------------- (2) MLflow run names


def tiny_experiment(**train: Any) -> Any:
    from fedplug.config import validate_experiment

    params: dict[str, Any] = {
        "study": {"name": "names", "seeds": [0]},
        "data": {
            "dataset": {"name": "synthetic", "num_train": 100, "num_test": 20, "num_features": 4, "num_classes": 2},
            "partition": {"name": "iid"},
            "num_clients": 2,
        },
        "train": {"model": {"name": "logreg"}, "rounds": 2, **copy.deepcopy(train)},
    }
    return validate_experiment(params, check_every_algorithm=False)


@pytest.mark.parametrize("algorithm", [None, "fedprox"])
def test_command_line_run_names_differ_within_the_columns_mlflow_shows(algorithm: str | None) -> None:
    from fedplug.run_folder import output_fingerprint
    from fedplug.tracking.naming import command_line_run_name

    # Prepare: two configs that differ only late in the train section (the learning rate).
    first = tiny_experiment(optimizer={"name": "sgd", "lr": 0.1})
    second = tiny_experiment(optimizer={"name": "sgd", "lr": 0.25})
    # Execute
    names = [command_line_run_name(config, algorithm) for config in (first, second)]
    # Assert: the names differ in what the UI shows; algorithm and seed lead, readable.
    assert names[0][:NAME_COLUMNS] != names[1][:NAME_COLUMNS], names
    label = algorithm or "fedavg"
    for name, config in zip(names, (first, second)):
        assert name.startswith(f"{label}-seed0-{output_fingerprint(config)[:8]}"), name
        assert name.endswith("-synthetic"), name


# ------------------------------------------------------------- (3) the metrics


def documented_metrics_command() -> str:
    """The line of docs/pipeline.md's first command block that shows the DVC metrics,
    without its comment."""
    for line in (ROOT / "docs" / "pipeline.md").read_text().splitlines():
        if line.startswith("dvc metrics "):
            return line.split("#")[0].strip()
    raise AssertionError("docs/pipeline.md names no `dvc metrics ...` command")


def git(folder: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=folder, check=True, capture_output=True, text=True).stdout


def dvc_output(command: str, folder: Path) -> list[str]:
    completed = subprocess.run(
        command.split(), cwd=folder, capture_output=True, text=True, timeout=120, check=False,
        env={"PATH": f"{BIN}:/usr/bin:/bin", "HOME": str(folder), "DVC_NO_ANALYTICS": "1", "COLUMNS": "100"},
    )
    assert completed.returncode == 0, completed.stderr
    return completed.stdout.splitlines()


def flat_keys(data: dict[str, Any], prefix: str = "") -> set[str]:
    keys = set()
    for key, value in data.items():
        keys |= flat_keys(value, f"{prefix}{key}.") if isinstance(value, dict) else {prefix + key}
    return keys


def test_the_documented_metrics_command_prints_a_line_per_metric_within_100_columns(tmp_path: Path) -> None:
    # Prepare: a repository with the project's pipeline and committed metrics.
    git(tmp_path, "init", "-q")
    git(tmp_path, "config", "user.email", "test@example.invalid")
    git(tmp_path, "config", "user.name", "test")
    dvc_output(f"{BIN / 'dvc'} init -q", tmp_path)
    for name in ("dvc.yaml", "dvc.lock", "params.yaml"):
        shutil.copy(ROOT / name, tmp_path / name)
    (tmp_path / "reports").mkdir()
    shutil.copy(ROOT / "reports" / "summary.json", tmp_path / "reports" / "summary.json")
    git(tmp_path, "add", "-A")
    git(tmp_path, "commit", "-q", "-m", "base")
    metrics = flat_keys(json.loads((ROOT / "reports" / "summary.json").read_text()))
    command = documented_metrics_command()
    assert command.startswith("dvc metrics "), command
    # Execute
    lines = dvc_output(str(BIN / command), tmp_path)
    plain = dvc_output(f"{BIN / 'dvc'} metrics show", tmp_path)
    # Assert: every metric on a line of its own, every line within 100 columns (the plain
    # `dvc metrics show` puts them all in one row, far wider).
    assert lines and max(len(line) for line in lines) <= 100, lines
    shown = {line.split()[0] for line in lines[1:] if line.strip()}
    assert shown == metrics, sorted(metrics ^ shown)
    assert max(len(line) for line in plain) > 100


# ----------------------------------------------- (4) the literal FedAvg swap


def test_fedplug_strategy_without_a_train_section_runs_fedavg_as_flowers_fedavg() -> None:
    import torch
    from fedplug.adapters.flower import FedplugStrategy, LoopbackGrid
    from fedplug.adapters.flower.records import record_to_vector, vector_layout
    from flwr.app import ArrayRecord
    from flwr.serverapp.strategy import FedAvg
    from test_flower_dropin_server import NUM_NODES, initial_net, quickstart_app

    # Prepare: Flower's quickstart line with only the class name changed, and Flower's own.
    swapped = FedplugStrategy(fraction_evaluate=0.5)
    flower = FedAvg(fraction_evaluate=0.5)
    results = []
    # Execute: two rounds of each on the quickstart ClientApp's nodes.
    for strategy in (swapped, flower):
        grid = LoopbackGrid(quickstart_app(), NUM_NODES)
        arrays = ArrayRecord(initial_net().state_dict())
        results.append(strategy.start(grid=grid, initial_arrays=arrays, num_rounds=2))
    # Assert: fedplug's defaults are FedAvg's (every node trains), and the global model
    # is Flower's FedAvg's.
    assert swapped.config.aggregator.name == "fedavg" and swapped.fraction_train == 1.0
    assert [record.participants for record in swapped.run_result.history] == [NUM_NODES, NUM_NODES]
    layout = vector_layout(initial_net())
    assert torch.allclose(
        record_to_vector(results[0].arrays, layout), record_to_vector(results[1].arrays, layout), atol=1e-6
    )
