"""``dvc plots show`` and ``dvc plots diff`` draw the project's Vega plots without internet.

A temporary git + DVC repository holds the project's ``dvc.yaml``, ``params.yaml``,
``.dvc/config`` and plot templates, the offline HTML template (:mod:`fedplug.dvc_plots`)
and a small fabricated ``reports/curves.csv``. The pages DVC writes must load no script or
stylesheet from the network, and, where Debian's Chromium is installed, headless Chromium
with every network request refused must draw both plots as SVG, with their titles and a
line per algorithm.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fedplug.dvc_plots import write_template

ROOT = Path(__file__).resolve().parent.parent
DVC = str(Path(sys.executable).parent / "dvc")
"""The dvc of the environment running the tests (.venv's under `make test`)."""
TITLES = ("Test accuracy vs communication round", "Test accuracy vs cumulative bytes communicated")
ALGORITHMS = ("fedavg", "fedprox")
EXTERNAL = re.compile(r"<(?:script|link|img|iframe)\b[^>]*\b(?:src|href)\s*=\s*[\"']?(?:https?:)?//", re.IGNORECASE)
"""A tag that makes the browser fetch something from another host."""


def curves(accuracies: dict[str, list[float]]) -> str:
    """``reports/curves.csv`` as the evaluate stage writes it."""
    lines = ["algorithm,seed,round,accuracy,loss,cumulative_bytes"]
    for algorithm, values in accuracies.items():
        for round_number, accuracy in enumerate(values, start=1):
            lines.append(f"{algorithm},0,{round_number},{accuracy},{1 - accuracy},{round_number * 1_000_000}")
    return "\n".join(lines) + "\n"


def dvc(repo: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([DVC, *argv], cwd=repo, capture_output=True, text=True, timeout=300, check=True)


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A git + DVC repository with the project's plot definitions, one commit of curves."""
    folder = tmp_path_factory.mktemp("plots-repo")
    for name in ("dvc.yaml", "params.yaml"):
        shutil.copy(ROOT / name, folder / name)
    subprocess.run(["git", "init", "-q"], cwd=folder, check=True)
    subprocess.run(["git", "config", "user.email", "test@example.invalid"], cwd=folder, check=True)
    subprocess.run(["git", "config", "user.name", "test"], cwd=folder, check=True)
    dvc(folder, "init", "-q")
    shutil.copy(ROOT / ".dvc" / "config", folder / ".dvc" / "config")
    (folder / ".dvc" / "plots").mkdir()
    for template in (ROOT / ".dvc" / "plots").glob("*.json"):
        shutil.copy(template, folder / ".dvc" / "plots" / template.name)
    write_template(folder / ".dvc" / "plots" / "offline.html")
    (folder / "reports").mkdir()
    (folder / "reports" / "curves.csv").write_text(curves({"fedavg": [0.5, 0.7, 0.8], "fedprox": [0.4, 0.6, 0.75]}))
    subprocess.run(["git", "add", "-A"], cwd=folder, check=True)
    subprocess.run(["git", "commit", "-q", "-m", "curves"], cwd=folder, check=True)
    return folder


def vega_divs(html: str) -> int:
    """How many Vega plots DVC put on the page."""
    return html.count("vegaEmbed('#")


def test_plots_show_writes_a_page_that_loads_nothing_from_the_network(repo: Path) -> None:
    # Execute
    dvc(repo, "plots", "show", "-o", "show")
    html = (repo / "show" / "index.html").read_text()
    # Assert: both Vega plots, with Vega inlined, and no tag fetching from another host
    # (DVC's own page has three <script src="https://cdn.jsdelivr.net/...">).
    assert vega_divs(html) == 2
    assert "inlined by fedplug.dvc_plots" in html
    assert EXTERNAL.findall(html) == []


def test_plots_diff_writes_a_page_that_loads_nothing_from_the_network(repo: Path) -> None:
    # Prepare: the workspace's curves differ from the committed ones.
    (repo / "reports" / "curves.csv").write_text(curves({"fedavg": [0.55, 0.72, 0.85], "fedprox": [0.4, 0.6, 0.7]}))
    # Execute
    dvc(repo, "plots", "diff", "HEAD", "-o", "diff")
    html = (repo / "diff" / "index.html").read_text()
    # Assert: both revisions are in the data, and the page stays offline.
    assert vega_divs(html) == 2
    assert '"rev": "HEAD"' in html and '"rev": "workspace"' in html
    assert EXTERNAL.findall(html) == []


def test_the_dvc_config_names_the_offline_template() -> None:
    completed = subprocess.run(
        [DVC, "config", "plots.html_template"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert completed.stdout.strip() == "plots/offline.html"


def chromium_dom(page: Path, profile: Path) -> str:
    """The DOM of ``page`` after headless Chromium ran its scripts, with every request to
    another host refused (a proxy that does not exist, no DNS)."""
    completed = subprocess.run(
        [
            shutil.which("chromium") or "chromium", "--headless", "--no-sandbox", "--disable-gpu",
            "--disable-quic", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", f"--user-data-dir={profile}",
            "--proxy-server=http://127.0.0.1:9", "--host-resolver-rules=MAP * ~NOTFOUND",
            "--virtual-time-budget=15000", "--dump-dom", page.as_uri(),
        ],
        capture_output=True, text=True, timeout=120, check=True,
    )
    return completed.stdout


@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs Debian's chromium (apt-get install chromium)")
def test_headless_chromium_draws_both_plots_offline(repo: Path, tmp_path: Path) -> None:
    # Prepare
    dvc(repo, "plots", "show", "-o", "browser")
    # Execute
    dom = chromium_dom(repo / "browser" / "index.html", tmp_path / "profile")
    # Assert: two SVG charts drawn by vega-embed, each with its title, a legend entry and a
    # line (an SVG path of the line mark) per algorithm.
    charts = re.findall(r'<svg[^>]*class="marks".*?</svg>', dom, flags=re.DOTALL)
    assert len(charts) == 2, dom[:2000]
    for chart, title in zip(sorted(charts, key=lambda svg: TITLES.index(next(t for t in TITLES if t in svg))), TITLES):
        assert title in chart
        for algorithm in ALGORITHMS:
            assert f">{algorithm}<" in chart
        lines = re.findall(r'<g class="mark-line role-mark[^"]*"[^>]*>(.*?)</g>', chart, flags=re.DOTALL)
        assert lines and sum(body.count("<path") for body in lines) == len(ALGORITHMS)
