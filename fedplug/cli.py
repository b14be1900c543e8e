"""The ``fedplug`` command line: ``fedplug list`` and ``fedplug run`` (here), ``fedplug compare``
(:mod:`fedplug.compare`) and ``fedplug check-plugin`` (:mod:`fedplug.plugin_check`)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from typing import TYPE_CHECKING, Any, Sequence

# Only what `fedplug --help` and a config error need is imported here: torch, Ray, Flower
# and MLflow are imported by the subcommands that use them (issue 41: `--help` took 12.7 s
# on a busy machine when it imported torch).
from fedplug.errors import ConfigError, FedplugError
from fedplug.registry import KINDS

if TYPE_CHECKING:
    from fedplug.registry import Registration

SECTIONS = ("study", "tracking", "data", "train")
"""The config's sections whose keys ``fedplug list`` shows."""
UI_COMMAND = "make ui"
"""Opens the MLflow UI on the project's local store (Makefile)."""
OUT_HELP = (
    "output folder (default: runs/<dataset>-<algorithm>-<config hash> in the config file's folder; <algorithm> "
    "is --algorithm's NAME, else the algorithm slots not at their default joined by '+', e.g. fedprox+fedavgm, "
    "else fedavg); a relative --out is read against the working folder"
)
"""``fedplug run --out``'s help: what :func:`fedplug.run_folder.default_output_dir` does."""
WIDTH = 100
"""``fedplug list`` wraps its lines to this many columns."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fedplug", description="Federated learning on non-IID data.")
    commands = parser.add_subparsers(dest="command", required=True)
    list_parser = commands.add_parser(
        "list", help="the registered components by kind, one line each; `fedplug list KIND` shows one kind's "
        "parameters, `fedplug list SECTION` a config section's keys with params.yaml's values and the defaults",
    )
    list_parser.add_argument(
        "kind", nargs="?", choices=(*KINDS, *SECTIONS, "trackers"), help="show this kind's or section's details"
    )
    list_parser.add_argument(
        "--config", metavar="FILE",
        help="params file whose values a section shows beside the defaults (default: ./params.yaml when it exists)",
    )
    run_parser = commands.add_parser("run", help="run an experiment from a config file")
    run_parser.add_argument(
        "config", help="YAML config (params.yaml is one); a relative data.root in it, the default --out and the "
        "MLflow store (mlflow.db) are read against the config file's folder, not the working folder",
    )
    run_parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override a value, e.g. --set train.rounds=5 --set train.aggregator=fedavgm "
        "(--set train.rounds 5 works too)",
    )
    run_parser.add_argument("--algorithm", help="apply the params file's algorithms.<NAME> entry to train")
    run_parser.add_argument("--out", help=OUT_HELP)
    run_parser.add_argument("--no-resume", action="store_true", help="ignore an existing checkpoint in --out")
    run_parser.add_argument(
        "--force", action="store_true",
        help="overwrite a fedplug output folder of another config (deletes only the files fedplug wrote there)",
    )
    run_parser.add_argument("--quiet", action="store_true", help="no progress bar")
    run_parser.add_argument(
        "--threads", type=thread_count, metavar="N",
        help="torch's threads (default: train.threads, else $FEDPLUG_TORCH_THREADS, else 1; 0 = torch's "
        "default, one per core); never more than the cores this process may use",
    )
    tracking = run_parser.add_mutually_exclusive_group()
    tracking.add_argument(
        "--track", dest="track", action="store_true", default=None,
        help="log the run to MLflow (and tracking.backends) even when tracking.enabled is false",
    )
    tracking.add_argument(
        "--no-track", dest="track", action="store_false", help="log nothing to MLflow (tracking.enabled: false)"
    )
    # Subcommands in their own modules: each adds its parser with a ``handler``.
    from fedplug import compare, plugin_check

    compare.add_subcommand(commands)
    plugin_check.add_subcommand(commands)
    args = parser.parse_args(join_set_values(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        if getattr(args, "handler", None) is not None:
            return int(args.handler(args))
        if args.command == "list":
            params = params_file(args.config) if args.kind in SECTIONS else None  # values only there
            print(describe_components(args.kind, params))
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

    from fedplug.config_files import read_with_overrides

    # A missing or malformed file and a malformed --set are reported before the plugins
    # (and torch with them) are imported to validate the config.
    document = read_with_overrides(args.config, args.overrides)
    from fedplug.config import experiment_from_document
    from fedplug.experiment import prepare_experiment
    from fedplug.output_folder import claim
    from fedplug.run_folder import default_output_dir, output_fingerprint, run_folder_layout

    config = experiment_from_document(document, args.config, args.algorithm, check_every_algorithm=False)
    # MLflow logs its store migrations and requirement checks at INFO: not a user's concern.
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    # The default folder sits beside the config file, as its MLflow store does (OUT_HELP).
    out = Path(args.out) if args.out else default_output_dir(config, args.algorithm, Path(args.config).parent)
    fingerprint = output_fingerprint(config)
    # A folder fedplug did not write, another config's run (without --force) or a folder
    # another run is writing is refused here, before any data is loaded.
    status = check_output_folder(out, fingerprint, force=args.force)
    resume = not args.no_resume and status != "replace"
    # Everything that can refuse the run (data, partition, model, checkpoint, tracking)
    # runs before anything is printed: a refused run shows its one error line only, never
    # a progress bar that started.
    simulator = prepare_experiment(config, out, resume=resume, force=args.force, threads=args.threads)
    # From here on the folder is ours: locked against a second run, marked as this config's.
    with claim(out, fingerprint, force=args.force, legacy=run_folder_layout(fingerprint)):
        return train_and_report(args, config, simulator, out, resume)


def train_and_report(args: argparse.Namespace, config: Any, simulator: Any, out: Any, resume: bool) -> int:
    """Track, train and print the result of a prepared run (see :func:`run_command`)."""
    from pathlib import Path

    from tqdm import tqdm

    from fedplug.experiment import checkpointed_rounds, train_experiment
    from fedplug.threads import announce_threads
    from fedplug.tracking.naming import command_line_experiment, open_command_line_tracker

    # The config file's folder is the project: its local store is <project>/mlflow.db.
    project_root = Path(args.config).resolve().parent
    tracker = open_command_line_tracker(
        config,
        out,
        "simulator",
        algorithm=args.algorithm,
        # Its own experiment; the folder remembers its finished run, so the same command
        # again logs nothing.
        experiment_name=command_line_experiment(config),
        keep_finished=True,
        resume=resume,
        project_root=project_root,
        enabled=args.track,
    )
    announce_threads()  # chosen by prepare_experiment; said once the run can no longer be refused
    if tracker.run_id is not None:
        state = " (resumed)" if tracker.resumed else " (finished before: nothing new to log)" if tracker.complete else ""
        print(f"MLflow run {tracker.run_id} in {tracker.uri}{state}", file=sys.stderr)
    progress = tqdm(total=config.train.rounds, desc="rounds", unit="round", disable=args.quiet, file=sys.stderr)

    def show(record: Any) -> None:
        progress.n = record.round
        progress.set_postfix(accuracy=f"{record.accuracy:.4f}", loss=f"{record.loss:.4f}", refresh=False)
        progress.refresh()

    trained: list[Any] = []  # the rounds this command trained (a finished run's re-run trains none)
    ctrl_c = CtrlC()
    simulator.observers.append(trained.append)
    simulator.observers.append(show)
    simulator.observers.append(tracker.log_round)
    simulator.observers.append(ctrl_c.after_round)

    with ctrl_c, tracker:  # FINISHED on success; FAILED (kept for resuming) on an error or Ctrl-C
        if tracker.resumed:
            tracker.log_history(checkpointed_rounds(out))  # rounds done before the interruption
        try:
            result = train_experiment(config, simulator, out, resume=resume)
        finally:
            progress.close()
        tracker.log_result(result)
        if tracker.enabled:
            tracker.log_model(simulator.model, simulator.federation.test_x[:5].cpu())
            for name in ("config.yaml", "run_info.json", "metrics.json"):
                tracker.log_artifacts({"": out / name})
    print(result_line(result.summary(), out, trained_any=bool(trained)))
    if tracker.run_id is not None:
        hint = ui_hint(tracker.uri, project_root, tracker.experiment_id, tracker.run_id)
        print(f"MLflow run {tracker.run_id}: model {tracker.model_uri}; see it with: {hint}")
    return 0


def result_line(summary: dict[str, Any], out: Any, *, trained_any: bool) -> str:
    """What ``fedplug run`` says it did: the accuracy and the file it wrote, or, when no
    round was trained (the same command again on its finished folder), that there was
    nothing to do and how to train again."""
    accuracy = f"final accuracy {summary['final_accuracy']:.4f}, best {summary['best_accuracy']:.4f}"
    if not trained_any:
        return (
            f"nothing to do: {out} already holds the finished run of this config ({summary['rounds']} rounds, "
            f"{accuracy}); pass --no-resume to train again"
        )
    return f"{accuracy} after {summary['rounds']} rounds; wrote {out / 'metrics.json'}"


class CtrlC:
    """Ctrl-C during training that is never lost.

    Python raises ``KeyboardInterrupt`` wherever the main thread happens to be when SIGINT
    arrives. Inside a weakref callback, a finalizer or an at-fork hook (the parallel engine
    forks its workers every round, and fork() is where Ctrl-C most often lands) the
    exception cannot propagate: Python prints it as "Exception ignored in ..." and the run
    goes on. While this is installed, every SIGINT is remembered, such a dropped
    ``KeyboardInterrupt`` is kept off stderr, and :meth:`after_round` (a round observer,
    called once the round's checkpoint is written) raises it again.
    """

    def __init__(self) -> None:
        self.pressed = False
        self._previous_handler: Any = None
        self._previous_hook: Any = None

    def __enter__(self) -> "CtrlC":
        if threading.current_thread() is threading.main_thread() and (
            signal.getsignal(signal.SIGINT) is signal.default_int_handler
        ):
            self._previous_handler = signal.signal(signal.SIGINT, self._on_sigint)
        self._previous_hook = sys.unraisablehook
        sys.unraisablehook = self._unraisable
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if self._previous_handler is not None:
            signal.signal(signal.SIGINT, self._previous_handler)
        sys.unraisablehook = self._previous_hook

    def _on_sigint(self, signum: int, frame: Any) -> None:
        self.pressed = True
        raise KeyboardInterrupt

    def _unraisable(self, unraisable: Any) -> None:
        if self.pressed and issubclass(unraisable.exc_type, KeyboardInterrupt):
            return  # dropped where it landed; after_round raises it again
        self._previous_hook(unraisable)

    def after_round(self, record: Any) -> None:
        """Raise the ``KeyboardInterrupt`` of a Ctrl-C that Python dropped mid-round."""
        if self.pressed:
            raise KeyboardInterrupt


def ui_hint(uri: str | None, project_root: Any, experiment_id: str | None = None, run_id: str | None = None) -> str:
    """How to open the MLflow UI on ``uri``: ``make ui`` for the project's local store; with
    ``experiment_id`` and ``run_id``, the run's page (:func:`fedplug.tracking.ui.run_url`)."""
    from fedplug.tracking import is_remote, local_tracking_uri
    from fedplug.tracking.ui import DEFAULT_UI, run_url

    if uri is None:
        return ""

    def page(base: str) -> str:
        return run_url(base, experiment_id, run_id) if experiment_id and run_id else base

    if is_remote(uri):
        return f"open {page(uri)} in a browser"
    if uri == local_tracking_uri(project_root):
        return f"{UI_COMMAND}, then open {page(DEFAULT_UI)}"
    return f"mlflow ui --host 127.0.0.1 --backend-store-uri {uri}, then open {page(DEFAULT_UI)}"


def check_output_folder(out: str | os.PathLike[str], fingerprint: str | None = None, *, force: bool = False) -> str:
    """Refuse an output folder that cannot be created or written, or that fedplug may not
    write into, before any work starts; return its status (``"new"``, ``"own"``, or
    ``"replace"``: another config's fedplug folder that ``force`` replaces).

    Raises :class:`ConfigError` when ``out`` is an existing file, when the nearest
    existing folder above it is a file, or when that folder is not writable; and, with a
    ``fingerprint``, as :func:`fedplug.output_folder.inspect` (``/``, the home folder or the
    project root; a non-empty folder fedplug did not write; another config's run without
    ``force``; a folder another run holds, naming its PID).
    """
    from pathlib import Path

    from fedplug.output_folder import inspect
    from fedplug.run_folder import run_folder_layout

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
    if fingerprint is None:
        return "new"
    return inspect(out, fingerprint, force=force, legacy=run_folder_layout(fingerprint))


def describe_os_error(error: OSError) -> str:
    """``<what went wrong>: <path>`` for an operating-system error, with the fix to try."""
    reason = error.strerror or type(error).__name__
    paths = [str(name) for name in (error.filename, error.filename2) if name is not None]
    where = f": {' -> '.join(repr(path) for path in paths)}" if paths else f" ({error})"
    return f"{reason}{where}; check data.root, --out and the files under them (free space, permissions)"


def thread_count(text: str) -> int:
    """``--threads``'s value: a whole number from 0 (torch's default) to 1024."""
    from fedplug.threads import MAX_THREADS

    try:
        threads = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of threads, e.g. 1, got {text!r}") from None
    if not 0 <= threads <= MAX_THREADS:
        raise argparse.ArgumentTypeError(f"use 0 (torch's default) to {MAX_THREADS} threads, got {threads}")
    return threads


def join_set_values(argv: Sequence[str]) -> list[str]:
    """``argv`` with each ``--set KEY VALUE`` written as ``--set KEY=VALUE`` (a KEY without
    ``=`` followed by a word that is not an option), so both spellings work; everything
    after ``--`` is left as it is."""
    joined: list[str] = []
    index = 0
    while index < len(argv):
        token = argv[index]
        if token == "--":
            return joined + list(argv[index:])
        rest = argv[index + 1 : index + 3]
        if token == "--set" and len(rest) == 2 and "=" not in rest[0] and not rest[0].startswith("-") and (
            not rest[1].startswith("--")
        ):
            joined += ["--set", f"{rest[0]}={rest[1]}"]
            index += 3
            continue
        joined.append(token)
        index += 1
    return joined


def params_file(path: str | None) -> tuple[str, Any] | None:
    """``(name, validated config)`` of the params file ``fedplug list`` shows values from:
    ``path`` (``--config``; an invalid one is an error), else ``./params.yaml`` when it
    exists and is valid (else None: the defaults only)."""
    from pathlib import Path

    from fedplug.config import load_experiment

    if path is not None:
        return path, load_experiment(path, check_every_algorithm=False)
    if not Path("params.yaml").is_file():
        return None
    try:
        return "params.yaml", load_experiment("params.yaml", check_every_algorithm=False)
    except ConfigError as error:  # not a fedplug config (another tool's params.yaml)
        print(f"fedplug: note: ./params.yaml is not used ({str(error).splitlines()[-1]})", file=sys.stderr)
        return None


def wrapped(text: str, indent: int, hang: int = 4) -> list[str]:
    """``text`` wrapped to :data:`WIDTH` columns, indented by ``indent`` spaces, its
    continuation lines by ``hang`` more."""
    import textwrap

    return textwrap.wrap(
        text, WIDTH, initial_indent=" " * indent, subsequent_indent=" " * (indent + hang),
        break_on_hyphens=False,
    ) or [""]


NOT_SENTENCE_ENDS = (
    "e.g.", "i.e.", "et al.", "cf.", "vs.", "approx.", "resp.", "Fig.", "Eq.", "Sec.", "No.",
)
"""Abbreviations whose full stop does not end a docstring's first sentence."""


def first_sentence(doc: str | None) -> str:
    """The first sentence of ``doc``'s first paragraph, on one line: what ``fedplug list``
    shows for a component (a docstring's first *line* can stop mid-sentence). A sentence ends
    at ``.``, ``?`` or ``!`` before a space and a capital letter, a backquote or a quote, or
    at the paragraph's end; abbreviations (:data:`NOT_SENTENCE_ENDS`), initials and decimals
    do not end it."""
    import re

    paragraph = " ".join((doc or "").strip().split("\n\n")[0].split())
    for end in re.finditer(r"[.?!](?=\s+[A-Z`\"'(])", paragraph):
        before = paragraph[: end.end()]
        if before.endswith(NOT_SENTENCE_ENDS) or re.search(r"(^|\s)[A-Z]\.$", before):
            continue
        return before
    return paragraph


def one_line(name: str, summary: str) -> str:
    """``  name             summary``, the summary wrapped under itself at :data:`WIDTH`
    columns (the overview's rows)."""
    head = f"  {name:<16} "
    lines = wrapped(head + " ".join(summary.split()), 0, len(head))
    return "\n".join(lines)


def describe_components(kind: str | None = None, params: tuple[str, Any] | None = None) -> str:
    """``fedplug list``: every kind's components with a one-line summary each, the
    trackers and the config's sections; ``fedplug list KIND``: that kind's components with
    their parameters; ``fedplug list SECTION``: that section's keys (with ``params``'s
    values, see :func:`describe_sections`). Every line fits :data:`WIDTH` columns."""
    from fedplug.plugins import default_registry

    registry = default_registry()
    if kind in SECTIONS:
        return describe_sections([kind], params)
    if kind == "trackers":
        return describe_trackers(registry, details=True)
    if kind is not None:
        return describe_kind(registry, kind)
    lines = ["Components by kind (`fedplug list KIND` shows their parameters):"]
    for each_kind in KINDS:
        lines.append(f"{each_kind}:")
        lines += [
            one_line(entry.name, first_sentence(entry.config_class.__doc__))
            for entry in registry.entries(each_kind)
        ]
    lines.append(describe_trackers(registry, details=False))
    lines += wrapped(
        f"Config sections: {', '.join(SECTIONS)} (`fedplug list SECTION` shows each key with its default"
        " and params.yaml's value).", 0, 0,
    )
    return "\n".join(lines)


def describe_kind(registry: Any, kind: str) -> str:
    """One kind's components: name, plugin, summary, then each parameter wrapped."""
    lines = [f"{kind}:"]
    for entry in registry.entries(kind):
        lines.append(f"  {entry.name}  [{entry.plugin}]")
        lines += wrapped(first_sentence(entry.config_class.__doc__), 4)
        for text in describe_parameters(entry):
            lines += wrapped(text, 6)
    return "\n".join(lines)


def describe_trackers(registry: Any, details: bool = True) -> str:
    lines = ["trackers:  (tracking.backends)"]
    for entry in registry.tracker_entries():
        summary = first_sentence(entry.factory.__doc__)
        if details:
            lines.append(f"  {entry.name}  [{entry.plugin}]")
            lines += wrapped(summary, 4)
        else:
            lines.append(one_line(entry.name, summary))
    return "\n".join(lines)


def describe_sections(sections: Sequence[str], params: tuple[str, Any] | None = None) -> str:
    """The keys of each config section with their defaults, as ``--set`` takes them
    (``train.rounds = 10``); a component slot shows its default component's name. With
    ``params`` (a params file's name and validated config), each key shows the file's
    value, and ``(default X)`` beside it where the two differ."""
    from fedplug.config import config_models
    from fedplug.plugins import default_registry

    experiment_model = config_models(default_registry())[0]
    lines: list[str] = []
    for section in sections:
        field = experiment_model.model_fields[section]
        values = getattr(params[1], section).model_dump(mode="json") if params else None
        source = f"; values from {params[0]}, with (default X) where it differs" if params else ""
        lines += wrapped(f"{section}:  (keys of the config's {section} section; --set {section}.KEY=VALUE{source})", 0)
        for text in describe_fields(field.annotation, values):
            lines += wrapped(f"{section}.{text}", 2, 6)
    return "\n".join(lines)


def describe_fields(model: Any, values: dict[str, Any] | None = None) -> list[str]:
    """One line per field of pydantic ``model``: ``name = default  (bounds)  doc``, or
    with ``values`` (the section in a params file, resolved) ``name = value (default X)``."""
    import typing

    from fedplug.config import COMPONENT_FIELDS

    lines = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        nested = annotation if isinstance(annotation, type) and hasattr(annotation, "model_fields") else None
        if field.is_required():
            default_text, default = "(required)", None
        else:
            default = field.get_default(call_default_factory=True)
            if hasattr(default, "model_dump"):
                default = getattr(default, "name", None) or default.model_dump(mode="json")
            default_text = f"= {default!r}"
        value = values.get(name) if values is not None else None
        component = isinstance(value, dict) and "name" in value and nested is None
        if nested is not None:
            text = f"{name}.*"  # its keys follow, one line each
        elif values is None or name not in values:
            text = f"{name} {default_text}"
        else:
            shown = value["name"] if component else value
            text = f"{name} = {shown!r}"
            if not field.is_required() and shown != default:
                text += f" (default {default!r})"
        if nested is None and typing.get_origin(annotation) is not None:
            members = [arg for arg in typing.get_args(annotation) if hasattr(arg, "model_fields")]
            names = sorted(
                typing.get_args(member.model_fields["name"].annotation)[0]
                for member in members
                if "name" in member.model_fields and typing.get_args(member.model_fields["name"].annotation)
            )
            if names:
                kind = COMPONENT_FIELDS.get(name, "KIND")
                text += f"  (one of: {', '.join(names)}; `fedplug list {kind}` shows their parameters)"
        if field.description:
            text += "  " + " ".join(field.description.split())
        lines.append(text)
        if component:
            lines += [f"{name}.{key} = {item!r}" for key, item in value.items() if key != "name"]
        if nested is not None and name != "name":
            nested_values = value if isinstance(value, dict) else ({} if values is not None else None)
            lines += [f"{name}.{line}" for line in describe_fields(nested, nested_values)]
    return lines


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
        if field.is_required():
            text = f"{name} (required)"
        else:
            text = f"{name} = {field.get_default(call_default_factory=True)!r}"
        if bounds:
            text += f"  ({', '.join(bounds)})"
        if field.description:
            text += "  " + " ".join(field.description.split())
        lines.append(text)
    return lines


if __name__ == "__main__":
    sys.exit(main())
