"""Click options generated from a config dataclass, and the config built back from click's values.

A field whose metadata holds a ``pipeplan.runtime.config.Option`` becomes one
``click.option``: its flag and help from the ``Option``, its type and default from the
field (``bool``: a flag; ``int`` / ``float`` / ``str``, each possibly ``| None``: a value;
``Option.choices``: a ``click.Choice``; ``Option.path``: a ``click.Path``). A field whose
type is itself a config dataclass contributes its own fields, in place. Any other field
(``RunConfig.plan``) is not an option: the command passes it to ``config_from_options``.

Each option's click parameter name is the field's path, ``optim_lr`` for ``RunConfig.optim.lr``,
so two groups may name a field alike. Written by hand (about 100 lines) rather than through a
library: the options must stay exactly as ``pipeplan run`` always spelled them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from dataclasses import MISSING, Field
from typing import TypeVar

import click

from pipeplan.runtime.config import OPTION, Option

__all__ = ["ConfigOption", "config_from_options", "config_options", "dataclass_options"]

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., object])

_VALUE_TYPES: dict[str, type] = {"int": int, "float": float, "str": str, "bool": bool}


@dataclasses.dataclass(frozen=True)
class ConfigOption:
    """One option of a config: where its field sits and what click makes of it."""

    name: str  # click's parameter name: the field's path joined by "_" (``optim_lr``)
    path: tuple[str, ...]  # attribute names from the top config down to the field
    option: Option
    value_type: type  # int, float, str or bool (a flag)
    default: object  # the field's default; MISSING for a required option

    def click_option(self) -> Callable[[F], F]:
        """The ``click.option`` decorator of this field."""
        option, default = self.option, self.default
        if self.value_type is bool:  # a flag sets the value opposite to its default
            if not isinstance(default, bool):
                raise TypeError(f"config field {self.name}: a flag needs a bool default, not {default!r}")
            return click.option(
                option.flag,
                self.name,
                is_flag=True,
                flag_value=not default,
                default=default,
                hidden=option.hidden,
                help=option.help,
            )
        kind: click.ParamType | type
        if option.choices is not None:
            kind = click.Choice(option.choices)
        elif option.path is not None:
            kind = click.Path(file_okay=option.path != "dir", dir_okay=option.path != "file")
        else:
            kind = self.value_type
        if default is MISSING:
            return click.option(
                option.flag, self.name, type=kind, required=True, hidden=option.hidden, help=option.help
            )
        return click.option(
            option.flag,
            self.name,
            type=kind,
            default=default,
            show_default=default is not None,
            hidden=option.hidden,
            help=option.help,
        )


def config_options(config_type: type) -> list[ConfigOption]:
    """Every option of ``config_type`` (nested configs included), in field order."""
    return list(_walk(config_type, ()))


def _walk(config_type: type, prefix: tuple[str, ...]) -> Iterator[ConfigOption]:
    for f in dataclasses.fields(config_type):
        path = (*prefix, f.name)
        nested = _nested_config(f)
        if nested is not None:
            yield from _walk(nested, path)
        elif OPTION in f.metadata:
            yield ConfigOption("_".join(path), path, f.metadata[OPTION], _value_type(f), f.default)


def _nested_config(f: Field[object]) -> type | None:
    """The config dataclass a group field holds (its default factory), else None."""
    factory = f.default_factory
    if factory is MISSING or not dataclasses.is_dataclass(factory):
        return None
    return factory  # type: ignore[return-value]  # a dataclass type, which is_dataclass narrows too loosely


def _value_type(f: Field[object]) -> type:
    """``int`` of ``int | None`` (annotations are strings under ``from __future__ import annotations``)."""
    name = str(f.type).removesuffix(" | None")
    if name not in _VALUE_TYPES:
        raise TypeError(f"config field {f.name}: {f.type} is not an option type ({', '.join(_VALUE_TYPES)})")
    return _VALUE_TYPES[name]


def dataclass_options(config_type: type) -> Callable[[F], F]:
    """Decorator adding one ``click.option`` per option field of ``config_type``, in field order."""

    def decorate(command: F) -> F:
        for config_option in reversed(config_options(config_type)):  # click lists the last applied first
            command = config_option.click_option()(command)
        return command

    return decorate


def config_from_options(config_type: type[T], values: Mapping[str, object], **given: object) -> T:
    """``config_type`` built from click's ``values`` (by parameter name); ``given`` fills the
    top-level fields that are not options (``plan=...``)."""
    return _build(config_type, (), values, given)


def _build(
    config_type: type[T], prefix: tuple[str, ...], values: Mapping[str, object], given: Mapping[str, object]
) -> T:
    arguments: dict[str, object] = {}
    for f in dataclasses.fields(config_type):  # type: ignore[arg-type]
        path = (*prefix, f.name)
        nested = _nested_config(f)
        if nested is not None:
            arguments[f.name] = _build(nested, path, values, {})
        elif OPTION in f.metadata:
            arguments[f.name] = values["_".join(path)]
        elif f.name in given:
            arguments[f.name] = given[f.name]
    return config_type(**arguments)
