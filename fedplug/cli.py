"""The ``fedplug`` command line: ``fedplug list`` and ``fedplug run``."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any, Sequence

from fedplug.errors import ConfigError, FedplugError
from fedplug.registry import KINDS, Registration


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fedplug", description="Federated learning on non-IID data.")
    commands = parser.add_subparsers(dest="command", required=True)
    list_parser = commands.add_parser("list", help="every registered component by kind, with its parameters")
    list_parser.add_argument("kind", nargs="?", choices=KINDS, help="show only this kind")
    run_parser = commands.add_parser("run", help="run an experiment from a config file")
    run_parser.add_argument("config", help="YAML config (params.yaml is one)")
    run_parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a value, e.g. --set train.rounds=5 --set train.aggregator=fedavgm",
    )
    run_parser.add_argument("--algorithm", help="apply the params file's algorithms.<NAME> entry to train")
    run_parser.add_argument("--out", help="output folder (default: runs/<study>-<config hash>)")
    run_parser.add_argument("--no-resume", action="store_true", help="ignore an existing checkpoint in --out")
    run_parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "list":
            print(describe_components(args.kind))
            return 0
        return run_command(args)
    except FedplugError as error:
        print(f"fedplug: error: {error}", file=sys.stderr)
        return 2
    except OSError as error:
        # A path the user gave (data.root, --out, a file under them) cannot be read or
        # written: disk full, no permission, a file where a folder should be. Say which
        # path and why, as pip does, instead of a traceback.
        print(f"fedplug: error: {describe_os_error(error)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fedplug: interrupted; run the same command again to resume from the last round", file=sys.stderr)
        return 130


def run_command(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tqdm import tqdm

    from fedplug.config import load_experiment
    from fedplug.experiment import default_output_dir, run_experiment

    config = load_experiment(args.config, args.overrides, args.algorithm, check_every_algorithm=False)
    out = Path(args.out) if args.out else default_output_dir(config)
    check_output_folder(out)
    progress = tqdm(total=config.train.rounds, desc="rounds", unit="round", disable=args.quiet, file=sys.stderr)

    def show(record: Any) -> None:
        progress.n = record.round
        progress.set_postfix(accuracy=f"{record.accuracy:.4f}", loss=f"{record.loss:.4f}", refresh=False)
        progress.refresh()

    try:
        result, _ = run_experiment(config, out, observers=[show], resume=not args.no_resume)
    finally:
        progress.close()
    summary = result.summary()
    print(
        f"final accuracy {summary['final_accuracy']:.4f}, best {summary['best_accuracy']:.4f} "
        f"after {summary['rounds']} rounds; wrote {out / 'metrics.json'}"
    )
    return 0


def check_output_folder(out: str | os.PathLike[str]) -> None:
    """Refuse an output folder that cannot be created or written, before any work starts.

    Raises :class:`ConfigError` when ``out`` is an existing file, when the nearest
    existing folder above it is a file, or when that folder is not writable.
    """
    from pathlib import Path

    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {str(out)!r} is a file, not a folder; choose another --out")
    existing = out
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(
            f"--out {str(out)!r} cannot be created: {str(existing)!r} is a file, not a folder; "
            "choose another --out"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(
            f"--out {str(out)!r} cannot be created: no permission to write in {str(existing)!r}; "
            "choose another --out"
        )


def describe_os_error(error: OSError) -> str:
    """``<what went wrong>: <path>`` for an operating-system error, with the fix to try."""
    reason = error.strerror or type(error).__name__
    paths = [str(name) for name in (error.filename, error.filename2) if name is not None]
    where = f": {' -> '.join(repr(path) for path in paths)}" if paths else f" ({error})"
    return f"{reason}{where}; check data.root, --out and the files under them (free space, permissions)"


def describe_components(kind: str | None = None) -> str:
    from fedplug.plugins import default_registry

    registry = default_registry()
    lines: list[str] = []
    for each_kind in [kind] if kind else KINDS:
        lines.append(f"{each_kind}:")
        for entry in registry.entries(each_kind):
            lines.append(f"  {entry.name:<16} {entry.summary}  [{entry.plugin}]")
            lines += [f"      {line}" for line in describe_parameters(entry)]
    return "\n".join(lines)


def describe_parameters(entry: Registration) -> list[str]:
    lines = []
    for name, field in entry.config_class.model_fields.items():
        if name == "name":
            continue
        bounds = [
            f"{symbol} {getattr(item, attribute)}"
            for item in field.metadata
            for attribute, symbol in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))
            if getattr(item, attribute, None) is not None
        ]
        default = field.get_default(call_default_factory=True)
        text = f"{name} = {default!r}"
        if bounds:
            text += f"  ({', '.join(bounds)})"
        if field.description:
            text += "  " + " ".join(field.description.split())
        lines.append(text)
    return lines


if __name__ == "__main__":
    sys.exit(main())
