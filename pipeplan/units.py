"""Strict parsing and formatting of sizes, bandwidths and durations.

Sizes are bytes, bandwidths bytes per second, durations milliseconds. A value is a
number followed by a unit, optionally separated by one space: ``"16 GiB"``,
``"10 Gbit/s"``, ``"25 GB/s"``, ``"5 us"``. Units are case-sensitive so that ``Mb``
(megabit) can never be mistaken for ``MB`` (megabyte). Decimal prefixes (K, M, G, T)
are powers of 1000, binary prefixes (Ki, Mi, Gi, Ti) powers of 1024.

>>> parse_bytes("16 GiB")
17179869184
>>> parse_bandwidth("10 Gbit/s")
1250000000.0
>>> parse_duration_ms("5 us")
0.005
>>> format_bytes(3 * 2**30)
'3.00 GiB'
"""

from __future__ import annotations

import math
import re

__all__ = [
    "BYTE_UNITS",
    "BANDWIDTH_UNITS",
    "DURATION_UNITS",
    "parse_bytes",
    "parse_bandwidth",
    "parse_duration_ms",
    "format_bytes",
    "format_ms",
]

_DECIMAL = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}

BYTE_UNITS: dict[str, int] = {
    **{f"{p}B": f for p, f in _DECIMAL.items()},
    **{f"{p}B": f for p, f in _BINARY.items()},
}
BANDWIDTH_UNITS: dict[str, float] = {
    **{f"{p}B/s": float(f) for p, f in _DECIMAL.items()},
    **{f"{p}B/s": float(f) for p, f in _BINARY.items()},
    **{f"{p}bit/s": f / 8.0 for p, f in _DECIMAL.items()},
}
DURATION_UNITS: dict[str, float] = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}

_VALUE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?)\s?([A-Za-z/]+)\s*$")


def _split(text: object, units: dict[str, float] | dict[str, int], what: str) -> tuple[float, str]:
    """(number, unit) of ``text``; ValueError naming the text and the accepted units."""
    if not isinstance(text, str):
        raise ValueError(f"{what} must be a string like '10 GB/s' with a unit (got {text!r})")
    match = _VALUE.match(text)
    if match is None:
        raise ValueError(f"{what} {text!r} is not '<number> <unit>'")
    number, unit = float(match.group(1)), match.group(2)
    if unit not in units:
        raise ValueError(f"unknown {what} unit {unit!r} in {text!r} (expected one of {', '.join(units)})")
    if not math.isfinite(number):
        raise ValueError(f"{what} {text!r} is not finite")
    return number, unit


def parse_bytes(text: object) -> int:
    """Bytes in ``text`` (``"16 GiB"``, ``"512 MB"``, ``"100 B"``), rounded to an integer."""
    number, unit = _split(text, BYTE_UNITS, "size")
    return int(round(number * BYTE_UNITS[unit]))


def parse_bandwidth(text: object) -> float:
    """Bytes per second in ``text`` (``"10 Gbit/s"``, ``"25 GB/s"``, ``"900 MiB/s"``)."""
    number, unit = _split(text, BANDWIDTH_UNITS, "bandwidth")
    return number * BANDWIDTH_UNITS[unit]


def parse_duration_ms(text: object) -> float:
    """Milliseconds in ``text`` (``"5 us"``, ``"1.5 ms"``, ``"2 s"``, ``"800 ns"``)."""
    number, unit = _split(text, DURATION_UNITS, "duration")
    return number * DURATION_UNITS[unit]


def format_bytes(size_bytes: float) -> str:
    """``size_bytes`` with a binary unit: ``'1.50 GiB'``, ``'12.0 MiB'``, ``'300 B'``.

    The unit is chosen after rounding, so 1023.7 B reads ``'1.00 KiB'``, not ``'1024 B'``.

    >>> format_bytes(1023.7), format_bytes(1536), format_bytes(300)
    ('1.00 KiB', '1.50 KiB', '300 B')
    """
    size = float(size_bytes)
    for unit, factor in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(size) >= factor - 0.5:
            value = size / factor
            return f"{value:.2f} {unit}" if abs(value) < 9.995 else f"{value:.1f} {unit}"
    return f"{size:.0f} B"


def format_ms(duration_ms: float) -> str:
    """``duration_ms`` with its unit: ``'12.3 ms'``, ``'1.25 s'``, ``'45 us'``.

    >>> format_ms(999.95), format_ms(12.34), format_ms(0.045)
    ('1 s', '12.3 ms', '45 us')
    """
    if not math.isfinite(duration_ms):
        return "inf"
    if abs(duration_ms) >= 999.5:
        return f"{duration_ms / 1000:.3g} s"
    if abs(duration_ms) < 0.09995 and duration_ms != 0:
        return f"{duration_ms * 1000:.3g} us"
    return f"{duration_ms:.3g} ms"
