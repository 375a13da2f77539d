"""Checkpoint after every round and resume: a run split in two equals the run in one go."""

import numpy as np
import pytest
import torch

from common.config import ConfigError, RunConfig
from common.run_folder import CHECKPOINT, ResultsWriter
from conftest import federation
from engine.contract import NO_METHOD, MethodServer
from engine.runner import Runner
from methods.registry import build_run

FAST = {"mh-pfedhn.hidden-dim": 16}


def run_with_results(rc, grid=None, name="run"):
    from client_app.app import app as client_app
    from fakegrid import FakeGrid

    cfg = RunConfig.from_dict(rc)
    strategy = build_run(cfg, ResultsWriter(cfg.output_dir, name, cfg.as_dict()))
    grid = grid or FakeGrid(client_app, rc, cfg.num_clients)
    strategy.start(grid)
    return strategy, grid


@pytest.mark.parametrize(
    "method,extra",
    [
        ("fedre", {"model-group": "fedavgcnn"}),
        ("mh-pfedhn", {"model-group": "mh-lenet", **FAST}),
        ("fedgh", {}),
        ("fedproto", {}),
        ("fedmrl", {}),
        ("fedtgp", {"fedtgp.server-epochs": 5}),
        # constant energy: T_t depends on num-server-rounds, which differs here
        ("fedkd", {"fedkd.energy-start": 0.5, "fedkd.energy-end": 0.5}),
    ],
)
def test_resume_continues_exactly(run_config, method, extra):
    base = run_config(method=method, **{"num-clients": 3, "fraction-train": 0.67, **extra})
    whole, _ = run_with_results({**base, "num-server-rounds": 2}, name="whole")
    first, grid = run_with_results({**base, "num-server-rounds": 1}, name="first")
    assert (first.results.path / CHECKPOINT).is_file()
    # the same clients (their state survives, as a SuperNode's does) and a new ServerApp
    second, _ = run_with_results(
        {**base, "num-server-rounds": 2, "resume-from": str(first.results.path)}, grid, name="second"
    )
    assert [r["round"] for r in second.rows] == [1, 2]
    for a, b in zip(whole.rows, second.rows):
        assert a["accuracy_per_client"] == b["accuracy_per_client"] and a["bytes_up"] == b["bytes_up"]
    assert second.results.summary()["rounds_completed"] == 2
    for key, value in whole.method.server_state().items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, second.method.server_state()[key])
        elif key in ("hn", "head", "header", "shared", "generator"):
            assert all(torch.equal(v, second.method.server_state()[key][k]) for k, v in value.items())
        elif key == "global_set":
            assert all(np.array_equal(v, second.method.server_state()[key][k]) for k, v in value.items())
    assert [r["accuracy_mean"] for r in whole.rows] == [r["accuracy_mean"] for r in second.rows]


def test_resume_refuses_other_method_and_unsupported(run_config):
    rc = run_config(method="local", **{"num-clients": 2, "num-server-rounds": 1})
    first, _ = run_with_results(rc)
    strategy, grid = federation({**rc, "method": "fedgh", "resume-from": str(first.results.path)})
    with pytest.raises(ConfigError, match="resume-from"):
        strategy.resume()
    strategy, _ = federation({**rc, "resume-from": str(first.results.path / "missing")})
    with pytest.raises(FileNotFoundError, match="resume-from"):
        strategy.resume()
    bare = Runner(
        RunConfig.from_dict(rc), MethodServer, NO_METHOD
    )  # a method that declares no server state cannot resume
    assert bare.method.server_state() is None
    assert np.isfinite(first.rows[0]["accuracy_mean"])


def test_resume_refuses_a_changed_run_config_naming_the_keys(run_config):
    rc = run_config(method="fedgh", **{"num-clients": 2, "num-server-rounds": 1})
    first, _ = run_with_results(rc)
    changed = {**rc, "num-server-rounds": 3, "resume-from": str(first.results.path), "seed": 7, "fedgh.server-lr": 0.5}
    strategy, grid = federation(changed)
    with pytest.raises(ConfigError, match=r"'fedgh.server-lr' \(0\.01, now 0\.5\), 'seed' \(42, now 7\)"):
        strategy.resume()
    strategy, grid = federation({**rc, "num-server-rounds": 3, "resume-from": str(first.results.path)})
    assert strategy.resume() == 1  # the round count alone may change


def test_resume_from_a_checkpoint_older_than_a_key_takes_the_key_at_its_default(run_config):
    """A key added after a checkpoint was written (a new option) matches at its declared default only."""
    rc = run_config(method="fedgh", **{"num-clients": 2, "num-server-rounds": 1})
    first, _ = run_with_results(rc)
    path = first.results.path / CHECKPOINT
    state = torch.load(path, weights_only=True)
    # a key of the run config, of the method's table and of a table every method shares
    saved = state["config"]
    assert saved.pop("fedgh.server-lr") == 0.01 and saved.pop("eval-every") == 1
    assert saved.pop("generalization.rounds") == 5 and saved.pop("dp.epsilon") == 0.0
    torch.save(state, path)
    resumed = {**rc, "num-server-rounds": 3, "resume-from": str(first.results.path)}
    strategy, _ = federation(resumed)
    assert strategy.resume() == 1
    strategy, _ = federation({**resumed, "fedgh.server-lr": 0.5, "eval-every": 2, "generalization.rounds": 3})
    with pytest.raises(
        ConfigError,
        match=r"'eval-every' \(None, now 2\), 'fedgh.server-lr' \(None, now 0\.5\), "
        r"'generalization.rounds' \(None, now 3\)",
    ):
        strategy.resume()


def crash_after_training(strategy):
    def crash(server_round, replies):
        raise RuntimeError("server killed after the clients trained")

    strategy.method.aggregate_train = crash


def crash_after_evaluation(strategy):
    evaluate_round = strategy.evaluate_round

    def crash(server_round, evaluated):
        evaluate_round(server_round, evaluated)
        raise RuntimeError("server killed after the clients evaluated")

    strategy.evaluate_round = crash


def crash_before_the_checkpoint(strategy):
    # any method, its own round (MH-pFedHN's) included: the round ran to its end but was never checkpointed
    def crash(*args, **kwargs):
        raise RuntimeError("server killed before its checkpoint")

    strategy.checkpoints.build = crash


@pytest.mark.parametrize(
    "method,extra,crash,rollbacks",
    [
        ("fedmrl", {}, crash_after_training, 3 * 2),  # model and projector of each client
        # FedRE's client stores its model in evaluate too (the received global head, P11)
        ("fedre", {"model-group": "fedavgcnn"}, crash_after_evaluation, 3),
        # a method the server asks before training (a query message of its own, as any run with DP or
        # record-payloads) whose client reads its state to answer: the resumed run's query meets the ahead
        # state first and must roll it back too
        ("mh-pfedhn", {"model-group": "mh-lenet", **FAST}, crash_before_the_checkpoint, 3),
    ],
)
def test_resume_after_a_crash_mid_round_repeats_it_exactly(run_config, tmp_path, method, extra, crash, rollbacks):
    """The clients trained (and evaluated) round 2 and stored their state, then the server
    crashed before its round-2 checkpoint. The resumed run (a new Flower run: empty contexts,
    state from disk) repeats round 2; the clients, ahead on disk, roll back to their state from
    before round 2 first, so the rows equal those of the run in one go."""
    base = run_config(method=method, **{"num-clients": 3, "state-dir": str(tmp_path / "state"), **extra})
    whole, _ = run_with_results({**base, "num-server-rounds": 2}, name="whole")
    first, grid = run_with_results({**base, "num-server-rounds": 1}, name="first")
    resumed = {**base, "num-server-rounds": 2, "resume-from": str(first.results.path)}

    cfg = RunConfig.from_dict(resumed)
    crashing = build_run(cfg, ResultsWriter(cfg.output_dir, "crashed", cfg.as_dict()))
    crash(crashing)
    with pytest.raises(RuntimeError, match="server killed"):
        crashing.start(grid)
    for node, ctx in list(grid.contexts.items()):  # a new Flower run: every context starts empty
        grid.add_node(node, ctx.node_config["partition-id"])

    second, _ = run_with_results(resumed, grid, name="second")
    assert [r["round"] for r in second.rows] == [1, 2]
    assert second.rows[1]["client_state_rollbacks"] == rollbacks
    for a, b in zip(whole.rows, second.rows):
        assert a["accuracy_per_client"] == b["accuracy_per_client"] and a["train_loss"] == b["train_loss"]


@pytest.mark.parametrize("method", ["mh-pfedhn", "mh-pfedhngd"])
def test_resume_with_the_sampled_handshake_continues_exactly(run_config, method):
    # a resumed ServerApp knows no client yet: the hypernetwork's clients are registered from the
    # checkpoint, in their order, before its state and Adam's are restored
    base = run_config(
        method=method,
        handshake="sampled",
        **{"num-clients": 6, "fraction-train": 0.34, "eval-clients": "trained", "model-group": "mh-lenet", **FAST},
    )
    whole, _ = run_with_results({**base, "num-server-rounds": 2}, name="whole")
    first, grid = run_with_results({**base, "num-server-rounds": 1}, name="first")
    second, _ = run_with_results(
        {**base, "num-server-rounds": 2, "resume-from": str(first.results.path)}, grid, name="second"
    )
    # the rounds draw different clients: the resumed run restores round 1's from the checkpoint, admits round 2's
    assert len({tuple(sorted(r["accuracy_per_client"])) for r in whole.rows}) == 2
    assert [r["accuracy_per_client"] for r in whole.rows] == [r["accuracy_per_client"] for r in second.rows]
    assert list(whole.method.server_state()["registered"]) == list(second.method.server_state()["registered"])
    assert all(
        torch.equal(v, second.method.server_state()["hn"][k]) for k, v in whole.method.server_state()["hn"].items()
    )
