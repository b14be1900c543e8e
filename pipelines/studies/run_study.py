"""Run one paper-reproduction study: every grid cell x draw x algorithm x seed, then its report.

    python pipelines/studies/run_study.py pipelines/studies/fedshift.yaml
    python pipelines/studies/run_study.py pipelines/studies/fedshift.yaml --set data.dataset=fashion_mnist
    python pipelines/studies/run_study.py pipelines/studies/fedshift.yaml --no-mlflow --report-only

Each run trains into ``<out>/<run-id>/`` (default ``reports/studies/<name>[-<dataset>]``)
with :func:`fedplug.experiment.run_experiment`: ``metrics.json``, ``config.yaml``,
``run_info.json``, ``model.pt``, plus the runner's ``provenance.json`` (whether the
checkout had uncommitted changes of the code).

**Reuse.** A run counts as done only when its folder's ``config.yaml`` (the resolved
config) equals the run's, apart from fields that cannot change results
(:data:`fedplug.study.run_folders.IGNORED_CONFIG_FIELDS`), or when the study's committed results file
holds a record of it with the same config hash. A folder of other settings (e.g. trained
with ``--set train.rounds=1``) stops the runner with one line that names the run and the
difference; ``--redo-mismatched`` deletes such folders and trains them again. A run killed
mid-way continues from its per-round checkpoint, and a checkpoint the run cannot use
(written for another config or federation) stops the runner the same way.

**Results.** After training (and with ``--report-only``) the runner writes
``pipelines/studies/results/<out folder name>.jsonl``: one compact line per finished run
(:func:`fedplug.study.run_record`), kept under git, from which
``pipelines/studies/render_results.py`` renders docs/results.md. Records already in that
file count as done, so a study can be finished over several sessions or machines, but not
over several commits: each record carries its resolved ``config`` and code version
(``fedplug``, ``commit``, ``dirty``), and when one grid cell's records come from different
commits (a checkout with uncommitted changes counts as its own version) the runner stops
with one line naming the cell, the commits and their runs, before the results file and the
report are written (runs trained so far stay in their folders); ``--allow-mixed-commits``
writes them anyway, with a warning. With
``--set`` overrides that change results (anything but ``data.dataset``, ``train.engine``,
``train.workers``, ``data.root`` and ``tracking.*``) or ``--out``, no results file is
written unless ``--results PATH`` names one.

**Tuning.** A spec with ``tune:`` has its searches run first (:mod:`fedplug.study.tuning`);
each finished trial is one line of ``<results>.trials.jsonl`` beside the results file
(:mod:`fedplug.study.trials`: its values, state, score, per-round validation curves,
resolved config and code version), appended as it ends, so an interrupted search goes on
from its recorded trials. Without a results file no trials are kept.

**Report.** ``<out>/summary.md``, ``summary.json`` and the spec's plots, from the records.
Each run is logged to the MLflow experiment ``study-<name>`` (``base.tracking.uri``, else
``$MLFLOW_TRACKING_URI``, else the project's ``sqlite:///<root>/mlflow.db``) unless
``--no-mlflow``, as a child run (named by its run id) of one parent run per study output
folder (named after it, found again by its tag ``fedplug.parent``, so a resumed study
adds to the same parent). After training, the summary goes to the parent run too (metrics
``<cell labels>/<algorithm>.<column>``, e.g. ``0.1/fedavgm0.9.final_accuracy``), which is
marked FINISHED.

**Parallel.** ``--jobs N`` (default: all cores) trains the pending runs as Ray tasks, N at a
time, one torch thread each (:mod:`fedplug.study.parallel`); ``--jobs 1``, or a single
pending run, trains them here one after another. ``--address ray://host:10001`` (or
``host:6379``, or ``auto``) sends them to a running Ray cluster instead (docs/pipeline.md,
"Studies on a Ray cluster"). Results are the sequential runner's. A run that fails in a
Ray task is listed in ``<out>/failed.json`` (with why) and the others go on; the runner
then exits with status 1, and later invocations skip the listed runs until
``--retry-failed`` trains them again.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "pipelines"))

from common import run_main, set_torch_threads  # noqa: E402

CHECKPOINT_NAME = "checkpoint.pt"
TRACKING_STATE_NAME = "mlflow_run.json"
PROVENANCE_NAME = "provenance.json"
RUN_FILES = (CHECKPOINT_NAME, TRACKING_STATE_NAME, PROVENANCE_NAME, "config.yaml", "metrics.json", "run_info.json",
             "model.pt")
"""What the runner writes into a run folder. Folders are claimed and marked
(:mod:`fedplug.output_folder`), and only the files their marker lists are ever deleted; a
folder written before markers existed counts as the runner's when it holds only these."""
RESULTS_DIR = ROOT / "pipelines" / "studies" / "results"
NEUTRAL_OVERRIDES = ("data.dataset", "data.root", "train.engine", "train.workers", "tracking")
"""``--set`` keys after which the runner still writes the default results file: the
dataset gets its own output folder and results file; the others cannot change results."""
CODE_PATHS = ("fedplug", "pyproject.toml", "pipelines/common.py", "pipelines/studies/run_study.py")
"""What a run's results depend on: uncommitted changes here make a record ``dirty``."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec", help="study file, e.g. pipelines/studies/fedshift.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override the base config, e.g. data.dataset=fashion_mnist (repeatable)")
    parser.add_argument("--out", default=None, help="output folder (default reports/studies/<name>, plus "
                        "-<dataset> when --set changes the dataset)")
    parser.add_argument("--results", default=None, metavar="PATH",
                        help="results file (default pipelines/studies/results/<out folder name>.jsonl, "
                        "only without --out and without --set overrides that change results)")
    parser.add_argument("--no-results", action="store_true", help="write no results file")
    parser.add_argument("--no-mlflow", action="store_true", help="do not log to MLflow")
    parser.add_argument("--report-only", action="store_true", help="train nothing; report the finished runs")
    parser.add_argument("--only", default=None, help="train only runs whose id contains this text")
    parser.add_argument("--redo-mismatched", action="store_true",
                        help="delete run folders trained or started with other settings and train them again")
    parser.add_argument("--jobs", type=int, default=None, metavar="N",
                        help="runs trained at once as Ray tasks (default: all cores, or the cluster's CPUs with "
                        "--address); 1 trains them one after another in this process")
    parser.add_argument("--address", default=None, metavar="ADDRESS",
                        help="train on the running Ray cluster at ADDRESS (ray://host:10001, host:6379 or auto)")
    parser.add_argument("--retry-failed", action="store_true",
                        help="train again the runs that failed before (listed in <out>/failed.json)")
    parser.add_argument("--allow-mixed-commits", action="store_true",
                        help="write and report the records even when a grid cell's runs come from different "
                        "commits (or a checkout with uncommitted changes); a warning names them")
    args = parser.parse_args(argv)
    process_code_version(refresh=True)  # the code this process imports, before any commit made while it trains
    if args.jobs is not None and args.jobs < 1:
        from fedplug.errors import ConfigError

        raise ConfigError(f"--jobs {args.jobs}: give at least 1 (1 trains the runs one after another)")

    from fedplug.config import read_yaml
    from fedplug.plugins import default_registry
    from fedplug.study import expand_study, parse_study

    spec = parse_study(read_yaml(args.spec), args.spec)
    registry = default_registry()
    runs = expand_study(spec, registry, args.overrides)
    out = Path(args.out) if args.out else default_out(spec.name, runs)
    check_study_folder(out, spec, runs)
    results = results_path(args, out)
    if spec.tune is not None:  # the search's choice goes into the runs' configs (fedplug.study.tuning)
        set_torch_threads()  # the trials train in this process: with torch's default (every core) they crowd each other
        from fedplug.study import load_records
        from fedplug.study.trials import trials_path
        from fedplug.study.tuning import apply_tuning

        runs = apply_tuning(spec, runs, out, registry, mlflow_root=None if args.no_mlflow else ROOT,
                            fingerprint=study_fingerprint(spec), legacy=study_layout(runs),
                            search_allowed=not args.report_only,
                            recorded=load_records(results) if results is not None else (),
                            trials_file=trials_path(results) if results is not None else None,
                            code_version=process_code_version())
    out.mkdir(parents=True, exist_ok=True)
    committed, dropped = committed_records(results, runs)
    plan = plan_runs(runs, out, committed, only=args.only)
    print(f"study {spec.name}: {len(runs)} runs, {len(plan.done)} done"
          + (f" ({len(plan.from_results)} from {display_path(results)})" if plan.from_results else "")
          + (f", {len(plan.mismatched)} of other settings" if plan.mismatched else "")
          + f", {len(plan.todo)} to train -> {out}", flush=True)
    parent = None
    failed: list[str] = []
    if not args.report_only:
        if plan.mismatched and not args.redo_mismatched:
            raise_mismatch(plan.mismatched, out)
        todo = skip_failed(spec, plan.todo + [run for run, _ in plan.mismatched], out, retry=args.retry_failed)
        kept = {run.run_id for run in todo}
        for run, reason in plan.mismatched:
            if run.run_id in kept:
                remove_run_folder(out / run.run_id)
                print(f"study {spec.name}: deleted {out / run.run_id} ({reason}); training it again", flush=True)
        parent = train_all(spec, todo, out, registry, mlflow=not args.no_mlflow, redo=args.redo_mismatched,
                           runs=runs, jobs=args.jobs, address=args.address)
        failed = settle_failures(spec, runs, out, todo)
    elif plan.mismatched:
        print(f"study {spec.name}: WARNING: {len(plan.mismatched)} run folders of other settings are left out of the "
              f"report, e.g. {plan.mismatched[0][0].run_id}: {plan.mismatched[0][1]}", file=sys.stderr)
    records = collect_records(runs, out, committed, args.overrides)
    check_code_versions(spec, records, out, results, allow=args.allow_mixed_commits)
    if results is not None and (records or results.is_file()):
        from fedplug.study import dump_records

        results.parent.mkdir(parents=True, exist_ok=True)
        results.write_text(dump_records(records))
        note = f"; dropped {dropped} records of other settings" if dropped else ""
        print(f"study {spec.name}: {len(records)} run records in {display_path(results)}{note}", flush=True)
    elif results is None and not args.no_results:
        print(f"study {spec.name}: no results file written (--out or --set given); --results PATH writes one", flush=True)
    write_study_report(spec, runs, records, out)
    if parent is not None:
        log_study_summary(parent, out, list(spec.grid))
    return 1 if failed else 0


def display_path(path: Path | None) -> str:
    if path is None:
        return "-"
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def results_path(args: argparse.Namespace, out: Path) -> Path | None:
    """``--results``, else the default file when neither ``--out`` nor an override that
    changes results was given, else None (nothing written)."""
    if args.no_results:
        return None
    if args.results:
        return Path(args.results)
    changing = [item for item in args.overrides
                if not any(item.partition("=")[0].strip() == key or item.startswith(key + ".")
                           for key in NEUTRAL_OVERRIDES)]
    if args.out or changing:
        return None
    return RESULTS_DIR / f"{out.name}.jsonl"


def committed_records(path: Path | None, runs: list[Any]) -> tuple[dict[str, dict[str, Any]], int]:
    """The records of the results file that belong to a run of this study with the same
    config hash and target (run id -> record), and how many others the file holds."""
    from fedplug.study import config_hash, load_records

    if path is None:
        return {}, 0
    wanted = {run.run_id: run for run in runs}
    kept: dict[str, dict[str, Any]] = {}
    records = load_records(path)
    for record in records:
        run = wanted.get(record["run"])
        if (run is not None and record.get("config_hash") == config_hash(run.config.model_dump(mode="json"))
                and record.get("target") == run.config.study.target_accuracy):
            kept[record["run"]] = record
    return kept, len(records) - len(kept)


class Plan(NamedTuple):
    """What the runner does with each run."""

    done: list[Any]
    """Finished with the run's settings: in its folder or in the results file."""
    from_results: list[Any]
    """The done runs whose only record is the results file's."""
    mismatched: list[tuple[Any, str]]
    """Folders of other settings (with the reason) whose runs the results file lacks."""
    todo: list[Any]
    """New or started runs (within ``--only``)."""


def plan_runs(runs: list[Any], out: Path, committed: dict[str, Any], only: str | None) -> Plan:
    from fedplug.study import run_folder_state

    done, from_results, mismatched, todo = [], [], [], []
    for run in runs:
        state = run_folder_state(run, out / run.run_id)
        if state.status == "done":
            done.append(run)
        elif run.run_id in committed:
            done.append(run)
            from_results.append(run)
        elif only is not None and only not in run.run_id:
            continue
        elif state.status == "mismatched":
            mismatched.append((run, state.reason))
        else:
            todo.append(run)
    return Plan(done, from_results, mismatched, todo)


def raise_mismatch(mismatched: list[tuple[Any, str]], out: Path) -> None:
    """Stop with one line: which run folder holds other settings, and what to do."""
    from fedplug.errors import ConfigError

    run, reason = mismatched[0]
    if len(mismatched) == 1:
        raise ConfigError(f"run {run.run_id} in {out}: {reason}; delete {out / run.run_id} or pass "
                          "--redo-mismatched to train it again")
    raise ConfigError(f"{len(mismatched)} run folders in {out} hold other settings than the study, e.g. run "
                      f"{run.run_id}: {reason}; delete them (or {out}) or pass --redo-mismatched to train them again")


class StudyParent(NamedTuple):
    """The MLflow parent run of a study output folder."""

    uri: str
    run_id: str


def parent_key(out: Path, root: Path) -> str:
    """``study:<out folder>``, relative to the project root when inside it."""
    resolved = out.resolve()
    try:
        return f"study:{resolved.relative_to(root)}"
    except ValueError:
        return f"study:{resolved}"


def log_study_summary(parent: StudyParent, out: Path, axes: list[str]) -> None:
    """The study's summary on the parent run, then FINISHED: one metric per summary row and
    numeric column (``<cell labels>/<algorithm>.<column>``, e.g. ``0.1/fedavgm0.9.final_accuracy``),
    ``summary.md``, ``summary.json`` and the figures."""
    from fedplug.project import log_parent_summary

    rows = read_json_or(out / "summary.json", [])
    metrics = {}
    for row in rows:
        label = "/".join([*(str(row[axis]) for axis in axes), str(row["algorithm"])])
        for key, value in row.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                metrics[f"{label}.{key}"] = value
    files = [("", out / "summary.md"), ("", out / "summary.json")]
    files += [("figures", figure) for figure in sorted(out.glob("*.png"))]
    log_parent_summary(parent.uri, parent.run_id, metrics, files)
    print(f"study: summary logged to MLflow parent run {parent.run_id} at {parent.uri}")


REPORT_FILES = ("summary.md", "summary.json")
"""What :func:`write_study_report` writes into the study folder, besides the spec's figures."""


def study_fingerprint(spec: Any) -> str:
    """What a study folder's marker holds: the study it reports (its run folders carry
    their own markers, one per run config)."""
    return f"fedplug study {spec.name}"


def study_layout(runs: list[Any]) -> Any:
    """The ``legacy`` test of a study folder written before markers: only this study's run
    folders, its report files and ``.png`` figures (which are then adopted)."""
    run_ids = {run.run_id for run in runs}

    def recognise(folder: Path) -> list[str] | None:
        from fedplug.output_folder import OWN_NAMES

        found = []
        for entry in folder.iterdir():
            if entry.name in OWN_NAMES or (entry.name in run_ids and entry.is_dir() and not entry.is_symlink()):
                continue
            if entry.is_symlink() or not entry.is_file():
                return None
            if entry.name not in REPORT_FILES and entry.suffix != ".png":
                return None
            found.append(entry.name)
        return found

    return recognise


def check_study_folder(out: Path, spec: Any, runs: list[Any]) -> None:
    """Refuse, before anything is trained or written, a study ``--out`` that fedplug must
    not write into: a folder of other files, another study's folder, ``/``, the home
    folder or the project root (:func:`fedplug.output_folder.inspect`). The folder is not
    locked for the whole study (runners with ``--only`` may share it); each run folder is,
    and the report is written under a short claim."""
    from fedplug.output_folder import inspect

    inspect(out, study_fingerprint(spec), legacy=study_layout(runs), force_option=None)


def default_out(name: str, runs: list[Any]) -> Path:
    """``reports/studies/<name>`` for MNIST, ``reports/studies/<name>-<dataset>`` otherwise,
    so runs on another dataset never mix with (or skip because of) the MNIST ones."""
    dataset = runs[0].config.data.dataset.name
    return Path("reports/studies") / (name if dataset == "mnist" else f"{name}-{dataset}")


def train_all(spec: Any, todo: list[Any], out: Path, registry: Any, *, mlflow: bool, redo: bool,
              runs: list[Any], jobs: int | None = 1, address: str | None = None) -> StudyParent | None:
    """Train ``todo`` (in study order), reusing one federation for runs that share a data
    config: here one after another when ``jobs`` (None: all cores) or the number of runs is
    1 and no Ray ``address`` is given, else as Ray tasks (:func:`train_parallel`). Returns
    the MLflow parent run (None without MLflow or when nothing was left to train)."""
    from fedplug.data.build import build_federation
    from fedplug.run.model import resolve_device

    order = {run.run_id: index for index, run in enumerate(runs)}
    todo = sorted(todo, key=lambda run: order[run.run_id])
    if not todo:
        return None
    parent = None
    if mlflow:
        from fedplug.project import find_or_create_parent_run, project_root, relocate_project_store
        from fedplug.tracking import choose_tracking_uri

        tracking = todo[0].config.tracking
        root = project_root(ROOT / "params.yaml")  # $DVC_ROOT under DVC, else this checkout
        target = choose_tracking_uri(tracking.uri, tracking.fallback_to_local, root)
        if target.fallback_reason:
            print(f"study: WARNING: {target.fallback_reason}; logging to {target.uri}", file=sys.stderr)
        relocate_project_store(target.uri, root)
        parent = StudyParent(target.uri, find_or_create_parent_run(
            target.uri, f"study-{spec.name}", parent_key(out, root), out.name,
            tags={"fedplug.study": spec.name},
        ))
        print(f"study {spec.name}: MLflow parent run {parent.run_id} at {target.uri}", flush=True)
    if address is not None or min(jobs or os.cpu_count() or 1, len(todo)) > 1:
        train_parallel(spec, todo, out, runs, parent, redo=redo, jobs=jobs, address=address)
        return parent
    set_torch_threads()
    cached_key, federation = None, None
    for index, run in enumerate(todo, 1):
        key = json.dumps(run.config.data.model_dump(mode="json"), sort_keys=True)
        if key != cached_key:
            federation = None  # free the previous one first: only one federation in memory
            federation = build_federation(run.config.data, registry, resolve_device(run.config.train.device))
            cached_key = key
        check_checkpoint(run, out / run.run_id, federation, redo=redo)
        started = time.perf_counter()
        summary = train_one(spec, run, out / run.run_id, registry, federation, parent)
        print(f"[{index}/{len(todo)}] {run.run_id}: final accuracy {summary['final_accuracy']:.4f}, "
              f"{time.perf_counter() - started:.0f} s", flush=True)
    return parent


def train_parallel(spec: Any, todo: list[Any], out: Path, runs: list[Any], parent: StudyParent | None, *,
                   redo: bool, jobs: int | None, address: str | None) -> None:
    """:func:`train_all` on Ray: each run one task (:func:`train_task`), ``jobs`` at a time
    (None: all cores, or the cluster's CPUs), one progress bar; a failed run goes into
    ``failed.json`` (:func:`record_failure`) and the others go on."""
    from fedplug.study.parallel import RunProgress, RunTask, ray_session, train_on_ray

    tasks = [RunTask.of(spec, run, out / run.run_id, parent, redo) for run in todo]
    if address is None:
        jobs = min(jobs or os.cpu_count() or 1, len(todo))
    with ray_session(address, jobs) as in_flight:
        print(f"study {spec.name}: training {len(todo)} runs as Ray tasks, {in_flight} at a time on "
              f"{address or 'a local Ray'}", flush=True)
        progress = RunProgress(len(todo))
        try:
            train_on_ray(tasks, train_task, in_flight=in_flight,
                         on_outcome=lambda outcome: (progress.update(outcome), record_failure(spec, runs, out, outcome)))
        finally:
            progress.close()


def train_task(spec: Any, run: Any, folder: Path, registry: Any, federation: Any, parent: StudyParent | None, *,
               redo: bool, provenance: dict[str, Any]) -> dict[str, Any]:
    """One run in a Ray task (:func:`fedplug.study.parallel.train_in_worker` calls it):
    :func:`check_checkpoint`, then :func:`train_one` with ``provenance`` (the Ray node)."""
    check_checkpoint(run, folder, federation, redo=redo)
    return train_one(spec, run, folder, registry, federation, parent, provenance=provenance)


def record_failure(spec: Any, runs: list[Any], out: Path, outcome: Any) -> None:
    """Add a failed run's outcome to the study folder's ``failed.json`` (under a short claim
    of the folder, like the report)."""
    if outcome.error is None:
        return
    from fedplug.output_folder import claim, write_text
    from fedplug.study.parallel import FAILED_NAME, read_failures, updated_failures

    with claim(out, study_fingerprint(spec), legacy=study_layout(runs), force_option=None):
        failures = updated_failures(read_failures(out), [outcome], when=time.strftime("%Y-%m-%dT%H:%M:%S"))
        write_text(out / FAILED_NAME, json.dumps(failures, indent=2) + "\n")


def skip_failed(spec: Any, todo: list[Any], out: Path, *, retry: bool) -> list[Any]:
    """``todo`` without the runs ``failed.json`` lists (one line says so), or all of it with
    ``retry`` (``--retry-failed``)."""
    from fedplug.study.parallel import FAILED_NAME, read_failures

    failures = read_failures(out)
    skipped = [run for run in todo if run.run_id in failures]
    if not skipped or retry:
        return todo
    first = skipped[0].run_id
    print(f"study {spec.name}: skipping {len(skipped)} runs that failed before (listed in {out / FAILED_NAME}), e.g. "
          f"{first}: {failures[first]['error']}; --retry-failed trains them again", flush=True)
    return [run for run in todo if run.run_id not in failures]


def settle_failures(spec: Any, runs: list[Any], out: Path, todo: list[Any]) -> list[str]:
    """Drop the runs that are now done from ``failed.json`` (the file goes when none is
    left), print the runs of ``todo`` that failed, and return their ids."""
    from fedplug.output_folder import claim, write_text
    from fedplug.study import run_folder_state
    from fedplug.study.parallel import FAILED_NAME, read_failures

    failures = read_failures(out)
    left = {run_id: entry for run_id, entry in failures.items()
            if not any(run.run_id == run_id and run_folder_state(run, out / run_id).status == "done" for run in runs)}
    if left != failures:
        with claim(out, study_fingerprint(spec), legacy=study_layout(runs), force_option=None) as owned:
            if left:
                write_text(out / FAILED_NAME, json.dumps(left, indent=2) + "\n")
            else:
                owned.remove(FAILED_NAME)
    failed = [run.run_id for run in todo if run.run_id in left]
    for run_id in failed:
        print(f"study {spec.name}: run {run_id} FAILED: {left[run_id]['error']}", file=sys.stderr)
    if failed:
        print(f"study {spec.name}: {len(failed)} of {len(todo)} runs failed (listed in {out / FAILED_NAME}); fix the "
              "cause and run again with --retry-failed", file=sys.stderr)
    return failed


def check_checkpoint(run: Any, folder: Path, federation: Any, *, redo: bool) -> None:
    """Refuse (one line), or with ``redo`` delete, a started run whose checkpoint this run
    cannot resume: its config.yaml matches, so the federation (data or partition code) or
    the checkpoint itself differs."""
    from fedplug.errors import ConfigError, TrainingError
    from fedplug.run.checkpoint import load_checkpoint
    from fedplug.simulation.simulator import config_fingerprint

    checkpoint = folder / CHECKPOINT_NAME
    if not checkpoint.is_file():
        return
    try:
        load_checkpoint(checkpoint, config_fingerprint(run.config.train, federation))
    except TrainingError as error:
        reason = str(error).split(";")[0]
        if "different config" in reason:  # config.yaml matched: the fingerprint's other inputs differ
            reason += " (its config.yaml matches, so the federation differs, e.g. after a change of the data or " \
                      "partition code, or the engine does)"
        if not redo:
            raise ConfigError(f"run {run.run_id}: {reason}; delete {folder} or pass --redo-mismatched to train it "
                              "again") from None
        remove_run_folder(folder)
        print(f"deleted {folder} ({reason}); training it again", flush=True)


def remove_run_folder(folder: Path) -> None:
    """Delete the files the runner wrote in ``folder`` (its marker's list), then the folder;
    a folder holding anything else is refused with one line (its files stay)."""
    from fedplug.output_folder import files_named, remove_owned_folder

    remove_owned_folder(folder, legacy=files_named(RUN_FILES))
    if folder.exists():
        from fedplug.errors import ConfigError

        raise ConfigError(f"run folder {folder} holds files the study runner did not write; move them away, "
                          "or delete the folder yourself, and run the study again")


def git_dirty(root: Path = ROOT) -> bool | None:
    """Whether the checkout has uncommitted changes of :data:`CODE_PATHS` (None outside git)."""
    try:
        completed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", *CODE_PATHS],
                                   capture_output=True, text=True, timeout=10, check=False, cwd=root)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return bool(completed.stdout.strip()) if completed.returncode == 0 else None


CODE_VERSION: dict[str, Any] = {}
"""What :func:`process_code_version` read (empty until it reads)."""


def process_code_version(*, refresh: bool = False) -> dict[str, Any]:
    """The commit and dirty flag of the code this process runs, read once: at the runner's
    start (:func:`main` refreshes it) or, in a Ray worker, at its first run. Read again at
    each run, a long study would name whatever the checkout holds by then (a commit made
    while it trains), not the code it imported."""
    from fedplug.run_folder import git_commit

    if refresh or not CODE_VERSION:
        CODE_VERSION.clear()
        CODE_VERSION.update(git_commit=git_commit(ROOT), git_dirty=git_dirty())
    return dict(CODE_VERSION)


def utc_now() -> str:
    """The time now, UTC, to the second (ISO 8601, e.g. ``2026-11-26T21:04:05+00:00``)."""
    from datetime import UTC, datetime

    return datetime.now(UTC).replace(microsecond=0).isoformat()


def run_clock() -> dict[str, Any]:
    """When a run (or its resumed part) started and the cores of the machine that trains it;
    with the ``finished_at`` written when it ends, the records give a study's wall time
    (:func:`fedplug.study.provenance.wall_time`)."""
    return {"started_at": utc_now(), "host_cores": os.cpu_count()}


def train_one(spec: Any, run: Any, folder: Path, registry: Any, federation: Any,
              parent: StudyParent | None, *, provenance: dict[str, Any] | None = None) -> dict[str, Any]:
    """Train one run into ``folder`` (resuming its checkpoint), logged to MLflow as a child
    of ``parent`` (nothing logged when ``parent`` is None); ``provenance`` adds entries to
    ``provenance.json`` (e.g. the Ray node)."""
    from fedplug.output_folder import claim, files_named
    from fedplug.run_folder import output_fingerprint

    # Locked against a second runner, marked as this run's (a folder of files the runner
    # did not write is refused).
    with claim(folder, output_fingerprint(run.config), legacy=files_named(RUN_FILES), option="run folder",
               force_option=None):
        return train_claimed(spec, run, folder, registry, federation, parent, provenance=provenance)


def train_claimed(spec: Any, run: Any, folder: Path, registry: Any, federation: Any,
                  parent: StudyParent | None, *, provenance: dict[str, Any] | None = None) -> dict[str, Any]:
    """:func:`train_one` in the claimed ``folder``."""
    from fedplug.experiment import run_experiment
    from fedplug.run_folder import write_json
    from fedplug.simulation.simulator import config_fingerprint
    from fedplug.tracking import open_tracker

    written = {**process_code_version(), **(provenance or {}), **run_clock()}
    write_json(folder / PROVENANCE_NAME, written)
    tags = {f"study.{axis}": label for axis, label in run.cell.items()}
    tags.update({"study.name": spec.name, "fedplug.algorithm": run.algorithm, "fedplug.seed": str(run.seed),
                 "study.draw": str(run.draw)})
    tracker = open_tracker(
        run.config, folder, run_name=run.run_id, enabled=parent is not None,
        parent=parent.run_id if parent is not None else None, tags=tags,
        fingerprint=config_fingerprint(run.config.train, federation), project_root=ROOT,
        experiment_name=f"study-{spec.name}", uri=parent.uri if parent is not None else None,
    )
    if tracker.resumed and parent is not None:
        tracker.set_tags({"mlflow.parentRunId": parent.run_id})
    with tracker:  # finished, or marked failed on any error
        result, simulator = run_experiment(run.config, folder, registry=registry, observers=[tracker.log_round],
                                           federation=federation)
        tracker.log_result(result)
        for name in ("config.yaml", "metrics.json", "run_info.json"):
            tracker.log_artifacts({"": folder / name})
        tracker.log_model(simulator.model, federation.test_x[:5])
    write_json(folder / PROVENANCE_NAME, {**written, "finished_at": utc_now()})
    (folder / CHECKPOINT_NAME).unlink(missing_ok=True)  # a name the runner owns: resume state, now done
    return result.summary()


def read_run_json(path: Path) -> Any:
    """The JSON document a run or study folder keeps at ``path``: a FIFO, socket or device
    there is refused in one line, not waited on.

    Raises:
        ConfigError: ``path`` is not a regular file.
        OSError: as ``open()`` (``FileNotFoundError`` for a missing file).
    """
    from fedplug.safe_files import read_regular_bytes

    return json.loads(read_regular_bytes(path, advice="remove it and run the study again"))


def read_json_or(path: Path, missing: Any) -> Any:
    """:func:`read_run_json`, or ``missing`` when no file is at ``path``."""
    try:
        return read_run_json(path)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):  # as is_file() said: none
        return missing


def collect_records(runs: list[Any], out: Path, committed: dict[str, dict[str, Any]],
                    overrides: list[str]) -> list[dict[str, Any]]:
    """One record per finished run, in study order: from its folder when it holds the run
    finished with the run's settings, else the results file's."""
    from fedplug.study import run_folder_state, run_record

    records = []
    for run in runs:
        folder = out / run.run_id
        if run_folder_state(run, folder).status == "done":
            records.append(run_record(
                run, read_run_json(folder / "metrics.json"), run.config.study.target_accuracy,
                info=read_json_or(folder / "run_info.json", None),
                provenance=read_json_or(folder / PROVENANCE_NAME, None),
                overrides=overrides,
            ))
        elif run.run_id in committed:
            records.append(committed[run.run_id])
    return records


def check_code_versions(spec: Any, records: list[dict[str, Any]], out: Path, results: Path | None, *,
                        allow: bool) -> None:
    """Refuse (one line), or with ``allow`` (``--allow-mixed-commits``) warn about, records
    of one grid cell trained with different code (:func:`fedplug.study.provenance.describe_mixed_commits`).
    Called after training and before the results file and the report are written: the runs
    trained here are already in their folders, so a re-run with the flag trains nothing."""
    from fedplug.study.provenance import describe_mixed_commits

    mixed = describe_mixed_commits(records)
    if mixed is None:
        return
    if allow:
        print(f"study {spec.name}: WARNING: runs of one cell come from different code (--allow-mixed-commits): {mixed}",
              file=sys.stderr, flush=True)
        return
    from fedplug.errors import ConfigError

    where = f" and their lines in {display_path(results)}" if results is not None else ""
    raise ConfigError(f"study {spec.name}: {mixed}; to compare them on one commit, delete the run folders of the other "
                      f"versions (under {out}){where} and run the study again on a clean checkout of the commit you "
                      "keep, or pass --allow-mixed-commits to write and report them as they are (the runs trained "
                      "so far stay in their folders and are not trained again)")


def write_study_report(spec: Any, runs: list[Any], records: list[dict[str, Any]], out: Path) -> list[dict[str, Any]] | None:
    """``summary.md``, ``summary.json`` and the spec's plots, from the records; returns the
    summary rows (None without records)."""
    from fedplug.output_folder import claim

    with claim(out, study_fingerprint(spec), legacy=study_layout(runs), force_option=None):
        return write_claimed_report(spec, runs, records, out)


def write_claimed_report(spec: Any, runs: list[Any], records: list[dict[str, Any]], out: Path) -> list[dict[str, Any]] | None:
    """:func:`write_study_report` in the claimed study folder ``out``."""
    from fedplug.output_folder import write_text, write_through_path
    from fedplug.study import draw_figures, summarise, summary_table
    from fedplug.study.statistics import PLATEAU_TOLERANCE, PLATEAU_WINDOW

    if not records:
        for name in ("summary.md", "summary.json"):  # a report of runs that no longer count would mislead
            (out / name).unlink(missing_ok=True)
        print(f"study {spec.name}: no finished runs in {out}; nothing to report")
        return None
    rows = summarise(records, spec.headline_metric, spec.baseline, spec.baselines)
    rounds = ", ".join(str(value) for value in sorted({int(record["rounds"]) for record in records}))
    write_text(out / "summary.json", json.dumps(rows, indent=2) + "\n")
    figures = draw_figures(spec, records, out, save=write_through_path)
    dataset = records[0].get("dataset")
    lines = [
        f"# Study {spec.name} ({dataset})",
        "",
        spec.description.strip(),
        "",
        f"{len(records)} of {len(runs)} runs finished, {rounds} rounds each. Accuracy is on the global test set; "
        "mean ± sample std over "
        "the runs (partition draws × training seeds). Rounds to target: first round at or above the target, "
        "averaged over the runs that reached it."
        + (f" Comparisons against {spec.baseline} (or the baseline the row names): the mean difference over "
           "partition draws with its 95% t interval and the draws won, then the runs of the same draw and seed won. "
           f"Plateaued: runs whose best accuracy of the last {PLATEAU_WINDOW} rounds is less than "
           f"{PLATEAU_TOLERANCE} above their best before."
           if spec.baseline or spec.baselines else ""),
        "",
        summary_table(rows, list(spec.grid), float(records[0]["target"]), labels=spec.labels, baseline=spec.baseline,
                      columns=spec.columns, baselines=spec.baselines),
        *[f"![{name}]({name})\n" for name in figures],
    ]
    write_text(out / "summary.md", "\n".join(lines))
    print(f"study {spec.name}: report in {out / 'summary.md'}")
    return rows


if __name__ == "__main__":
    run_main(main)
