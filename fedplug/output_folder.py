"""Owning an output folder safely: fedplug deletes and overwrites only what it created, and
one run writes into a folder at a time. :func:`claim` locks a folder and marks it with a
fingerprint (:mod:`fedplug.output_ownership` says whose a folder is); :func:`write_atomically`
and its siblings write through a temporary file and list what they wrote in the marker.
Why and how: docs/reliability.md, section 8.1.
"""

from __future__ import annotations

import errno
import fcntl
import io
import json
import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, BinaryIO, Self, Unpack

from fedplug.errors import ConfigError, OutputError
from fedplug.output_ownership import (
    DEFAULT_OPTION,
    LOCK_NAME,
    MARKER_NAME,
    OWN_NAMES,
    TEMPORARY_SUFFIX,
    FolderRules,
    Legacy,
    Status,
    files_named,
    in_use_error,
    open_no_follow,
    ownership,
    plain_relative,
    read_marker,
    read_pid,
    refuse_if_locked,
    refuse_protected,
    remove_stale_temporaries,
    unlink_entry,
)
from fedplug.safe_files import refuse_unless_regular

__all__ = [
    "LOCK_NAME",
    "MARKER_NAME",
    "OWN_NAMES",
    "FolderRules",
    "Legacy",
    "OutputFolder",
    "Status",
    "claim",
    "default_file_mode",
    "files_named",
    "inspect",
    "remove_owned_folder",
    "write_atomically",
    "write_bytes",
    "write_text",
    "write_through_path",
]

MARKER_FORMAT = 1
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)

_HELD: dict[str, OutputFolder] = {}
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

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def record(self, relative: str) -> None:
        """Add ``relative`` (a path inside the folder) to the marker's list of files."""
        if relative not in self.files and plain_relative(relative):
            self.files = sorted({*self.files, relative})
            _write_marker(self.path, self.fingerprint, self.files)

    def remove(self, relative: str) -> None:
        """Delete ``relative`` if the marker lists it (the file itself, never what a
        symlink there points to), and drop it from the list."""
        if relative not in self.files:
            return
        unlink_entry(self.path, relative)
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


def inspect(folder: str | os.PathLike[str], fingerprint: str, **rules: Unpack[FolderRules]) -> Status:
    """Whether ``folder`` may receive the outputs of ``fingerprint``, without writing
    anything: ``"new"`` (absent or empty), ``"own"`` (its marker holds ``fingerprint``, or
    ``legacy`` recognises it) or ``"replace"`` (``force`` and another fingerprint's
    fedplug folder: :func:`claim` deletes the files its marker lists). ``rules``:
    :class:`~fedplug.output_ownership.FolderRules`.

    Raises:
        ConfigError: a folder fedplug never writes into, one another process holds, a
            non-empty folder without a marker, or another fingerprint's folder (without
            ``force``).
    """
    path = Path(folder)
    option = rules.get("option", DEFAULT_OPTION)
    refuse_protected(path, option)
    if not os.path.lexists(path):
        return "new"
    if not path.is_dir():
        raise ConfigError(f"{option} {str(path)!r} is a file, not a folder; choose another {option}")
    if _key(path) not in _HELD:
        refuse_if_locked(path, option)
    return ownership(path, fingerprint, rules)[0]


def claim(folder: str | os.PathLike[str], fingerprint: str, **rules: Unpack[FolderRules]) -> OutputFolder:
    """Create ``folder`` if needed, lock it and write its marker (see :func:`inspect` for
    what is refused; with ``force``, the files another fingerprint's marker lists are
    deleted first). Re-entrant: a folder this process holds is returned again.

    Raises:
        ConfigError: as :func:`inspect`, or when another process claimed it meanwhile.
    """
    path = Path(folder)
    option = rules.get("option", DEFAULT_OPTION)
    held = _HELD.get(_key(path)) if os.path.isdir(path) else None
    if held is not None:
        if held.fingerprint != fingerprint:
            raise ConfigError(
                f"{option} {str(path)!r} is already in use by this process for a different config; "
                f"choose another {option}"
            )
        held._claims += 1
        return held
    inspect(path, fingerprint, **rules)
    path.mkdir(parents=True, exist_ok=True)
    # Opened for writing too: a device planted there is refused before it is opened at all.
    refuse_unless_regular(path / LOCK_NAME)
    lock_fd = open_no_follow(path / LOCK_NAME, os.O_RDWR | os.O_CREAT)
    try:
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise in_use_error(path, read_pid(lock_fd), option) from None
        os.ftruncate(lock_fd, 0)
        os.pwrite(lock_fd, f"{os.getpid()}\n".encode(), 0)
        # Checked again under the lock: another process may have claimed it meanwhile.
        status, files = ownership(path, fingerprint, rules)
        if status == "replace":
            for relative in files:
                unlink_entry(path, relative)
            files = []
        remove_stale_temporaries(path, [*files, MARKER_NAME])
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
    refuse_protected(path, option)
    refuse_if_locked(path, option)
    marker = read_marker(path, option) if os.path.lexists(path / MARKER_NAME) else None
    files = marker["files"] if marker is not None else (legacy(path) if legacy is not None else None)
    if files is None:
        raise ConfigError(
            f"{option} {str(path)!r} was not written by fedplug (no {MARKER_NAME}); fedplug does not "
            "delete it: delete it yourself if it is not needed"
        )
    for relative in [*files, MARKER_NAME, LOCK_NAME]:
        unlink_entry(path, relative)
    try:
        path.rmdir()
    except OSError:
        pass  # files fedplug did not write stay, and so does their folder


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
            fd = open_no_follow(temporary, os.O_RDONLY)
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
