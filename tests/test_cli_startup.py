"""`fedplug --help` and a config error import neither torch nor Ray, Flower or MLflow
(issue 41: `--help` took 12.7 s on a busy machine, importing torch)."""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest

HEAVY = ("torch", "ray", "flwr", "mlflow")
PROBE = """
import sys
from fedplug.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
heavy = sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})
print("heavy modules:", heavy, file=sys.stderr)
"""


def heavy_modules_after(*arguments: str, cwd: Path) -> tuple[list[str], str, float]:
    """The modules of torch, Ray, Flower and MLflow a fresh interpreter holds after
    ``fedplug ARGUMENTS``; its stderr, and the CPU seconds it took."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    completed = subprocess.run(
        [sys.executable, "-c", PROBE.replace("{HEAVY!r}", repr(set(HEAVY))), *arguments],
        capture_output=True, text=True, timeout=120, check=True, cwd=cwd,
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    line = next(line for line in completed.stderr.splitlines() if line.startswith("heavy modules:"))
    return eval(line.removeprefix("heavy modules:")), completed.stderr, cpu  # noqa: S307 (our own list)


def test_help_imports_no_heavy_library(tmp_path: Path) -> None:
    heavy, _, cpu = heavy_modules_after("--help", cwd=tmp_path)
    print(f"fedplug --help: {cpu:.2f} s CPU")  # reported with -s; no timing assertion (shared machines)
    assert heavy == []
    for command in ("run", "list", "compare", "check-plugin"):
        assert heavy_modules_after(command, "--help", cwd=tmp_path)[0] == []


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (("run", "missing.yaml"), "config file 'missing.yaml' does not exist"),
        (("run", "params.yaml", "--set", "train.rounds"), "--set 'train.rounds': expected dotted.key=value"),
        (("run", "broken.yaml"), "broken.yaml: not valid YAML at line 2"),
    ],
)
def test_a_config_error_imports_no_heavy_library(tmp_path: Path, arguments: tuple[str, ...], message: str) -> None:
    (tmp_path / "params.yaml").write_text("train: {rounds: 2}\n")
    (tmp_path / "broken.yaml").write_text("train: [rounds\n")

    heavy, err, _ = heavy_modules_after(*arguments, cwd=tmp_path)

    assert f"fedplug: error: {message}" in err
    assert heavy == []
