"""Options declared once: frozen dataclasses whose fields are :func:`option` s, and the one reader
that validates them.

Every key of the run config is declared this way: :class:`common.config.RunConfig`'s keys
(``[tool.flwr.app.config]``) and each method's options (the table named after the method,
``[tool.flwr.app.config.fedgh]``, flattened by Flower to ``fedgh.server-lr``). A field declares one
key: its name (field ``server_lr`` is key ``server-lr``; a trailing underscore is dropped, so
``lambda_`` is ``lambda``), its type (``bool``, ``int``, ``float`` or ``str``), default, bounds or
allowed values and its meaning. :func:`read_values` reads and validates any set of keys from that
declaration alone (``common.config.read_options`` a method's table), and :func:`option_rows` gives
the documentation's key tables.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Callable, Mapping
from typing import Any

from common.errors import ConfigError

#: the range of every integer key unless it declares a narrower one: Flower carries run config
#: integers as signed 64-bit (``sint64``), so a larger one passes nowhere
INT64 = (-(2**63), 2**63 - 1)


#: the longest string value of any key (characters; Linux's ``PATH_MAX`` bounds a path to 4096 bytes):
#: a larger one is a mistake (a file pasted into a value) that would reach every message and summary
MAX_STRING = 4096


def excerpt(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut to its first ``limit`` characters (its length said) when it is longer, so that
    an error never echoes a huge value whole."""
    text = repr(value)
    if len(text) <= limit:
        return text
    size = f"{len(value)} characters" if isinstance(value, str) else f"{len(text)} characters as text"
    return f"{text[:limit]}... ({size})"


def invalid(key: str, value: Any, allowed: str) -> ConfigError:
    """The error of a run config value outside its declaration, naming the key (and quoting at most the
    start of the value: :func:`excerpt`) and what is allowed."""
    return ConfigError(f"run config key '{key}' = {excerpt(value)} is invalid: allowed values are {allowed}")


def choice(key: str, value: Any, allowed: tuple[str, ...] | list[str]) -> str:
    """Return ``value`` if it is one of ``allowed``.

    Raises:
        ConfigError: naming ``key`` and listing the allowed values.
    """
    if not isinstance(value, str) or value not in allowed:
        raise invalid(key, value, ", ".join(repr(a) for a in allowed))
    return value


def number(
    key: str,
    value: Any,
    *,
    kind: type = float,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
) -> Any:
    """Return ``value`` as ``kind`` (int or float) if it is finite and lies in the given range.

    Every numeric run config key and method option is read here, so this is the one place that
    refuses NaN and infinity (a ``<``/``>`` range check lets NaN through, and Flower compares a
    run's config before and after each message, where NaN != NaN) and integers outside
    :data:`INT64` (or the key's narrower ``low``/``high``). ``low_open=True`` excludes ``low``
    itself (e.g. a learning rate must be > 0).

    Raises:
        ConfigError: naming ``key`` and the allowed range.
    """
    if kind is int:
        low = INT64[0] if low is None else max(low, INT64[0])
        high = INT64[1] if high is None else min(high, INT64[1])
    allowed = f"finite {'integers' if kind is int else 'numbers'}{_range_text(low, high, low_open)}"
    ok_types = (int,) if kind is int else (int, float)
    if isinstance(value, bool) or not isinstance(value, ok_types):
        raise invalid(key, value, f"{'an integer' if kind is int else 'a number'}{_range_text(low, high, low_open)}")
    try:
        v = kind(value)
    except OverflowError:  # an integer beyond float range given for a float key
        raise invalid(key, value, allowed) from None
    if (
        (kind is float and not math.isfinite(v))
        or (low is not None and (v < low or (low_open and v == low)))
        or (high is not None and v > high)
    ):
        raise invalid(key, value, allowed)
    return v


def flag(key: str, value: Any) -> bool:
    """Return ``value`` if it is a bool.

    Raises:
        ConfigError: naming ``key``.
    """
    if not isinstance(value, bool):
        raise invalid(key, value, "true, false")
    return value


def _range_text(low: float | None, high: float | None, low_open: bool) -> str:
    parts = []
    if low is not None:
        parts.append(f"{'>' if low_open else '>='} {low}")
    if high is not None:
        parts.append(f"<= {high}")
    return (" " + " and ".join(parts)) if parts else ""


def option(
    default: Any,
    meaning: str,
    *,
    choices: tuple[str, ...] | Callable[[], tuple[str, ...]] | None = None,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    nonempty: bool = False,
) -> Any:
    """One key of an options dataclass (use as the field's default).

    Args:
        default: the value when the run config does not set the key (must equal ``pyproject.toml``'s).
        meaning: what the key does, for the documentation's key table.
        choices: allowed values of a ``str`` key, or a function returning them (a registry that is
            expensive to import); None: any string.
        low, high, low_open: bounds of a number key (``low_open``: ``low`` itself excluded).
        nonempty: a ``str`` key must not be empty.
    """
    meta = {"meaning": meaning, "choices": choices, "low": low, "high": high, "low_open": low_open}
    return dataclasses.field(default=default, metadata={**meta, "nonempty": nonempty})


def option_key(field: dataclasses.Field) -> str:
    """The run config key of an options field: ``server_lr`` -> ``server-lr``, ``lambda_`` -> ``lambda``."""
    return field.name.rstrip("_").replace("_", "-")


def declared_fields(cls: type) -> list[tuple[dataclasses.Field, type]]:
    """``(field, type)`` of every :func:`option` field of ``cls``, in declaration order."""
    hints = typing.get_type_hints(cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls) if "meaning" in f.metadata]


def declared_defaults(cls: type, table: str | None = None) -> dict[str, Any]:
    """Run config key -> declared default of every :func:`option` field of ``cls``; the keys are
    ``<table>.<key>`` with ``table`` (a method's options), bare without (``RunConfig``)."""
    prefix = f"{table}." if table else ""
    return {prefix + option_key(f): f.default for f, _ in declared_fields(cls)}


def _choices(meta: Mapping[str, Any]) -> tuple[str, ...] | None:
    return meta["choices"]() if callable(meta["choices"]) else meta["choices"]


def check_value(key: str, value: Any, field: dataclasses.Field, kind: type) -> Any:
    """``value`` of key ``key`` checked against its declaration; returns it typed. A free string is at
    most :data:`MAX_STRING` characters long.

    Raises:
        ConfigError: naming ``key`` and its allowed values.
    """
    meta = field.metadata
    if kind is bool:
        return flag(key, value)
    if kind is str:
        allowed = _choices(meta)
        if allowed is not None:
            return choice(key, value, allowed)
        if not isinstance(value, str) or (meta["nonempty"] and not value) or len(value) > MAX_STRING:
            free = "a non-empty string" if meta["nonempty"] else "a string (empty: off)"
            raise invalid(key, value, f"{free} of at most {MAX_STRING} characters")
        return value
    return number(key, value, kind=kind, low=meta["low"], high=meta["high"], low_open=meta["low_open"])


def read_values(cls: type, given: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Field name -> validated value of every option of ``cls`` from ``given`` (keys without
    ``prefix``); a key ``given`` lacks takes its declared default.

    Raises:
        ConfigError: a value outside its declaration, naming ``prefix + key`` and what is allowed.
    """
    return {
        f.name: check_value(f"{prefix}{option_key(f)}", given.get(option_key(f), f.default), f, kind)
        for f, kind in declared_fields(cls)
    }


def option_rows(cls: type, choices: dict[str, list[str]] | None = None) -> list[tuple[str, str, str, str]]:
    """``(key, default, allowed, meaning)`` of every option of ``cls``, as Markdown cell texts;
    ``choices`` (key -> names) lists the allowed values of a string checked elsewhere (``method``:
    the method table)."""
    rows = []
    for f, kind in declared_fields(cls):
        meta = f.metadata
        if option_key(f) in (choices or {}):
            allowed = ", ".join(f"`{c}`" for c in choices[option_key(f)])
        elif kind is bool:
            allowed = "`true`, `false`"
        elif kind is str:
            names = _choices(meta)
            free = "a non-empty string" if meta["nonempty"] else "a string (empty: off)"
            allowed = ", ".join(f"`{c}`" for c in names) if names is not None else free
        else:
            allowed = ("integer" if kind is int else "number") + _range_text(
                meta["low"], meta["high"], meta["low_open"]
            )
        default = str(f.default).lower() if kind is bool else (f'"{f.default}"' if kind is str else repr(f.default))
        rows.append((f"`{option_key(f)}`", f"`{default}`", allowed, meta["meaning"].replace("|", "\\|")))
    return rows


def option_table(cls: type, choices: dict[str, list[str]] | None = None) -> str:
    """Markdown table (key, default, allowed, meaning) of every option of ``cls`` (:func:`option_rows`)."""
    lines = ["| key | default | allowed | meaning |", "|---|---|---|---|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in option_rows(cls, choices)]) + "\n"
