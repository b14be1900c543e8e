"""``fedplug compare``: algorithms x metrics over seeds, as a table that fits a terminal.

Runs are read from run folders (the pipeline's ``reports/runs/<algorithm>/seed-<s>/`` and
``fedplug run``'s ``runs/<name>/``, each holding a ``metrics.json``) or from an MLflow
experiment (:func:`runs_from_mlflow`). Pure functions group them by algorithm
(:func:`summarize`: mean ± population standard deviation over seeds, ``ddof=0`` as in
``reports/comparison.md``), rank them (:func:`rank`) and lay the table out within a width
(:func:`render_table`); :func:`command` is the I/O edge.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import shutil
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedplug.errors import ConfigError, DataError, TrackingError
from fedplug.safe_files import read_regular_bytes

DEFAULT_FOLDER = Path("reports") / "runs"
"""Where the DVC pipeline's train stages write their runs."""
DEFAULT_WIDTH = 100
"""The table's width when the terminal's is unknown (output piped to a file)."""
METRICS = ("final", "best", "rounds", "bytes", "seconds")
DEFAULT_METRICS = ("final", "best", "rounds")
RANK_BY = ("final", "best", "rounds")
SEED_FOLDER = re.compile(r"seed-(\d+)")
HASH_SUFFIX = re.compile(r"-[0-9a-f]{8,64}$")
"""``fedplug run``'s default folder name ends in the config's hash: one run per seed."""
MIN_ALGORITHM_WIDTH = 12


# ------------------------------------------------------------------------------ inputs


@dataclass(frozen=True)
class RunSummary:
    """One finished run: what ``metrics.json`` (or the MLflow run) says about it."""

    algorithm: str
    seed: int
    final_accuracy: float | None
    best_accuracy: float | None
    rounds_to_target: float | None
    """None: the run never reached the target."""
    target_accuracy: float | None
    total_bytes: float | None = None
    seconds: float | None = None
    source: str = ""
    """Where it came from (a file or an MLflow run id), for messages."""


def _number(value: Any) -> float | None:
    """A finite float, or None (metrics.json writes NaN as null)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def run_from_metrics(algorithm: str, seed: int, metrics: dict[str, Any], source: str = "") -> RunSummary:
    """A :class:`RunSummary` from the content of a run's ``metrics.json``."""
    return RunSummary(
        algorithm=algorithm,
        seed=seed,
        final_accuracy=_number(metrics.get("final_accuracy")),
        best_accuracy=_number(metrics.get("best_accuracy")),
        rounds_to_target=_number(metrics.get("rounds_to_target")),
        target_accuracy=_number(metrics.get("target_accuracy")),
        total_bytes=_number(metrics.get("total_bytes")),
        seconds=_number(metrics.get("total_seconds")),
        source=source,
    )


# --------------------------------------------------------------------------- summaries


@dataclass(frozen=True)
class Statistic:
    """Mean and population standard deviation (``ddof=0``) of ``count`` values."""

    mean: float
    std: float
    count: int


def mean_std(values: Sequence[float]) -> Statistic | None:
    """:class:`Statistic` of ``values``; None for none."""
    if not values:
        return None
    mean = sum(values) / len(values)
    variance = sum((value - mean) ** 2 for value in values) / len(values)
    return Statistic(mean, math.sqrt(variance), len(values))


@dataclass(frozen=True)
class AlgorithmRow:
    """One row of the table: an algorithm over its seeds."""

    algorithm: str
    seeds: tuple[int, ...]
    final: Statistic | None
    best: Statistic | None
    rounds: Statistic | None
    """Over the seeds that reached the target only (``reached`` of them)."""
    reached: int
    total_bytes: Statistic | None
    seconds: Statistic | None


def summarize(runs: Iterable[RunSummary]) -> list[AlgorithmRow]:
    """Group ``runs`` by algorithm (in order of first appearance).

    Raises:
        DataError: two runs have the same algorithm and seed.
    """
    grouped: dict[str, dict[int, RunSummary]] = {}
    for run in runs:
        seeds = grouped.setdefault(run.algorithm, {})
        if run.seed in seeds:
            raise DataError(
                f"two runs of {run.algorithm} seed {run.seed} ({seeds[run.seed].source} and {run.source}); "
                "compare one folder (or MLflow parent run) at a time"
            )
        seeds[run.seed] = run
    rows = []
    for algorithm, by_seed in grouped.items():
        members = [by_seed[seed] for seed in sorted(by_seed)]

        def values(
            pick: Callable[[RunSummary], float | None], members: list[RunSummary] = members
        ) -> list[float]:
            return [value for value in map(pick, members) if value is not None]

        reached = values(lambda run: run.rounds_to_target)
        rows.append(
            AlgorithmRow(
                algorithm=algorithm,
                seeds=tuple(sorted(by_seed)),
                final=mean_std(values(lambda run: run.final_accuracy)),
                best=mean_std(values(lambda run: run.best_accuracy)),
                rounds=mean_std(reached),
                reached=len(reached),
                total_bytes=mean_std(values(lambda run: run.total_bytes)),
                seconds=mean_std(values(lambda run: run.seconds)),
            )
        )
    return rows


def rank(rows: Sequence[AlgorithmRow], by: str) -> list[AlgorithmRow]:
    """Best first: highest mean final or best accuracy, or fewest mean rounds to the
    target (an algorithm that reached it with fewer of its seeds ranks after one that
    reached it with more); rows without the value last; ties by name."""
    if by not in RANK_BY:
        raise ConfigError(f"--by {by!r}: choose one of {', '.join(RANK_BY)}")

    def key(row: AlgorithmRow) -> tuple[Any, ...]:
        if by == "rounds":
            share = row.reached / len(row.seeds) if row.seeds else 0.0
            return (row.rounds is None, -share, row.rounds.mean if row.rounds else 0.0, row.algorithm)
        statistic = row.final if by == "final" else row.best
        return (statistic is None, -statistic.mean if statistic else 0.0, row.algorithm)

    return sorted(rows, key=key)


# ------------------------------------------------------------------------------ layout


@dataclass(frozen=True)
class Symbols:
    """The characters the table uses; plain ASCII where the terminal cannot show others."""

    plus_minus: str = "±"
    ellipsis: str = "…"


ASCII = Symbols(plus_minus="+/-", ellipsis="...")


def format_statistic(statistic: Statistic | None, digits: int, symbols: Symbols, unit: str = "") -> str:
    """``0.8753`` (one value), ``0.8753 ± 0.0040`` (several), ``-`` (none)."""
    if statistic is None:
        return "-"
    if statistic.count == 1:
        return f"{statistic.mean:.{digits}f}{unit}"
    return f"{statistic.mean:.{digits}f} {symbols.plus_minus} {statistic.std:.{digits}f}{unit}"


def format_rounds(row: AlgorithmRow, symbols: Symbols) -> str:
    """``6`` / ``6.5 ± 0.5`` over the seeds that reached the target, ``(2/3)`` appended
    when not all did, ``never`` when none did."""
    if row.rounds is None:
        return "never"
    statistic = row.rounds
    digits = 0 if statistic.count == 1 and float(statistic.mean).is_integer() else 1
    text = format_statistic(statistic, digits, symbols)
    if row.reached < len(row.seeds):
        text += f" ({row.reached}/{len(row.seeds)})"
    return text


def format_bytes(statistic: Statistic | None) -> str:
    """Mean traffic in decimal units: ``79.7 MB``."""
    if statistic is None:
        return "-"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(statistic.mean) >= size:
            return f"{statistic.mean / size:.1f} {unit}"
    return f"{statistic.mean:.0f} B"


@dataclass(frozen=True)
class Column:
    """A column: its header in full and abbreviated, and how a row's cell reads."""

    name: str
    header: str
    short: str
    cell: Callable[[AlgorithmRow, int, Symbols], str]


def columns(target: float | None) -> dict[str, Column]:
    """Every metric column; ``target`` names the rounds-to-target column."""
    target_text = f"{100 * target:g}%" if target is not None else "target"
    return {
        "final": Column("final", "final accuracy", "final", lambda row, d, s: format_statistic(row.final, d, s)),
        "best": Column("best", "best accuracy", "best", lambda row, d, s: format_statistic(row.best, d, s)),
        "rounds": Column(
            "rounds", f"rounds to {target_text}", f"to {target_text}", lambda row, d, s: format_rounds(row, s)
        ),
        "bytes": Column("bytes", "traffic", "bytes", lambda row, d, s: format_bytes(row.total_bytes)),
        "seconds": Column(
            "seconds", "train seconds", "secs", lambda row, d, s: format_statistic(row.seconds, 1, s)
        ),
    }


def truncate(text: str, width: int, symbols: Symbols) -> str:
    """``text`` cut to ``width`` characters, its end replaced by an ellipsis."""
    if len(text) <= width:
        return text
    keep = max(width - len(symbols.ellipsis), 1)
    return text[:keep] + symbols.ellipsis


def shorten_name(name: str, width: int, symbols: Symbols) -> str:
    """``name`` cut to ``width`` characters in the middle (``fedavg_fau…ropout_0.5``): the
    start and the end both stay, and the end is where variants of one algorithm differ."""
    if len(name) <= width:
        return name
    keep = max(width - len(symbols.ellipsis), 2)
    head = (keep + 1) // 2
    return name[:head] + symbols.ellipsis + name[len(name) - (keep - head):]


def _lay_out(
    rows: Sequence[AlgorithmRow],
    chosen: Sequence[Column],
    *,
    short: bool,
    digits: int,
    algorithm_width: int | None,
    symbols: Symbols,
) -> list[str]:
    headers = ["#", "algorithm", "seeds"] + [column.short if short else column.header for column in chosen]
    names = [row.algorithm for row in rows]
    if algorithm_width is not None:
        names = [shorten_name(name, algorithm_width, symbols) for name in names]
    body = [
        [str(place), name, str(len(row.seeds))] + [column.cell(row, digits, symbols) for column in chosen]
        for place, (row, name) in enumerate(zip(rows, names), start=1)
    ]
    widths = [max(len(line[index]) for line in [headers, *body]) for index in range(len(headers))]
    left = {1}  # the algorithm's name reads left to right; numbers line up on the right

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            cell.ljust(width) if index in left else cell.rjust(width)
            for index, (cell, width) in enumerate(zip(cells, widths))
        ).rstrip()

    return [line(headers), line(["-" * width for width in widths]), *(line(cells) for cells in body)]


def render_table(
    rows: Sequence[AlgorithmRow],
    metrics: Sequence[str] = DEFAULT_METRICS,
    *,
    target: float | None = None,
    width: int = DEFAULT_WIDTH,
    symbols: Symbols = Symbols(),
) -> list[str]:
    """The table's lines, none wider than ``width``: full headers and 4 digits if they fit,
    else algorithm names cut in the middle (down to :data:`MIN_ALGORITHM_WIDTH`
    characters), then abbreviated headers, then 3 digits, and as a last resort the
    rightmost metric columns left out (a last line names them)."""
    available = columns(target)
    unknown = [name for name in metrics if name not in available]
    if unknown:
        raise ConfigError(f"--metrics: unknown {', '.join(unknown)}; choose from {', '.join(METRICS)}")
    chosen = [available[name] for name in metrics]
    longest = max((len(row.algorithm) for row in rows), default=0)
    for count in range(len(chosen), -1, -1):
        kept = chosen[:count]
        cuts = [None, *range(longest - 1, MIN_ALGORITHM_WIDTH - 1, -1)]
        for short, digits, algorithm_width in (
            *((False, 4, cut) for cut in cuts),
            *((True, 4, cut) for cut in cuts),
            (True, 3, min(longest, MIN_ALGORITHM_WIDTH)),
        ):
            lines = _lay_out(rows, kept, short=short, digits=digits, algorithm_width=algorithm_width, symbols=symbols)
            if max(len(text) for text in lines) <= width:
                left_out = [column.name for column in chosen[count:]]
                if left_out:
                    note = f"not shown (wider than {width} columns): {', '.join(left_out)}"
                    lines.append(truncate(note, width, symbols))
                return lines
    raise ConfigError(f"--width {width}: too narrow for the table; give at least 40")


def title(rows: Sequence[AlgorithmRow], by: str, source: str, width: int, symbols: Symbols) -> str:
    """One line: what is ranked by what, and where the runs came from."""
    what = {"final": "mean final accuracy", "best": "mean best accuracy", "rounds": "fewest rounds to target"}[by]
    spread = f"mean {symbols.plus_minus} std over seeds"
    text = f"{len(rows)} algorithm{'s' if len(rows) != 1 else ''} ranked by {what} ({spread}); runs: {source}"
    return truncate(text, width, symbols)


def common_target(runs: Sequence[RunSummary]) -> float | None:
    """The runs' target accuracy when they share one (None otherwise)."""
    targets = {run.target_accuracy for run in runs}
    return targets.pop() if len(targets) == 1 else None


# --------------------------------------------------------------------- reading runs


RUN_FILE_ADVICE = "delete that run folder or run it again"
"""What to do about a run folder's file that cannot be read."""


def _read_run_file(path: Path) -> bytes:
    """The bytes of a run folder's file: a FIFO, socket or device there is refused in one
    line (:class:`DataError`), not waited on."""
    return read_regular_bytes(path, advice=RUN_FILE_ADVICE, error=DataError)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        content = json.loads(_read_run_file(path))
    except (OSError, ValueError) as error:
        raise DataError(f"{path} is not readable JSON ({error}); {RUN_FILE_ADVICE}") from None
    if not isinstance(content, dict):
        raise DataError(f"{path} holds no metrics object; delete that run folder or run it again")
    return content


def _without_seed(config: dict[str, Any]) -> str:
    """A short hash of a ``config.yaml``'s data and train sections, ``train.seed`` left
    out: the runs of one config over several seeds share it."""
    train = dict(config.get("train") or {})
    train.pop("seed", None)
    text = json.dumps({"data": config.get("data"), "train": train}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:6]


def runs_from_folders(folders: Sequence[Path]) -> list[RunSummary]:
    """Every finished run (a folder holding ``metrics.json``) under ``folders``.

    A run folder named ``seed-<s>`` is the pipeline's: its algorithm is its parent's path
    below the folder searched (``fedavg``). Any other run folder is ``fedplug run``'s: its
    seed is its ``config.yaml``'s ``train.seed`` and its algorithm its path without the
    trailing config hash (``mnist-fedprox``); runs of different configs (other than the
    seed) that would get one name get the config's hash appended.

    Raises:
        ConfigError: a folder does not exist, or holds no finished run.
        DataError: a ``metrics.json`` or ``config.yaml`` cannot be read.
    """
    import yaml

    runs: list[RunSummary] = []
    for folder in folders:
        if not folder.is_dir():
            raise ConfigError(
                f"{folder} is not a folder of runs; run `make repro` (writes reports/runs) or "
                "`fedplug run` (writes runs/) first, or give the folder: fedplug compare PATH"
            )
        single = folder / "metrics.json"
        found = [single] if single.is_file() else sorted(folder.rglob("metrics.json"))
        if not found:
            raise ConfigError(
                f"no finished runs (metrics.json) under {folder}; run `make repro` or `fedplug run` first, "
                "or give the folder that holds them: fedplug compare PATH (or --mlflow EXPERIMENT)"
            )
        named: dict[str, set[str]] = {}
        pending: list[tuple[str, str, int, dict[str, Any], Path]] = []
        for path in found:
            run_folder = path.parent
            relative = run_folder.relative_to(folder) if run_folder != folder else Path(run_folder.name)
            seed_match = SEED_FOLDER.fullmatch(run_folder.name)
            if seed_match:
                parent = relative.parent if relative.parent != Path(".") else Path(folder.name)
                pending.append((parent.as_posix(), "", int(seed_match.group(1)), _read_json(path), path))
                continue
            config_path = run_folder / "config.yaml"
            try:
                config = yaml.safe_load(_read_run_file(config_path))
            except (OSError, yaml.YAMLError) as error:
                raise DataError(
                    f"{config_path} is missing or unreadable ({type(error).__name__}); a run folder of "
                    "`fedplug run` holds config.yaml beside metrics.json: delete that folder or run it again"
                ) from None
            if not isinstance(config, dict):
                raise DataError(f"{config_path} holds no config; delete that folder or run it again")
            label = HASH_SUFFIX.sub("", relative.as_posix())
            variant = _without_seed(config)
            named.setdefault(label, set()).add(variant)
            seed = int(((config.get("train") or {}).get("seed")) or 0)
            pending.append((label, variant, seed, _read_json(path), path))
        for label, variant, seed, metrics, path in pending:
            if variant and len(named[label]) > 1:
                label = f"{label}-{variant}"
            runs.append(run_from_metrics(label, seed, with_timings(metrics, path.parent), source=str(path)))
    return runs


def with_timings(metrics: dict[str, Any], folder: Path) -> dict[str, Any]:
    """``metrics`` plus the measured ``total_seconds`` of the pipeline's run folders, which
    keep their times in ``timings.json`` beside ``metrics.json`` (pipelines/train.py)."""
    timings = folder / "timings.json"
    if "total_seconds" in metrics or not timings.is_file():
        return metrics
    try:
        measured = json.loads(_read_run_file(timings))
    except (OSError, ValueError):
        return metrics
    seconds = measured.get("total_seconds") if isinstance(measured, dict) else None
    return {**metrics, "total_seconds": seconds}


def runs_from_mlflow(uri: str, experiment: str, parent: str | None = None) -> list[RunSummary]:
    """The latest finished run of each algorithm and seed (tags ``fedplug.algorithm``,
    ``fedplug.seed``) in MLflow ``experiment``; with ``parent``, only the children of the
    parent run(s) of that name (a DVC experiment's, ``repro-<commit>``).

    Raises:
        TrackingError: the store does not exist, or holds no such experiment or runs.
    """
    from fedplug.project import local_store_path

    database = local_store_path(uri)
    if database is not None and not database.is_file():
        raise TrackingError(
            f"no MLflow store at {database}; run `make repro` or `fedplug run` first, or name the store "
            "with --tracking-uri (or MLFLOW_TRACKING_URI)"
        )
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        names = sorted(item.name for item in client.search_experiments())
        raise TrackingError(
            f"no MLflow experiment {experiment!r} in {uri}; experiments there: {', '.join(names) or 'none'}"
        )
    runs = _search(client, found.experiment_id, "attributes.status = 'FINISHED'")
    if parent is not None:
        parents = {run.info.run_id for run in runs if run.data.tags.get("mlflow.runName") == parent}
        parents |= {
            run.info.run_id
            for run in _search(client, found.experiment_id, f"attributes.run_name = '{_quoted(parent)}'")
        }
        if not parents:
            raise TrackingError(f"no run named {parent!r} in MLflow experiment {experiment!r}; see `make ui`")
        runs = [run for run in runs if run.data.tags.get("mlflow.parentRunId") in parents]
    latest: dict[tuple[str, int], Any] = {}
    for run in runs:
        tags = run.data.tags
        if "fedplug.algorithm" not in tags or not str(tags.get("fedplug.seed", "")).isdigit():
            continue
        key = (tags["fedplug.algorithm"], int(tags["fedplug.seed"]))
        if key not in latest or run.info.start_time > latest[key].info.start_time:
            latest[key] = run
    if not latest:
        raise TrackingError(
            f"no finished fedplug runs in MLflow experiment {experiment!r}"
            + (f" under {parent!r}" if parent else "")
            + "; run `make repro` or `fedplug run` first"
        )
    summaries = []
    for (algorithm, seed), run in latest.items():
        metrics = dict(run.data.metrics)
        target = run.data.params.get("study.target_accuracy")
        metrics["target_accuracy"] = float(target) if target not in (None, "None") else None
        summaries.append(run_from_metrics(algorithm, seed, metrics, source=f"MLflow run {run.info.run_id}"))
    return sorted(summaries, key=lambda run: (run.algorithm, run.seed))


def _quoted(text: str) -> str:
    return text.replace("\\", "\\\\").replace("'", "\\'")


def _search(client: Any, experiment_id: str, filter_string: str) -> list[Any]:
    runs: list[Any] = []
    token = None
    while True:
        page = client.search_runs([experiment_id], filter_string=filter_string, max_results=1000, page_token=token)
        runs.extend(page)
        token = page.token
        if not token:
            return runs


# --------------------------------------------------------------------------- the CLI


def add_subcommand(commands: Any) -> None:
    """Add ``fedplug compare`` to the CLI's subparsers."""
    parser = commands.add_parser(
        "compare",
        help="a table of algorithms x metrics (mean ± std over seeds) from run folders or MLflow",
        description=(
            "Print algorithms x metrics (final and best accuracy, rounds to the target; mean ± std over "
            "seeds, and how many seeds) from run folders (default: the pipeline's reports/runs) or an MLflow "
            "experiment, ranked by one metric, fitting the terminal (100 columns when piped)."
        ),
    )
    parser.add_argument(
        "paths", nargs="*", type=Path, metavar="PATH",
        help="folders of runs: reports/runs (the pipeline's, default), runs (fedplug run's), or one run folder",
    )
    parser.add_argument("--by", choices=RANK_BY, default="final", help="rank by this metric (default final)")
    parser.add_argument(
        "--metrics", default=",".join(DEFAULT_METRICS),
        help=f"comma-separated columns, from {', '.join(METRICS)} (default {','.join(DEFAULT_METRICS)})",
    )
    parser.add_argument("--mlflow", metavar="EXPERIMENT", help="read the runs of this MLflow experiment instead")
    parser.add_argument("--parent", metavar="RUN_NAME", help="with --mlflow: only the children of this parent run")
    parser.add_argument(
        "--tracking-uri", help="with --mlflow: the store (default $MLFLOW_TRACKING_URI, else ./mlflow.db)"
    )
    parser.add_argument("--width", type=int, help="fit this many columns (default: the terminal's, else 100)")
    parser.set_defaults(handler=command)


def command(args: argparse.Namespace) -> int:
    """Run ``fedplug compare``: read the runs, print the ranked table."""
    width = args.width or shutil.get_terminal_size((DEFAULT_WIDTH, 24)).columns
    metrics = [name.strip() for name in args.metrics.split(",") if name.strip()]
    if args.mlflow:
        if args.paths:
            raise ConfigError("give run folders or --mlflow EXPERIMENT, not both")
        from fedplug.tracking import resolve_tracking_uri

        uri = args.tracking_uri or resolve_tracking_uri(None, Path.cwd())
        runs = runs_from_mlflow(uri, args.mlflow, args.parent)
        source = f"MLflow {args.mlflow!r}" + (f" / {args.parent}" if args.parent else "")
    else:
        if args.parent or args.tracking_uri:
            raise ConfigError("--parent and --tracking-uri go with --mlflow EXPERIMENT")
        folders = list(args.paths) or [DEFAULT_FOLDER]
        runs = runs_from_folders(folders)
        source = ", ".join(str(folder) for folder in folders)
    symbols = Symbols() if _can_show(Symbols()) else ASCII
    rows = rank(summarize(runs), args.by)
    lines = render_table(rows, metrics, target=common_target(runs), width=width, symbols=symbols)
    print("\n".join([title(rows, args.by, source, width, symbols), *lines]))
    return 0


def _can_show(symbols: Symbols) -> bool:
    encoding = getattr(sys.stdout, "encoding", None)
    if not encoding:  # an in-memory stream takes any text
        return True
    try:
        (symbols.plus_minus + symbols.ellipsis).encode(encoding)
    except (UnicodeEncodeError, LookupError):
        return False
    return True
