"""Text a client sent, made safe to keep and to log.

A client's error reply, the exception its training raised and the names of its metrics
are another party's text: it may be 25 MB long (every round, in the checkpoint's records,
until resume is refused) or hold a newline and terminal escapes (a forged
``fedplug round 1: 3/3 chains accepted`` line in the server's log). :func:`client_text`
is the one place that makes such text bounded and single-line; every runtime passes a
client's text through it before the text reaches a reason, a log line, ``metrics.json``
or the checkpoint. Pure functions, no state.
Design: docs/reliability.md, 'Nothing a client sends grows server state without bound'.
"""

from __future__ import annotations

from collections.abc import Iterator

MAX_CLIENT_TEXT_CHARS = 500
"""Longest client text kept (a reason, with the server's words around the client's): long
enough for any honest exception's message, short enough that a round's records of many
failed clients stay a few KB."""
MAX_CONFIGURATION_LINE_CHARS = 4_000
"""Longest configuration-error line a client reports back (it stops the run, once, and
is never kept): room for fedplug's longest configuration errors."""


def client_text(text: object, limit: int = MAX_CLIENT_TEXT_CHARS) -> str:
    """``text`` as one line of at most ``limit`` characters, safe to keep and to log.

    Every character that is not printable (newlines, tabs, ANSI escapes ``\\x1b``, other
    control and format characters, line and paragraph separators, lone surrogates) is
    written as Python's ``repr`` writes it (``\\n``, ``\\x1b``, ``\\u2028``), so no client
    text can start a log line or move the terminal's cursor. Text longer than ``limit``
    keeps its beginning and its end (where a traceback names the exception, as Ray's
    wrapped errors do) around a note of how many characters were cut from the middle.
    The result is returned unchanged by ``client_text`` (backslashes are kept as they
    are), so a reason may pass through it at every layer.

    Args:
        text: any object (a ``str``, an exception, whatever a peer sent); a non-string
            is shown by ``str``, or by its type's name when ``str`` fails.
        limit: the most characters returned (default :data:`MAX_CLIENT_TEXT_CHARS`;
            at least 50, room for the note).
    """
    raw = _as_string(text)
    if len(raw) <= limit and raw.isprintable():
        return raw  # the common case: an honest, short, one-line text
    if len(raw) <= limit:
        escaped = _escaped(raw)
        if len(escaped) <= limit:
            return escaped
    # Reserve room for the note's longest count (the whole text), so that how much of
    # the text is kept is known before the note is written; only the two ends are walked.
    room = max(limit - len(_cut_note(len(raw))), 0)
    head = _fitting(iter(raw), room - room // 2)
    tail = _fitting(reversed(raw), room // 2)
    ending = _escaped(raw[len(raw) - tail :]) if tail else ""
    return _escaped(raw[:head]) + _cut_note(len(raw) - head - tail) + ending


def _as_string(text: object) -> str:
    if isinstance(text, str):
        return text
    try:
        return str(text)
    except Exception:  # noqa: BLE001 - a hostile object's __str__ may raise anything
        return f"<{type(text).__name__} that cannot be shown>"


def _escaped(text: str) -> str:
    """``text`` with every non-printable character as ``repr`` writes it."""
    return "".join(char if char.isprintable() else repr(char)[1:-1] for char in text)


def _fitting(chars: Iterator[str], room: int) -> int:
    """How many of ``chars`` (a text from its start, or reversed from its end), escaped,
    fit in ``room`` characters; walks at most ``room + 1`` of them."""
    used = count = 0
    for char in chars:
        used += 1 if char.isprintable() else len(repr(char)) - 2
        if used > room:
            break
        count += 1
    return count


def _cut_note(cut: int) -> str:
    return f" [... {cut:,} characters cut ...] "
