"""Stage ``train@<algorithm>-<seed>``: train one algorithm entry with one seed, and log it
to MLflow.

Reads ``data``, ``train``, ``algorithms.<algorithm>`` and ``study`` (DVC deps), plus
``tracking`` (not a DVC dep: where runs are logged does not change what is trained; run
``dvc repro -f`` to log again elsewhere). The resolved config is ``train`` with
``algorithms.<algorithm>`` applied and ``train.seed`` set to the seed.

MLflow (:func:`fedplug.tracking.open_tracker`): the run ``<algorithm>-seed<seed>@<group>``
in the experiment ``study.name``, nested under the parent run of its group: the DVC
experiment (``DVC_EXP_NAME``) or, for a plain ``dvc repro``, the checked-out commit
(``repro-<commit>``). The parent is found by its tag ``fedplug.parent``
(:func:`fedplug.project.find_or_create_parent_run`), since every train stage is its own
process. The store is the project's (:func:`fedplug.project.project_root`: ``$DVC_ROOT``),
also when DVC runs the stage in a temporary copy. The model is logged as an MLflow model.

Writes to ``reports/runs/<algorithm>/seed-<seed>/``:

- ``metrics.json`` (final/best accuracy, rounds to target, bytes, and every round),
  ``config.yaml`` (the resolved config), ``model.pt`` (the final global model);
- ``rounds.csv`` (every round's record, one column per key) and ``curves.png`` (this run's
  learning curves);
- beside those DVC outputs, not among them: ``timings.json`` (the measured wall times) and
  ``run_info.json`` (versions, machine, commit). Every output is a function of the params and
  the code, so a re-run on another machine writes it byte for byte and leaves ``dvc.lock``
  as committed; the times and the machine stay out of it (and in MLflow).

Resuming: the simulator checkpoints after every round to ``checkpoint.pt`` in the same
folder, and the MLflow run id is kept in ``mlflow_run.json``. Neither is a DVC output (DVC
deletes outputs before it re-runs a stage, which would defeat resuming), and both are
deleted once the run completes, so a finished folder holds only the outputs. When a killed
stage is re-run, training continues after the last checkpointed round and the same MLflow
run receives only the rounds it lacks. A checkpoint of a different config (the params
changed since) is discarded and training starts over.

The folder is claimed for the run (:mod:`fedplug.output_folder`): locked against a second
process and marked with the config's fingerprint. The stage owns it like DVC owns its
outputs: a fedplug run folder of other params is replaced (only the files its marker lists
are deleted), but a folder holding files fedplug did not write is refused with one line.

A component with a ``cache_dir`` (one that keeps its setup phase in a file,
:meth:`fedplug.components.ComponentConfig.setup_file`): ``cache_dir`` is set to
``data/setup/<algorithm>``, where the ``setup`` stage left the file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    PARTITION_DIR,
    RUNS_DIR,
    SETUP_DIR,
    read_params,
    run_main,
    set_torch_threads,
)

CHECKPOINT_NAME = "checkpoint.pt"
TRACKING_STATE_NAME = "mlflow_run.json"
TIMINGS_NAME = "timings.json"
RUN_FILES = (
    "metrics.json", "rounds.csv", "curves.png", "model.pt", "config.yaml", "run_info.json",
    TIMINGS_NAME, CHECKPOINT_NAME, TRACKING_STATE_NAME,
)
"""What this stage writes into a run folder: a folder holding only these (written before
output markers existed) is adopted as this stage's."""


def run_folder(runs: Path, algorithm: str, seed: int) -> Path:
    """``<runs>/<algorithm>/seed-<seed>``."""
    return runs / algorithm / f"seed-{seed}"


def resolved_config(
    params: dict[str, Any], algorithm: str, seed: int, setup_dir: Path, registry: Any
) -> Any:
    """The validated experiment config of this run (``algorithms`` left out), every
    component with a ``cache_dir`` pointed at ``setup_dir/<algorithm>``."""
    from fedplug.config import ALGORITHM_SLOTS, component_entry, validate_experiment, with_algorithm

    merged = with_algorithm(params, algorithm)
    train = dict(merged.get("train") or {})
    train["seed"] = seed
    for slot in ALGORITHM_SLOTS:
        entry = component_entry(train.get(slot))
        if isinstance(entry, dict) and entry.get("name") in registry.names(f"{slot}s"):
            config_class = registry.get(f"{slot}s", entry["name"]).config_class
            if "cache_dir" in config_class.model_fields:
                train[slot] = {**entry, "cache_dir": str(setup_dir / algorithm)}
    document = {key: merged[key] for key in ("study", "tracking", "data") if key in merged}
    document["train"] = train
    return validate_experiment(document, registry)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithm", required=True, help="a label of params.yaml's `algorithms`")
    parser.add_argument(
        "--seed", required=True, type=int, help="training seed (one of study.seeds)"
    )
    parser.add_argument("--params", default="params.yaml", help="params file (default params.yaml)")
    parser.add_argument(
        "--partition", default=str(PARTITION_DIR / "partition.npz"), help="partition file"
    )
    parser.add_argument(
        "--setup",
        default=str(SETUP_DIR),
        help=f"the setup stage's folder (default {SETUP_DIR})",
    )
    parser.add_argument("--runs", default=str(RUNS_DIR), help=f"runs folder (default {RUNS_DIR})")
    args = parser.parse_args(argv)

    from fedplug.plugins import default_registry
    from fedplug.project import project_root
    from fedplug.tracking import choose_tracking_uri

    params = read_params(args.params)
    registry = default_registry()
    config = resolved_config(params, args.algorithm, args.seed, Path(args.setup), registry)
    # The project's store, also when DVC runs this stage in a temporary copy (--temp, queue).
    root = project_root(args.params)
    target = None
    if config.tracking.enabled:
        # Before any data is loaded or trained: an unreachable tracking server stops here.
        target = choose_tracking_uri(config.tracking.uri, config.tracking.fallback_to_local, root)
        if target.fallback_reason:
            print(
                f"train: WARNING: {target.fallback_reason}; logging to the local store {target.uri} instead",
                file=sys.stderr,
            )
    set_torch_threads()
    out = run_folder(Path(args.runs), args.algorithm, args.seed)
    train(config, args.algorithm, args.seed, Path(args.partition), out, target, registry, root)
    return 0


def open_run_tracker(
    config: Any, algorithm: str, seed: int, out: Path, target: Any, fingerprint: str, root: Path
) -> Any:
    """The run's tracker, nested under the parent run of its DVC experiment (or of the
    plain ``dvc repro`` of the checked-out commit), named ``<label>-seed<seed>@<group>``;
    a disabled tracker when ``tracking.enabled`` is false."""
    from common import dvc_run_group

    from fedplug.project import find_or_create_parent_run, relocate_project_store
    from fedplug.tracking import open_tracker

    tags = {"fedplug.algorithm": algorithm, "fedplug.seed": str(seed)}
    if target is None:
        return open_tracker(config, out, run_name=algorithm, enabled=False)
    relocate_project_store(target.uri, root)
    group = dvc_run_group(root)
    parent = find_or_create_parent_run(
        target.uri,
        config.study.name,
        group.key,
        group.label,
        tags={**group.tags, "fedplug.study": config.study.name},
    )
    run_name = f"{algorithm}-seed{seed}@{group.label}"
    tracker = open_tracker(
        config,
        out,
        run_name=run_name,
        parent=parent,
        tags={**tags, **group.tags},
        fingerprint=fingerprint,
        project_root=root,
        uri=target.uri,
    )
    if tracker.resumed:
        # A re-run after a kill may belong to another experiment (a new `dvc exp run`):
        # the continued run moves under the parent of the experiment that finishes it.
        tracker.set_tags({"mlflow.parentRunId": parent, "mlflow.runName": run_name, **group.tags})
    if target.fallback_reason:
        tracker.set_tags({"fedplug.tracking_fallback_from": target.requested_uri})
    return tracker


def train(
    config: Any,
    algorithm: str,
    seed: int,
    partition_path: Path,
    out: Path,
    target: Any,
    registry: Any,
    root: Path,
) -> None:
    """Train, log to MLflow, write the run's outputs (see the module docstring)."""
    from common import load_federation

    from fedplug.output_folder import claim, files_named
    from fedplug.run.model import resolve_device
    from fedplug.run_folder import output_fingerprint

    federation = load_federation(
        config.data, registry, resolve_device(config.train.device), partition_path
    )
    check_setup_files(config, federation)
    with claim(
        out, output_fingerprint(config), force=True, legacy=files_named(RUN_FILES),
        option="run folder", force_option=None,
    ) as owned:
        train_claimed(config, algorithm, seed, partition_path, owned, target, registry, root, federation)


def train_claimed(
    config: Any,
    algorithm: str,
    seed: int,
    partition_path: Path,
    owned: Any,
    target: Any,
    registry: Any,
    root: Path,
    federation: Any,
) -> None:
    """:func:`train` in the claimed run folder ``owned``."""
    from fedplug.experiment import run_experiment
    from fedplug.output_folder import write_text, write_through_path
    from fedplug.report import plot_run_curves, write_curve_csv
    from fedplug.run.checkpoint import load_checkpoint
    from fedplug.run.results import RoundRecord, split_wall_clock
    from fedplug.simulation.simulator import config_fingerprint

    out = owned.path
    checkpoint = out / CHECKPOINT_NAME
    fingerprint = config_fingerprint(config.train, federation)
    done_before = discard_foreign_checkpoint(checkpoint, fingerprint, load_checkpoint)

    tracker = open_run_tracker(config, algorithm, seed, out, target, fingerprint, root)
    if tracker.run_id is not None:
        print(
            f"train: {algorithm} seed {seed}: MLflow run {tracker.run_id} at {tracker.uri}"
            + (f" (resumed; holds {len(tracker.logged_rounds)} round(s))" if tracker.resumed else "")
        )
    if done_before:
        tracker.log_history(RoundRecord.from_dict(record) for record in done_before)
        print(f"train: resuming from {checkpoint} after round {len(done_before)}")

    def report(record: RoundRecord) -> None:
        tracker.log_round(record)
        print(
            f"train: {algorithm} seed {seed} round {record.round}/{config.train.rounds}: "
            f"accuracy {record.accuracy:.4f}, loss {record.loss:.4f}, {record.seconds:.1f} s",
            flush=True,
        )

    with tracker:  # finished, or marked failed on any error
        result, simulator = run_experiment(
            config, out, registry=registry, observers=[report], federation=federation
        )
        # What DVC hashes must reproduce byte for byte on a re-run: the measured times go to
        # timings.json beside the outputs (not an output), as does run_info.json.
        reproducible, timings = split_wall_clock(result.summary())
        write_text(out / "metrics.json", json.dumps(reproducible, indent=2) + "\n")
        write_text(out / TIMINGS_NAME, json.dumps(timings, indent=2) + "\n")
        history = reproducible["history"]
        # Every key of every round, so the metrics a component reports each round get a column.
        columns = list(dict.fromkeys(key for row in history for key in row))
        write_through_path(out / "rounds.csv", lambda path: write_curve_csv(history, path, columns))
        title = f"{algorithm} (seed {seed}) on {config.data.dataset.name}"
        write_through_path(out / "curves.png", lambda path: plot_run_curves(history, path, title))
        tracker.log_result(result)
        artifacts = {"curves": out / "curves.png"}
        heatmap = partition_path.parent / "heatmap.png"
        if heatmap.is_file():
            artifacts["partition"] = heatmap
        tracker.log_artifacts(artifacts)
        for name in ("config.yaml", "metrics.json", "run_info.json", TIMINGS_NAME):
            tracker.log_artifacts({"": out / name})
        tracker.log_model(simulator.model, federation.test_x[:5])
    owned.remove(CHECKPOINT_NAME)
    summary = result.summary()
    print(
        f"train: {algorithm} seed {seed}: final accuracy {summary['final_accuracy']:.4f}, "
        f"best {summary['best_accuracy']:.4f}, {summary['total_bytes']} bytes"
    )


def discard_foreign_checkpoint(
    checkpoint: Path, fingerprint: str, load_checkpoint: Any
) -> list[dict[str, Any]] | None:
    """The rounds a checkpoint of *this* config holds (None when there is none). A
    checkpoint of another config, or an unreadable one, is deleted: the params changed
    since it was written, so training starts over."""
    from fedplug.errors import TrainingError

    try:
        state = load_checkpoint(checkpoint, fingerprint)
    except TrainingError as error:
        print(f"train: discarding {checkpoint}: {error}")
        checkpoint.unlink(missing_ok=True)
        return None
    return None if state is None else list(state["history"])


def check_setup_files(config: Any, federation: Any) -> None:
    """For every component that keeps its setup phase in a file under its ``cache_dir``,
    require the file the ``setup`` stage computed, so training never computes (and
    writes) it inside another stage's output."""
    from fedplug.config import ALGORITHM_SLOTS
    from fedplug.errors import DataError

    for slot in ALGORITHM_SLOTS:
        component = getattr(config.train, slot)
        cache_dir = getattr(component, "cache_dir", None)
        file_name = component.setup_file(federation) if cache_dir is not None else None
        if file_name is not None and not (Path(cache_dir) / file_name).is_file():
            raise DataError(
                f"the {component.name} setup file {Path(cache_dir) / file_name} is missing or was computed for "
                "other params; run the setup stage first (`dvc repro setup`)"
            )


if __name__ == "__main__":
    run_main(main)
