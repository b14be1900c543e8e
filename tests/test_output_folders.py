"""fedplug deletes and overwrites only what it created; one writer per folder
(``fedplug.output_folder``; issue 29, findings 1, 4, 5, 6 and 9).

Each test is an attack a careless user (or a second process, or a planted symlink) makes
on an output folder, run the way a user runs it: ``fedplug run`` through
:func:`fedplug.cli.main`, ``pipelines/setup_phase.py`` (the setup stage) as a subprocess. Every file that
is not fedplug's is compared byte for byte before and after.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import stat
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from fedplug.cli import main
from fedplug.errors import ConfigError, OutputError
from fedplug.output_folder import (
    LOCK_NAME,
    MARKER_NAME,
    claim,
    inspect,
    remove_owned_folder,
    write_atomically,
    write_bytes,
    write_through_path,
)

REPO = Path(__file__).resolve().parent.parent
SETUP_STAGE = REPO / "pipelines" / "setup_phase.py"

TINY: dict[str, Any] = {
    "study": {"name": "tiny"},
    "tracking": {"enabled": False},
    "data": {
        "dataset": {"name": "synthetic", "num_train": 120, "num_test": 40, "num_features": 6, "num_classes": 3},
        "partition": {"name": "iid"},
        "num_clients": 3,
        "seed": 0,
    },
    "train": {"model": {"name": "logreg"}, "rounds": 2, "batch_size": 20, "seed": 0},
}
"""Three clients, two rounds of logistic regression: well under a second."""


# ------------------------------------------------------------------------------ helpers


def snapshot(folder: Path) -> dict[str, bytes | str]:
    """Every entry under ``folder``: file bytes, or ``-> target`` for a symlink."""
    found: dict[str, bytes | str] = {}
    for path in sorted(folder.rglob("*")):
        relative = str(path.relative_to(folder))
        if path.is_symlink():
            found[relative] = f"-> {os.readlink(path)}"
        elif path.is_file():
            found[relative] = path.read_bytes()
        else:
            found[relative] = "<dir>"
    return found


def user_folder(folder: Path) -> Path:
    """A folder of someone's own work, as in finding 1."""
    (folder / "MNIST" / "raw").mkdir(parents=True)
    (folder / "MNIST" / "raw" / "train-images-idx3-ubyte").write_bytes(b"\x00\x00\x08\x03 images")
    (folder / "important-notes").mkdir()
    (folder / "important-notes" / "x.txt").write_text("do not lose this\n")
    (folder / "thesis.tex").write_text("\\documentclass{article}\n")
    return folder


def write_config(folder: Path, **train: Any) -> Path:
    config = json.loads(json.dumps(TINY))
    config["train"].update(train)
    path = folder / f"config-{abs(hash(json.dumps(train, sort_keys=True)))}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def run_cli(*argv: str) -> tuple[int, str]:
    """``fedplug <argv>`` in process: (exit code, stderr)."""
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        code = main(list(argv))
    return code, stderr.getvalue()


def one_line(stderr: str) -> str:
    """The single error line of a refused command (no traceback, nothing else)."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    assert lines[0].startswith("fedplug: error: "), stderr
    return lines[0]


def fingerprint_of(config_path: Path) -> str:
    from fedplug.config import load_experiment
    from fedplug.run_folder import output_fingerprint

    return output_fingerprint(load_experiment(str(config_path), [], None, check_every_algorithm=False))


def setup_params(folder: Path, labels: list[str]) -> Path:
    """A params file whose algorithms have no setup phase (the stage then loads no data)."""
    params = {**TINY, "algorithms": {label: {} for label in labels}}
    path = folder / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    return path


def setup_stage(params: Path, out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SETUP_STAGE), "--params", str(params), "--out", str(out)],
        capture_output=True, text=True, timeout=300, check=False, cwd=params.parent,
    )


# ------------------------------------------------------------ finding 1: the setup stage


@pytest.mark.parametrize("name", ["my-thesis", "data"])
def test_setup_stage_refuses_a_folder_of_user_files_and_keeps_every_file(tmp_path: Path, name: str) -> None:
    out = user_folder(tmp_path / name)  # `--out data` is the same folder as the data's
    before = snapshot(out)
    completed = setup_stage(setup_params(tmp_path, ["fedavg", "fedprox"]), out)
    assert completed.returncode == 2, completed.stdout + completed.stderr
    line = completed.stderr.strip()
    assert "\n" not in line and "Traceback" not in completed.stderr
    assert "is not empty and was not written by fedplug" in line and "choose another --out" in line
    assert snapshot(out) == before


def test_setup_stage_removes_only_the_stale_files_its_marker_lists(tmp_path: Path) -> None:
    out = tmp_path / "setup"
    assert setup_stage(setup_params(tmp_path, ["fedavg", "fedprox"]), out).returncode == 0
    assert json.loads((out / MARKER_NAME).read_text())["files"] == ["fedavg/info.json", "fedprox/info.json"]
    # The user keeps notes in the folder fedplug owns, also inside the label folder that goes stale.
    (out / "notes.txt").write_text("mine\n")
    (out / "fedprox" / "plot.png").write_bytes(b"png")
    completed = setup_stage(setup_params(tmp_path, ["fedavg"]), out)
    assert completed.returncode == 0, completed.stderr
    assert (out / "notes.txt").read_text() == "mine\n"
    assert (out / "fedprox" / "plot.png").read_bytes() == b"png"
    assert not (out / "fedprox" / "info.json").exists()  # fedplug's own stale file went
    assert (out / "fedavg" / "info.json").is_file()
    assert json.loads((out / MARKER_NAME).read_text())["files"] == ["fedavg/info.json"]


def test_setup_stage_adopts_its_layout_from_before_markers(tmp_path: Path) -> None:
    """``make repro`` keeps working on a setup folder written by an older fedplug (DVC
    keeps it: the output is ``persist``)."""
    out = tmp_path / "setup"
    for label in ("fedavg", "old"):
        (out / label).mkdir(parents=True)
        (out / label / "info.json").write_text(json.dumps({"algorithm": label, "needs_density": False}))
    completed = setup_stage(setup_params(tmp_path, ["fedavg"]), out)
    assert completed.returncode == 0, completed.stderr
    assert sorted(path.name for path in out.iterdir() if not path.name.startswith(".")) == ["fedavg"]


# ------------------------------------------------------------ finding 4: one writer per folder


HOLDER = textwrap.dedent(
    """
    import sys
    from fedplug.output_folder import claim
    held = claim(sys.argv[1], sys.argv[2])
    print("ready", flush=True)
    sys.stdin.read()
    """
)


@pytest.mark.parametrize("same_config", [True, False], ids=["same-config", "other-seed"])
def test_a_second_run_on_one_out_is_refused_naming_the_first_ones_pid(tmp_path: Path, same_config: bool) -> None:
    config = write_config(tmp_path)
    holder_config = config if same_config else write_config(tmp_path, seed=1)
    out = tmp_path / "conc"
    first = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(out), fingerprint_of(holder_config)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert first.stdout is not None and first.stdout.readline().strip() == "ready"
        before = snapshot(out)
        code, stderr = run_cli("run", str(config), "--out", str(out), "--quiet")
        assert code == 2
        line = one_line(stderr)
        assert f"is in use by another fedplug run (PID {first.pid})" in line
        assert snapshot(out) == before
    finally:
        first.communicate(input="", timeout=60)
    # Once the first one is done, the folder is free again.
    code, stderr = run_cli("run", str(config), "--out", str(out), "--quiet", *(["--force"] if not same_config else []))
    assert code == 0, stderr


def test_claims_of_one_folder_in_one_process_are_reentrant(tmp_path: Path) -> None:
    with claim(tmp_path / "out", "a") as outer:
        with claim(tmp_path / "out", "a") as inner:
            assert inner is outer
        with pytest.raises(ConfigError, match="already in use by this process for a different config"):
            claim(tmp_path / "out", "b")
    # Released: another process could claim it now.
    completed = subprocess.run(
        [sys.executable, "-c", "import sys; from fedplug.output_folder import claim; claim(sys.argv[1], 'a')",
         str(tmp_path / "out")], capture_output=True, text=True, timeout=120, check=False,
    )
    assert completed.returncode == 0, completed.stderr


def test_writers_of_one_file_never_share_a_temporary_name(tmp_path: Path) -> None:
    """Finding 4's ``No such file or directory: 'conc/checkpoint.pt.tmp' -> 'conc/checkpoint.pt'``:
    two writers with a fixed temporary name rename each other's file away."""
    from fedplug.run.checkpoint import save_checkpoint
    from fedplug.run_folder import write_json

    state = {"fingerprint": "f", "history": [], "global": torch.arange(50_000, dtype=torch.float32)}
    errors: list[BaseException] = []

    def writer(index: int) -> None:
        try:
            for step in range(25):
                save_checkpoint(tmp_path / "checkpoint.pt", {**state, "writer": index, "step": step})
                write_json(tmp_path / "metrics.json", {"writer": index, "step": step, "pad": "x" * 20_000})
        except BaseException as error:  # noqa: BLE001 (any failure of any writer fails the test)
            errors.append(error)

    threads = [threading.Thread(target=writer, args=(index,)) for index in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["step"] == 24
    assert json.loads((tmp_path / "metrics.json").read_text())["step"] == 24
    assert sorted(path.name for path in tmp_path.iterdir()) == ["checkpoint.pt", "metrics.json"]


def test_a_killed_writes_temporary_file_goes_at_the_next_claim_and_nothing_else(tmp_path: Path) -> None:
    from fedplug.output_folder import write_text

    out = tmp_path / "out"
    with claim(out, "a"):
        write_text(out / "metrics.json", "{}")
    (out / ".metrics.json.k1ll3d.tmp").write_text("{")  # kill -9 between mkstemp and rename
    (out / ".notes.tmp").write_text("the user's\n")
    with claim(out, "a"):
        pass
    assert sorted(path.name for path in out.iterdir()) == [MARKER_NAME, LOCK_NAME, ".notes.tmp", "metrics.json"]


# ------------------------------------------------------------ finding 5: planted symlinks


def test_symlinks_planted_in_out_are_never_written_through(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    out = tmp_path / "run"
    assert run_cli("run", str(config), "--out", str(out), "--quiet")[0] == 0
    victims = tmp_path / "outside"
    victims.mkdir()
    planted = ("checkpoint.pt.tmp", "metrics.json.tmp", "config.yaml", "metrics.json", "model.pt", "run_info.json")
    for name in planted:
        (victims / name).write_text(f"precious {name}\n")
        (out / name).unlink(missing_ok=True)
        (out / name).symlink_to(victims / name)
    before = snapshot(victims)
    code, stderr = run_cli("run", str(config), "--out", str(out), "--quiet", "--no-resume")
    assert code == 0, stderr
    assert snapshot(victims) == before
    for name in ("config.yaml", "metrics.json", "model.pt", "run_info.json", "checkpoint.pt"):
        assert (out / name).is_file() and not (out / name).is_symlink(), name
    assert json.loads((out / "metrics.json").read_text())["rounds"] == 2


def test_write_atomically_replaces_a_symlink_instead_of_following_it(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "file.json").symlink_to(victim)
    write_atomically(tmp_path / "out" / "file.json", lambda handle: handle.write(b"{}"))
    assert victim.read_text() == "precious\n"
    assert (tmp_path / "out" / "file.json").read_bytes() == b"{}" and not (tmp_path / "out" / "file.json").is_symlink()


def test_a_symlinked_lock_or_a_tampered_marker_never_reaches_outside(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    out = tmp_path / "out"
    with claim(out, "a"):
        pass
    (out / MARKER_NAME).write_text(json.dumps({"fedplug_output": 1, "fingerprint": "a",
                                              "files": ["../victim.txt", str(victim), "ok.txt"]}))
    (out / "ok.txt").write_text("fedplug's\n")
    remove_owned_folder(out)
    assert victim.read_text() == "precious\n" and not out.exists()
    out.mkdir()
    (out / LOCK_NAME).symlink_to(victim)
    with pytest.raises(ConfigError, match="is a symlink"):
        claim(out, "a")
    assert victim.read_text() == "precious\n"


# ------------------------------------------------------------ finding 6: whose folder --out is


def test_an_unrelated_folder_is_refused_and_left_untouched(tmp_path: Path) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "config.yaml").write_text("my: own config\n")
    (out / "model.pt").write_bytes(b"my model")
    (out / "notes.txt").write_text("notes\n")
    before = snapshot(out)
    code, stderr = run_cli("run", str(write_config(tmp_path)), "--out", str(out), "--quiet")
    assert code == 2
    line = one_line(stderr)
    assert "is not empty and was not written by fedplug" in line and "choose another --out" in line
    assert snapshot(out) == before
    # --force overwrites only fedplug's folders.
    code, stderr = run_cli("run", str(write_config(tmp_path)), "--out", str(out), "--quiet", "--force")
    assert code == 2 and "was not written by fedplug" in one_line(stderr)
    assert snapshot(out) == before


def test_a_finished_run_of_another_config_is_refused_then_replaced_with_force(tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert run_cli("run", str(write_config(tmp_path)), "--out", str(out), "--quiet")[0] == 0
    (out / "checkpoint.pt").unlink()  # as a DVC-tracked (finished) run folder has none
    (out / "notes.txt").write_text("my notes on this run\n")
    before = snapshot(out)
    other = write_config(tmp_path, seed=7)
    code, stderr = run_cli("run", str(other), "--out", str(out), "--quiet")
    assert code == 2
    line = one_line(stderr)
    assert "belongs to a different config" in line and "pass --force to overwrite this fedplug folder" in line
    assert snapshot(out) == before
    code, stderr = run_cli("run", str(other), "--out", str(out), "--quiet", "--force")
    assert code == 0, stderr
    assert yaml.safe_load((out / "config.yaml").read_text())["train"]["seed"] == 7
    assert (out / "notes.txt").read_text() == "my notes on this run\n"
    assert json.loads((out / MARKER_NAME).read_text())["fingerprint"] == fingerprint_of(other)


def test_a_resumed_run_of_the_same_config_is_welcome(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    out = tmp_path / "run"
    assert run_cli("run", str(config), "--out", str(out), "--quiet")[0] == 0
    code, stderr = run_cli("run", str(config), "--out", str(out), "--quiet")
    assert code == 0, stderr
    files = json.loads((out / MARKER_NAME).read_text())["files"]
    assert files == ["checkpoint.pt", "config.yaml", "metrics.json", "model.pt", "run_info.json"]


@pytest.mark.parametrize("where", ["project-root", "home"])
def test_force_never_writes_into_the_project_root_or_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    project = tmp_path / "project"
    project.mkdir()
    (project / "pyproject.toml").write_text("[project]\nname = 'mine'\n")
    (project / "config.yaml").write_text("mine\n")
    config = write_config(tmp_path)
    monkeypatch.chdir(project)
    if where == "home":
        home = tmp_path / "home"
        home.mkdir()
        (home / ".bashrc").write_text("mine\n")
        monkeypatch.setenv("HOME", str(home))
        out, target = str(home), home
    else:
        out, target = ".", project
    # Even a fedplug marker planted there does not make it fedplug's.
    (target / MARKER_NAME).write_text(json.dumps({"fedplug_output": 1, "fingerprint": "x", "files": []}))
    before = snapshot(target)
    code, stderr = run_cli("run", str(config), "--out", out, "--quiet", "--force")
    assert code == 2
    assert "fedplug never writes its outputs there, not even with --force" in one_line(stderr)
    assert snapshot(target) == before


def test_the_file_system_root_is_never_an_output_folder() -> None:
    for force in (False, True):
        with pytest.raises(ConfigError, match="is the file system root"):
            inspect("/", "x", force=force)


# ------------------------------------------------------------ finding 9: disk full


@pytest.fixture
def full_disk(tmp_path: Path) -> Any:
    """A folder on a 256 KiB tmpfs (mounted when permitted: root in a container), else a
    folder where writes of temporary files fail with ENOSPC (``os.write`` patched)."""
    mount = tmp_path / "tiny"
    mount.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True, check=False
    ).returncode == 0 if os.geteuid() == 0 else False
    yield mount, mounted
    if mounted:
        subprocess.run(["umount", "-l", str(mount)], check=False)  # lazy: a test that failed may hold a file there


def fill(folder: Path) -> None:
    """Fill the file system of ``folder`` up to its last byte."""
    for size in (4096, 1):
        with contextlib.suppress(OSError), open(folder / f"filler-{size}", "wb", buffering=0) as handle:
            while True:
                handle.write(b"\0" * size)


def no_space_for_temporaries(monkeypatch: pytest.MonkeyPatch, name: str, after: int = 0) -> None:
    """Writes to temporary files of ``name`` fail with ENOSPC, after ``after`` files made it."""
    real_write = os.write
    seen: list[str] = []

    def write(fd: int, data: Any) -> int:
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            path = ""
        if Path(path).name.startswith(f".{name}.") or Path(path).name == f"{name}.tmp":
            if path not in seen:
                seen.append(path)
            if len(seen) > after:
                raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)


def test_disk_full_during_a_checkpoint_is_one_line_and_keeps_the_previous_one(
    full_disk: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fedplug.run.checkpoint import save_checkpoint

    folder, mounted = full_disk
    path = folder / "checkpoint.pt"
    save_checkpoint(path, {"fingerprint": "f", "history": [1]})
    if mounted:
        fill(folder)
    else:
        no_space_for_temporaries(monkeypatch, "checkpoint.pt")
    with pytest.raises(OutputError) as refused:
        save_checkpoint(path, {"fingerprint": "f", "history": [1, 2], "global": torch.zeros(100_000)})
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"no space left on device writing {str(path)!r}")
    assert message.endswith("the previous checkpoint is kept")
    assert sorted(entry.name for entry in folder.iterdir() if not entry.name.startswith("filler")) == ["checkpoint.pt"]
    assert torch.load(path, weights_only=True)["history"] == [1]


def test_disk_full_during_a_run_is_one_line_and_the_run_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = write_config(tmp_path, rounds=3)
    out = tmp_path / "run"
    with monkeypatch.context() as patch:
        no_space_for_temporaries(patch, "checkpoint.pt", after=1)  # round 1's checkpoint is written
        code, stderr = run_cli("run", str(config), "--out", str(out), "--quiet")
    assert code == 2
    line = one_line(stderr)
    assert f"no space left on device writing {str(out / 'checkpoint.pt')!r}" in line
    assert line.endswith("the previous checkpoint is kept")
    assert not [path.name for path in out.iterdir() if path.name.endswith(".tmp")]
    assert len(torch.load(out / "checkpoint.pt", weights_only=False)["history"]) == 1
    code, stderr = run_cli("run", str(config), "--out", str(out), "--quiet")
    assert code == 0, stderr
    assert json.loads((out / "metrics.json").read_text())["rounds"] == 3


def test_outputs_get_the_mode_open_would_give_them_not_mkstemps(tmp_path: Path) -> None:
    # Prepare: a umask of 027 (group may read, others nothing); mkstemp alone gives 0600.
    previous = os.umask(0o027)
    try:
        # Execute
        write_bytes(tmp_path / "metrics.json", b"{}")
        write_through_path(tmp_path / "curves.csv", lambda name: name.write_text("a\n"))
        with claim(tmp_path / "run", "fingerprint"):
            pass
    finally:
        os.umask(previous)
    # Assert: 0666 less the umask, as open() would create them (the marker too).
    for name in ("metrics.json", "curves.csv", f"run/{MARKER_NAME}"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o640


def test_a_run_folder_of_an_earlier_fedplug_resumes_only_for_its_own_config(tmp_path: Path) -> None:
    # Prepare: a finished run whose folder has no marker or lock, as a fedplug before
    # markers left it (config.yaml, run_info.json, metrics.json, model.pt, checkpoint.pt).
    config = write_config(tmp_path)
    out = tmp_path / "run"
    assert run_cli("run", str(config), "--out", str(out), "--quiet")[0] == 0
    (out / MARKER_NAME).unlink()
    (out / LOCK_NAME).unlink()
    before = snapshot(out)
    # Execute / Assert: another config is refused in one line and nothing changes ...
    code, stderr = run_cli("run", str(write_config(tmp_path, seed=7)), "--out", str(out), "--quiet")
    assert code == 2 and "was not written by fedplug" in one_line(stderr)
    assert snapshot(out) == before
    # ... while the same command adopts the folder: it resumes from its checkpoint.
    code, stderr = run_cli("run", str(config), "--out", str(out), "--quiet")
    assert code == 0, stderr
    assert json.loads((out / "metrics.json").read_bytes()) == json.loads(before["metrics.json"])
    files = json.loads((out / MARKER_NAME).read_text())["files"]
    assert files == ["checkpoint.pt", "config.yaml", "metrics.json", "model.pt", "run_info.json"]
