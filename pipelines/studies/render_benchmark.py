"""Render docs/benchmark.md and its heatmap from the cross-paper benchmark's records.

    python pipelines/studies/render_benchmark.py          # rewrite docs/benchmark.md, draw the heatmap
    python pipelines/studies/render_benchmark.py --check  # exit 1 when the page or its figure is out of date

Inputs, all committed: the spec (``--spec``, default ``pipelines/studies/benchmark.yaml``),
its reported runs (``--results``, default ``pipelines/studies/results/benchmark.jsonl``)
and its tuning trials (``--trials``, default the results file's ``.trials.jsonl``
sibling; no file: no trials shown). Outputs: the page (``--page``, default
``docs/benchmark.md``) and, once there are records, ``img/benchmark_heatmap.png`` beside
it. The numbers come from :mod:`fedplug.study.benchmark_numbers`, the Markdown from
:mod:`fedplug.study.benchmark_page`, the figure from :mod:`fedplug.study.benchmark_heatmap`;
the records are checked as ``render_results.py`` checks a study's (one line naming the
file and run when one is not data the page can show).

``--check`` writes nothing. It compares the page's text with what would be rendered, and
the heatmap by its data, not its pixels: the PNG carries the hash of the data it was
drawn from, which must be the current data's (pixels differ between matplotlib versions).
Exit 1 with one line saying what is stale.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "pipelines"))

from render_results import check_records, read_text_or

DEFAULT_SPEC = "pipelines/studies/benchmark.yaml"
DEFAULT_RESULTS = "pipelines/studies/results/benchmark.jsonl"
DEFAULT_PAGE = "docs/benchmark.md"


def shown(path: Path) -> str:
    """``path`` relative to the repository root when it lies inside it, else as given."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def trials_path(results: Path) -> Path:
    """``benchmark.trials.jsonl`` beside ``benchmark.jsonl``."""
    return results.with_name(results.name.removesuffix(".jsonl") + ".trials.jsonl")


def load_spec(path: Path) -> Any | None:
    """The benchmark spec at ``path``; None when it is not committed yet."""
    from fedplug.config import read_yaml
    from fedplug.study.spec import parse_study

    if not path.is_file():
        return None
    return parse_study(read_yaml(path), shown(path))


def command_text(args: argparse.Namespace) -> str:
    """The command that renders this page: the defaults left out, other paths named."""
    from fedplug.study.benchmark_page import COMMAND

    options = [(flag, value, default) for flag, value, default in (
        ("--spec", args.spec, DEFAULT_SPEC), ("--results", args.results, DEFAULT_RESULTS),
        ("--trials", args.trials, None), ("--page", args.page, DEFAULT_PAGE))]
    return " ".join([COMMAND] + [f"{flag} {shown(Path(value))}" for flag, value, default in options
                                 if value is not None and shown(Path(value)) != default])


def render(args: argparse.Namespace) -> tuple[str, dict[str, Any] | None]:
    """The page's text and the heatmap's data (None before any reported run)."""
    from fedplug.study.benchmark_heatmap import heatmap_data
    from fedplug.study.benchmark_numbers import benchmark_tables, reported_records
    from fedplug.study.benchmark_page import Sources, load_trials, render_page
    from fedplug.study.records import load_records

    spec_path, results_path = Path(args.spec), Path(args.results)
    trials = Path(args.trials) if args.trials else trials_path(results_path)
    spec = load_spec(spec_path)
    records = load_records(results_path)
    if spec is not None:
        records = check_records(records, shown(results_path), spec)
    sources = Sources(spec=shown(spec_path), results=shown(results_path), trials=shown(trials),
                      command=command_text(args))
    tables = benchmark_tables(spec, records) if spec is not None and reported_records(spec, records) else None
    page = render_page(spec, records, load_trials(trials), sources, tables)
    return page, (heatmap_data(tables) if tables is not None else None)


def stale_parts(page_path: Path, page: str, heatmap: Path, data: dict[str, Any] | None) -> list[str]:
    """What is out of date, each as a few words (empty: everything is current)."""
    from fedplug.study.benchmark_heatmap import drawn_digest, heatmap_digest

    stale = []
    current = read_text_or(page_path, None)
    if current is None:
        stale.append(f"{shown(page_path)} is missing")
    elif current != page:
        old, new = current.splitlines(), page.splitlines()
        first = next((number for number, (a, b) in enumerate(zip(old, new), 1) if a != b), min(len(old), len(new)) + 1)
        differing = sum(a != b for a, b in zip(old, new)) + abs(len(old) - len(new))
        stale.append(f"{shown(page_path)} differs in {differing} line{'s' if differing != 1 else ''} "
                     f"(the first at line {first})")
    if data is not None:
        digest = drawn_digest(heatmap)
        if digest is None:
            stale.append(f"{shown(heatmap)} is missing or carries no data hash")
        elif digest != heatmap_digest(data):
            stale.append(f"{shown(heatmap)} was drawn from other data")
    return stale


def main(argv: list[str] | None = None) -> int:
    from fedplug.study.benchmark_heatmap import draw_heatmap
    from fedplug.study.benchmark_page import HEATMAP_FILE

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 when the page or its heatmap is out of date")
    parser.add_argument("--spec", default=str(ROOT / DEFAULT_SPEC), help=f"the benchmark spec (default {DEFAULT_SPEC})")
    parser.add_argument("--results", default=str(ROOT / DEFAULT_RESULTS),
                        help=f"the reported runs (default {DEFAULT_RESULTS})")
    parser.add_argument("--trials", default=None,
                        help="the tuning trials (default: the results file's .trials.jsonl sibling)")
    parser.add_argument("--page", default=str(ROOT / DEFAULT_PAGE), help=f"the page to write (default {DEFAULT_PAGE})")
    args = parser.parse_args(argv)
    page_path = Path(args.page)
    heatmap = page_path.parent / HEATMAP_FILE
    page, data = render(args)
    if args.check:
        stale = stale_parts(page_path, page, heatmap, data)
        if stale:
            print("; ".join(stale) + f": run {command_text(args)}", file=sys.stderr)
            return 1
        print(f"{shown(page_path)} is up to date")
        return 0
    page_path.parent.mkdir(parents=True, exist_ok=True)
    page_path.write_text(page)
    print(f"wrote {shown(page_path)}")
    if data is not None:
        heatmap.parent.mkdir(parents=True, exist_ok=True)
        draw_heatmap(data, heatmap)
        print(f"drew {shown(heatmap)}")
    return 0


if __name__ == "__main__":
    from common import run_main

    run_main(main)
