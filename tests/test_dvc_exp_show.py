"""The ``dvc exp show`` and ``dvc exp diff`` commands docs/pipeline.md gives fit a 100- and
a 120-column terminal: run in a pseudo-terminal of that width on a repository with the
project's ``dvc.yaml``, ``dvc.lock``, ``params.yaml`` and ``reports/summary.json`` and two
commits that turn a parameter each, no line is wider and no cell is squeezed to ``…``
(what plain ``dvc exp show --no-pager`` prints at 120 columns)."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import shlex
import shutil
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
CHANGED = {"train.rounds": ("10", "5"), "algorithms.fedprox.loss_transform.mu": ("0.01", "0.1")}


def documented_command(prefix: str) -> str:
    """The first line of docs/pipeline.md that starts with ``prefix``."""
    for line in (ROOT / "docs" / "pipeline.md").read_text().splitlines():
        if line.startswith(prefix):
            return line
    raise AssertionError(f"docs/pipeline.md has no line starting with {prefix!r}")


def in_terminal(command: str, cwd: Path, columns: int) -> list[str]:
    """The lines ``command`` prints in a terminal ``columns`` wide (escape codes removed)."""
    main, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 60, columns, 0, 0))
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "TERM": "xterm", "DVC_PAGER": "cat"}
    env.pop("COLUMNS", None)
    process = subprocess.Popen(
        shlex.split(command), cwd=cwd, stdin=child, stdout=child, stderr=child, env=env, close_fds=True
    )
    os.close(child)
    output = b""
    while True:
        try:
            chunk = os.read(main, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        output += chunk
    os.close(main)
    assert process.wait(timeout=120) == 0, output.decode(errors="replace")
    text = ANSI.sub("", output.decode()).replace("\r", "")
    return [line.rstrip() for line in text.splitlines() if line.strip()]


def git(repo: Path, *argv: str) -> None:
    subprocess.run(["git", *argv], cwd=repo, check=True, capture_output=True)


def set_param(repo: Path, dotted: str, value: float) -> None:
    params = yaml.safe_load((repo / "params.yaml").read_text())
    node = params
    *parents, last = dotted.split(".")
    for part in parents:
        node = node[part]
    node[last] = value
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("exp-repo")
    git(folder, "init", "-q")
    git(folder, "config", "user.email", "test@example.invalid")
    git(folder, "config", "user.name", "test")
    subprocess.run([str(BIN / "dvc"), "init", "-q"], cwd=folder, check=True)
    for name in ("dvc.yaml", "dvc.lock", "params.yaml"):
        shutil.copy(ROOT / name, folder / name)
    (folder / "reports").mkdir()
    shutil.copy(ROOT / "reports" / "summary.json", folder / "reports" / "summary.json")
    # The same values as params.yaml, written as the edits below write them: only the
    # turned values differ between the commits.
    set_param(folder, "train.rounds", 10)
    set_param(folder, "algorithms.fedprox.loss_transform.mu", 0.01)
    git(folder, "add", "-A")
    git(folder, "commit", "-q", "-m", "base")
    set_param(folder, "algorithms.fedprox.loss_transform.mu", 0.1)
    git(folder, "commit", "-q", "-am", "fedprox mu 0.1")
    set_param(folder, "train.rounds", 5)
    summary = json.loads((folder / "reports" / "summary.json").read_text())
    for metrics in summary.values():
        metrics["final_accuracy"] = round(metrics["final_accuracy"] - 0.01, 4)
    (folder / "reports" / "summary.json").write_text(json.dumps(summary, indent=2))
    git(folder, "commit", "-q", "-am", "five rounds")
    return folder


@pytest.mark.parametrize("columns", [100, 120])
def test_the_documented_exp_show_fits_and_shows_what_changed(repo: Path, columns: int) -> None:
    # Execute: the documented command, with -n 3 to list the commits (the rows a user's
    # experiments would be).
    lines = in_terminal(documented_command("dvc exp show --no-pager") + " -n 3", repo, columns)
    # Assert
    assert max(len(line) for line in lines) <= columns
    assert not any("…" in line for line in lines), "\n".join(lines)
    header = lines[1].split()
    assert header == ["Experiment", *CHANGED]
    rows = {line.split()[0]: line.split()[1:] for line in lines[3:-1]}
    assert rows["workspace"] == rows["master"] == ["5", "0.1"]
    assert sorted(value for key, value in rows.items() if key not in ("workspace", "master")) == [
        ["10", "0.01"], ["10", "0.1"]
    ]


def test_the_documented_exp_show_example_is_its_output(repo: Path) -> None:
    lines = in_terminal(documented_command("dvc exp show --no-pager") + " -n 3", repo, 100)
    documented = (ROOT / "docs" / "pipeline.md").read_text().splitlines()
    start = documented.index("<!-- exp-show-example -->") + 2
    block = documented[start : documented.index("```", start)]
    commit = re.compile(r"^(\s+)[0-9a-f]{7}\b")
    assert [commit.sub(r"\1<commit>", line) for line in lines] == [commit.sub(r"\1<commit>", line) for line in block]


def test_plain_exp_show_squeezes_cells_at_120_columns(repo: Path) -> None:
    """Why the docs need the filtered command: the finding as the user saw it."""
    lines = in_terminal("dvc exp show --no-pager", repo, 120)
    assert any("…" in line for line in lines)


@pytest.mark.parametrize("columns", [100, 120])
def test_the_documented_exp_diff_fits_with_a_line_per_algorithm(repo: Path, columns: int) -> None:
    # Execute: the documented command on the last commit against the first (an
    # experiment's name stands where a commit does).
    command = documented_command("dvc exp diff --no-path").split()[:4] + ["HEAD~2", "HEAD"]
    lines = in_terminal(" ".join(command), repo, columns)
    # Assert: every line fits; each algorithm's final accuracy and both changed params
    # are listed.
    assert max(len(line) for line in lines) <= columns
    assert not any("…" in line for line in lines)
    algorithms = json.loads((repo / "reports" / "summary.json").read_text())
    names = [line.split()[0] for line in lines]
    assert sorted(name for name in names if name.endswith(".final_accuracy")) == sorted(
        f"{algorithm}.final_accuracy" for algorithm in algorithms
    )
    assert sorted(name for name in names if name in CHANGED) == sorted(CHANGED)
