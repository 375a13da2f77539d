"""The methods: one :class:`engine.contract.Method` descriptor per method module, listed once.

``python -m methods.registry`` prints the run config key table and every method's option table
(the generated sections of ``docs/configuration.md``).
"""

from __future__ import annotations

import sys
from functools import lru_cache

from common.config import ConfigError, RunConfig
from common.options import declared_defaults, option_rows, option_table
from common.protocol import MESSAGE_TYPES
from common.run_folder import ResultsWriter
from engine import runner
from engine.contract import SHARED_OPTION_TABLES, ClientProcedure, Method
from methods import (
    fd,
    fedgen,
    fedgh,
    fedkd,
    fedl2g,
    fedmrl,
    fedproto,
    fedre,
    fedsa,
    fedtgp,
    fml,
    lg_fedavg,
    local,
    mh_pfedhn,
)

METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        fedgh.METHOD,
        local.METHOD,
        fedproto.METHOD,
        fedtgp.METHOD,
        fedre.METHOD,
        mh_pfedhn.METHOD,
        mh_pfedhn.METHOD_GD,
        fedmrl.METHOD,
        fml.METHOD,
        fedkd.METHOD,
        lg_fedavg.METHOD,
        fd.METHOD,
        fedl2g.METHOD,
        fedl2g.METHOD_LOGIT,
        fedgen.METHOD,
        fedsa.METHOD,
    )
}
#: every option table of the run config: each method's, and the keys every method shares (differential
#: privacy, held-out clients)
OPTION_TABLES: dict[str, type] = {
    **{name: m.options for name, m in METHODS.items()},
    **SHARED_OPTION_TABLES,
}


def method_of(cfg: RunConfig) -> Method:
    """The descriptor of ``cfg.method``, after checking every dotted key of ``cfg`` names a table of
    :data:`OPTION_TABLES` and a key that table declares (values of the other methods' tables are not
    checked: the run does not use them).

    Raises:
        ConfigError: an unknown method, table or key, naming it and what is allowed.
    """
    if cfg.method not in METHODS:
        raise ConfigError(
            f"run config key 'method' = {cfg.method!r} is invalid: allowed values are "
            + ", ".join(repr(m) for m in METHODS)
        )
    for key, _ in cfg.extra:
        table, _, name = key.partition(".")
        if table not in OPTION_TABLES or not name:
            raise ConfigError(
                f"run config key {key!r} is unknown: other than the keys of [tool.flwr.app.config], "
                "keys belong to a table: " + ", ".join(f"'{t}.*'" for t in OPTION_TABLES)
            )
        declared = list(declared_defaults(OPTION_TABLES[table]))
        if name not in declared:
            raise ConfigError(
                f"run config key {key!r} is unknown: the keys of [{table}] are "
                + (", ".join(repr(k) for k in declared) or "none")
            )
    return METHODS[cfg.method]


def build_run(cfg: RunConfig, results: ResultsWriter | None = None) -> runner.Runner:
    """The run of ``cfg.method`` for ``cfg`` (``engine.runner.build_run``; validates the method name and
    its options).

    Raises:
        ConfigError: unknown method, an unknown key or an invalid method option, and as
            ``engine.runner.build_run``.
    """
    return runner.build_run(cfg, method_of(cfg), results)


@lru_cache(maxsize=8)
def client_procedure(cfg: RunConfig) -> ClientProcedure:
    """The method's client procedure for ``cfg`` (one per config and process).

    Raises:
        ConfigError: as :func:`method_of` and ``engine.contract.Method.bind``.
    """
    return method_of(cfg).build_client(cfg)


def unserved_message_types(methods: dict[str, Method]) -> list[str]:
    """``"<method>: <message type>"`` for each message type a method of ``methods`` sends that
    :data:`common.protocol.MESSAGE_TYPES` lacks: the ClientApp registers a handler for those only, so
    such a message would fail on every client."""
    return sorted(f"{name}: {t}" for name, m in methods.items() for t in m.message_types if t not in MESSAGE_TYPES)


_unserved = unserved_message_types(METHODS)
if _unserved:  # fails at import, not in round 1 of a run
    raise RuntimeError(
        "message types no ClientApp handler serves (declare them in common.protocol.MESSAGE_TYPES): "
        + ", ".join(_unserved)
    )


def option_tables() -> str:
    """Markdown: one option table per table of :data:`OPTION_TABLES` with options (key, default, allowed
    values, meaning)."""
    return "\n".join(
        f"`[tool.flwr.app.config.{name}]`\n\n{option_table(options)}"
        for name, options in OPTION_TABLES.items()
        if option_rows(options)
    )


def key_table() -> str:
    """Markdown: the table of every run config key of ``[tool.flwr.app.config]`` (``RunConfig``)."""
    return option_table(RunConfig, {"method": sorted(METHODS)})


if __name__ == "__main__":
    sys.stdout.write(f"{key_table()}\n{option_tables()}")
