"""``fedplug check-plugin NAME``: the conformance checks fedplug's own components pass, run
on an installed third-party plugin.

For each component the plugin registers, one line per check (``docs``, ``config``,
``simulator``, ``deterministic``, ``resume``, ``engines``, ``flower``): ``PASS``, ``FAIL``
(with what to fix) or ``SKIP`` (with why); the exit status is 0 when no check failed.
Guide: README.md, 'Check it' (what each check runs).
"""

from __future__ import annotations

import argparse
import copy
import logging
import math
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from fedplug.errors import ConfigError, FedplugError, PluginError

Verdict = Literal["PASS", "FAIL", "SKIP"]
ROUNDS = 2
TOLERANCE = 1e-5
"""Accuracy, loss and model differences allowed between runtimes or engines (float sums in
another order), as in tests/test_conformance.py."""
VOLATILE = {"seconds"}
"""Round-record fields that measure wall-clock time."""
CONFORMANCE_FIELDS = (
    "round", "accuracy", "loss", "participants", "failures", "bytes_up", "bytes_down", "cumulative_bytes",
    "compute_seconds_model", "communication_seconds_model", "metrics",
)
"""What two runtimes or engines must agree on each round (tests/test_conformance.py): Flower
runs here without federated evaluation, so the clients' own accuracies are left out."""
SLOTS = {
    "datasets": ("data", "dataset"),
    "partitioners": ("data", "partition"),
    "models": ("train", "model"),
    "samplers": ("train", "sampler"),
    "loss_transforms": ("train", "loss_transform"),
    "aggregators": ("train", "aggregator"),
    "groupers": ("train", "grouper"),
}
"""Where each kind of component goes in an experiment config."""
BASE_EXPERIMENT: dict[str, Any] = {
    "study": {"name": "check-plugin", "target_accuracy": 0.5},
    "tracking": {"enabled": False},
    "data": {
        "dataset": {"name": "synthetic", "num_train": 600, "num_test": 200, "num_features": 12, "num_classes": 4},
        "partition": {"name": "dirichlet_class", "alpha": 0.5, "min_size": 10},
        "num_clients": 4,
        "local_test_fraction": 0.2,
        "seed": 0,
    },
    "train": {
        "model": {"name": "mlp", "hidden": [16]},
        "client_fraction": 1.0,
        "rounds": ROUNDS,
        "local_epochs": 1,
        "batch_size": 16,
        "optimizer": {"name": "sgd", "lr": 0.5},
        "seed": 0,
        "engine": "sequential",
    },
}
"""The small synthetic experiment every component is run in (its slot replaced)."""


@dataclass(frozen=True)
class Outcome:
    """One check's result: its line reads ``<verdict>  <kind> <name>: <check>: <detail>``."""

    verdict: Verdict
    subject: str
    check: str
    detail: str

    def line(self) -> str:
        return f"{self.verdict}  {self.subject}: {self.check}: {self.detail}"


class CheckFailed(Exception):
    """A check found a defect; the message says what and what to fix."""


class CheckSkipped(Exception):
    """A check does not apply; the message says why."""


class _StopAfterRound(Exception):
    """Raised by an observer to stop a run after a round (its checkpoint is written)."""


# ------------------------------------------------------------------- the plugin


def find_plugin(name: str, registry: Any) -> tuple[str, list[Any], list[Any]]:
    """The plugin name ``name`` stands for (an entry point's name, or a distribution that
    declares one), with the components and trackers it registers.

    Raises:
        PluginError: nothing installed is called ``name`` (the line lists what is).
    """
    import importlib.metadata

    from fedplug.hookspecs import PROJECT_NAME
    from fedplug.registry import KINDS

    entries = [entry for kind in KINDS for entry in registry.entries(kind)]
    trackers = registry.tracker_entries()
    plugins = {entry.plugin for entry in [*entries, *trackers]}
    candidates = {name} if name in plugins else set()
    installed: list[str] = []
    for distribution in importlib.metadata.distributions():
        points = [point.name for point in distribution.entry_points if point.group == PROJECT_NAME]
        installed += points
        dist_name = str(distribution.metadata["Name"] or "")
        if points and _normal(dist_name) == _normal(name):
            candidates.update(points)
    chosen = [entry for entry in entries if entry.plugin in candidates]
    chosen_trackers = [tracker for tracker in trackers if tracker.plugin in candidates]
    if not candidates or not (chosen or chosen_trackers):
        shown = ", ".join(sorted(set(installed))) or "none"
        raise PluginError(
            f"no installed fedplug plugin {name!r} registers anything; installed plugins (entry points of "
            f"group {PROJECT_NAME!r}): {shown}; install yours (pip install -e PATH) or give its entry point's name"
        )
    return min(candidates) if len(candidates) == 1 else name, chosen, chosen_trackers


def _normal(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


# ------------------------------------------------------------------- the checks


def experiment_for(kind: str, name: str, overrides: Sequence[str] = (), **train: Any) -> dict[str, Any]:
    """:data:`BASE_EXPERIMENT` with component ``name`` in the slot of ``kind``, then the
    ``--set`` overrides and ``train`` values applied."""
    from fedplug.config import apply_override

    data = copy.deepcopy(BASE_EXPERIMENT)
    section, slot = SLOTS[kind]
    data[section][slot] = {"name": name}
    if kind == "datasets":
        data["data"]["root"] = "data/raw"
    for assignment in overrides:
        data = apply_override(data, assignment)
    data["train"].update(train)
    return data


def check_docs(entry: Any) -> str:
    """The config class and each parameter carry a docstring."""
    if not entry.summary:
        raise CheckFailed(
            f"{entry.config_class.__name__} has no docstring; its first line is what `fedplug list` shows"
        )
    undocumented = [
        field_name for field_name, field in entry.config_class.model_fields.items()
        if field_name != "name" and not (field.description or "").strip()
    ]
    if undocumented:
        raise CheckFailed(
            f"parameter{'s' if len(undocumented) > 1 else ''} {', '.join(undocumented)} of "
            f"{entry.config_class.__name__} without a docstring; write one on the line under each field "
            "(it becomes the parameter's `fedplug list` text)"
        )
    count = len(entry.config_class.model_fields) - 1
    return f"summary and {count} parameter docstring{'s' if count != 1 else ''}"


def check_config(entry: Any, data: dict[str, Any], registry: Any) -> Any:
    """The experiment validates; a misspelt key is refused; the component's config
    survives a JSON round trip. Returns the validated experiment."""
    from fedplug.config import validate_experiment

    try:
        config = validate_experiment(data, registry)
    except ConfigError as error:
        raise CheckFailed(
            f"the defaults do not validate ({' '.join(str(error).split())}); give the required values with "
            f"--set {'.'.join(SLOTS[entry.kind])}.KEY=VALUE, or defaults in the config class"
        ) from None
    section, slot = SLOTS[entry.kind]
    component = getattr(getattr(config, section), slot)
    misspelt = copy.deepcopy(data)
    misspelt[section][slot] = {**component.model_dump(mode="json"), "no_such_parameter": 1}
    try:
        validate_experiment(misspelt, registry)
    except ConfigError:
        pass
    else:
        raise CheckFailed(
            f"{entry.config_class.__name__} accepts an unknown key (no_such_parameter), so a typo in "
            "params.yaml would pass unnoticed; do not override ComponentConfig's model_config extra='forbid'"
        )
    dumped = component.model_dump(mode="json")
    try:
        again = type(component).model_validate(dumped)
    except Exception as error:  # noqa: BLE001 (any refusal is the defect reported)
        raise CheckFailed(
            f"model_dump(mode='json') of {entry.config_class.__name__} does not validate again "
            f"({type(error).__name__}); config.yaml and checkpoints store it that way"
        ) from None
    if again != component:
        raise CheckFailed(
            f"{entry.config_class.__name__} changes in a JSON round trip ({dumped}); use JSON types for its fields"
        )
    return config


def run(config: Any, registry: Any, out: Path | None = None, *, stop_after: int | None = None,
        resume: bool = False) -> tuple[Any, Any]:
    """One run on the simulator: ``(RunResult, final model vector)``; ``stop_after`` stops
    it once that round's checkpoint is written."""
    from fedplug.experiment import run_experiment

    observers = []
    if stop_after is not None:

        def stop(record: Any) -> None:
            if record.round >= stop_after:
                raise _StopAfterRound

        observers.append(stop)
    result, simulator = run_experiment(config, out, registry=registry, observers=observers, resume=resume)
    return result, simulator.final_vector


def check_simulator(config: Any, registry: Any) -> tuple[str, Any]:
    """A short run finishes with finite numbers and no failed client update."""
    try:
        result, vector = run(config, registry)
    except FedplugError as error:
        raise CheckFailed(f"the run stopped: {' '.join(str(error).split())}") from None
    except Exception as error:  # noqa: BLE001 (the plugin's bug, shown in one line)
        raise CheckFailed(f"the run raised {type(error).__name__}: {' '.join(str(error).split())}") from None
    for record in result.history:
        if not (math.isfinite(record.accuracy) and math.isfinite(record.loss)):
            raise CheckFailed(f"round {record.round}: accuracy {record.accuracy}, loss {record.loss} (not finite)")
        if record.failures:
            raise CheckFailed(
                f"round {record.round}: {record.failures} of {record.participants} client updates failed "
                "(screened out); see the round's `dropped` reasons with a plain `fedplug run`"
            )
    last = result.history[-1]
    return f"{len(result.history)} rounds, final accuracy {last.accuracy:.4f}, loss {last.loss:.4f}", (result, vector)


def records(result: Any, fields: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """The run's round records: ``fields`` of each, or every field but wall-clock ones."""
    if fields is not None:
        return [{name: getattr(record, name) for name in fields} for record in result.history]
    return [{key: value for key, value in record.as_dict().items() if key not in VOLATILE} for record in result.history]


def first_difference(ours: Any, theirs: Any, tolerance: float, where: str = "") -> str | None:
    """Where two values differ (numbers by more than ``tolerance``), or None."""
    if isinstance(theirs, dict):
        if not isinstance(ours, dict) or set(ours) != set(theirs):
            return f"{where or 'record'}: keys {sorted(ours) if isinstance(ours, dict) else ours} != {sorted(theirs)}"
        for key in theirs:
            found = first_difference(ours[key], theirs[key], tolerance, f"{where} {key}" if where else str(key))
            if found:
                return found
        return None
    if isinstance(theirs, list):
        if not isinstance(ours, list) or len(ours) != len(theirs):
            return f"{where}: {len(ours) if isinstance(ours, list) else ours} entries != {len(theirs)}"
        for index, (mine, other) in enumerate(zip(ours, theirs)):
            found = first_difference(mine, other, tolerance, f"{where}[{index}]" if where else f"round {index + 1}")
            if found:
                return found
        return None
    if isinstance(theirs, float) and isinstance(ours, (int, float)) and not isinstance(ours, bool):
        both_nan = math.isnan(theirs) and math.isnan(ours)
        if both_nan or abs(ours - theirs) <= tolerance:
            return None
        return f"{where}: {ours!r} != {theirs!r}"
    return None if ours == theirs else f"{where}: {ours!r} != {theirs!r}"


def compare_runs(ours: tuple[Any, Any], reference: tuple[Any, Any], tolerance: float) -> str | None:
    """Where two runs' records or final models differ, or None: every field but wall-clock
    time bit for bit (``tolerance`` 0), else :data:`CONFORMANCE_FIELDS` within it."""
    import torch

    fields = None if tolerance == 0.0 else CONFORMANCE_FIELDS
    found = first_difference(records(ours[0], fields), records(reference[0], fields), tolerance)
    if found:
        return found
    vector, expected = ours[1], reference[1]
    if vector.shape != expected.shape:
        return f"final model: shape {tuple(vector.shape)} != {tuple(expected.shape)}"
    if tolerance == 0.0:
        same = torch.equal(vector, expected)
    else:
        same = torch.allclose(vector, expected, rtol=0.0, atol=tolerance)
    if not same:
        largest = float((vector.double() - expected.double()).abs().max())
        return f"final model differs by up to {largest:.3g}"
    return None


def check_deterministic(config: Any, registry: Any, reference: tuple[Any, Any]) -> str:
    found = compare_runs(run(config, registry), reference, 0.0)
    if found:
        raise CheckFailed(
            f"a second run with the same seed differs ({found}); draw randomness only from the generators "
            "fedplug passes (rng), never from global state or the clock"
        )
    return "a second run with the same seed is identical"


def check_resume(config: Any, registry: Any, reference: tuple[Any, Any], folder: Path) -> str:
    out = folder / "resume"
    try:
        run(config, registry, out, stop_after=1)
    except _StopAfterRound:
        pass
    else:
        raise CheckFailed("the run did not stop after round 1")
    try:
        resumed = run(config, registry, out, resume=True)
    except FedplugError as error:
        raise CheckFailed(f"resuming from the round-1 checkpoint failed: {' '.join(str(error).split())}") from None
    found = compare_runs(resumed, reference, 0.0)
    if found:
        raise CheckFailed(
            f"the run resumed after round 1 differs from the uninterrupted one ({found}); return every piece "
            "of state from state_dict() and restore it in load_state_dict()"
        )
    return "stopped after round 1 and resumed: identical to the uninterrupted run"


def check_engines(data: dict[str, Any], registry: Any, reference: tuple[Any, Any]) -> str:
    from fedplug.config import validate_experiment

    ran, skipped = [], []
    for engine in ("vectorized", "parallel"):
        variant = copy.deepcopy(data)
        variant["train"]["engine"] = engine
        if engine == "parallel":
            variant["train"]["workers"] = 2
        try:
            config = validate_experiment(variant, registry)
            outcome = run(config, registry)
        except ConfigError as error:
            skipped.append(f"{engine} ({' '.join(str(error).split())})")
            continue
        found = compare_runs(outcome, reference, TOLERANCE)
        if found:
            raise CheckFailed(f"engine {engine} differs from the sequential engine: {found}")
        ran.append(engine)
    if not ran:
        raise CheckSkipped("; ".join(skipped))
    return f"{' and '.join(ran)} agree with sequential" + (f"; skipped: {'; '.join(skipped)}" if skipped else "")


def check_flower(config: Any, registry: Any, reference: tuple[Any, Any]) -> str:
    try:
        from fedplug.adapters.flower import LoopbackGrid, make_client_app, run_on_grid
    except ImportError:
        raise CheckSkipped("Flower is not installed (pip install 'fedplug[flower]')") from None
    from fedplug.run.components import Components

    components = Components.build(config.train, registry, config.data.num_clients)
    if components.needs().pooled_data is not None:
        raise CheckSkipped("a component pools raw data in one place: simulator only")
    grid = LoopbackGrid(make_client_app(), config.data.num_clients)
    flower_logger = logging.getLogger("flwr")
    level = flower_logger.level
    flower_logger.setLevel(logging.WARNING)  # Flower narrates every round at INFO
    try:
        flower, strategy = run_on_grid(grid, config, registry=registry, federated_evaluation=False)
    except FedplugError as error:
        raise CheckFailed(f"the run on Flower stopped: {' '.join(str(error).split())}") from None
    finally:
        flower_logger.setLevel(level)
    found = compare_runs((flower, strategy.final_vector), reference, TOLERANCE)
    if found:
        raise CheckFailed(f"Flower's records differ from the simulator's: {found}")
    return "Flower's grid gives the simulator's records"


# ------------------------------------------------------------------- the suite


def check_component(entry: Any, registry: Any, overrides: Sequence[str], folder: Path) -> Iterator[Outcome]:
    """Every check of one component, in order; a failed prerequisite skips what needs it."""
    subject = f"{entry.kind[:-1].replace('_', ' ')} {entry.name}"
    state: dict[str, Any] = {}

    def attempt(name: str, check: Callable[[], str], needs: Sequence[str] = ()) -> Outcome:
        missing = [need for need in needs if need not in state]
        if missing:
            return Outcome("SKIP", subject, name, f"needs {', '.join(missing)} to pass first")
        try:
            detail = check()
        except CheckFailed as failure:
            return Outcome("FAIL", subject, name, str(failure))
        except CheckSkipped as skip:
            return Outcome("SKIP", subject, name, str(skip))
        except Exception as error:  # noqa: BLE001 (the plugin's bug, shown in one line)
            return Outcome("FAIL", subject, name, f"raised {type(error).__name__}: {' '.join(str(error).split())}")
        state[name] = True
        return Outcome("PASS", subject, name, detail)

    data = experiment_for(entry.kind, entry.name, overrides)

    def config_check() -> str:
        state["experiment"] = check_config(entry, data, registry)
        return "defaults validate, a misspelt key is refused, JSON round trip"

    def simulator_check() -> str:
        detail, state["reference"] = check_simulator(state["experiment"], registry)
        return detail

    yield attempt("docs", lambda: check_docs(entry))
    yield attempt("config", config_check)
    yield attempt("simulator", simulator_check, ["config"])
    yield attempt("deterministic", lambda: check_deterministic(state["experiment"], registry, state["reference"]),
                  ["simulator"])
    # A run that differs from itself cannot be compared with another: these need determinism.
    yield attempt("resume", lambda: check_resume(state["experiment"], registry, state["reference"], folder),
                  ["deterministic"])
    yield attempt("engines", lambda: check_engines(data, registry, state["reference"]), ["deterministic"])
    yield attempt("flower", lambda: check_flower(state["experiment"], registry, state["reference"]),
                  ["deterministic"])


def check_plugin(name: str, overrides: Sequence[str] = (), registry: Any = None) -> Iterator[Outcome]:
    """Every check of every component plugin ``name`` registers (see the module docstring).

    Raises:
        PluginError: the plugin is not installed, or it (or another plugin) fails to load.
    """
    from fedplug.plugins import default_registry

    registry = registry if registry is not None else default_registry()
    plugin, entries, trackers = find_plugin(name, registry)
    kinds = ", ".join(f"{entry.kind[:-1].replace('_', ' ')} {entry.name}" for entry in entries)
    yield Outcome("PASS", f"plugin {plugin}", "load", f"registers {kinds or 'no component'}"
                  + (f"; trackers {', '.join(tracker.name for tracker in trackers)}" if trackers else ""))
    for tracker in trackers:
        yield Outcome("SKIP", f"tracker {tracker.name}", "run", "trackers have no conformance checks yet")
    with tempfile.TemporaryDirectory(prefix="fedplug-check-plugin-") as folder:
        for entry in entries:
            yield from check_component(entry, registry, overrides, Path(folder) / entry.kind / entry.name)


# ------------------------------------------------------------------- the CLI


def add_subcommand(commands: Any) -> None:
    """Add ``fedplug check-plugin`` to the CLI's subparsers."""
    parser = commands.add_parser(
        "check-plugin",
        help="run fedplug's conformance checks on an installed plugin (one line per check)",
        description=__doc__.split("\n\n")[0].replace("``", "`") if __doc__ else None,
    )
    parser.add_argument(
        "name", help="the plugin's entry point name (in [project.entry-points.fedplug]) or distribution"
    )
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="change the small test experiment, e.g. --set train.aggregator.step=0.3 (a required parameter) "
        "or --set data.root=PATH (a dataset's files)",
    )
    parser.set_defaults(handler=command)


def command(args: argparse.Namespace) -> int:
    """Run the checks, print one line each as it finishes; exit 1 when one failed."""
    failed = passed = skipped = 0
    for outcome in check_plugin(args.name, args.overrides):
        print(outcome.line(), flush=True)
        failed += outcome.verdict == "FAIL"
        passed += outcome.verdict == "PASS"
        skipped += outcome.verdict == "SKIP"
    total = passed + failed + skipped
    print(f"check-plugin {args.name}: {total} checks, {passed} pass, {failed} fail, {skipped} skip", file=sys.stderr)
    return 1 if failed else 0
