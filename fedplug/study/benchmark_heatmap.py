"""The benchmark page's heatmap (``docs/img/benchmark_heatmap.png``): methods x skew
families, the mean difference of the primary metric against the reference, ``*`` where
the Holm-adjusted p-value is at most alpha (:mod:`fedplug.study.benchmark_page`).

Whether the committed figure is current is decided on its data, not its pixels: the
figure's data (:func:`heatmap_data`: every label, value and mark it shows) is hashed
(:func:`heatmap_digest`) and the hash is written into the PNG's ``Description`` text chunk;
``render_benchmark.py --check`` compares that hash with the current data's. Pixels
differ between matplotlib and FreeType versions; the data does not. The PNG is written
without a ``Software`` chunk or timestamp at a fixed dpi, so the same installation draws
the same bytes twice.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from fedplug.study.benchmark_numbers import BenchmarkTables
from fedplug.study.benchmark_page import signed
from fedplug.study.tables import metric_name

DIGEST_PREFIX = "fedplug benchmark heatmap data sha256:"
"""How the PNG's ``Description`` chunk starts; the data's hash follows."""
DPI = 100


def heatmap_data(tables: BenchmarkTables) -> dict[str, Any]:
    """What the heatmap shows, as plain JSON data: ``rows`` (methods but the reference),
    ``columns`` (families), ``values`` (mean difference, 6 decimals; None where not
    compared), ``texts`` (what each cell says: ``+0.0500*``, ``7/10`` when incomplete),
    ``title`` and ``caption``."""
    methods = [method for method in tables.methods if method != tables.reference]
    values: list[list[float | None]] = []
    texts: list[list[str]] = []
    for method in methods:
        row_values: list[float | None] = []
        row_texts: list[str] = []
        for family in tables.families:
            comparison = tables.comparisons.get((family, method))
            planned = tables.planned.get((family, method))
            if comparison is not None and comparison["difference"] is not None:
                row_values.append(round(float(comparison["difference"]), 6))
                row_texts.append(signed(comparison["difference"]) + ("*" if comparison["significant"] else ""))
            else:
                row_values.append(None)
                row_texts.append("-" if planned is None else f"{tables.present(family, method)}/{planned}")
        values.append(row_values)
        texts.append(row_texts)
    reference = tables.name(tables.reference)
    return {
        "rows": [tables.name(method) for method in methods],
        "columns": list(tables.families),
        "values": values,
        "texts": texts,
        "title": f"{metric_name(tables.metric)}: mean difference against {reference} over partition draws",
        "caption": (f"* Holm-adjusted p <= {tables.alpha:g} across the table's {len(tables.comparisons)} comparisons; "
                    "grey n/N: incomplete, n of the N planned draws (not compared)."),
    }


def heatmap_digest(data: dict[str, Any]) -> str:
    """The SHA-256 of ``data`` as sorted, compact JSON."""
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def draw_heatmap(data: dict[str, Any], path: str | Path) -> None:
    """Draw :func:`heatmap_data`'s ``data`` into ``path`` (PNG, a diverging colour scale
    centred on 0), with its digest in the ``Description`` chunk and no ``Software`` chunk."""
    from fedplug.study.plots import _caption, _pyplot

    plt = _pyplot()
    matrix = np.array([[math.nan if value is None else value for value in row] for row in data["values"]], dtype=float)
    matrix = matrix.reshape(len(data["rows"]), len(data["columns"]))
    finite = np.abs(matrix[np.isfinite(matrix)])
    bound = float(finite.max()) if finite.size and finite.max() > 0 else 0.01
    figure, axes = plt.subplots(figsize=(1.4 * len(data["columns"]) + 3.5, 0.5 * len(data["rows"]) + 2.6),
                                constrained_layout=True)
    colours = plt.get_cmap("RdBu").with_extremes(bad="0.85")  # not compared (incomplete): grey, apart from ~0
    image = axes.imshow(matrix, cmap=colours, vmin=-bound, vmax=bound, aspect="auto")
    axes.set_xticks(range(len(data["columns"])), data["columns"])
    axes.set_yticks(range(len(data["rows"])), data["rows"])
    axes.set_xlabel("skew family")
    for i, row in enumerate(data["texts"]):
        for j, text in enumerate(row):
            strong = np.isfinite(matrix[i, j]) and abs(matrix[i, j]) > 0.6 * bound
            axes.text(j, i, text, ha="center", va="center", fontsize=8, color="white" if strong else "black")
    figure.colorbar(image, ax=axes, label="mean difference")
    axes.set_title(data["title"], fontsize=10)
    _caption(figure, data["caption"])
    figure.savefig(path, dpi=DPI, metadata={"Software": None, "Description": DIGEST_PREFIX + heatmap_digest(data)})
    plt.close(figure)


def drawn_digest(path: str | Path) -> str | None:
    """The data digest a heatmap PNG was drawn from; None when there is no such file or
    it carries none (a FIFO or device there is refused, not waited on)."""
    from PIL import Image, UnidentifiedImageError

    from fedplug.errors import DataError
    from fedplug.safe_files import read_regular_bytes

    try:
        content = read_regular_bytes(path, what="benchmark heatmap", advice="delete it and render the page again",
                                     error=DataError)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None
    try:
        with Image.open(io.BytesIO(content)) as image:
            description = getattr(image, "text", {}).get("Description", "")
    except (UnidentifiedImageError, OSError):
        return None
    return description.removeprefix(DIGEST_PREFIX) if description.startswith(DIGEST_PREFIX) else None
