"""fedplug's algorithms in Flower's PyTorch quickstart, each as the smallest edit of the
app in tests/flower_quickstart/ that keeps the user's own loop and optimiser.

A variant is the base app plus a list of :class:`Edit` (one exact text replacement in
one file). :func:`write_variant` writes the edited app for ``flwr run``;
:func:`docs_block` renders the table of changed lines and the unified diffs that
docs/flower.md shows between its ``<!-- quickstart-table -->`` markers
(``python tests/test_flower_quickstart.py --write-docs``).
"""

from __future__ import annotations

import difflib
import shutil
from dataclasses import dataclass
from pathlib import Path

BASE_APP = Path(__file__).resolve().parent / "flower_quickstart"
PACKAGE = "quickstartapp"
TASK = f"{PACKAGE}/task.py"
CLIENT = f"{PACKAGE}/client_app.py"
SERVER = f"{PACKAGE}/server_app.py"


@dataclass(frozen=True)
class Edit:
    """Replace ``old`` (found exactly once) by ``new`` in the app's file ``path``."""

    path: str
    old: str
    new: str


@dataclass(frozen=True)
class Variant:
    """One algorithm in the quickstart: its name, what serves it on the server
    (``"FedAvg"``: the quickstart's own strategy, unchanged), a line for the docs, and
    its edits."""

    name: str
    server: str
    note: str
    edits: tuple[Edit, ...]


def after(path: str, anchor: str, added: str) -> Edit:
    """An edit that adds the line(s) ``added`` after the line ``anchor``."""
    return Edit(path, anchor + "\n", anchor + "\n" + added + "\n")


# --------------------------------------------------------------------- the pieces

IMPORT_ANCHOR = "from flwr.clientapp import ClientApp"
APP_ANCHOR = "app = ClientApp()"
DATA_ANCHOR = "    trainloader, _ = load_data(partition_id, num_partitions, batch_size)"
CALL_ANCHOR = "        device,\n    )"
REPLY_ANCHOR = '    content = RecordDict({"arrays": model_record, "metrics": metric_record})'
STRATEGY_LINE = "    strategy = FedAvg(fraction_evaluate=fraction_evaluate)"
NODE_DATA = (
    'data=lambda context: load_data(context.node_config["partition-id"], '
    'context.node_config["num-partitions"], 32)[0]'
)


def client_import(names: str) -> Edit:
    return after(CLIENT, IMPORT_ANCHOR, f"from fedplug.adapters.flower import {names}")


def piece(line: str) -> Edit:
    """The fedplug piece, built once next to the ClientApp."""
    return after(CLIENT, APP_ANCHOR, line)


def criterion_argument(call: str) -> Edit:
    """``train_fn(...)`` gets the fedplug loss as its criterion."""
    return Edit(CLIENT, CALL_ANCHOR, f"        device,\n        {call},\n    )")


# task.train takes the criterion instead of always building its own.
TRAIN_TAKES_CRITERION = (
    Edit(
        TASK,
        "def train(net, trainloader, epochs, lr, device):",
        "def train(net, trainloader, epochs, lr, device, criterion=None):",
    ),
    Edit(
        TASK,
        "    criterion = torch.nn.CrossEntropyLoss().to(device)\n    optimizer",
        "    criterion = criterion or torch.nn.CrossEntropyLoss().to(device)\n    optimizer",
    ),
)


def served_by_fedplug(train_config: str = "") -> tuple[Edit, ...]:
    """The server's strategy line: ``FedplugStrategy`` with the same keywords, after
    ``train_config``'s arguments (default none: the literal class-name swap)."""
    arguments = f"{train_config}, " if train_config else ""
    return (
        Edit(
            SERVER,
            "from flwr.serverapp.strategy import FedAvg\n",
            "from fedplug.adapters.flower import FedplugStrategy\n",
        ),
        Edit(
            SERVER,
            STRATEGY_LINE,
            f"    strategy = FedplugStrategy({arguments}fraction_evaluate=fraction_evaluate)",
        ),
    )


def class_count_loss(name: str) -> tuple[Edit, ...]:
    """A loss that works from the client's class counts (FedShift, Reweighting): the
    server asks every node for them before round 1, ``app=app, data=...`` answers."""
    return (
        client_import("FedplugLoss"),
        piece(f'{name} = FedplugLoss(loss_transform={{"name": "{name}"}}, app=app, {NODE_DATA})'),
        criterion_argument(f"{name}.begin_round(msg, context, model, trainloader)"),
        *TRAIN_TAKES_CRITERION,
        *served_by_fedplug(
            f'{{"loss_transform": {{"name": "{name}"}}}}, model=Net(), num_classes=10'
        ),
    )


def scaffold_loop(finish_round: str, *task_edits: Edit) -> tuple[Edit, ...]:
    """SCAFFOLD's client in the user's loop: the criterion, ``finish_round`` called as
    ``finish_round`` on the reply, the ``task_edits``, and the FedplugStrategy server."""
    return (
        client_import("FedplugLoss"),
        piece('scaffold = FedplugLoss(aggregator={"name": "scaffold"}, app=app)'),
        criterion_argument("scaffold.begin_round(msg, context, model)"),
        after(CLIENT, REPLY_ANCHOR, f"    scaffold.{finish_round}"),
        *TRAIN_TAKES_CRITERION,
        *task_edits,
        *served_by_fedplug('{"aggregator": {"name": "scaffold"}}, model=Net()'),
    )


VARIANTS: tuple[Variant, ...] = (
    Variant(
        "fedavg",
        "FedplugStrategy",
        "the class name swapped, `FedAvg` -> `FedplugStrategy`, and its import; no train "
        "section: FedAvg with the defaults (`fraction_train` 1.0, as Flower's)",
        served_by_fedplug(),
    ),
    Variant(
        "fedavgm",
        "FedplugStrategy",
        "server-side: the strategy line; the ClientApp stays as it is",
        served_by_fedplug('{"aggregator": {"name": "fedavgm", "momentum": 0.9}}'),
    ),
    Variant(
        "iwds",
        "FedAvg",
        "the DataLoader's sampler; the server stays Flower's `FedAvg`",
        (
            after(CLIENT, IMPORT_ANCHOR, "from torch.utils.data import DataLoader"),
            client_import("RoundSampler"),
            piece('iwds = RoundSampler({"name": "iwds"})'),
            after(
                CLIENT,
                DATA_ANCHOR,
                "    trainloader = DataLoader(trainloader.dataset, batch_size=batch_size, "
                "sampler=iwds.for_round(msg, context, trainloader))",
            ),
        ),
    ),
    Variant(
        "fedprox",
        "FedAvg",
        "the criterion; the server stays Flower's `FedAvg`",
        (
            client_import("FedplugLoss"),
            piece('fedprox = FedplugLoss(loss_transform={"name": "fedprox", "mu": 0.01})'),
            criterion_argument("fedprox.begin_round(msg, context, model)"),
            *TRAIN_TAKES_CRITERION,
        ),
    ),
    Variant(
        "fedshift",
        "FedplugStrategy",
        "the criterion, from the client's class counts (the server asks for them before round 1)",
        class_count_loss("fedshift"),
    ),
    Variant(
        "reweighting",
        "FedplugStrategy",
        "as FedShift (the FedShift paper's baseline)",
        class_count_loss("reweighting"),
    ),
    Variant(
        "scaffold",
        "FedplugStrategy",
        "the criterion, `finish_round` on the reply, and SGD without momentum",
        scaffold_loop(
            "finish_round(content)",
            Edit(
                TASK,
                "optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)",
                "optimizer = torch.optim.SGD(net.parameters(), lr=lr)",
            ),
        ),
    ),
    Variant(
        "feddisk",
        "FedplugStrategy",
        "the criterion with each sample's index (`with_sample_ids`); a setup phase before round 1",
        (
            after(CLIENT, IMPORT_ANCHOR, "from torch.utils.data import DataLoader"),
            client_import("FedplugLoss, with_sample_ids"),
            piece(
                'feddisk = FedplugLoss(loss_transform={"name": "feddisk", "global_rounds": 2}, '
                f"app=app, {NODE_DATA})"
            ),
            after(
                CLIENT,
                DATA_ANCHOR,
                "    trainloader = DataLoader(with_sample_ids(trainloader.dataset), "
                "batch_size=batch_size, shuffle=True)",
            ),
            criterion_argument("feddisk.begin_round(msg, context, model, trainloader)"),
            *TRAIN_TAKES_CRITERION,
            Edit(
                TASK,
                "            loss = criterion(net(images), labels)\n",
                '            loss = criterion(net(images), labels, batch["sample_id"])\n',
            ),
            *served_by_fedplug(
                '{"loss_transform": {"name": "feddisk", "global_rounds": 2}}, model=Net()'
            ),
        ),
    ),
)


MISCONFIGURED: tuple[Variant, ...] = (
    Variant(
        "scaffold-momentum",
        "FedplugStrategy",
        "SCAFFOLD with the quickstart's SGD momentum 0.9 left in place and the learning "
        "rate passed to `finish_round`: refused at the first optimiser step, in one line",
        scaffold_loop('finish_round(content, learning_rate=msg.content["config"]["lr"])'),
    ),
    Variant(
        "fedshift-stock-client",
        "FedplugStrategy",
        "a FedShift server with the quickstart's ClientApp unchanged: refused before any "
        "client trains, in one line naming the piece to add",
        served_by_fedplug(
            '{"loss_transform": {"name": "fedshift"}}, model=Net(), num_classes=10'
        ),
    ),
)
"""Documented misconfigurations, run to check that they fail in one line before any
client trains; kept out of the docs' table, which lists working variants only."""


# ------------------------------------------------------------------ apply, count


def base_files() -> dict[str, str]:
    """The base app's Python files, by path relative to the app folder, in
    :func:`reading_order`."""
    paths = sorted((BASE_APP / PACKAGE).glob("*.py"))
    files = {path.relative_to(BASE_APP).as_posix(): path.read_text() for path in paths}
    return {path: files[path] for path in sorted(files, key=reading_order)}


def reading_order(path: str) -> tuple[int, str]:
    """task.py, client_app.py, server_app.py first: the order the quickstart reads."""
    order = (TASK, CLIENT, SERVER)
    return (order.index(path) if path in order else len(order), path)


def edited_files(variant: Variant) -> dict[str, str]:
    """The base app's files with ``variant``'s edits applied, in order.

    Raises:
        ValueError: an edit's ``old`` text is not found exactly once (the base app
            changed: update the edit).
    """
    files = base_files()
    for edit in variant.edits:
        found = files[edit.path].count(edit.old)
        if found != 1:
            raise ValueError(
                f"variant {variant.name!r}: {edit.path} holds {found} copies of {edit.old!r} "
                "(expected exactly 1): update the edit to the base app"
            )
        files[edit.path] = files[edit.path].replace(edit.old, edit.new)
    return files


def write_variant(variant: Variant, folder: Path) -> Path:
    """Copy the base app to ``folder`` with ``variant``'s edits; returns ``folder``."""
    shutil.copytree(BASE_APP, folder, ignore=shutil.ignore_patterns("__pycache__"))
    for path, text in edited_files(variant).items():
        (folder / path).write_text(text)
    return folder


def file_diffs(variant: Variant) -> dict[str, list[str]]:
    """Unified diff lines (no headers) of each changed file, by path."""
    before, after_edits = base_files(), edited_files(variant)
    diffs = {}
    for path in before:
        if before[path] != after_edits[path]:
            lines = difflib.unified_diff(
                before[path].splitlines(), after_edits[path].splitlines(), n=0, lineterm=""
            )
            diffs[path] = [line for line in lines if not line.startswith(("---", "+++"))]
    return diffs


def changed_lines(variant: Variant) -> tuple[int, int, int]:
    """``(files changed, lines added, lines removed)``, as ``git diff --stat`` counts
    them: a changed line is one removed and one added."""
    diffs = file_diffs(variant)
    added = sum(line.startswith("+") for lines in diffs.values() for line in lines)
    removed = sum(line.startswith("-") for lines in diffs.values() for line in lines)
    return len(diffs), added, removed


def docs_block() -> str:
    """docs/flower.md's text between the ``<!-- quickstart-table -->`` markers: the
    table of changed lines, then each variant's diff. The diffs are fenced as ``udiff``
    (GitHub highlights it as ``diff``): they are whole-file diffs checked here and run
    by ``flwr run``, not snippets for tests/test_doc_snippets.py to patch."""
    rows = [
        "| variant | server | files changed | lines added | lines removed |",
        "|---|---|---|---|---|",
    ]
    for variant in VARIANTS:
        files, added, removed = changed_lines(variant)
        rows.append(f"| {variant.name} | `{variant.server}` | {files} | +{added} | -{removed} |")
    sections = ["\n".join(rows)]
    for variant in VARIANTS:
        diff = []
        for path, lines in file_diffs(variant).items():
            diff += [f"--- {path}", f"+++ {path}", *lines]
        sections.append(
            f"**{variant.name}**: {variant.note}.\n\n```udiff\n" + "\n".join(diff) + "\n```"
        )
    return "\n\n".join(sections)
