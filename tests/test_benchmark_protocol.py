"""The cross-paper benchmark is pre-registered: its protocol page is in a commit older than
every benchmark record (docs/benchmark_protocol.md, issue 40).

Git answers it: the commit that first added the protocol page must be an ancestor of the
commit that first added each `pipelines/studies/results/benchmark*` file (the records and
the trials), and not that same commit.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROTOCOL = "docs/benchmark_protocol.md"
RECORDS = "pipelines/studies/results/benchmark*"


def git(root: Path, *arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *arguments], cwd=root, capture_output=True, text=True)


def first_commit(root: Path, path: str) -> str:
    """The oldest commit that added ``path`` (empty when git has none)."""
    added = git(root, "log", "--diff-filter=A", "--format=%H", "--", path).stdout.split()
    return added[-1] if added else ""


def records_not_after_the_protocol(root: Path, protocol: str, records: str) -> list[str]:
    """The committed files matching ``records`` that were added before ``protocol``, or in
    the same commit (each with why); empty when the protocol came first."""
    registered = first_commit(root, protocol)
    if not registered:
        return [f"{protocol} is not committed"]
    problems = []
    for path in git(root, "ls-files", records).stdout.split():
        added = first_commit(root, path)
        if added == registered:
            problems.append(f"{path} was added in the commit that added {protocol}")
        elif git(root, "merge-base", "--is-ancestor", registered, added).returncode != 0:
            problems.append(f"{path} was added before {protocol}")
    return problems


def test_the_protocol_page_is_older_than_every_benchmark_record() -> None:
    if git(ROOT, "rev-parse", "--is-shallow-repository").stdout.strip() != "false":
        pytest.skip("needs the repository's full history (a clone, not a shallow one)")
    assert records_not_after_the_protocol(ROOT, PROTOCOL, RECORDS) == []


def test_a_record_committed_with_or_before_the_protocol_is_named(tmp_path: Path) -> None:
    # Prepare: a repository where one record came before the protocol, one with it, one after.
    def commit(files: dict[str, str], message: str) -> None:
        for name, text in files.items():
            (tmp_path / name).write_text(text)
        git(tmp_path, "add", "-A")
        git(tmp_path, "-c", "user.email=t@example.org", "-c", "user.name=t", "commit", "-qm", message)

    git(tmp_path, "init", "-q")
    commit({"benchmark-early.jsonl": "{}\n"}, "a record before the protocol")
    commit({"protocol.md": "p\n", "benchmark-same.jsonl": "{}\n"}, "the protocol and a record")
    commit({"benchmark-late.jsonl": "{}\n"}, "a record after")
    # Execute
    problems = records_not_after_the_protocol(tmp_path, "protocol.md", "benchmark*")
    # Assert: the early and the same-commit records are named; the late one is fine.
    assert problems == [
        "benchmark-early.jsonl was added before protocol.md",
        "benchmark-same.jsonl was added in the commit that added protocol.md",
    ]
