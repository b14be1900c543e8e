"""Keep a FedML rank's network traffic on this machine.

FedML 0.9.6 contacts its cloud service even with ``using_mlops: false``:
``fedml.init`` -> ``mlops.init`` -> ``fetch_config`` posts to the backend five times
(``fedml/core/mlops/__init__.py``, the ``while config_try_count < 5`` loop); the failures
are not fatal. The launcher points that backend at the loopback address
(``FEDML_ENV_VERSION=local``, see :func:`fedml_environment`), and :func:`install` adds a
Python audit hook that refuses, before any packet leaves, every socket connection,
datagram and name lookup that does not stay on loopback, and records it. A run that
records nothing proves that FedML, as configured, made no outside attempt.

Open MPI's own sockets are C code, out of reach of the hook; ``OMPI_MCA_*_if_include=lo``
keeps them on the loopback interface.
"""

from __future__ import annotations

import ipaddress
import socket
import sys
from typing import Any

LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})

_blocked: list[str] = []
_installed = False


def is_loopback_host(host: Any) -> bool:
    """True for a loopback IP address (127.0.0.0/8, ::1) or a name that always means it."""
    if host is None:
        return True  # getaddrinfo(None, port): the local wildcard, no lookup
    if isinstance(host, bytes):
        host = host.decode(errors="replace")
    if not isinstance(host, str):
        return False
    name = host.strip("[]").split("%")[0]
    if name.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def is_allowed(event: str, args: tuple[Any, ...]) -> bool:
    """Whether the audited ``event`` stays on this machine."""
    if event in ("socket.connect", "socket.sendto"):
        sock, address = args[0], args[1]
        if getattr(sock, "family", None) not in (socket.AF_INET, socket.AF_INET6):
            return True  # Unix sockets are files on this machine; netlink talks to the kernel
        return isinstance(address, tuple) and is_loopback_host(address[0])
    if event == "socket.getaddrinfo":
        return is_loopback_host(args[0])
    if event == "socket.gethostbyname":
        return is_loopback_host(args[0])
    return True


def _hook(event: str, args: tuple[Any, ...]) -> None:
    if not event.startswith("socket."):
        return
    if not is_allowed(event, args):
        target = args[1] if event in ("socket.connect", "socket.sendto") else args[0]
        _blocked.append(f"{event} {target!r}")
        raise ConnectionRefusedError(
            f"fedplug's FedML adapter keeps traffic on loopback; refused {event} to {target!r}"
        )


def install() -> None:
    """Add the audit hook to this process (once; audit hooks cannot be removed)."""
    global _installed
    if not _installed:
        sys.addaudithook(_hook)
        _installed = True


def blocked() -> list[str]:
    """Every attempt refused so far in this process."""
    return list(_blocked)


def fedml_environment(home: str, threads: int) -> dict[str, str]:
    """Environment variables of every rank.

    - ``HOME``: FedML writes ``~/.fedml`` (logs, a ``.env`` file that *overrides* the
      environment on every ``fedml.init``); a folder of the run keeps them out of the
      user's home and the settings below in force.
    - ``FEDML_ENV_VERSION=local`` with host 127.0.0.1: FedML's backend calls go to
      loopback (``fedml._get_backend_service``).
    - Open MPI on the loopback interface, allowed to run as root, to place more ranks
      than cores, and not pinning every rank to the same core.
    - ``OMP_NUM_THREADS``: ranks share the cores; one thread each by default.
    """
    return {
        "HOME": home,
        "FEDML_ENV_VERSION": "local",
        "FEDML_ENV_LOCAL_ON_PREMISE_PLATFORM_HOST": "127.0.0.1",
        "WANDB_MODE": "disabled",
        "WANDB_SILENT": "true",
        "OMPI_MCA_btl": "self,tcp",
        "OMPI_MCA_btl_tcp_if_include": "lo",
        "OMPI_MCA_oob_tcp_if_include": "lo",
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        "OMPI_MCA_rmaps_base_oversubscribe": "1",
        "OMPI_MCA_hwloc_base_binding_policy": "none",
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "PYTHONUNBUFFERED": "1",
    }
