"""Owning an output folder safely: fedplug deletes and overwrites only what it created, and
one run writes into a folder at a time.

Every folder fedplug writes its outputs to (``fedplug run --out``, a Flower ServerApp's
``fedplug-out``, the pipeline's ``data/density`` and ``reports/runs/<label>/seed-<n>``, a
study's folder and its run folders) carries a
marker, :data:`MARKER_NAME`: JSON with the *fingerprint* of what the folder is for (a
config's hash, or a stage's name) and the list of files fedplug wrote there. Why: a folder
the user already had (``--out ~/thesis``, ``--out data``) must never lose or get a file
overwritten, and a finished run of another config must not be replaced silently
(``config.yaml`` would then describe one run and ``model.pt`` another).

- :func:`inspect` (read only) and :func:`claim` refuse, with one line
  (:class:`~fedplug.errors.ConfigError`): a non-empty folder without a marker, one whose
  marker holds another fingerprint (``force=True`` replaces such a *fedplug* folder: the
  files its marker lists are deleted first, nothing else), one another process holds (the
  line names its PID), and always ``/``, the user's home and the project root (and the
  folders above them), even with ``force``.
- :func:`claim` holds an advisory lock (``fcntl.flock`` on :data:`LOCK_NAME` inside the
  folder) until released: a second fedplug process on the same folder is refused. The lock
  is advisory: it stops fedplug, not other programs. Claims are re-entrant within one
  process (the CLI claims, then :func:`fedplug.experiment.train_experiment` claims again).
- :func:`write_atomically` writes a file through a unique temporary file made with
  :func:`tempfile.mkstemp` in the same folder (``O_EXCL``: a symlink planted at any name is
  never opened), fsyncs it and renames it over the target (a rename replaces a symlink
  planted at the target instead of writing through it). While the folder is claimed, the
  file is added to the marker's list. A full disk (``ENOSPC``, also when ``torch.save``
  wraps it in ``RuntimeError: [enforce fail at inline_container.cc...]``) becomes one line
  (:class:`~fedplug.errors.OutputError`); the temporary file is removed and the previous
  version of the file stays.
- :meth:`OutputFolder.remove` and :func:`remove_owned_folder` delete only listed files.

A folder written by a fedplug version before markers has none; a command that knows its own
old layout passes ``legacy`` (a function returning the files it recognises as its own, or
None) so that such a folder is adopted instead of refused (:func:`files_named`).
"""

from __future__ import annotations

import errno
import fcntl
import io
import json
import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO, Literal

from fedplug.errors import ConfigError, OutputError

MARKER_NAME = ".fedplug-output.json"
"""The marker file in every folder fedplug writes outputs to."""
LOCK_NAME = ".fedplug-output.lock"
"""The lock file (``fcntl.flock``; holds the holder's PID) inside a claimed folder."""
MARKER_FORMAT = 1
TEMPORARY_SUFFIX = ".tmp"
"""Temporary files are ``.<name>.<random>.tmp`` in the target's folder (plus the target's
extension for :func:`write_through_path`)."""
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
OWN_NAMES = (MARKER_NAME, LOCK_NAME)

Status = Literal["new", "own", "replace"]
Legacy = Callable[[Path], "list[str] | None"]
"""Given a folder without a marker: the files in it this command wrote before markers
existed (then it is adopted), or None (then it is refused)."""

_HELD: dict[str, "OutputFolder"] = {}
"""Folders this process holds, by real path (claims are re-entrant)."""


class OutputFolder:
    """A claimed output folder: the lock is held, the marker names this fingerprint.

    Use it as a context manager, or call :meth:`release`; every :func:`claim` of the same
    folder in this process returns this object and needs its own release.
    """

    def __init__(self, path: Path, fingerprint: str, lock_fd: int, files: Iterable[str]) -> None:
        self.path = path
        self.fingerprint = fingerprint
        self.files: list[str] = sorted(set(files))
        self._lock_fd = lock_fd
        self._claims = 1

    def __enter__(self) -> "OutputFolder":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.release()

    def record(self, relative: str) -> None:
        """Add ``relative`` (a path inside the folder) to the marker's list of files."""
        if relative not in self.files and _plain_relative(relative):
            self.files = sorted({*self.files, relative})
            _write_marker(self.path, self.fingerprint, self.files)

    def remove(self, relative: str) -> None:
        """Delete ``relative`` if the marker lists it (the file itself, never what a
        symlink there points to), and drop it from the list."""
        if relative not in self.files:
            return
        _unlink_entry(self.path, relative)
        self.files = [name for name in self.files if name != relative]
        _write_marker(self.path, self.fingerprint, self.files)

    def release(self) -> None:
        """Give up one claim; the last one unlocks the folder."""
        self._claims -= 1
        if self._claims > 0:
            return
        _HELD.pop(_key(self.path), None)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
        finally:
            os.close(self._lock_fd)


def inspect(
    folder: str | os.PathLike[str],
    fingerprint: str,
    *,
    force: bool = False,
    legacy: Legacy | None = None,
    option: str = "--out",
    force_option: str | None = "--force",
) -> Status:
    """Whether ``folder`` may receive the outputs of ``fingerprint``, without writing
    anything: ``"new"`` (absent or empty), ``"own"`` (its marker holds ``fingerprint``, or
    ``legacy`` recognises it) or ``"replace"`` (``force`` and another fingerprint's
    fedplug folder: :func:`claim` deletes the files its marker lists).

    Args:
        option: how messages name the folder (``--out``).
        force_option: the flag that overwrites a fedplug folder, or None where the
            command has none.

    Raises:
        ConfigError: a folder fedplug never writes into, one another process holds, a
            non-empty folder without a marker, or another fingerprint's folder (without
            ``force``).
    """
    path = Path(folder)
    _refuse_protected(path, option)
    if not os.path.lexists(path):
        return "new"
    if not path.is_dir():
        raise ConfigError(f"{option} {str(path)!r} is a file, not a folder; choose another {option}")
    if _key(path) not in _HELD:
        _refuse_if_locked(path, option)
    return _ownership(path, fingerprint, force, legacy, option, force_option)[0]


def claim(
    folder: str | os.PathLike[str],
    fingerprint: str,
    *,
    force: bool = False,
    legacy: Legacy | None = None,
    option: str = "--out",
    force_option: str | None = "--force",
) -> OutputFolder:
    """Create ``folder`` if needed, lock it and write its marker (see :func:`inspect` for
    what is refused; with ``force``, the files another fingerprint's marker lists are
    deleted first). Re-entrant: a folder this process holds is returned again.

    Raises:
        ConfigError: as :func:`inspect`, or when another process claimed it meanwhile.
    """
    path = Path(folder)
    held = _HELD.get(_key(path)) if os.path.isdir(path) else None
    if held is not None:
        if held.fingerprint != fingerprint:
            raise ConfigError(
                f"{option} {str(path)!r} is already in use by this process for a different config; "
                f"choose another {option}"
            )
        held._claims += 1
        return held
    inspect(path, fingerprint, force=force, legacy=legacy, option=option, force_option=force_option)
    path.mkdir(parents=True, exist_ok=True)
    lock_fd = _open_no_follow(path / LOCK_NAME, os.O_RDWR | os.O_CREAT, option)
    try:
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _in_use(path, _read_pid(lock_fd), option) from None
        os.ftruncate(lock_fd, 0)
        os.pwrite(lock_fd, f"{os.getpid()}\n".encode(), 0)
        # Checked again under the lock: another process may have claimed it meanwhile.
        status, files = _ownership(path, fingerprint, force, legacy, option, force_option)
        if status == "replace":
            for relative in files:
                _unlink_entry(path, relative)
            files = []
        _remove_stale_temporaries(path, [*files, MARKER_NAME])
        _write_marker(path, fingerprint, files)
    except BaseException:
        os.close(lock_fd)
        raise
    owned = OutputFolder(path, fingerprint, lock_fd, files)
    _HELD[_key(path)] = owned
    return owned


def remove_owned_folder(
    folder: str | os.PathLike[str], *, legacy: Legacy | None = None, option: str = "run folder"
) -> None:
    """Delete the files fedplug wrote in ``folder`` (its marker's list, or what ``legacy``
    recognises), the marker and the lock, then the folder and its emptied subfolders.
    Files fedplug did not write are left, and the folder with them.

    Raises:
        ConfigError: ``folder`` has no readable marker and ``legacy`` does not recognise
            it, or another process holds it.
    """
    path = Path(folder)
    if not os.path.lexists(path):
        return
    _refuse_protected(path, option)
    _refuse_if_locked(path, option)
    marker = _read_marker(path, option) if os.path.lexists(path / MARKER_NAME) else None
    files = marker["files"] if marker is not None else (legacy(path) if legacy is not None else None)
    if files is None:
        raise ConfigError(
            f"{option} {str(path)!r} was not written by fedplug (no {MARKER_NAME}); fedplug does not "
            "delete it: delete it yourself if it is not needed"
        )
    for relative in [*files, MARKER_NAME, LOCK_NAME]:
        _unlink_entry(path, relative)
    try:
        path.rmdir()
    except OSError:
        pass  # files fedplug did not write stay, and so does their folder


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


# ------------------------------------------------------------------------------ writing


def write_atomically(path: str | os.PathLike[str], write: Callable[[BinaryIO], None], *, what: str | None = None) -> None:
    """Write ``path`` via ``write(handle)`` on a unique temporary file in the same folder,
    fsync, and rename it over ``path``; list it in the marker of a folder this process holds.

    Args:
        what: what the file is (``"checkpoint"``), for the disk-full message.

    Raises:
        OutputError: the disk (or quota) is full; the temporary file is gone and a previous
            ``path`` is unchanged.
    """
    target = Path(path)
    folder = target.parent
    folder.mkdir(parents=True, exist_ok=True)
    existed = os.path.lexists(target)
    fd, temporary = tempfile.mkstemp(prefix=f".{target.name}.", suffix=TEMPORARY_SUFFIX, dir=folder)
    os.fchmod(fd, default_file_mode())
    raw = _RecordingFile(fd)
    try:
        try:
            with io.BufferedWriter(raw, buffer_size=1 << 20) as handle:
                write(handle)
                handle.flush()
                os.fsync(fd)
        except (OSError, RuntimeError) as failure:
            cause = failure if isinstance(failure, OSError) else raw.error
            if cause is not None and cause.errno in DISK_FULL:
                raise _disk_full(target, what, existed) from None
            raise
        os.replace(temporary, target)
    except BaseException:
        try:
            os.unlink(temporary)
        except FileNotFoundError:
            pass
        raise
    _record(target)


def default_file_mode() -> int:
    """The mode ``open()`` would give a new file (``0o666`` less the umask): ``mkstemp``
    creates its files ``0o600``, and outputs must stay readable to whoever could read them
    before (a DVC cache, a shared results folder)."""
    umask = _umask()
    return 0o666 & ~umask


def _umask() -> int:
    """The process's umask, read without changing it where Linux says it
    (``/proc/self/status``), else set and restored at once."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    current = os.umask(0o022)
    os.umask(current)
    return current


def write_bytes(path: str | os.PathLike[str], data: bytes, *, what: str | None = None) -> None:
    """:func:`write_atomically` of ``data``."""
    write_atomically(path, lambda handle: handle.write(data), what=what)


def write_text(path: str | os.PathLike[str], text: str, *, what: str | None = None) -> None:
    """:func:`write_atomically` of ``text`` (UTF-8)."""
    write_bytes(path, text.encode("utf-8"), what=what)


def write_through_path(path: str | os.PathLike[str], produce: Callable[[Path], None], *, what: str | None = None) -> None:
    """For writers that take a file name only (matplotlib, a CSV helper): ``produce`` writes
    a unique temporary name that :func:`tempfile.mkstemp` created, which is then renamed
    over ``path`` as in :func:`write_atomically`. The name ends in ``path``'s extension,
    from which matplotlib picks the image format."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    existed = os.path.lexists(target)
    suffix = TEMPORARY_SUFFIX + target.suffix
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=suffix, dir=target.parent)
    os.fchmod(fd, default_file_mode())
    os.close(fd)
    temporary = Path(name)
    try:
        try:
            produce(temporary)
            fd = _open_no_follow(temporary, os.O_RDONLY, "output")
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as failure:
            if failure.errno in DISK_FULL:
                raise _disk_full(target, what, existed) from None
            raise
        os.replace(temporary, target)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    _record(target)


class _RecordingFile(io.RawIOBase):
    """The temporary file's descriptor as a raw stream that remembers the ``OSError`` a
    write raised: ``torch.save`` turns it into a ``RuntimeError`` that no longer says the
    disk was full."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.error: OSError | None = None

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return os.lseek(self.fd, offset, whence)

    def tell(self) -> int:
        return os.lseek(self.fd, 0, os.SEEK_CUR)

    def write(self, data: Any) -> int:
        try:
            return os.write(self.fd, data)
        except OSError as failure:
            self.error = failure
            raise

    def fileno(self) -> int:
        return self.fd

    def close(self) -> None:
        if not self.closed:
            super().close()
            os.close(self.fd)


def _disk_full(target: Path, what: str | None, existed: bool) -> OutputError:
    kept = f"; the previous {what or target.name} is kept" if existed else ""
    return OutputError(
        f"no space left on device writing {str(target)!r}: free space on that disk (or write to "
        f"another one) and run the same command again{kept}"
    )


def _record(target: Path) -> None:
    """List ``target`` in the marker of the held folder it lies in, if any."""
    if not _HELD:
        return
    parent = Path(os.path.realpath(target.parent))
    for key, owned in _HELD.items():
        try:
            relative = (parent / target.name).relative_to(key)
        except ValueError:
            continue
        owned.record(relative.as_posix())
        return


# ------------------------------------------------------------------------------ internals


def _key(path: Path) -> str:
    return os.path.realpath(path)


def _ownership(
    path: Path,
    fingerprint: str,
    force: bool,
    legacy: Legacy | None,
    option: str,
    force_option: str | None,
) -> tuple[Status, list[str]]:
    """``(status, files fedplug wrote there)`` of an existing folder (see :func:`inspect`)."""
    if not path.is_dir():
        return "new", []
    if os.path.lexists(path / MARKER_NAME):
        marker = _read_marker(path, option)
        if marker["fingerprint"] == fingerprint:
            return "own", marker["files"]
        if force:
            return "replace", marker["files"]
        overwrite = f", or pass {force_option} to overwrite this fedplug folder" if force_option else ""
        raise ConfigError(
            f"{option} {str(path)!r} belongs to a different config (it holds fedplug outputs of other "
            f"settings); choose another {option}{overwrite}"
        )
    entries = [name for name in os.listdir(path) if name not in OWN_NAMES]
    if not entries:
        return "new", []
    recognised = legacy(path) if legacy is not None else None
    if recognised is not None:
        return "own", recognised
    shown = ", ".join(sorted(entries)[:3]) + (", ..." if len(entries) > 3 else "")
    raise ConfigError(
        f"{option} {str(path)!r} is not empty and was not written by fedplug (it holds {shown}); "
        f"fedplug overwrites only its own folders: choose another {option} (a new or empty folder)"
    )


def _read_marker(path: Path, option: str) -> dict[str, Any]:
    damaged = ConfigError(
        f"{option} {str(path)!r} has a damaged fedplug marker {MARKER_NAME}; choose another {option}, "
        "or delete the folder if its files are not needed"
    )
    try:
        fd = _open_no_follow(path / MARKER_NAME, os.O_RDONLY, option)
    except ConfigError:
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
    files = [name for name in marker["files"] if isinstance(name, str) and _plain_relative(name)]
    return {"fingerprint": marker["fingerprint"], "files": files}


def _write_marker(path: Path, fingerprint: str, files: list[str]) -> None:
    content = {"fedplug_output": MARKER_FORMAT, "fingerprint": fingerprint, "files": sorted(files)}
    # Not write_text: that would list the marker in itself.
    data = (json.dumps(content, indent=2) + "\n").encode()
    fd, temporary = tempfile.mkstemp(prefix=f".{MARKER_NAME}.", suffix=TEMPORARY_SUFFIX, dir=path)
    os.fchmod(fd, default_file_mode())
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path / MARKER_NAME)
    except OSError as failure:
        os.unlink(temporary)
        if failure.errno in DISK_FULL:
            raise _disk_full(path / MARKER_NAME, None, False) from None
        raise


def _plain_relative(name: str) -> bool:
    """A path inside the folder: relative, no ``..``, not fedplug's marker or lock."""
    parts = PurePosixPath(name).parts
    return (
        bool(parts)
        and not name.startswith("/")
        and "\\" not in name
        and all(part not in ("", ".", "..") for part in parts)
        and name not in OWN_NAMES
    )


def _unlink_entry(folder: Path, relative: str) -> None:
    """Delete ``folder/relative`` (a file or a symlink itself; never a folder, never through
    a symlinked parent), then its parent folders inside ``folder`` that became empty."""
    if relative not in OWN_NAMES and not _plain_relative(relative):
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


def _remove_stale_temporaries(folder: Path, files: list[str]) -> None:
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
                _unlink_entry(folder, f"{parent}/{entry.name}" if parent else entry.name)


def _is_temporary(name: str, allowed: set[str]) -> bool:
    """``name.tmp`` (the fixed name of old versions) or ``.name.<random>.tmp[.ext]`` of one
    of ``allowed``."""
    if name.endswith(TEMPORARY_SUFFIX) and name[: -len(TEMPORARY_SUFFIX)] in allowed:
        return True
    return any(name.startswith(f".{known}.") and TEMPORARY_SUFFIX in name for known in allowed)


def _open_no_follow(path: Path, flags: int, option: str) -> int:
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as failure:
        if failure.errno == errno.ELOOP:
            raise ConfigError(
                f"{str(path)!r} is a symlink; fedplug does not follow symlinks in its output folders: "
                "delete it, or choose another folder"
            ) from None
        raise


def _refuse_if_locked(path: Path, option: str) -> None:
    lock = path / LOCK_NAME
    if not os.path.lexists(lock):
        return
    fd = _open_no_follow(lock, os.O_RDONLY, option)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _in_use(path, _read_pid(fd), option) from None
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _in_use(path: Path, pid: int | None, option: str) -> ConfigError:
    holder = f"PID {pid}" if pid is not None else "PID unknown"
    return ConfigError(
        f"{option} {str(path)!r} is in use by another fedplug run ({holder}); wait for it to finish, "
        f"or choose another {option}"
    )


def _refuse_protected(path: Path, option: str) -> None:
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
