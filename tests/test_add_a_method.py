"""The "Adding a method" checklist of docs/architecture.md, walked with a toy method (``tests/toy_method.py``)
registered through exactly its steps and run end to end on the fake grid: each [id] of the list is one test
here, and the list and the tests must name the same ids."""

import re

import pytest
import toy_method

from common.config import ConfigError, RunConfig
from common.protocol import TRAIN
from conftest import ROOT, make_run_config

STEPS = {
    "module",
    "message-types",
    "own-round",
    "evaluation",
    "dp",
    "aggregation",
    "checkpoint",
    "metrics",
    "registry",
    "options",
    "privacy-view",
    "docs",
    "tests",
    "crosscheck",
}
SMALL = {"num-clients": 3, "num-server-rounds": 2, "max-examples-per-client": 60, "dataset": "mnist"}


def checklist_ids() -> list[str]:
    """The [ids] of the numbered items of docs/architecture.md's "Adding a method" section, in order."""
    section = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8").split("## Adding a method", 1)[1]
    return re.findall(r"^\d+\. \[([a-z-]+)\]", section, re.M)


def test_the_checklist_is_what_this_test_walks():
    ids = checklist_ids()
    assert len(ids) == len(set(ids)) and set(ids) == STEPS
    walked = {m.group(1) for name in globals() if (m := re.match(r"test_step_(\w+)", name))}
    assert walked == {s.replace("-", "_") for s in STEPS}


@pytest.fixture
def toy(monkeypatch):
    """[registry] + [options]: the toy as one more entry of the method table and of the option tables
    (what its line in ``methods/registry.py`` and its ``pyproject.toml`` table do)."""
    from methods import registry

    monkeypatch.setitem(registry.METHODS, "toy", toy_method.METHOD)
    monkeypatch.setitem(registry.OPTION_TABLES, "toy", toy_method.ToyOptions)
    registry.client_procedure.cache_clear()  # cached per run config: a config of another method table
    yield toy_method.METHOD
    registry.client_procedure.cache_clear()


def run_toy(tmp_path, tamper=None, grid=None, name="toy", in_run_folder=False, **overrides):
    """(server, grid, replies) of a finished toy run of :data:`SMALL` in run folder ``tmp_path / name``,
    ``overrides`` on top: on ``grid`` (a new FakeGrid by default, whose clients keep their state as
    SuperNodes do; with ``in_run_folder``, in the run folder as a simulation's); ``tamper(node, reply)``
    may change a reply before the server sees it."""
    from client_app.app import app as client_app
    from common.run_folder import ResultsWriter
    from fakegrid import FakeGrid
    from methods.registry import build_run

    rc = make_run_config(method="toy", **{"output-dir": str(tmp_path), **SMALL, **overrides})
    cfg = RunConfig.from_dict(rc)
    replies = []

    def seen(node, reply):
        reply = tamper(node, reply) if tamper else reply
        replies.append(reply)
        return reply

    server = build_run(cfg, ResultsWriter(cfg.output_dir, name, cfg.as_dict()))
    grid = grid or FakeGrid(client_app, rc, cfg.num_clients, seen)
    server.start(grid, state_in_run_folder=in_run_folder)
    return server, grid, replies


def test_step_module(toy):
    from engine.contract import ClientProcedure, MethodServer

    assert issubclass(toy.server, MethodServer) and issubclass(toy.client, ClientProcedure)
    assert toy.server.__module__ == toy.client.__module__ == "toy_method"


def test_step_message_types(toy):
    from methods.registry import unserved_message_types

    assert unserved_message_types({"toy": toy}) == []
    other = toy_method.Method("toy", toy_method.ToyServer, toy_method.ToyClient, {"train.other": (None, None)})
    assert unserved_message_types({"toy": other}) == ["toy: train.other"]


def test_step_registry(toy, tmp_path):
    from methods.registry import method_of

    assert method_of(RunConfig.from_dict(make_run_config(method="toy"))) is toy


def test_step_options(toy):
    from methods.registry import OPTION_TABLES, method_of

    assert OPTION_TABLES["toy"] is toy_method.ToyOptions
    with pytest.raises(ConfigError, match="'toy.lambda' is unknown"):
        method_of(RunConfig.from_dict(make_run_config(method="toy", **{"toy.lambda": 1.0})))


def test_step_evaluation(toy, tmp_path):
    server, grid, replies = run_toy(tmp_path)
    assert [r["num_clients"] for r in server.rows] == [3, 3]
    assert all(r["accuracy_weighted"] is not None for r in server.rows)
    # evaluated after training: every client is sampled, so none gets an evaluate message
    assert not [m for m in grid.sent if m.metadata.message_type == "evaluate"]
    train = [r for r in replies if r.metadata.message_type == TRAIN]
    assert len(train) == 6 and all(r.content.metric_records["metrics"]["toy-classes"] >= 1 for r in train)


def test_step_metrics(toy, tmp_path):
    """An undeclared reply metric drops the reply; the declared one passes."""

    def undeclared(node, reply):
        if node == 1000 and reply.metadata.message_type == TRAIN:
            reply.content.metric_records["metrics"]["toy-secret"] = 1
        return reply

    server, _, _ = run_toy(tmp_path, undeclared)
    assert [r["num_clients"] for r in server.rows] == [2, 2]


def test_step_aggregation(toy, tmp_path):
    server, _, _ = run_toy(tmp_path, aggregation="median")
    assert server.rows[-1]["num_clients"] == 3
    with pytest.raises(ConfigError, match="'aggregation' = 'krum' does not apply to method 'toy'"):
        run_toy(tmp_path, name="krum", aggregation="krum")


def test_step_dp(toy, tmp_path):
    server, _, replies = run_toy(tmp_path, **{"dp.epsilon": 8.0, "num-server-rounds": 1})
    assert 0 < server.rows[-1]["dp_epsilon_max"] <= 8.0
    assert all("protos" in r.content.array_records["payload"] for r in replies if r.metadata.message_type == TRAIN)


def test_step_checkpoint(toy, tmp_path):
    """Resumed after round 1 by a new server (the same clients), round 2 is the uninterrupted run's."""
    whole, _, _ = run_toy(tmp_path, name="whole")
    first, grid, _ = run_toy(tmp_path, name="first", **{"num-server-rounds": 1})
    resumed, _, _ = run_toy(tmp_path, grid=grid, name="second", **{"resume-from": str(first.results.path)})
    keys = ("accuracy_per_client", "bytes_up", "bytes_down", "num_clients")
    assert [[r[k] for k in keys] for r in resumed.rows] == [[r[k] for k in keys] for r in whole.rows]


def test_step_own_round(toy):
    from engine.contract import needs_query_first

    assert not needs_query_first(toy_method.ToyServer) and needs_query_first(toy_method.ToyWithOwnRound)


def test_step_privacy_view(toy, tmp_path):
    from tools.privacy_view import RunView, class_rows

    server, _, _ = run_toy(tmp_path, in_run_folder=True, **{"record-payloads": "1"})
    found = class_rows(RunView(server.results.path).payload(1, 0, "up"))
    assert found is not None and found[0] == "protos" and found[3] == "representation"


def test_step_docs():
    """[docs] is kept by ``tests/test_layout.py``: every registered method needs its page with its payload;
    here, that the check fires for a method registered without one."""
    from test_layout import test_every_method_has_its_page_and_code_cites_no_outside_document as pages

    from methods import registry

    registry.METHODS["toy"] = toy_method.METHOD
    try:
        with pytest.raises(AssertionError, match="toy"):
            pages()
    finally:
        del registry.METHODS["toy"]


def test_step_tests():
    """[tests]: every registered method has its own test module (MH-pFedHNGD shares MH-pFedHN's)."""
    from methods.registry import METHODS

    modules = {m.server.__module__.rsplit(".", 1)[-1] for m in METHODS.values()}
    assert [m for m in sorted(modules) if not (ROOT / "tests" / f"test_{m}.py").is_file()] == []


def test_step_crosscheck():
    """[crosscheck]: every registered method has a reference (HtFLlib's or its authors' code); the check fires
    for a method registered without one."""
    from bench.htfllib import AUTHORS_REFERENCES, REFERENCE_METHODS
    from methods import registry

    def without_reference() -> list[str]:
        return [m for m in registry.METHODS if m not in REFERENCE_METHODS and m not in AUTHORS_REFERENCES]

    assert without_reference() == []
    registry.METHODS["toy"] = toy_method.METHOD
    try:
        assert without_reference() == ["toy"]
    finally:
        del registry.METHODS["toy"]
