"""Crafted or damaged checkpoints get one line, never a traceback or a poisoned resume
(issue #29, finding 7; build item 5).

- A few kilobytes of shared references (``x = [x, x]`` forty times) used to expand into
  2**40 nodes before the fingerprint was even read: now the fingerprint is checked on the
  unexpanded state, and a structure that would expand beyond the file's size, or nests
  deeper than any checkpoint, or a tensor larger than its stored data, is refused at once.
- A checkpoint of the right config with keys removed or of the wrong type used to give
  ``KeyError: 'history'``, ``AttributeError`` or ``TypeError`` tracebacks.
- A NaN or truncated global model used to load: every client's update then came back
  non-finite and the clients were blamed.

Each case runs through the resume path of ``fedplug run`` (the experiment API, and the
CLI for the exit code and the one line), and the Flower strategy's restore.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from conftest import SMALL_EXPERIMENT, in_process

from fedplug.config import validate_experiment
from fedplug.errors import TrainingError
from fedplug.run.checkpoint import load_checkpoint

ADVICE = "start over with --no-resume or delete it"


def experiment(**train: Any) -> dict[str, Any]:
    data = copy.deepcopy(SMALL_EXPERIMENT)
    data["data"]["num_clients"] = 4
    data["train"].update({"rounds": 2, "client_fraction": 0.5, **train})
    return data


def finished_run(out: Path, **train: Any) -> tuple[Any, dict[str, Any]]:
    """A finished 2-round run in ``out``: its config and its checkpoint's raw state."""
    from fedplug.experiment import run_experiment

    config = validate_experiment(experiment(**train))
    run_experiment(config, out)
    return config, torch.load(out / "checkpoint.pt", weights_only=True)


def resume(config: Any, out: Path) -> Any:
    """What ``fedplug run`` does first when resuming: refuse or restore."""
    from fedplug.experiment import prepare_experiment

    return prepare_experiment(config, out)


def refused_line(call: Callable[[], Any], path: Path) -> str:
    with pytest.raises(TrainingError) as refused:
        call()
    text = str(refused.value).strip()
    assert "\n" not in text, f"not one line: {text!r}"
    assert str(path) in text
    return text


def bomb(levels: int) -> list[Any]:
    """A list whose pickle is tiny (each level references the one below twice) and whose
    expanded tree has 2**levels leaves."""
    nested: list[Any] = [0]
    for _ in range(levels):
        nested = [nested, nested]
    return nested


# ---------------------------------------------------------------- crafted structures


@pytest.mark.parametrize("right_fingerprint", [True, False], ids=["this-config", "other-config"])
def test_a_shared_reference_bomb_is_refused_before_it_expands(tmp_path: Path, right_fingerprint: bool) -> None:
    """Finding 7: 1.5 KB of nested shared lists ran 9 s into a MemoryError before the
    fingerprint check. Now: refused in well under a second, the fingerprint first."""
    out = tmp_path / "out"
    config, state = finished_run(out)
    path = out / "checkpoint.pt"
    if not right_fingerprint:
        state["fingerprint"] = "0" * 16
    state["history"] = bomb(21)
    torch.save(state, path)
    assert path.stat().st_size < 64 * 1024  # the pickle shares every level

    started = time.perf_counter()
    text = refused_line(lambda: resume(config, out), path)
    elapsed = time.perf_counter() - started

    assert elapsed < 1.5, f"took {elapsed:.1f} s: the structure was expanded"
    if right_fingerprint:
        assert "expands to more than" in text and ADVICE in text
    else:
        assert "belongs to a different config" in text


def test_the_cli_refuses_a_bomb_with_one_line_and_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fedplug.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(experiment()))
    _, state = finished_run(tmp_path / "out")
    state["aggregator"] = {"buffers": bomb(21)}
    torch.save(state, tmp_path / "out" / "checkpoint.pt")
    (tmp_path / "out" / "metrics.json").unlink()

    code, stderr = in_process(lambda: main(["run", "params.yaml", "--out", "out", "--quiet"]))

    assert code == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    assert lines[0].startswith("fedplug: error: checkpoint 'out/checkpoint.pt' expands to more than")
    assert not (tmp_path / "out" / "metrics.json").exists()


def test_nesting_deeper_than_any_checkpoint_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.pt"
    nested: list[Any] = []
    for _ in range(150):  # pickle's own recursion limits a deeper save
        nested = [nested]
    torch.save({"version": 2, "fingerprint": "f" * 16, "history": [], "deep": nested}, path)

    text = refused_line(lambda: load_checkpoint(path, "f" * 16), path)

    assert "nested more than 100 levels deep" in text


def test_a_tensor_larger_than_its_stored_data_is_refused(tmp_path: Path) -> None:
    """A stride-0 view claims 10**9 elements over one stored float: copying it (to the
    training device, into the model) would allocate 4 GB."""
    path = tmp_path / "checkpoint.pt"
    huge = torch.zeros(1).expand(10**9)
    torch.save({"version": 2, "fingerprint": "f" * 16, "history": [], "global_vector": huge}, path)

    text = refused_line(lambda: load_checkpoint(path, "f" * 16), path)

    assert "over 4 stored bytes" in text


def test_a_file_larger_than_the_run_can_hold_is_refused_before_it_is_read(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.pt"
    torch.save({"version": 2, "fingerprint": "f" * 16, "history": [], "pad": torch.zeros(4096)}, path)

    text = refused_line(lambda: load_checkpoint(path, "f" * 16, max_bytes=1024), path)

    assert "more than a checkpoint of this run can hold (1,024)" in text


def test_the_size_bound_admits_every_checkpoint_a_run_writes(tmp_path: Path) -> None:
    """SCAFFOLD keeps a control variate per client: the largest state a run writes."""
    from fedplug.run.checkpoint_bounds import SLACK_BYTES, checkpoint_size_bound

    out = tmp_path / "out"
    config, state = finished_run(out, aggregator={"name": "scaffold"}, client_fraction=1.0)
    model_bytes = state["global_vector"].numel() * 4

    assert len(state["client_states"]) == 4
    written = (out / "checkpoint.pt").stat().st_size - SLACK_BYTES
    assert written < checkpoint_size_bound(model_bytes, 4, 0, 2) - SLACK_BYTES
    assert resume(config, out) is not None


# ----------------------------------------------------------------- damaged contents


def _drop(key: str) -> Callable[[dict[str, Any]], None]:
    return lambda state: state.pop(key)


def _set(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda state: state.__setitem__(key, value)


def _edit_record(key: str, value: Any = None) -> Callable[[dict[str, Any]], None]:
    def edit(state: dict[str, Any]) -> None:
        if value is None:
            del state["history"][0][key]
        else:
            state["history"][0][key] = value

    return edit


def _nan_vector(state: dict[str, Any]) -> None:
    state["global_vector"][3] = float("nan")


def _short_vector(state: dict[str, Any]) -> None:
    state["global_vector"] = state["global_vector"][:-5].clone()


DAMAGES: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "no-history": (_drop("history"), "its 'history' is missing"),
    "history-of-str": (_set("history", "lost"), "its 'history' is not a list of round records"),
    "record-of-int": (lambda s: s["history"].__setitem__(0, 5), "'history' is not a list of round records"),
    "record-without-accuracy": (_edit_record("accuracy"), "history[0] is incomplete"),
    "record-accuracy-str": (_edit_record("accuracy", "high"), "history[0]['accuracy'] is str 'high', not a number"),
    "records-out-of-order": (_edit_record("round", 2), "history[0] is round int 2, not round 1"),
    "no-global-vector": (_drop("global_vector"), "it lacks 'global_vector'"),
    "global-vector-list": (_set("global_vector", [1.0, 2.0]), "its 'global_vector' is list [1.0, 2.0], not a float tensor"),
    "global-vector-nan": (_nan_vector, "its 'global_vector' holds NaN or infinite values"),
    "global-vector-short": (_short_vector, "its 'global_vector' has shape"),
    "no-aggregator": (_drop("aggregator"), "it lacks 'aggregator'"),
    "grouper-of-str": (_set("grouper", "x"), "its 'grouper' state is str 'x', not a dict"),
    "no-client-states": (_drop("client_states"), "it lacks 'client_states'"),
    "client-states-list": (_set("client_states", []), "its 'client_states' is list [], not a dict"),
    "client-states-foreign-id": (_set("client_states", {99: {}}), "names client 99, not one of 0..3"),
    "setup-cost-none": (_set("setup_cost", None), "its 'setup_cost' is not a dict of non-negative integers"),
    "setup-cost-negative": (
        _set("setup_cost", {"rounds": -1, "bytes_up": 0, "bytes_down": 0}),
        "its 'setup_cost' is not a dict of non-negative integers",
    ),
    "setup-seconds-str": (_set("setup_seconds", "soon"), "its 'setup_seconds' is str 'soon'"),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_checkpoint_of_this_config_gets_one_line(tmp_path: Path, damage: str) -> None:
    """Finding 7: keys removed, values of the wrong type, a NaN or truncated global model:
    each is named, with what to do, before anything trains on it."""
    out = tmp_path / "out"
    config, state = finished_run(out)
    edit, expected = DAMAGES[damage]
    edit(state)
    torch.save(state, out / "checkpoint.pt")

    text = refused_line(lambda: resume(config, out), out / "checkpoint.pt")

    assert expected in text, text
    assert "is damaged" in text and text.endswith(ADVICE), text


@pytest.mark.parametrize(
    ("velocity", "expected"),
    [
        (lambda v: torch.full_like(v, float("nan")), "its 'aggregator' state holds NaN or infinite values"),
        (lambda v: v[:7].clone(), "its 'aggregator.velocity' state holds a tensor of shape (7,) where this run's has"),
        (lambda v: "fast", "its 'aggregator' state does not fit FedAvgM"),
    ],
    ids=["nan", "wrong-shape", "str"],
)
def test_a_damaged_aggregator_state_gets_one_line(tmp_path: Path, velocity: Any, expected: str) -> None:
    out = tmp_path / "out"
    config, state = finished_run(out, aggregator={"name": "fedavgm", "momentum": 0.9})
    state["aggregator"]["velocity"] = velocity(state["aggregator"]["velocity"])
    if isinstance(state["aggregator"]["velocity"], str):  # a state the component cannot read
        state["aggregator"] = {"momentum_buffer": state["aggregator"].pop("velocity")}
    torch.save(state, out / "checkpoint.pt")

    text = refused_line(lambda: resume(config, out), out / "checkpoint.pt")

    assert expected in text and text.endswith(ADVICE), text


def test_an_intact_checkpoint_still_resumes_where_it_stopped(tmp_path: Path) -> None:
    """The checks refuse nothing fedplug writes: a checkpoint cut back to its first round
    resumes and trains the second."""
    out = tmp_path / "out"
    config, state = finished_run(out, aggregator={"name": "fedavgm", "momentum": 0.9})
    state["history"] = state["history"][:1]
    torch.save(state, out / "checkpoint.pt")

    simulator = resume(config, out)
    result = simulator.run()

    assert [record.round for record in result.history] == [1, 2]


# ------------------------------------------------------------------------- Flower


def test_the_flower_strategy_refuses_a_damaged_checkpoint(tmp_path: Path) -> None:
    """The Flower runtime resumes through the same checks (a NaN global model here)."""
    from fedplug.adapters.flower import LoopbackGrid, make_client_app, run_on_grid

    config = validate_experiment(experiment())
    out = tmp_path / "out"
    run_on_grid(LoopbackGrid(make_client_app(), 4), config, out_dir=out, federated_evaluation=False, track=False)
    state = torch.load(out / "checkpoint.pt", weights_only=True)
    state["history"] = state["history"][:1]
    state["global_vector"][0] = float("inf")
    torch.save(state, out / "checkpoint.pt")

    text = refused_line(
        lambda: run_on_grid(
            LoopbackGrid(make_client_app(), 4), config, out_dir=out, federated_evaluation=False, track=False
        ),
        out / "checkpoint.pt",
    )

    assert "its 'global_vector' holds NaN or infinite values" in text and text.endswith(ADVICE)


def test_a_flower_checkpoint_of_format_2_is_refused_saying_to_start_over(tmp_path: Path) -> None:
    """Before the shared run state (format 3) the Flower strategy saved neither the loss
    transform's state nor the client states nor the setup time; such a file is refused
    with one line that says why and what to do, never resumed without them."""
    from fedplug.adapters.flower import LoopbackGrid, make_client_app, run_on_grid

    config = validate_experiment(experiment())
    out = tmp_path / "out"
    run_on_grid(LoopbackGrid(make_client_app(), 4), config, out_dir=out, federated_evaluation=False, track=False)
    state = torch.load(out / "checkpoint.pt", weights_only=True)
    state["history"] = state["history"][:1]
    for key in ("loss_transform", "client_states", "setup_seconds"):
        del state[key]
    state["version"] = 2
    torch.save(state, out / "checkpoint.pt")

    text = refused_line(
        lambda: run_on_grid(
            LoopbackGrid(make_client_app(), 4), config, out_dir=out, federated_evaluation=False, track=False
        ),
        out / "checkpoint.pt",
    )

    assert "written by an older fedplug's Flower strategy (format 2)" in text
    assert "'setup_seconds', 'loss_transform', 'client_states'" in text
    assert text.endswith("delete it or pass another checkpoint_path to start over")


def test_a_simulator_checkpoint_of_format_2_still_resumes(tmp_path: Path) -> None:
    """The simulator's format 2 held what a run state holds: it resumes unchanged."""
    out = tmp_path / "out"
    config, state = finished_run(out, aggregator={"name": "fedavgm", "momentum": 0.9})
    state["history"] = state["history"][:1]
    state["version"] = 2
    torch.save(state, out / "checkpoint.pt")

    result = resume(config, out).run()

    assert [record.round for record in result.history] == [1, 2]
    assert torch.load(out / "checkpoint.pt", weights_only=True)["version"] == 3
