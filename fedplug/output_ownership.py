"""Whose is an output folder: its marker, the folders fedplug never writes to, and deleting
only the files a marker lists. The read-only checks behind :mod:`fedplug.output_folder`'s
:func:`~fedplug.output_folder.inspect` and :func:`~fedplug.output_folder.claim`
(docs/reliability.md, section 8.1)."""

from __future__ import annotations

import errno
import fcntl
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path, PurePosixPath
from typing import Any, Literal, TypedDict

from fedplug.errors import ConfigError
from fedplug.safe_files import open_regular_fd

MARKER_NAME = ".fedplug-output.json"
"""The marker file in every folder fedplug writes outputs to."""
LOCK_NAME = ".fedplug-output.lock"
"""The lock file (``fcntl.flock``; holds the holder's PID) inside a claimed folder."""
OWN_NAMES = (MARKER_NAME, LOCK_NAME)
TEMPORARY_SUFFIX = ".tmp"
"""Temporary files are ``.<name>.<random>.tmp`` in the target's folder (plus the target's
extension for :func:`fedplug.output_folder.write_through_path`)."""
DEFAULT_OPTION = "--out"
"""How messages name the folder unless :attr:`FolderRules.option` says otherwise."""

Status = Literal["new", "own", "replace"]
Legacy = Callable[[Path], "list[str] | None"]
"""Given a folder without a marker: the files in it this command wrote before markers
existed (then it is adopted), or None (then it is refused)."""


class FolderRules(TypedDict, total=False):
    """How :func:`~fedplug.output_folder.inspect` and :func:`~fedplug.output_folder.claim`
    judge a folder for a command; each key may be left out."""

    force: bool
    """Replace another fingerprint's fedplug folder (default False): the files its marker
    lists are deleted when it is claimed, nothing else."""
    legacy: Legacy | None
    """Recognises this command's folders from before markers, which are then adopted
    (default None: such a folder is refused)."""
    option: str
    """How messages name the folder (default ``"--out"``)."""
    force_option: str | None
    """The flag that overwrites a fedplug folder, or None where the command has none
    (default ``"--force"``)."""


def files_named(names: Iterable[str]) -> Legacy:
    """A ``legacy`` test: a folder holding only regular files with these names (and
    fedplug's temporary files) was written by fedplug before markers existed."""
    allowed = set(names)

    def recognise(folder: Path) -> list[str] | None:
        found = []
        for entry in os.scandir(folder):
            if entry.name in OWN_NAMES:
                continue
            if not entry.is_file(follow_symlinks=False):
                return None
            if entry.name not in allowed and not _is_temporary(entry.name, allowed):
                return None
            found.append(entry.name)
        return found

    return recognise


def ownership(path: Path, fingerprint: str, rules: FolderRules) -> tuple[Status, list[str]]:
    """``(status, files fedplug wrote there)`` of ``path`` for ``fingerprint``: ``"new"``
    (absent or empty), ``"own"`` (its marker holds ``fingerprint``, or ``rules``' legacy
    test recognises it) or ``"replace"`` (forced, another fingerprint's fedplug folder).

    Raises:
        ConfigError: a non-empty folder fedplug did not write, or another fingerprint's
            folder without ``force``.
    """
    option = rules.get("option", DEFAULT_OPTION)
    if not path.is_dir():
        return "new", []
    if os.path.lexists(path / MARKER_NAME):
        marker = read_marker(path, option)
        if marker["fingerprint"] == fingerprint:
            return "own", marker["files"]
        if rules.get("force", False):
            return "replace", marker["files"]
        force_option = rules.get("force_option", "--force")
        overwrite = f", or pass {force_option} to overwrite this fedplug folder" if force_option else ""
        raise ConfigError(
            f"{option} {str(path)!r} belongs to a different config (it holds fedplug outputs of other "
            f"settings); choose another {option}{overwrite}"
        )
    entries = [name for name in os.listdir(path) if name not in OWN_NAMES]
    if not entries:
        return "new", []
    legacy = rules.get("legacy")
    recognised = legacy(path) if legacy is not None else None
    if recognised is not None:
        return "own", recognised
    shown = ", ".join(sorted(entries)[:3]) + (", ..." if len(entries) > 3 else "")
    raise ConfigError(
        f"{option} {str(path)!r} is not empty and was not written by fedplug (it holds {shown}); "
        f"fedplug overwrites only its own folders: choose another {option} (a new or empty folder)"
    )


def read_marker(path: Path, option: str) -> dict[str, Any]:
    """The marker of ``path``: its fingerprint and the files it lists that lie inside the
    folder (a damaged marker is refused with one line naming ``option``)."""
    damaged = ConfigError(
        f"{option} {str(path)!r} has a damaged fedplug marker {MARKER_NAME}; choose another {option}, "
        "or delete the folder if its files are not needed"
    )
    if os.path.islink(path / MARKER_NAME):
        raise damaged
    try:
        fd = open_no_follow(path / MARKER_NAME, os.O_RDONLY)  # a FIFO or device: its own one line
    except OSError:
        raise damaged from None
    try:
        with os.fdopen(fd, "rb") as handle:
            marker = json.loads(handle.read(1 << 22))
    except (OSError, ValueError):
        raise damaged from None
    if (
        not isinstance(marker, dict)
        or not isinstance(marker.get("fingerprint"), str)
        or not isinstance(marker.get("files"), list)
    ):
        raise damaged
    # A tampered marker must not make fedplug delete anything outside the folder.
    files = [name for name in marker["files"] if isinstance(name, str) and plain_relative(name)]
    return {"fingerprint": marker["fingerprint"], "files": files}


def plain_relative(name: str) -> bool:
    """A path inside the folder: relative, no ``..``, not fedplug's marker or lock."""
    parts = PurePosixPath(name).parts
    return (
        bool(parts)
        and not name.startswith("/")
        and "\\" not in name
        and all(part not in ("", ".", "..") for part in parts)
        and name not in OWN_NAMES
    )


def unlink_entry(folder: Path, relative: str) -> None:
    """Delete ``folder/relative`` (a file or a symlink itself; never a folder, never through
    a symlinked parent), then its parent folders inside ``folder`` that became empty."""
    if relative not in OWN_NAMES and not plain_relative(relative):
        return
    target = folder / relative
    parent = target.parent
    if os.path.realpath(parent) != os.path.join(os.path.realpath(folder), *PurePosixPath(relative).parts[:-1]):
        return  # a parent inside the folder became a symlink: never delete through it
    try:
        if os.path.isdir(target) and not os.path.islink(target):
            return
        os.unlink(target)
    except FileNotFoundError:
        return
    while parent != folder:
        try:
            parent.rmdir()
        except OSError:
            return
        parent = parent.parent


def remove_stale_temporaries(folder: Path, files: list[str]) -> None:
    """Delete the temporary files of ``files`` that a killed write left (``kill -9`` between
    mkstemp and rename): under the lock, no other fedplug process is writing them."""
    by_parent: dict[str, set[str]] = {}
    for relative in files:
        parent, _, name = relative.rpartition("/")
        by_parent.setdefault(parent, set()).add(name)
    for parent, names in by_parent.items():
        try:
            entries = list(os.scandir(folder / parent))
        except OSError:
            continue
        for entry in entries:
            if entry.name.startswith(".") and _is_temporary(entry.name, names) and entry.is_file(follow_symlinks=False):
                unlink_entry(folder, f"{parent}/{entry.name}" if parent else entry.name)


def _is_temporary(name: str, allowed: set[str]) -> bool:
    """``name.tmp`` (the fixed name of old versions) or ``.name.<random>.tmp[.ext]`` of one
    of ``allowed``."""
    if name.endswith(TEMPORARY_SUFFIX) and name[: -len(TEMPORARY_SUFFIX)] in allowed:
        return True
    return any(name.startswith(f".{known}.") and TEMPORARY_SUFFIX in name for known in allowed)


def open_no_follow(path: Path, flags: int) -> int:
    """``os.open`` that refuses, with one line, a symlink at ``path``, and anything but a
    regular file there without waiting on it (a FIFO planted as the lock or the marker:
    :func:`fedplug.safe_files.open_regular_fd`)."""
    try:
        return open_regular_fd(path, flags, follow_symlinks=False)
    except OSError as failure:
        if failure.errno == errno.ELOOP:
            raise ConfigError(
                f"{str(path)!r} is a symlink; fedplug does not follow symlinks in its output folders: "
                "delete it, or choose another folder"
            ) from None
        raise


def refuse_if_locked(path: Path, option: str) -> None:
    """Refuse ``path`` while another process holds its lock (the message names its PID)."""
    lock = path / LOCK_NAME
    if not os.path.lexists(lock):
        return
    fd = open_no_follow(lock, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise in_use_error(path, read_pid(fd), option) from None
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def read_pid(fd: int) -> int | None:
    """The PID a lock file holds, or None when unreadable."""
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def in_use_error(path: Path, pid: int | None, option: str) -> ConfigError:
    """The one line refusing ``path`` because the fedplug run of ``pid`` holds it."""
    holder = f"PID {pid}" if pid is not None else "PID unknown"
    return ConfigError(
        f"{option} {str(path)!r} is in use by another fedplug run ({holder}); wait for it to finish, "
        f"or choose another {option}"
    )


def refuse_protected(path: Path, option: str) -> None:
    """Never ``/``, the home folder or the project root, nor a folder above them."""
    resolved = Path(os.path.realpath(path))
    protected: list[tuple[Path, str]] = [(Path(resolved.anchor or "/"), "the file system root")]
    home = os.path.expanduser("~")
    if home and home != "~":
        protected.append((Path(os.path.realpath(home)), "your home folder"))
    root = _project_root(Path.cwd())
    if root is not None:
        protected.append((root, "the project root"))
    for folder, described in protected:
        if resolved == folder or resolved in folder.parents:
            raise ConfigError(
                f"{option} {str(path)!r} is {described} ({folder}) or a folder above it; fedplug never "
                f"writes its outputs there, not even with --force: choose another {option}, e.g. runs/<name>"
            )


def _project_root(start: Path) -> Path | None:
    """The nearest folder at or above ``start`` holding ``pyproject.toml`` or ``.git``."""
    current = Path(os.path.realpath(start))
    for folder in (current, *current.parents):
        if (folder / "pyproject.toml").exists() or (folder / ".git").exists():
            return folder
    return None
