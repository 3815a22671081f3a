"""Strict field checks for the JSON contracts: unknown keys, missing keys, value types.

``check_fields(Cls, obj, where)`` compares a JSON object with the dataclass ``Cls``
that it is read into: every key must be a field of ``Cls`` (so a field another branch
adds with a default is accepted, a misspelt one is not), every field without a default
must be present, and every value must have its annotated type. JSON numbers map to
``int`` (not ``bool``) and ``float`` (finite ints or floats); ``tuple[X, ...]`` takes a
JSON list; ``dict[str, X]`` an object. Fields named in ``nested`` are left to the
caller (sub-contracts with their own check). Errors are one line naming the field.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing

from pipeplan.errors import InputError

__all__ = ["check_fields"]


def _describe(hint: object) -> str:  # hint: a type form (int, tuple[str, ...], X | None)
    origin = typing.get_origin(hint)
    if origin is tuple or origin is list:
        return f"a list of {_describe(typing.get_args(hint)[0])}"
    if origin is dict:
        return f"an object of {_describe(typing.get_args(hint)[1])}"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(arg) for arg in typing.get_args(hint))
    if hint is type(None):
        return "null"
    if hint is float:
        return "a finite number"
    names: dict[object, str] = {int: "an integer", str: "a string", bool: "true or false"}
    return names.get(hint, str(hint))


def _conforms(value: object, hint: object) -> bool:  # value: anything, checked here
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_conforms(value, arg) for arg in typing.get_args(hint))
    if origin is tuple or origin is list:
        return isinstance(value, (list, tuple)) and all(
            _conforms(item, typing.get_args(hint)[0]) for item in value
        )
    if origin is dict:
        key_hint, value_hint = typing.get_args(hint)
        return isinstance(value, dict) and all(
            _conforms(k, key_hint) and _conforms(v, value_hint) for k, v in value.items()
        )
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:  # an int is finite however large (math.isfinite would overflow on it)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        return isinstance(value, int) or math.isfinite(value)
    if hint is str:
        return isinstance(value, str)
    return True  # Any, sub-contracts: checked by their own reader


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_fields(cls: type, obj: object, where: str, nested: tuple[str, ...] = ()) -> None:
    """``InputError`` unless ``obj`` is a JSON object matching dataclass ``cls`` (see module doc).

    O(size of ``obj``).

    >>> @dataclasses.dataclass
    ... class Point:
    ...     x: int
    ...     label: str = ""
    >>> check_fields(Point, {"x": 1}, "p")
    >>> check_fields(Point, {"x": 1, "lable": "a"}, "p")
    Traceback (most recent call last):
    pipeplan.errors.InputError: p: unknown field 'lable' (fields: x, label)
    """
    if not isinstance(obj, dict):
        raise InputError(f"{where} must be a JSON object, got {_short(obj)}")
    declared = {f.name: f for f in dataclasses.fields(cls)}
    for key in obj:
        if key not in declared:
            raise InputError(f"{where}: unknown field {key!r} (fields: {', '.join(declared)})")
    hints = typing.get_type_hints(cls)
    for name, spec in declared.items():
        if name not in obj:
            if spec.default is dataclasses.MISSING and spec.default_factory is dataclasses.MISSING:
                raise InputError(f"{where}: missing field {name!r}")
            continue
        if name in nested:
            continue
        if not _conforms(obj[name], hints[name]):
            raise InputError(
                f"{where}: field {name!r} must be {_describe(hints[name])}, got {_short(obj[name])}"
            )
