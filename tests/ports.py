"""Ports for multi-process tests, drawn from below the kernel's ephemeral range.

A port from ``bind(0)`` lies in the ephemeral range, where every outgoing connection also
draws its local port. The multi-rank tests pick ports ahead of their launches, and gloo
opens many connections per job, so an earlier job's connection could take a picked port
before its store listened on it (CI failed once so: EADDRINUSE). The kernel never hands a
connection a port below the range, so a port that binds here stays free for the test that
drew it; each process walks its own stretch, from a start drawn once, so two pytest
workers seldom try the same port and one process never draws a port twice.
"""

import itertools
import os
import random
import socket
from collections.abc import Iterator
from pathlib import Path

_LOWEST = 10_000  # below the ports services usually listen on above 1024 stays clear of them


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default range starts here; macOS's (49152) lies above it


def _candidates() -> Iterator[int]:
    high = _ephemeral_low()
    if high - _LOWEST < 1_000:  # a machine whose ephemeral range starts low: no room below it
        return iter(())
    span = high - _LOWEST
    start = random.Random(os.getpid()).randrange(span)
    return (_LOWEST + (start + step) % span for step in itertools.count())


_PORTS = _candidates()


def _binds(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port on 127.0.0.1 that binds now and that no outgoing connection will be given."""
    for port in itertools.islice(_PORTS, 2_000):
        if _binds(port):
            return port
    with socket.socket() as s:  # nothing free below the range: fall back to the kernel's pick
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
