"""Method options declared once: a frozen dataclass whose fields are :func:`option` s.

A method's options live in the run config table named after the method
(``[tool.flwr.app.config.fedgh]``, flattened by Flower to ``fedgh.server-lr``). Each field of the
method's options dataclass declares one key: its name (field ``server_lr`` is key ``server-lr``; a
trailing underscore is dropped, so ``lambda_`` is ``lambda``), its type (``bool``, ``int``,
``float`` or ``str``), default, bounds or allowed values and a one-line meaning.
:func:`read_options` reads and validates any method's table from that declaration alone, rejects
keys it does not declare, and :func:`option_rows` gives the README's option table.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, TypeVar

from common.config import RunConfig, choice, flag, number
from common.errors import ConfigError

T = TypeVar("T")


def option(
    default: Any,
    meaning: str,
    *,
    choices: tuple[str, ...] | None = None,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
) -> Any:
    """One option of a method's options dataclass (use as the field's default).

    Args:
        default: the value when the run config does not set the key (must equal ``pyproject.toml``'s).
        meaning: one line for the README's option table.
        choices: allowed values of a ``str`` option (required for one).
        low, high, low_open: bounds of a number option (``low_open``: ``low`` itself excluded).
    """
    meta = {"meaning": meaning, "choices": choices, "low": low, "high": high, "low_open": low_open}
    return dataclasses.field(default=default, metadata=meta)


def option_key(field: dataclasses.Field) -> str:
    """The run config key of an options field: ``server_lr`` -> ``server-lr``, ``lambda_`` -> ``lambda``."""
    return field.name.rstrip("_").replace("_", "-")


def _typed_fields(cls: type) -> list[tuple[dataclasses.Field, type]]:
    hints = typing.get_type_hints(cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls)]


def check_value(key: str, value: Any, field: dataclasses.Field, kind: type) -> Any:
    """``value`` of option ``key`` checked against its declaration; returns it typed.

    Raises:
        ConfigError: naming ``key`` and its allowed values.
    """
    meta = field.metadata
    if kind is bool:
        return flag(key, value)
    if kind is str:
        return choice(key, value, meta["choices"])
    return number(key, value, kind=kind, low=meta["low"], high=meta["high"], low_open=meta["low_open"])


def read_options(cls: type[T], cfg: RunConfig, table: str | None = None) -> T:
    """The options of table ``table`` (default: the run's method) of ``cfg``, validated.

    Keys the table does not set take their declared default. If ``cls`` has a ``check(cfg)``
    method (cross-key or cross-config rules), it runs last.

    Raises:
        ConfigError: an unknown key in the table (naming it and the table's keys), or a value
            outside its declaration (naming the key and its allowed values).
    """
    table = table or cfg.method
    given = cfg.method_options(table)
    typed = {option_key(f): (f, kind) for f, kind in _typed_fields(cls)}
    unknown = sorted(set(given) - set(typed))
    if unknown:
        known = ", ".join(repr(k) for k in typed) or "none"
        raise ConfigError(
            f"run config key(s) {', '.join(repr(f'{table}.{k}') for k in unknown)} unknown: "
            f"the keys of [{table}] are {known}"
        )
    values = {
        f.name: check_value(f"{table}.{key}", given.get(key, f.default), f, kind) for key, (f, kind) in typed.items()
    }
    options = cls(**values)
    if hasattr(options, "check"):
        options.check(cfg)
    return options


def option_defaults(cls: type) -> dict[str, Any]:
    """Key -> declared default of every option of ``cls``."""
    return {option_key(f): f.default for f in dataclasses.fields(cls)}


def option_rows(cls: type) -> list[tuple[str, str, str, str]]:
    """``(key, default, allowed, meaning)`` of every option of ``cls``, as Markdown cell texts."""
    rows = []
    for f, kind in _typed_fields(cls):
        meta = f.metadata
        if kind is bool:
            allowed = "`true`, `false`"
        elif kind is str:
            allowed = ", ".join(f"`{c}`" for c in meta["choices"])
        else:
            bounds = []
            if meta["low"] is not None:
                bounds.append(f"{'>' if meta['low_open'] else '>='} {meta['low']}")
            if meta["high"] is not None:
                bounds.append(f"<= {meta['high']}")
            allowed = ("integer" if kind is int else "number") + (" " + " and ".join(bounds) if bounds else "")
        default = str(f.default).lower() if kind is bool else (f'"{f.default}"' if kind is str else repr(f.default))
        rows.append((f"`{option_key(f)}`", f"`{default}`", allowed, meta["meaning"].replace("|", "\\|")))
    return rows
