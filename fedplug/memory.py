"""Refuse, before allocating, what cannot fit in this machine's memory.

A config value inside its bounds can still ask for more memory than the machine has:
``hidden: [65536, 65536, 65536]`` is 8.6e9 parameters (34 GB of float32 before training
copies it), a synthetic dataset of ``num_train: 1e7`` x ``num_features: 1e5`` is 8 TB.
Allocating that ends in an allocator's traceback (``DefaultCPUAllocator: can't allocate
memory``, numpy's ``_ArrayMemoryError``) after seconds of swapping, or in the kernel's
OOM killer. The builders estimate their need first and call :func:`check_fits`, which
refuses with one line naming the config key and the estimate.

The estimate is compared with the memory available *now* (``MemAvailable`` in
``/proc/meminfo``, and a cgroup v2 ``memory.max`` when the process runs under one); where
neither can be read (not Linux) nothing is refused. It is an estimate of the largest
allocations, not of everything a run holds: passing the check does not promise that the
run fits.
"""

from __future__ import annotations

from pathlib import Path

from fedplug.errors import ConfigError

MEMINFO = Path("/proc/meminfo")
CGROUP = Path("/sys/fs/cgroup")


def available_bytes() -> int | None:
    """Bytes this process can still allocate, as far as the system says (None: unknown)."""
    candidates: list[int] = []
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                candidates.append(int(line.split()[1]) * 1024)
                break
    except (OSError, ValueError, IndexError):
        pass
    cgroup_left = _cgroup_bytes_left()
    if cgroup_left is not None:
        candidates.append(cgroup_left)
    return min(candidates) if candidates else None


def _cgroup_bytes_left() -> int | None:
    """``memory.max - memory.current`` of this process's cgroup v2 (None: no limit or unknown)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
        relative = next(line for line in lines if line.startswith("0::"))[3:]
        folder = CGROUP / relative.lstrip("/")
        limit = (folder / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(int(limit) - int((folder / "memory.current").read_text()), 0)
    except (OSError, ValueError, StopIteration):
        return None


def human_bytes(count: float) -> str:
    """``34.4 GB``: decimal units, three significant digits."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= size:
            return f"{count / size:.3g} {unit}"
    return f"{count:.0f} B"


def check_fits(needed: float, what: str, fix: str) -> None:
    """Refuse when ``needed`` bytes are more than this machine has available.

    Args:
        needed: the estimate, in bytes.
        what: the config key(s) and what they ask for, e.g.
            ``"train.model.hidden=(65536, 65536, 65536): 8.59e+09 parameters"``.
        fix: what to do, e.g. ``"use narrower layers"``.

    Raises:
        ConfigError: ``"<what> need about <needed> of memory, more than the <available>
            this machine has available; <fix>"``.
    """
    available = available_bytes()
    if available is None or needed <= available:
        return
    raise ConfigError(
        f"{what}: needs about {human_bytes(needed)} of memory, more than the {human_bytes(available)} "
        f"this machine has available; {fix}"
    )


def allocation_failed(error: BaseException) -> bool:
    """Whether ``error`` is an allocator's refusal (numpy's ``MemoryError``, torch's
    ``RuntimeError: ... can't allocate memory``), the backstop where an estimate passed."""
    if isinstance(error, MemoryError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text)


__all__ = ["allocation_failed", "available_bytes", "check_fits", "human_bytes"]
