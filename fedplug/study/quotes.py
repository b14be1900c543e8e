"""Numbers a verdict quotes, computed from a study's records instead of typed by hand.

A verdict fragment (``pipelines/studies/verdicts/<study>.md``) writes a result as a
placeholder the renderer fills from the committed records of the study's planned runs,
so that a re-run changes the prose with the tables:

- ``{{mean ALG@CELL FIELD}}``: the mean over the runs of algorithm ``ALG`` in grid cell
  ``CELL`` (a cell id such as ``0.1`` or ``1_0.5``), ``0.884``;
- ``{{range ALG@CELL FIELD}}``: the lowest and highest mean of one partition draw,
  ``0.11 to 0.16``;
- ``{{diff A vs B@CELL [FIELD]}}``: ``A - B`` with the partition draw as the unit
  (:func:`~fedplug.study.statistics.partition_comparison`),
  ``+0.004 [-0.021, +0.029] over 3 partitions, won 2 of 3``;
- ``{{pairs A vs B@CELL [FIELD]}}``: runs of the same draw and seed that ``A`` wins,
  ``5 of 9``;
- ``{{change A vs B@CELL FIELD}}``: the relative change of the means, ``-75%``;
- ``{{paper TEXT}}``: a number quoted from the paper, shown as ``TEXT`` (marked so
  that :func:`hand_typed_numbers` knows it is not a result of ours).

``FIELD`` (default: the study's headline metric) is a numeric record field, a setup
summary's per-client statistic averaged over the clients (``weights.median``; its lowest
and highest client with ``weights.median.min`` and ``.max``), the mean of
a setup summary's pooled histogram (``weights.histogram_mean``, from the bins' centres), one
round of a per-round series (``accuracy.2``: round 2), or
``time_to_target_model`` (cost-model compute time to the target plus the communication time
of as many rounds at the run's mean per round). A ``:N`` after the field sets the decimals
(default 3). Outside a study's own fragment (the page's introduction), the argument starts
with the study's name: ``{{diff mystudy: method vs fedavg@0.1}}``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from fedplug.errors import ConfigError
from fedplug.study.spec import cell_id
from fedplug.study.statistics import draw_means, paired_comparison, partition_comparison
from fedplug.study.tables import partition_text

QUOTE = re.compile(r"\{\{(mean|range|diff|pairs|change|paper) ([^{}]+)\}\}")
"""A quote placeholder: its kind and its argument."""
ARGUMENT = re.compile(
    r"(?:(?P<study>[\w-]+): )?(?P<method>[\w.+-]+?)(?: vs (?P<reference>[\w.+-]+?))?@(?P<cell>[\w.+-]+)"
    r"(?: (?P<field>[\w.]+))?(?::(?P<digits>\d))?"
)
COMPARISONS = frozenset({"diff", "pairs", "change"})
"""Kinds that compare two algorithms (``A vs B``)."""
DEFAULT_DIGITS = 3


def record_value(record: dict[str, Any], field: str) -> float | None:
    """``field`` of one record (see the module docstring); None when the run has none."""
    if field == "time_to_target_model":
        compute, reached = record.get("compute_seconds_to_target"), record.get("rounds_to_target")
        communication, rounds = record.get("communication_seconds_model"), record.get("rounds")
        if compute is None or reached is None or communication is None or not rounds:
            return None
        return float(compute) + float(communication) * float(reached) / float(rounds)
    key, _, statistic = field.partition(".")
    value = record.get(key)
    if not statistic:
        return None if value is None or isinstance(value, bool) else float(value)
    if isinstance(value, list) and statistic.isdigit():  # a per-round series: round N
        index = int(statistic) - 1
        return None if not 0 <= index < len(value) or value[index] is None else float(value[index])
    if not isinstance(value, dict):
        return None
    if statistic == "histogram_mean":
        edges, counts = np.asarray(value["edges"], dtype=float), np.asarray(value["counts"], dtype=float)
        return float(np.sum((edges[:-1] + edges[1:]) / 2 * counts) / np.sum(counts))
    statistic, _, over_clients = statistic.partition(".")
    reduce = {"": np.mean, "min": np.min, "max": np.max}.get(over_clients)
    per_client = [item for item in value.get(statistic) or [] if item is not None]
    return float(reduce(per_client)) if reduce is not None and per_client else None


Studies = dict[str, tuple[Sequence[dict[str, Any]], str]]
"""Each study's name: the records of its planned runs and its headline metric."""


def fill_quotes(fragment: str, studies: Studies, source: str, study: str | None = None) -> str:
    """``fragment`` with every quote placeholder replaced by its value from the records
    of ``studies``; ``study``: the fragment's own study, which placeholders without a
    study name read (None: each must name one).

    Raises:
        ConfigError: a placeholder that does not parse, names an unknown study, an
            algorithm or cell without runs, or a field no run has (the message names
            ``source`` and the placeholder).
    """
    return QUOTE.sub(lambda match: quote(match.group(1), match.group(2), studies, source, study), fragment)


def quote(kind: str, argument: str, studies: Studies, source: str, study: str | None = None) -> str:
    """The text of one placeholder ``{{kind argument}}`` (see :func:`fill_quotes`)."""
    placeholder = f"{{{{{kind} {argument}}}}}"
    if kind == "paper":
        return argument
    parsed = ARGUMENT.fullmatch(argument)
    if parsed is None or (kind in COMPARISONS) != (parsed["reference"] is not None):
        form = "A vs B@CELL [FIELD][:N]" if kind in COMPARISONS else "ALG@CELL [FIELD][:N]"
        raise ConfigError(f"{source}: {placeholder} does not read as {{{{{kind} [STUDY: ]{form}}}}}")
    name = parsed["study"] or study
    if name not in studies:
        known = ", ".join(sorted(studies))
        raise ConfigError(f"{source}: {placeholder}: " + (f"no study {name!r} (known: {known})" if name else
                                                           f"name the study, e.g. {{{{{kind} {next(iter(sorted(studies)), 'STUDY')}: ...}}}}"))
    records, metric = studies[name]
    field = parsed["field"] or metric
    digits = int(parsed["digits"]) if parsed["digits"] else DEFAULT_DIGITS
    method = _values(records, parsed["method"], parsed["cell"], field, placeholder, source)
    if kind == "mean":
        return f"{np.mean(list(method.values())):.{digits}f}"
    if kind == "range":
        means = draw_means(method)
        return f"{min(means):.{digits}f} to {max(means):.{digits}f}"
    reference = _values(records, parsed["reference"], parsed["cell"], field, placeholder, source)
    if kind == "change":
        change = np.mean(list(method.values())) / np.mean(list(reference.values())) - 1
        return f"{100 * change:+.0f}%"
    if kind == "pairs":
        paired = paired_comparison(method, reference)  # type: ignore[arg-type]
        return f"{paired['wins']} of {paired['pairs']}"
    return partition_text(partition_comparison(method, reference), digits)  # type: ignore[arg-type]


def _values(records: Sequence[dict[str, Any]], algorithm: str, cell: str, field: str, placeholder: str,
            source: str) -> dict[tuple[int, int], float]:
    """``field`` of each run of ``algorithm`` in ``cell``, by (draw, seed); only runs with a value."""
    runs = [record for record in records if record["algorithm"] == algorithm and cell_id(record["cell"]) == cell]
    if not runs:
        raise ConfigError(f"{source}: {placeholder}: no runs of {algorithm!r} in cell {cell!r}")
    values = {(record["draw"], record["seed"]): record_value(record, field) for record in runs}
    present = {key: value for key, value in values.items() if value is not None}
    if not present:
        raise ConfigError(f"{source}: {placeholder}: no run of {algorithm!r} in cell {cell!r} has {field!r}")
    return present


# ------------------------------------------------------------ numbers typed by hand

RESULT_NUMBER = re.compile(r"(?<![\w.])[+-]?(?:\d+\.\d+|\d+(?:\.\d+)?%|\d+ of \d+)(?![\w])")
"""What reads as a result: a decimal (``0.884``, ``-0.025``), a percentage (``-78%``) or a
count of wins (``9 of 9``). Whole numbers alone (rounds, clients, seeds) are not counted."""
NOT_PROSE = re.compile(r"\{\{[^{}]*\}\}|`[^`]*`|\]\([^)]*\)|<!--.*?-->", re.DOTALL)
"""Placeholders, code spans, link targets and comments: not prose that quotes numbers."""


def hand_typed_numbers(fragment: str, settings: Sequence[str] = ()) -> list[str]:
    """The result-like numbers (:data:`RESULT_NUMBER`) in the verdict prose of ``fragment``
    that are typed by hand: outside placeholders, code spans, link targets and comments,
    and not among ``settings`` (numbers of the study's spec, such as ``0.1`` of ``alpha
    0.1``, which describe what ran). The verdict prose starts at ``**Verdict`` (the whole
    fragment when it has none: the intro's summary table) and ends at the paper's setting
    (``**The paper's setting**``) or a superseded verdict (``_Previous verdict``)."""
    start = fragment.find("**Verdict")
    prose = fragment[start:] if start >= 0 else fragment
    for end in ("**The paper's setting**", "_Previous verdict"):
        prose = prose.split(end)[0]
    allowed = {setting.lstrip("+") for setting in settings}
    found = RESULT_NUMBER.findall(NOT_PROSE.sub(" ", prose))
    return [number for number in found if number.lstrip("+") not in allowed]


def spec_numbers(document: Any) -> list[str]:
    """Every number written in a study file's settings (not its description), as text:
    the values of ``base``, ``grid`` (labels included), ``algorithms`` and ``labels``, the
    ``draws``, ``seeds`` and ``target``; what :func:`hand_typed_numbers` lets a verdict name."""
    numbers: list[str] = []

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                if key != "description":
                    walk(key)
                    walk(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            numbers.append(f"{value:g}")
            if isinstance(value, float) and 0 < value < 1:
                numbers.append(f"{100 * value:g}%")
        elif isinstance(value, str):
            numbers.extend(re.findall(r"\d+(?:\.\d+)?%?", value))

    walk(document)
    return numbers
