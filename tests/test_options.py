"""Run config keys and method options are declared once: pyproject.toml, docs/configuration.md and both apps agree
with the declarations."""

import re
from dataclasses import dataclass

import pytest

from common.config import ConfigError, RunConfig, read_options
from common.options import declared_defaults, option, option_rows
from conftest import ROOT, federation, make_run_config
from methods.registry import METHODS, OPTION_TABLES, client_procedure, key_table, option_tables
from tools.runconfig import app_defaults


def test_pyproject_defaults_equal_the_declared_ones():
    defaults = app_defaults()
    for table, options in OPTION_TABLES.items():
        declared = declared_defaults(options, table)
        in_pyproject = {k: v for k, v in defaults.items() if k.startswith(f"{table}.")}
        assert in_pyproject == declared, table
    tables = {k.split(".", 1)[0] for k in defaults if "." in k}
    assert tables <= set(OPTION_TABLES)  # no unknown table
    assert set(OPTION_TABLES) == set(METHODS) | {"dp", "client-dp", "generalization"}


def test_pyproject_run_config_defaults_equal_the_declared_ones():
    declared = declared_defaults(RunConfig)
    assert {k: v for k, v in app_defaults().items() if "." not in k} == declared
    assert declared["method"] == "fedgh" and declared["partition-seed"] == -1


def generated_section(name: str) -> str:
    page = (ROOT / "docs" / "configuration.md").read_text()
    section = re.search(rf"<!-- {name}: begin.*?-->\n(.*?)<!-- {name}: end -->", page, re.S)
    assert section is not None, name
    return section.group(1)


def test_the_option_tables_of_the_docs_are_the_generated_ones():
    section = generated_section("option tables")
    assert section == option_tables()
    assert "`[tool.flwr.app.config.fedgh]`" in section
    assert '| `server-mode` | `"per-lar"` |' in section


def test_the_key_table_of_the_docs_is_the_generated_one():
    section = generated_section("key table")
    assert section == key_table()
    assert '| `data-pool` | `"train"` | `train`, `train+test` |' in section
    assert "| `partition-seed` | `-1` | integer >= -1 |" in section
    assert "`lg-fedavg`, `local`, `mh-pfedhn`, `mh-pfedhngd` | the method" in section  # the method table's names


@dataclass(frozen=True)
class Toy:
    lambda_: float = option(1.0, "weight", low=0)
    mode: str = option("a", "mode", choices=("a", "b"))
    steps: int = option(2, "steps", low=1, high=5)
    on: bool = option(False, "switch")


def test_read_options_defaults_values_and_errors():
    assert read_options(Toy, RunConfig.from_dict(make_run_config()), "toy") == Toy()
    cfg = RunConfig.from_dict(make_run_config(**{"toy.lambda": 0.5, "toy.steps": 5, "toy.on": True}))
    assert read_options(Toy, cfg, "toy") == Toy(lambda_=0.5, steps=5, on=True)
    for key, value, allowed in [
        ("lambda", -1.0, ">= 0"),
        ("mode", "c", "'a', 'b'"),
        ("steps", 6, "<= 5"),
        ("steps", 2.5, "an integer"),
        ("on", 1, "true, false"),
    ]:
        cfg = RunConfig.from_dict(make_run_config(**{f"toy.{key}": value}))
        with pytest.raises(ConfigError, match=f"'toy.{key}' = .*{re.escape(allowed)}"):
            read_options(Toy, cfg, "toy")
    cfg = RunConfig.from_dict(make_run_config(**{"toy.lamda": 1.0}))
    with pytest.raises(ConfigError, match=r"'toy.lamda' unknown: the keys of \[toy\] are 'lambda', 'mode'"):
        read_options(Toy, cfg, "toy")


def test_option_rows_give_key_default_allowed_and_meaning():
    assert option_rows(Toy) == [
        ("`lambda`", "`1.0`", "number >= 0", "weight"),
        ("`mode`", '`"a"`', "`a`, `b`", "mode"),
        ("`steps`", "`2`", "integer >= 1 and <= 5", "steps"),
        ("`on`", "`false`", "`true`, `false`", "switch"),
    ]


@pytest.mark.parametrize("key", ["fedgh.server-mood", "fedtgp.lamda", "fedgh2.server-lr", "no-such-key"])
def test_unknown_keys_are_rejected_by_the_server_and_the_client_apps(key):
    rc = make_run_config(**{key: 1})
    cfg = RunConfig.from_dict(rc)
    with pytest.raises(ConfigError, match=re.escape(repr(key)) + " is unknown"):
        federation(rc)  # the ServerApp's strategy
    with pytest.raises(ConfigError, match=re.escape(repr(key)) + " is unknown"):
        client_procedure(cfg)  # what every ClientApp message builds first


def test_both_halves_read_the_same_options_and_schemas():
    rc = make_run_config(**{"fedgh.eval-global-head": True, "fedgh.server-lr": 0.5})
    strategy, _ = federation(rc)
    client = client_procedure(RunConfig.from_dict(rc))
    assert strategy.method.options == client.options and strategy.method.options.server_lr == 0.5
    assert strategy.method.schemas is client.schemas and "head.weight" in strategy.method.schemas["evaluate"][0].arrays
