"""Atomic writes and strict reads of the versioned JSON contracts.

Writes go through a temp file in the target's folder, then a rename, so a reader (or a
crash) never sees a half-written file; the file gets the mode ``0o666 & ~umask`` as an
``open()`` would give it. A write that fails (read-only or full file system, a parent
that is a file) raises ``InputError`` naming the file and removes the temp file.

Reads refuse what ``json`` would accept but a contract must not hold: bare ``NaN`` /
``Infinity``, duplicate keys, bytes that are not UTF-8, nesting deeper than
``MAX_JSON_DEPTH``. Writes turn non-finite floats into ``null`` so the output is JSON.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from pipeplan.errors import InputError

__all__ = [
    "JSONValue",
    "write_atomic",
    "write_json_atomic",
    "read_json",
    "read_json_object",
    "finite_or_none",
    "parse_json_text",
    "MAX_JSON_DEPTH",
]

# A JSON value: what ``json`` parses (objects are dicts, arrays lists) and what a writer hands
# over (any mapping with string keys, any sequence; tuples become lists).
JSONValue = Mapping[str, "JSONValue"] | Sequence["JSONValue"] | str | int | float | bool | None

MAX_JSON_DEPTH = 64  # contracts nest 4 levels; deeper input is refused, never recursed into


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_atomic(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` through a temp file in the same folder, then rename.

    A reader never sees a half-written file: either the old one or the new one. Any
    ``OSError`` becomes one ``InputError`` line naming ``path``; no temp file is left.
    """
    target = Path(path)
    tmp_name: str | None = None
    existing = next((p for p in target.parents if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise InputError(f"cannot write {path}: {existing} is a file, not a folder")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        with os.fdopen(fd, "wb") as handle:
            os.fchmod(handle.fileno(), 0o666 & ~_umask())
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_name, target)
        tmp_name = None
    except OSError as exc:
        raise InputError(f"cannot write {path}: {exc.strerror or exc}") from exc
    finally:
        if tmp_name is not None:
            try:
                os.unlink(tmp_name)
            except OSError:
                pass


def finite_or_none(obj: JSONValue) -> JSONValue:
    """``obj`` with every non-finite float (NaN, ±inf) replaced by ``None`` (JSON ``null``).

    >>> finite_or_none({"losses": [1.5, float("nan")], "x": (float("inf"),)})
    {'losses': [1.5, None], 'x': [None]}
    """
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {key: finite_or_none(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_none(value) for value in obj]
    return obj


def write_json_atomic(path: str | os.PathLike[str], obj: JSONValue) -> None:
    """Write ``obj`` as JSON (non-finite floats as ``null``) atomically; see ``write_atomic``."""
    text = json.dumps(finite_or_none(obj), indent=2, sort_keys=False, allow_nan=False)
    write_atomic(path, (text + "\n").encode())


def _no_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not a JSON number")


def _unique_keys(pairs: list[tuple[str, JSONValue]]) -> dict[str, JSONValue]:
    out: dict[str, JSONValue] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _depth(text: str) -> int:
    """Deepest nesting of ``[``/``{`` outside strings (O(len(text)))."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def parse_json_text(text: str, where: str) -> Any:
    """Strictly parse JSON ``text``; ``InputError`` naming ``where`` on any problem."""
    if _depth(text) > MAX_JSON_DEPTH:
        raise InputError(f"{where} is nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        return json.loads(text, parse_constant=_no_constant, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as exc:
        raise InputError(f"{where} is not valid JSON (line {exc.lineno}: {exc.msg})") from exc
    except (ValueError, RecursionError) as exc:
        raise InputError(f"{where} is not valid JSON: {exc}") from exc


def read_json_object(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a file holding one JSON object; ``InputError`` (one line) otherwise."""
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except OSError as exc:
        raise InputError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise InputError(f"{path} is not UTF-8 text (byte {exc.start}: {exc.reason})") from exc
    obj = parse_json_text(text, str(path))
    if not isinstance(obj, dict):
        raise InputError(f"{path}: expected a JSON object, got {type(obj).__name__}")
    return obj


def read_json(path: str | os.PathLike[str], schema: str, older: tuple[str, ...] = ()) -> dict[str, Any]:
    """Read a JSON object whose ``"schema"`` must equal ``schema`` (e.g. ``pipeplan.plan/2``)
    or one of the ``older`` versions the reader still loads."""
    obj = read_json_object(path)
    found = obj.get("schema")
    if found != schema and found not in older:
        raise InputError(f"{path}: schema is {found!r}, expected {schema!r}")
    return obj
