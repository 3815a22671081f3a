"""Atomic writes and strict reads of the versioned JSON contracts."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from pipeplan.errors import InputError

__all__ = ["write_atomic", "write_json_atomic", "read_json", "read_json_object"]


def write_atomic(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` through a temp file in the same folder, then rename.

    A reader never sees a half-written file: either the old one or the new one.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_name, target)
    except BaseException:
        try:
            os.unlink(tmp_name)
        except FileNotFoundError:
            pass
        raise


def write_json_atomic(path: str | os.PathLike[str], obj: Any) -> None:
    write_atomic(path, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode())


def read_json_object(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a file holding one JSON object; ``InputError`` (one line) otherwise."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise InputError(f"cannot read {path}: {exc.strerror or exc}") from exc
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"{path} is not valid JSON (line {exc.lineno}: {exc.msg})") from exc
    if not isinstance(obj, dict):
        raise InputError(f"{path}: expected a JSON object, got {type(obj).__name__}")
    return obj


def read_json(path: str | os.PathLike[str], schema: str) -> dict[str, Any]:
    """Read a JSON object whose ``"schema"`` must equal ``schema`` (e.g. ``pipeplan.plan/1``)."""
    obj = read_json_object(path)
    found = obj.get("schema")
    if found != schema:
        raise InputError(f"{path}: schema is {found!r}, expected {schema!r}")
    return obj
