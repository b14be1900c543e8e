"""Opening the files fedplug reads without trusting what lies at their paths.

:func:`open_regular` opens a path without blocking and refuses, in one line, anything
but a regular file: a FIFO planted as a lock, marker or checkpoint would otherwise make
``open()`` wait forever for a writer (``O_NOFOLLOW`` refuses symlinks, not FIFOs), and a
device or socket is never data. :func:`load_npz` reads an ``.npz`` archive only after
every member's ``.npy`` header is shown to fit the file's own bytes, so a header claiming
10^12 elements is refused before numpy allocates them. Why: docs/reliability.md, section 8.
"""

from __future__ import annotations

import errno
import fcntl
import math
import os
import stat
import zipfile
from typing import Any, BinaryIO

import numpy as np
from numpy.lib import format as npy_format

from fedplug.errors import ConfigError, DataError, FedplugError

__all__ = [
    "check_npz_headers",
    "describe_kind",
    "load_npz",
    "not_regular_error",
    "open_regular",
    "open_regular_fd",
    "read_regular_bytes",
    "refuse_unless_regular",
]

REMOVE_IT = "remove it"
"""The advice of a refusal when the caller gives none."""
MAX_HEADER_BYTES = 10_000
"""Longest ``.npy`` header read (numpy's own default bound)."""
DEFLATE_MAX_RATIO = 1032
"""The most bytes deflate can expand one compressed byte into (zlib's technical note):
a deflated member's stated size above this is a lie."""
_KINDS = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISDIR, "a folder"),
)


def describe_kind(mode: int) -> str:
    """What a file of ``st_mode`` ``mode`` is, in words (``"a FIFO"``)."""
    for test, described in _KINDS:
        if test(mode):
            return described
    return "a regular file" if stat.S_ISREG(mode) else "not a regular file"


def not_regular_error(
    path: str | os.PathLike[str], mode: int, what: str, advice: str, error: type[FedplugError]
) -> FedplugError:
    """The one line refusing ``path``, which is not a regular file but what ``mode`` says."""
    named = f"{what} {str(path)!r}" if what else repr(str(path))
    return error(f"{named} is {describe_kind(mode)}, not a regular file; {advice}")


def refuse_unless_regular(
    path: str | os.PathLike[str],
    *,
    what: str = "",
    advice: str = REMOVE_IT,
    error: type[FedplugError] = ConfigError,
) -> None:
    """Refuse ``path`` when something other than a regular file or a symlink lies there
    (``lstat``: nothing is opened); nothing there is fine. For a path about to be opened
    for writing, where even a non-blocking open of a device is one open too many."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode) and not stat.S_ISLNK(mode):
        raise not_regular_error(path, mode, what, advice, error)


def open_regular_fd(
    path: str | os.PathLike[str],
    flags: int = os.O_RDONLY,
    *,
    what: str = "",
    advice: str = REMOVE_IT,
    error: type[FedplugError] = ConfigError,
    follow_symlinks: bool = True,
    mode: int = 0o644,
) -> int:
    """A descriptor of ``path`` opened with ``flags`` (plus ``O_CLOEXEC``), which must be a
    regular file: it is opened with ``O_NONBLOCK`` (a FIFO opens at once instead of waiting
    for a writer), checked with ``fstat`` (the file opened, not a name someone can swap),
    and only then switched back to blocking reads.

    Args:
        what: what the file is, the message's first words (``"checkpoint"``).
        advice: what the user should do, the message's end (default ``"remove it"``).
        error: the error class raised for a file that is not a regular one.
        follow_symlinks: False adds ``O_NOFOLLOW``: a symlink at ``path`` makes
            ``os.open`` fail with ``ELOOP`` (the caller words that refusal).

    Raises:
        ``error``: ``path`` is a FIFO, socket or device (one line naming it).
        OSError: as ``os.open`` (a missing file, no permission, ``ELOOP``), or
            ``IsADirectoryError`` for a folder, as ``open()`` raises.
    """
    extra = os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_symlinks else os.O_NOFOLLOW)
    fd = os.open(path, flags | extra, mode)
    try:
        found = os.fstat(fd).st_mode
        if stat.S_ISDIR(found):  # what open() says of a folder, as before
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
        if not stat.S_ISREG(found):
            raise not_regular_error(path, found, what, advice, error)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_regular(
    path: str | os.PathLike[str],
    *,
    what: str = "",
    advice: str = REMOVE_IT,
    error: type[FedplugError] = ConfigError,
    follow_symlinks: bool = True,
) -> BinaryIO:
    """``path`` opened for binary reading, refused in one line unless it is a regular file
    (:func:`open_regular_fd`; a symlink is refused with one line too when
    ``follow_symlinks`` is False)."""
    try:
        fd = open_regular_fd(path, what=what, advice=advice, error=error, follow_symlinks=follow_symlinks)
    except OSError as failure:
        if failure.errno == errno.ELOOP and not follow_symlinks:
            named = f"{what} {str(path)!r}" if what else repr(str(path))
            raise error(f"{named} is a symlink, which fedplug does not follow here; {advice}") from None
        raise
    return os.fdopen(fd, "rb")


def read_regular_bytes(path: str | os.PathLike[str], **options: Any) -> bytes:
    """The bytes of ``path``, a regular file (``options`` as :func:`open_regular`)."""
    with open_regular(path, **options) as handle:
        return handle.read()


# ---------------------------------------------------------------------------- .npz files


def load_npz(
    path: str | os.PathLike[str],
    *,
    what: str,
    advice: str,
    error: type[FedplugError] = DataError,
    max_bytes: int | None = None,
) -> dict[str, np.ndarray]:
    """Every array of the ``.npz`` archive at ``path``, by name, read with
    ``allow_pickle=False`` after :func:`check_npz_headers` (nothing is allocated for a
    header that claims more than the file holds).

    Args:
        what: what the file is (``"partition file"``), in every message.
        advice: what to do about a refused file (``"delete it to recompute"``).
        error: the error class raised.
        max_bytes: the most data bytes one array may hold (None: the file's bound only).

    Raises:
        ``error``: ``path`` is not a regular file, a member's header is malformed or
            claims more than the file can hold, or the archive is unreadable; one line
            naming the file. A missing file raises ``FileNotFoundError``.
    """
    with open_regular(path, what=what, advice=advice, error=error) as handle:
        invalid = f"{path} is not a valid {what}"
        check_npz_headers(handle, invalid, advice, error, max_bytes)
        handle.seek(0)
        try:
            with np.load(handle, allow_pickle=False) as archive:
                return {name: np.asarray(archive[name]) for name in archive.files}
        except Exception as failure:  # a torn zip, a CRC error, a pickled object: all one kind
            raise error(f"{invalid} ({_reason(failure)}); {advice}") from None


def check_npz_headers(
    handle: BinaryIO,
    invalid: str,
    advice: str,
    error: type[FedplugError] = DataError,
    max_bytes: int | None = None,
) -> None:
    """Refuse the ``.npz`` archive open as ``handle`` unless every ``.npy`` member fits
    the file: stored or deflated, its stated size within what its compressed bytes can
    expand to, which lie within the file, and exactly its header's shape times its
    dtype's item size (no object dtype; at most ``max_bytes`` when given). Only the zip
    directory and the headers are read.

    ``invalid`` starts each message (``"p.npz is not a valid partition file"``),
    ``advice`` ends it.
    """
    file_bytes = os.fstat(handle.fileno()).st_size
    try:
        archive = zipfile.ZipFile(handle)
    except Exception as failure:  # not a zip, a truncated directory
        raise error(f"{invalid} ({_reason(failure)}); {advice}") from None
    with archive:
        for member in archive.infolist():
            if member.filename.endswith(".npy"):
                problem = _member_problem(archive, member, file_bytes, max_bytes)
                if problem is not None:
                    raise error(f"{invalid}: its array {member.filename[:-4]!r} {problem}; {advice}")


def _member_problem(
    archive: zipfile.ZipFile, member: zipfile.ZipInfo, file_bytes: int, max_bytes: int | None
) -> str | None:
    """Why ``member`` cannot be the array its header claims, or None when it can."""
    if member.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        return f"is compressed with zip method {member.compress_type}, not stored or deflated"
    expandable = member.compress_size if member.compress_type == zipfile.ZIP_STORED else (
        DEFLATE_MAX_RATIO * member.compress_size + 1024
    )
    if member.compress_size > file_bytes or member.file_size > expandable:
        return f"states {member.file_size} bytes, more than the file's {file_bytes} bytes can hold"
    try:
        with archive.open(member) as stream:
            shape, dtype = _npy_header(stream)
            offset = stream.tell()
    except Exception as failure:  # hostile headers make numpy raise almost anything
        return f"has no readable .npy header ({_reason(failure)})"
    if dtype.hasobject:
        return "holds Python objects (a pickle), which fedplug does not load"
    if any(not isinstance(size, int) or size < 0 for size in shape):
        return f"has shape {shape}"
    data_bytes = math.prod(shape) * dtype.itemsize
    if data_bytes != member.file_size - offset:
        return (
            f"claims shape {shape} of {dtype} ({data_bytes} bytes) in {member.file_size - offset} bytes "
            "of data"
        )
    if max_bytes is not None and data_bytes > max_bytes:
        return f"holds {data_bytes} bytes, more than the {max_bytes} accepted"
    return None


def _npy_header(stream: Any) -> tuple[tuple[Any, ...], np.dtype[Any]]:
    """``(shape, dtype)`` of the ``.npy`` header at the start of ``stream``."""
    version = npy_format.read_magic(stream)
    if version == (1, 0):
        shape, _, dtype = npy_format.read_array_header_1_0(stream, max_header_size=MAX_HEADER_BYTES)
    elif version == (2, 0):
        shape, _, dtype = npy_format.read_array_header_2_0(stream, max_header_size=MAX_HEADER_BYTES)
    else:
        raise ValueError(f".npy format {version}, not 1.0 or 2.0")
    return tuple(shape), dtype


def _reason(failure: BaseException) -> str:
    """The first line of ``failure``'s message, cut to about 120 characters (its kind
    when it has none)."""
    text = str(failure).splitlines()[0] if str(failure) else ""
    text = text if len(text) <= 120 else text[:117] + "..."
    return text or type(failure).__name__

