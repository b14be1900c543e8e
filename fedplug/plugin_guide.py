"""The plugin guide's reference, generated from the interfaces, so that writing a plugin
needs no reading of the source: for each component slot (sampler, loss transform,
aggregator, grouper) every method its base class in :mod:`fedplug.components` declares or
inherits, with its signature, whether a plugin must implement it, and the first paragraph
of its docstring; the partitioner's factory; every ``fedplug_register_*`` hook of
:mod:`fedplug.hookspecs`; and the fields of what the hooks take and return
(:class:`~fedplug.components.ClientNeeds`, :class:`~fedplug.components.RoundPlan`, ...).

``docs/plugins.md`` holds the text between its ``<!-- plugin-reference -->`` markers::

    python -m fedplug.plugin_guide --write docs/plugins.md   # regenerate the block
    python -m fedplug.plugin_guide --check docs/plugins.md   # exit 1 when it is stale
"""

from __future__ import annotations

import argparse
import ast
import inspect
import re
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from fedplug import hookspecs
from fedplug.component_config import ClientNeeds, ComponentConfig, ReplyExtra
from fedplug.components import (
    SLOT_KINDS,
    SLOTS,
    Aggregator,
    ClientUpdate,
    ComponentHooks,
    Grouper,
    LocalTraining,
    LossTransform,
    PhaseCost,
    RoundPlan,
    Sampler,
)
from fedplug.data.partitions.partition import Partition
from fedplug.hookspecs import FACTORIES
from fedplug.run.results import RoundRecord

BEGIN = "<!-- plugin-reference -->"
END = "<!-- /plugin-reference -->"
BLOCK = re.compile(re.escape(BEGIN) + r"\n.*?" + re.escape(END), re.DOTALL)

SLOT_CLASSES: dict[str, type] = {
    "sampler": Sampler,
    "loss_transform": LossTransform,
    "aggregator": Aggregator,
    "grouper": Grouper,
}
"""The base class a component of each of :data:`~fedplug.components.SLOTS` subclasses."""

RECORDS: tuple[type, ...] = (
    ClientNeeds, ReplyExtra, RoundPlan, ClientUpdate, LocalTraining, PhaseCost, Partition, RoundRecord,
)
"""What the hooks take and return, and what a run records of each round, each listed with
its fields' docstrings."""

_ROLE = re.compile(r":(?:class|meth|func|attr|data|mod|exc|obj):`(~?)([^`]+)`")


# ------------------------------------------------------------------------- text


def markdown(text: str) -> str:
    """A docstring's reStructuredText as Markdown on one line: ``code`` and Sphinx roles
    (:class:`~a.B` reads `B`, :class:`a.B` reads `a.B`) as code spans."""

    def role(match: re.Match[str]) -> str:
        target = match.group(2)
        return f"`{target.rsplit('.', 1)[-1] if match.group(1) else target}`"

    text = _ROLE.sub(role, text).replace("``", "`")
    return " ".join(text.split())


def first_paragraph(function_or_class: Any) -> str:
    """The first paragraph of a docstring (inherited ones too), as :func:`markdown`."""
    return paragraphs(function_or_class)[0]


def paragraphs(documented: Any) -> list[str]:
    """Every paragraph of ``documented``'s docstring, each as :func:`markdown` (one
    empty paragraph when it has none)."""
    doc = inspect.getdoc(documented) or ""
    return [markdown(paragraph) for paragraph in doc.split("\n\n")]


def signature(function: Callable[..., Any], name: str | None = None) -> str:
    """``name(param: type, ...) -> type`` as written in the source (without ``self``,
    positional-only and keyword-only markers kept)."""
    parameters = []
    shown = inspect.signature(function)
    for parameter in shown.parameters.values():
        if parameter.name == "self":
            continue
        text = parameter.name
        if parameter.annotation is not inspect.Parameter.empty:
            text += f": {_annotation(parameter.annotation)}"
        if parameter.default is not inspect.Parameter.empty:
            text += f" = {parameter.default!r}"
        if parameter.kind is inspect.Parameter.VAR_POSITIONAL:
            text = "*" + text
        elif parameter.kind is inspect.Parameter.VAR_KEYWORD:
            text = "**" + text
        parameters.append((parameter.kind, text))
    texts = []
    for index, (kind, text) in enumerate(parameters):
        following = parameters[index + 1][0] if index + 1 < len(parameters) else None
        if kind is inspect.Parameter.KEYWORD_ONLY and (index == 0 or parameters[index - 1][0] is not kind):
            texts.append("*")
        texts.append(text)
        if kind is inspect.Parameter.POSITIONAL_ONLY and following is not inspect.Parameter.POSITIONAL_ONLY:
            texts.append("/")
    returned = shown.return_annotation
    tail = "" if returned is inspect.Signature.empty else f" -> {_annotation(returned)}"
    return f"{name or function.__name__}({', '.join(texts)}){tail}"


def _annotation(annotation: Any) -> str:
    # The modules use `from __future__ import annotations`: annotations are the source text.
    return annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)


def attribute_docs(cls: type) -> Iterator[tuple[str, str, str]]:
    """``(name, annotation, docstring's first paragraph)`` of each annotated attribute of
    ``cls``'s own body, in source order (the string right under a field documents it)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    for index, node in enumerate(body):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        if node.target.id.startswith("_"):
            continue
        following = body[index + 1] if index + 1 < len(body) else None
        doc = ""
        if isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant) and isinstance(following.value.value, str):
            doc = markdown(inspect.cleandoc(following.value.value).split("\n\n", 1)[0])
        yield node.target.id, ast.unparse(node.annotation), doc


# ------------------------------------------------------------------------ slots


def slot_methods(cls: type) -> list[tuple[str, Callable[..., Any], bool]]:
    """``(name, function, required)`` of every public method a component of slot class
    ``cls`` may implement: the abstract ones first, then the slot's own, then the hooks
    every slot shares (:class:`~fedplug.components.ComponentHooks`), each in source order."""
    abstract = getattr(cls, "__abstractmethods__", frozenset())
    names: list[str] = []
    for owner in (cls, ComponentHooks):
        names += [name for name, value in vars(owner).items() if _public_method(name, value) and name not in names]
    names.sort(key=lambda name: name not in abstract)  # stable: source order within each part
    return [(name, getattr(cls, name), name in abstract) for name in names]


def _public_method(name: str, value: Any) -> bool:
    return callable(value) and not name.startswith("_")


def slot_section(slot: str) -> list[str]:
    """The reference of one slot: its base class, factory, config key and methods; the
    hooks every slot shares are listed by signature, described once in
    :func:`shared_hooks_section`."""
    cls = SLOT_CLASSES[slot]
    kind = SLOT_KINDS[slot]
    lines = [f"### `{slot}`: `{cls.__name__}`", ""]
    for paragraph in paragraphs(cls):
        lines += [paragraph, ""]
    lines += [
        f"Chosen by `train.{slot}: {{name: ...}}`; registered in `fedplug_register_{kind}` as "
        f"`register(ConfigClass, factory)` with `{factory_signature(FACTORIES[kind])}`.",
        "",
    ]
    for name, function, required in slot_methods(cls):
        if name in vars(cls) or name not in vars(ComponentHooks):
            need = "**required**" if required else "optional"
            lines.append(f"- `{signature(function, name)}`: {need}. {first_paragraph(function)}")
        else:
            lines.append(f"- `{signature(function, name)}`: optional, as in every slot (below).")
    return [*lines, ""]


def shared_hooks_section() -> list[str]:
    """The hooks every slot shares (:class:`~fedplug.components.ComponentHooks`)."""
    lines = ["### Hooks every slot shares: `ComponentHooks`", "", first_paragraph(ComponentHooks), ""]
    for name, value in vars(ComponentHooks).items():
        if _public_method(name, value):
            lines.append(f"- `{signature(value, name)}`: {first_paragraph(value)}")
    return [*lines, ""]


def partitioner_section() -> list[str]:
    """The partitioner: a factory function, not a class with methods."""
    factory = factory_signature(FACTORIES["partitioners"])
    lines = [
        "### `partitioner`: a factory function",
        "",
        f"Chosen by `data.partition: {{name: ...}}`; registered in `fedplug_register_partitioners` as "
        f"`register(ConfigClass, factory)` with `{factory}`.",
        "",
    ]
    for paragraph in paragraphs(hookspecs.fedplug_register_partitioners)[1:]:
        lines += [paragraph, ""]
    return lines


def hooks_table() -> list[str]:
    """Every ``fedplug_register_*`` hook, in source order: its factory's signature and its
    docstring's first paragraph."""
    lines = ["| hook | factory | registers |", "|---|---|---|"]
    for name, hook in vars(hookspecs).items():
        if name.startswith("fedplug_register_"):
            kind = name.removeprefix("fedplug_register_")
            factory = FACTORIES.get(kind, hookspecs.TrackerFactory)
            registered = "register(ConfigClass, factory)" if kind in FACTORIES else "register(name, factory)"
            cell = f"`{registered}`, `{factory_signature(factory)}`"
            lines.append(f"| `{name}` | {_table_cell(cell)} | {_table_cell(first_paragraph(hook))} |")
    return [*lines, ""]


def factory_signature(factory: type) -> str:
    """A factory Protocol's call as a plugin writes it: ``factory(config: Any) -> Sampler``
    (the positional-only marker left out: every factory is called positionally)."""
    return signature(factory.__call__, "factory").replace(", /", "").replace("/, ", "")


def _table_cell(text: str) -> str:
    return text.replace("|", "\\|")


def config_section() -> list[str]:
    """What a component's config class may override (:class:`ComponentConfig`)."""
    lines = ["### The config class: `ComponentConfig`", ""]
    for paragraph in paragraphs(ComponentConfig):
        lines += [paragraph, ""]
    for name, annotation, doc in attribute_docs(ComponentConfig):
        lines.append(f"- `{name}: {annotation}`" + (f": {doc}" if doc else ""))
    for name, value in vars(ComponentConfig).items():
        if _public_method(name, value) and not isinstance(value, (classmethod, staticmethod)):
            lines.append(f"- `{signature(value, name)}`: optional. {first_paragraph(value)}")
    return [*lines, ""]


def record_section(cls: type) -> list[str]:
    """One class of :data:`RECORDS`: its docstring's first paragraph and its fields."""
    lines = [f"#### `{cls.__name__}` (`{cls.__module__}`)", "", first_paragraph(cls), ""]
    for name, annotation, doc in attribute_docs(cls):
        lines.append(f"- `{name}: {annotation}`" + (f": {doc}" if doc else ""))
    return [*lines, ""]


def render() -> str:
    """The generated reference: the text between :data:`BEGIN` and :data:`END`."""
    lines = [
        "<!-- generated by `python -m fedplug.plugin_guide --write docs/plugins.md` from the",
        "interfaces' docstrings (fedplug/components.py, component_config.py, hookspecs.py, ...): edit those -->",
        "",
        "### The hooks",
        "",
    ]
    for paragraph in paragraphs(hookspecs):
        lines += [paragraph, ""]
    lines += hooks_table()
    for slot in SLOTS:
        lines += slot_section(slot)
    lines += shared_hooks_section()
    lines += partitioner_section()
    lines += config_section()
    lines += ["### What the hooks take and return, and what a round records", ""]
    for cls in RECORDS:
        lines += record_section(cls)
    return "\n".join(lines).rstrip() + "\n"


# ------------------------------------------------------------------------- page


def updated_page(page: str) -> str:
    """``page`` with the text between its markers replaced by :func:`render`'s.

    Raises:
        ValueError: the page lacks the markers.
    """
    if not BLOCK.search(page):
        raise ValueError(f"the page has no {BEGIN} ... {END} markers; add them where the reference goes")
    return BLOCK.sub(lambda _: f"{BEGIN}\n{render()}{END}", page, count=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--write", metavar="PAGE", type=Path, help="regenerate the reference block of PAGE")
    action.add_argument("--check", metavar="PAGE", type=Path, help="exit 1 when PAGE's reference block is stale")
    action.add_argument("--print", action="store_true", help="print the reference block")
    args = parser.parse_args(argv)
    if args.print:
        sys.stdout.write(render())
        return 0
    path: Path = args.write or args.check
    try:
        page = path.read_text()
        updated = updated_page(page)
    except (OSError, ValueError) as error:
        print(f"{path}: {error}", file=sys.stderr)
        return 2
    if args.check:
        if updated != page:
            print(f"{path}'s plugin reference is out of date: run python -m fedplug.plugin_guide --write {path}",
                  file=sys.stderr)
            return 1
        print(f"{path}'s plugin reference is up to date")
        return 0
    if updated != page:
        path.write_text(updated)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
