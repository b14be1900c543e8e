"""Stage ``train@<algorithm>-<seed>``: train one algorithm entry with one seed, and log it
to MLflow.

Reads ``data``, ``train``, ``algorithms.<algorithm>`` and ``study`` (DVC deps), plus
``tracking`` (not a DVC dep: where runs are logged does not change what is trained; run
``dvc repro -f`` to log again elsewhere). The resolved config is ``train`` with
``algorithms.<algorithm>`` applied and ``train.seed`` set to the seed. Writes to
``runs/<algorithm>/seed-<seed>/``:

- ``metrics.json`` (final/best accuracy, rounds to target, bytes, and every round),
  ``config.yaml`` (the resolved config), ``run_info.json`` (versions, machine),
  ``model.pt`` (the final global model), written by :func:`fedplug.experiment.run_experiment`;
- ``rounds.csv`` (every round's record, one column per key) and ``curves.png`` (this run's learning curves).

Resuming: the simulator checkpoints after every round to ``checkpoint.pt`` in the same
folder, and the MLflow run id is kept in ``mlflow_run.json``. Neither is a DVC output (DVC
deletes outputs before it re-runs a stage, which would defeat resuming), and both are
deleted once the run completes, so a finished folder holds only the outputs. When a killed
stage is re-run, training continues after the last checkpointed round and the same MLflow
run receives only the rounds it lacks. A checkpoint of a different config (the params
changed since) is discarded and training starts over.

FedDisk (any loss transform with a ``cache_dir``): ``cache_dir`` is set to
``data/density/<algorithm>``, where the ``pretrain_density`` stage left the weights.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    DENSITY_DIR,
    PARTITION_DIR,
    RUNS_DIR,
    read_params,
    run_main,
    set_torch_threads,
)

CHECKPOINT_NAME = "checkpoint.pt"
TRACKING_STATE_NAME = "mlflow_run.json"


def run_folder(runs: Path, algorithm: str, seed: int) -> Path:
    """``runs/<algorithm>/seed-<seed>``."""
    return runs / algorithm / f"seed-{seed}"


def resolved_config(
    params: dict[str, Any], algorithm: str, seed: int, density_dir: Path, registry: Any
) -> Any:
    """The validated experiment config of this run (``algorithms`` left out)."""
    from fedplug.config import component_entry, validate_experiment, with_algorithm

    merged = with_algorithm(params, algorithm)
    train = dict(merged.get("train") or {})
    train["seed"] = seed
    loss_transform = component_entry(train.get("loss_transform"))
    if isinstance(loss_transform, dict) and loss_transform.get("name") in registry.names(
        "loss_transforms"
    ):
        config_class = registry.get("loss_transforms", loss_transform["name"]).config_class
        if "cache_dir" in config_class.model_fields:
            train["loss_transform"] = {**loss_transform, "cache_dir": str(density_dir / algorithm)}
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
        "--density",
        default=str(DENSITY_DIR),
        help=f"density weights folder (default {DENSITY_DIR})",
    )
    parser.add_argument("--runs", default=str(RUNS_DIR), help=f"runs folder (default {RUNS_DIR})")
    args = parser.parse_args(argv)

    from fedplug.plugins import default_registry
    from fedplug.tracking import choose_tracking_uri

    params = read_params(args.params)
    registry = default_registry()
    config = resolved_config(params, args.algorithm, args.seed, Path(args.density), registry)
    # Before any data is loaded or trained: an unreachable tracking server stops here.
    target = choose_tracking_uri(config.tracking.uri, config.tracking.fallback_to_local, Path.cwd())
    if target.fallback_reason:
        print(
            f"train: WARNING: {target.fallback_reason}; logging to the local store {target.uri} instead",
            file=sys.stderr,
        )
    set_torch_threads()
    out = run_folder(Path(args.runs), args.algorithm, args.seed)
    train(config, args.algorithm, args.seed, Path(args.partition), out, target, registry)
    return 0


def train(
    config: Any,
    algorithm: str,
    seed: int,
    partition_path: Path,
    out: Path,
    target: Any,
    registry: Any,
) -> None:
    """Train, log to MLflow, write the run's outputs (see the module docstring)."""
    from common import load_federation

    from fedplug.config import flatten
    from fedplug.experiment import run_experiment
    from fedplug.report import plot_run_curves, write_curve_csv
    from fedplug.simulation.checkpoint import load_checkpoint
    from fedplug.simulation.results import RoundRecord
    from fedplug.simulation.simulator import config_fingerprint, resolve_device
    from fedplug.tracking import MlflowTracker, run_tags

    federation = load_federation(
        config.data, registry, resolve_device(config.train.device), partition_path
    )
    check_density_weights(config, federation)
    out.mkdir(parents=True, exist_ok=True)
    checkpoint = out / CHECKPOINT_NAME
    fingerprint = config_fingerprint(config.train, federation)
    done_before = discard_foreign_checkpoint(checkpoint, fingerprint, load_checkpoint)

    tracker = MlflowTracker.open(
        target.uri,
        config.study.name,
        f"{algorithm}-seed{seed}",
        tags=run_tags(config, algorithm, seed),
        state_path=out / TRACKING_STATE_NAME,
        fingerprint=fingerprint,
    )
    if target.fallback_reason:
        tracker.set_tags({"fedplug.tracking_fallback_from": target.requested_uri})
    print(
        f"train: {algorithm} seed {seed}: MLflow run {tracker.run_id} at {target.uri}"
        + (f" (resumed; holds {len(tracker.logged_rounds)} round(s))" if tracker.resumed else "")
    )
    tracker.log_params({"fedplug.algorithm": algorithm, **flatten(config)})
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

    try:
        result, _ = run_experiment(
            config, out, registry=registry, observers=[report], federation=federation
        )
    except BaseException:
        tracker.fail()
        raise
    history = [record.as_dict() for record in result.history]
    # Every key of every round, so the metrics a component reports (cpd_median) get a column.
    columns = list(dict.fromkeys(key for row in history for key in row))
    write_curve_csv(history, out / "rounds.csv", columns)
    plot_run_curves(
        history, out / "curves.png", f"{algorithm} (seed {seed}) on {config.data.dataset.name}"
    )
    tracker.log_result(result)
    artifacts = {"": out / "config.yaml", "curves": out / "curves.png", "model": out / "model.pt"}
    heatmap = partition_path.parent / "heatmap.png"
    if heatmap.is_file():
        artifacts["partition"] = heatmap
    tracker.log_artifacts(artifacts)
    tracker.log_artifacts({"": out / "metrics.json"})
    tracker.finish()
    checkpoint.unlink(missing_ok=True)
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


def check_density_weights(config: Any, federation: Any) -> None:
    """For a sample-weight loss transform (FedDisk), require the weights the
    ``pretrain_density`` stage computed, so training never computes (and writes) them
    inside another stage's output."""
    from fedplug.algorithms.feddisk import SampleWeightConfig, cache_key, partition_fingerprint
    from fedplug.errors import DataError

    loss_transform = config.train.loss_transform
    if not isinstance(loss_transform, SampleWeightConfig) or loss_transform.cache_dir is None:
        return
    key = cache_key(
        federation.dataset_name,
        partition_fingerprint(federation),
        loss_transform.seed,
        loss_transform,
    )
    path = Path(loss_transform.cache_dir) / f"{key}.npz"
    if not path.is_file():
        raise DataError(
            f"the {loss_transform.name} weights {path} are missing or were computed for other params; "
            "run the pretrain_density stage first (`dvc repro pretrain_density`)"
        )


if __name__ == "__main__":
    run_main(main)
