"""Run config ``[dp]``: calibrated noise, bounded per-example sensitivity, the accountant's ε in the rows,
a spent budget, and every method training privately with its payload unchanged in shape."""

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from flwr.serverapp import GaussianPrivacyEvent, NeighboringRelation, PrivacyConfig, RdpAccountant, SamplingMethod

from common.config import ConfigError, RunConfig
from common.dp import (
    BudgetSpent,
    check_reachable,
    clipped_class_sums,
    epsilon_of,
    make_plan,
    merge_events,
    noisy_class_means,
    planned_rounds,
)
from common.dp import _calibrate as dp_calibrate
from conftest import ROOT, captured_federation, client_runtime, federation, make_run_config, shapes_of
from methods.registry import METHODS, build_run


def flower_epsilon(sigma, n, batch, steps, releases, delta):
    """ε of ``steps`` Poisson-sampled Gaussian steps and ``releases`` Gaussian releases, by Flower's accountant."""
    accountant = RdpAccountant(PrivacyConfig(delta, n, NeighboringRelation.ADD_OR_REMOVE_ONE, SamplingMethod.POISSON))
    accountant.compose(GaussianPrivacyEvent(sigma, batch, n), steps)
    if releases:
        accountant.compose(GaussianPrivacyEvent(sigma, n, n), releases)
    return accountant.get_epsilon(delta)


def pld_epsilon(events, delta):
    """ε of ``events`` ((σ, q, count) each) by dp-accounting's PLD accountant at its default (finer) grid."""
    import dp_accounting

    parts = [
        dp_accounting.SelfComposedDpEvent(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(s)), c)
        for s, q, c in events
    ]
    return dp_accounting.pld.PLDAccountant().compose(dp_accounting.ComposedDpEvent(parts)).get_epsilon(delta)


def test_dp_sgd_and_the_releases_get_their_own_noise_calibrated_together_to_the_target():
    rc = make_run_config(**{"dp.epsilon": 4.0, "num-server-rounds": 6, "batch-size": 32, "local-epochs": 2})
    cfg = RunConfig.from_dict(rc)
    plan = make_plan(cfg, 200, 4, 1, 1)
    steps = 6 * 2 * math.ceil(200 / 32)
    assert (plan.rounds, plan.steps_per_training, plan.sample_rate) == (6, 2 * 7, 32 / 200)
    sgd, release = (plan.noise_multiplier, 32 / 200, steps), (plan.release_noise_multiplier, 1.0, 6)
    # the releases alone spend dp.release-share of ε, and everything together ε, by the PLD accountant
    assert pld_epsilon([release], 1e-5) == pytest.approx(0.25 * 4.0, rel=2e-3)
    assert 4.0 * (1 - 2e-3) <= pld_epsilon([sgd, release], 1e-5) <= 4.0
    assert plan.epsilon(6, 6) == pytest.approx(pld_epsilon([sgd, release], 1e-5), rel=2e-3)
    # a little less noise on DP-SGD would overspend: its σ is the smallest that meets the target
    assert pld_epsilon([(sgd[0] * 0.99, *sgd[1:]), release], 1e-5) > 4.0
    # RDP beside it, Flower's accountant the same: looser than PLD
    flower = flower_epsilon(plan.noise_multiplier, 200, 32, steps, 0, 1e-5)
    assert epsilon_of(merge_events(sgd), 1e-5, "rdp") == pytest.approx(flower, rel=1e-9)
    assert plan.epsilon(6, 6, "rdp") > plan.epsilon(6, 6)
    assert plan.rounds_left(()) == 6
    # DP-SGD gets (nearly) what it gets with no release at all, far less noise than one σ for both
    alone = make_plan(cfg, 200, 4, 1, 0)
    assert alone.release_noise_multiplier == 0.0 and alone.noise_multiplier < plan.noise_multiplier
    shared = dp_calibrate(lambda s: merge_events((s, 32 / 200, steps), (s, 1.0, 6)), 4.0, 1e-5)
    assert plan.noise_multiplier < 0.9 * shared
    # a larger release share: less noise on the releases, more on DP-SGD
    half = make_plan(RunConfig.from_dict({**rc, "dp.release-share": 0.5}), 200, 4, 1, 1)
    assert half.release_noise_multiplier < plan.release_noise_multiplier
    assert half.noise_multiplier > plan.noise_multiplier


def test_the_split_on_the_privacy_preset_as_docs_privacy_quotes_it():
    # docs/privacy.md quotes these: CIFAR-10 clients of 400 training examples, batch 64, one epoch, 10 rounds
    rc = make_run_config(
        **{"dp.epsilon": 8.0, "num-server-rounds": 10, "batch-size": 64, "local-epochs": 1, "num-clients": 10}
    )
    plan = make_plan(RunConfig.from_dict(rc), 400, 10, 1, 1)
    assert (round(plan.noise_multiplier, 2), round(plan.release_noise_multiplier, 2)) == (1.14, 6.31)
    assert round(plan.epsilon(10, 0), 2) == 7.62 and round(plan.epsilon(0, 10), 2) == 2.0
    assert round(make_plan(RunConfig.from_dict(rc), 400, 10, 1, 0).noise_multiplier, 2) == 1.11
    # one σ for both: the ten releases alone would spend most of ε, and DP-SGD run at nearly twice the noise
    shared = dp_calibrate(lambda s: merge_events((s, 64 / 400, 70), (s, 1.0, 10)), 8.0, 1e-5)
    assert round(shared, 2) == 2.09
    assert round(epsilon_of(merge_events((shared, 1.0, 10)), 1e-5), 2) == 7.13


def test_the_budget_is_planned_over_the_rounds_a_client_is_expected_to_train():
    cfg = RunConfig.from_dict(make_run_config(**{"num-server-rounds": 10, "fraction-train": 0.5}))
    assert planned_rounds(cfg, 4) == 5
    assert planned_rounds(RunConfig.from_dict(make_run_config(**{"num-server-rounds": 10})), 4) == 10


def test_a_target_that_cannot_be_met_is_refused_naming_the_key_before_any_data():
    from methods.registry import build_run

    rc = make_run_config(**{"dp.epsilon": 1e-4, "num-server-rounds": 50})
    cfg = RunConfig.from_dict(rc)
    message = "run config key 'dp.epsilon' = 0.0001 cannot be met by a client of 200 examples over 50 rounds"
    with pytest.raises(ConfigError, match=message):
        make_plan(cfg, 200, 4, 1, 1)
    # without data: the largest client the run config allows (max-examples-per-client), the same one line,
    # and so the strategy (tools.run's pre-flight builds it) is refused before any message
    with pytest.raises(ConfigError, match=message):
        check_reachable(cfg, 1, 1)
    with pytest.raises(ConfigError, match=message):
        build_run(cfg)
    # num-clients = 0: the rounds are unknown until the handshake, which checks it
    check_reachable(RunConfig.from_dict({**rc, "num-clients": 0}), 1, 1)
    loose = RunConfig.from_dict(make_run_config(**{"dp.epsilon": 1.0, "dp.delta": 0.01}))
    with pytest.raises(ConfigError, match="'dp.delta'.*1/n"):
        make_plan(loose, 200, 4, 1, 1)


@pytest.mark.parametrize(
    "overrides, key",
    [
        ({"batch-order": "fixed"}, "'batch-order'"),
        ({"model-group": "htfe2"}, "'model-group'"),
        ({"method": "fedproto", "fedproto.reg-form": "paper-l2"}, "'fedproto.reg-form'"),
        ({"method": "fedre", "fedre.re-mode": "rar"}, "'fedre.re-mode'"),
    ],
)
def test_a_run_that_cannot_be_private_fails_before_it_starts(overrides, key):
    from methods.registry import build_run

    with pytest.raises(ConfigError, match=key):
        build_run(RunConfig.from_dict(make_run_config(**{"dp.epsilon": 8.0, **overrides})))


def test_one_example_moves_the_released_sums_and_counts_by_at_most_the_bound():
    generator = torch.Generator().manual_seed(0)
    rows, labels, clip = 5 * torch.randn(50, 8, generator=generator), torch.randint(3, (50,), generator=generator), 1.5
    base = torch.cat([t.flatten() for t in clipped_class_sums(rows, labels, 10, clip)])
    moves = []
    for outlier in (torch.zeros(8), torch.full((8,), 1e6), 0.1 * torch.ones(8)):
        for label in (0, 7):
            added = clipped_class_sums(
                torch.cat([rows, outlier[None]]), torch.cat([labels, torch.tensor([label])]), 10, clip
            )
            moves.append(float((torch.cat([t.flatten() for t in added]) - base).norm()))
    for i in (0, 17, 49):
        keep = torch.arange(50) != i
        removed = clipped_class_sums(rows[keep], labels[keep], 10, clip)
        moves.append(float((torch.cat([t.flatten() for t in removed]) - base).norm()))
    assert max(moves) <= math.sqrt(2) * clip + 1e-9
    assert max(moves) > 0.999 * math.sqrt(2) * clip  # the bound is reached: a huge row counts as clip


def test_the_release_noise_has_the_calibrated_standard_deviation():
    rows, labels = torch.zeros(4000, 2), torch.zeros(4000, dtype=torch.int64)
    sigma, clip = 0.5, 2.0
    draws = torch.stack([noisy_class_means(rows, labels, 10, clip, sigma)[0][0] for _ in range(400)])
    # mean of zero rows = noise(σ·√2·c) / ~4000: its std over draws
    assert float(draws.std()) == pytest.approx(sigma * math.sqrt(2) * clip / 4000, rel=0.15)
    # the empty classes stay below the noisy-count threshold, 3 noise stds (the noise is drawn from a secret,
    # unseedable generator, so count: each of the 9 empty classes passes with P(Z > 3) = 0.00135 a release,
    # about 2 of 1,800 here; 15 or more has a chance below 1e-7, and without the threshold about half pass)
    kept = [noisy_class_means(rows, labels, 10, clip, sigma)[1].tolist() for _ in range(200)]
    assert all(0 in classes for classes in kept)
    assert sum(len(classes) - 1 for classes in kept) < 15


def test_a_spent_budget_ends_a_clients_training_and_the_run_goes_on_with_the_others(run_config):
    rc = run_config(
        method="fedproto",
        dataset="mnist",
        **{"dp.epsilon": 20.0, "fraction-train": 0.5, "num-server-rounds": 6, "max-examples-per-client": 80},
    )
    strategy, grid, replies = captured_federation(rc)
    strategy.start(grid)
    rows = strategy.rows
    exhausted = rows[-1]["dp_exhausted"]
    assert exhausted  # 2 of 4 clients a round: those sampled more than 3 times ran out
    first_out = {p: min(r["round"] for r in rows if p in r["dp_exhausted"]) for p in exhausted}
    for row in rows:
        trained = {int(p) for p in row.get("dp_epsilon_per_client", {})}
        assert not {p for p in trained if p in first_out and row["round"] > first_out[p]}, row["round"]
        assert row["num_clients"] >= 1 and max(row.get("dp_epsilon_per_client", {0: 0}).values()) <= 20.0
    # 2 of 4 clients a round over 6 rounds, 3 rounds each within the budget: each trains at most 3 rounds,
    # and the others take the places of the spent ones, so a round trains 2 while 2 have budget left
    trained = [p for r in rows for p in r.get("dp_epsilon_per_client", {})]
    assert max(trained.count(p) for p in set(trained)) == 3
    for row in rows:
        left = 4 - len([p for p in first_out if first_out[p] < row["round"]])
        assert row["num_clients"] == min(2, left), row["round"]
    # the run stops early only when every budget is spent before its last round
    assert (rows[-1].get("stop_reason") == "every client's privacy budget (dp.epsilon) is spent") == (len(rows) < 6)
    assert len(rows) == 6 or len(exhausted) == 4


def private_client(rc, partition=0, state_key="in-memory", server_round=1, context=None):
    """A ClientRuntime of ``partition`` as a train message with ``state_key`` and ``server_round`` makes it, its
    DP plan set as the ClientApp sets it, and its method's client procedure."""
    from common.runtime import ClientRuntime
    from methods.registry import client_procedure

    if context is None:
        context = client_runtime(rc, partition).context
    client = ClientRuntime(context, state_key, server_round, trains=True)
    procedure = client_procedure(RunConfig.from_dict(rc))
    client.dp = procedure.dp_plan(client)
    return client, procedure


def train_once(rc, state_key, server_round):
    """What the ClientApp does with a train message of the method ``local``: check the budget, then train."""
    from conftest import train_config

    client, procedure = private_client(rc, 0, state_key, server_round)
    client.check_budget(1, procedure.dp_releases)
    return procedure.train(client, {}, train_config(rc, server_round))


def test_a_server_cannot_reset_a_clients_budget_by_state_key_or_round(run_config, tmp_path):
    state = tmp_path / "node-state"
    rc = run_config(
        method="local", dataset="mnist", **{"dp.epsilon": 20.0, "max-examples-per-client": 80, "state-dir": str(state)}
    )
    client, _ = private_client(rc)
    budget = client.dp.rounds_left(())
    assert budget == 2  # the planned rounds (num-server-rounds)
    ledger = state / "dp-ledger" / "mnist-partition-0.json"
    # the server sends a new state key every time, and replays round 1: every training is counted all the same
    for key in range(budget):
        train_once(rc, f"key-{key}", 1)
        assert json.loads(ledger.read_text())["trainings"] == key + 1
    for key, server_round in (("key-0", 1), ("key-new", 1), ("key-1", 3), ("in-memory", 0)):
        with pytest.raises(BudgetSpent, match=f"spent ε = .* the budget is kept in {ledger}"):
            train_once(rc, key, server_round)
    # nothing was charged by the refusals, and what was spent stays within ε (PLD; RDP's is looser)
    client, _ = private_client(rc, state_key="another")
    metrics = client.privacy_metrics()
    assert metrics["dp-trainings-total"] == budget and metrics["dp-rounds-left"] == 0
    assert metrics["dp-epsilon"] <= 20.0 and metrics["dp-epsilon-rdp"] > metrics["dp-epsilon"]
    # only deleting the file resets it
    ledger.unlink()
    train_once(rc, "key-0", 1)


def test_a_node_caps_its_budget_below_what_any_run_config_asks(run_config, tmp_path):
    from conftest import train_config

    rc = run_config(
        method="local",
        dataset="mnist",
        **{"dp.epsilon": 20.0, "max-examples-per-client": 80, "state-dir": str(tmp_path / "node-state")},
    )
    context = client_runtime(rc).context
    client, procedure = private_client(rc, context=context)
    one, two = client.dp.epsilon(1, 0), client.dp.epsilon(2, 0)
    assert two <= 20.0
    context.node_config["dp-epsilon-max"] = (one + two) / 2  # room for one training, where the run config allows two
    for expected in (None, "node config key 'dp-epsilon-max'"):
        client, procedure = private_client(rc, context=context)
        if expected is None:
            client.check_budget(1, 0)
            procedure.train(client, {}, train_config(rc, 1))
            assert client.privacy_metrics()["dp-rounds-left"] == 0
        else:
            with pytest.raises(BudgetSpent, match=expected):
                client.check_budget(1, 0)
    context.node_config["dp-epsilon-max"] = "lots"
    with pytest.raises(ConfigError, match="'dp-epsilon-max' = 'lots'"):
        private_client(rc, context=context)[0].check_budget(1, 0)


def test_the_ledger_is_charged_durably_before_the_training_runs(run_config, tmp_path, monkeypatch):
    import common.dp
    import common.training

    rc = run_config(method="local", dataset="mnist", **{"dp.epsilon": 20.0, "max-examples-per-client": 80})
    rc["state-dir"] = str(tmp_path / "node-state")
    ledger = tmp_path / "node-state" / "dp-ledger" / "mnist-partition-0.json"
    writes = []
    real_write = common.dp.atomic_write
    monkeypatch.setattr(common.dp, "atomic_write", lambda path, write: writes.append(path) or real_write(path, write))

    def crash(*args, **kwargs):
        assert writes == [ledger]  # written (and fsynced by atomic_write) before the training starts
        raise RuntimeError("the node lost power")

    monkeypatch.setattr(common.training, "train_supervised", crash)
    with pytest.raises(RuntimeError, match="lost power"):
        train_once(rc, "in-memory", 1)
    assert json.loads(ledger.read_text())["trainings"] == 1  # a crash mid-training still counts it


def test_a_new_or_resumed_run_continues_the_spent_budget_and_its_clients_refuse(run_config, tmp_path):
    from common.errors import RunFailed

    rc = run_config(
        method="fedproto",
        dataset="mnist",
        **{"dp.epsilon": 20.0, "max-examples-per-client": 80, "state-dir": str(tmp_path / "state")},
    )
    strategy, grid = federation(rc)
    strategy.start(grid)
    assert all(e <= 20.0 for e in strategy.rows[-1]["dp_epsilon_per_client"].values())
    # a second run (or a resumed one: the ledger is outside its state key and rounds) finds every budget spent:
    # each client answers with an error naming its ledger, the server logs it, and a run that trains nothing fails
    strategy, grid = federation({**rc, "max-untrained-rounds": 1})
    with pytest.raises(RunFailed) as failed:
        strategy.start(grid)
    assert any("BudgetSpent" in e and "dp-ledger/mnist-partition-" in e for e in failed.value.client_errors)


def test_the_rows_and_the_summary_carry_every_parameter_of_the_guarantee(run_config):
    from common.run_folder import privacy_spent

    rc = run_config(method="fedgh", dataset="mnist", **{"dp.epsilon": 8.0, "num-server-rounds": 2})
    strategy, grid = federation(rc)
    strategy.start(grid)
    client = client_runtime(rc, 1)
    plan = make_plan(RunConfig.from_dict(rc), len(client.data.train_y), 4, 1, 1)
    first, last = (row["dp_per_client"]["1"] for row in strategy.rows)
    assert last == {
        "epsilon": pytest.approx(plan.epsilon(2, 2), rel=1e-9),
        "epsilon_rdp": pytest.approx(plan.epsilon(2, 2, "rdp"), rel=1e-9),
        "noise_multiplier": plan.noise_multiplier,
        "release_noise_multiplier": plan.release_noise_multiplier,
        "sample_rate": plan.sample_rate,
        "steps": plan.steps_per_training,
        "releases": 1,
        "trainings_total": 2,
        "releases_total": 2,
        "clip_norm": 7.0,  # the defaults, at the models' scale (docs/privacy.md)
        "payload_clip": 10.0,
        "rounds_left": 0,
    }
    assert first["epsilon"] < last["epsilon"] <= 8.0 < last["epsilon_rdp"] + 8.0
    assert strategy.rows[-1]["dp_epsilon_per_client"]["1"] == last["epsilon"]
    assert privacy_spent(strategy.rows)["dp_per_client"]["1"] == last  # the summary: each client's last entry


#: methods whose upload no DP mechanism here releases: their options refuse ``dp.epsilon`` > 0 (FedL2G's quiz
#: gradient through a step on study examples; FedGen's exact per-class counts; FedSA's head run on the anchors)
REFUSE_DP = {"fedl2g-feat", "fedl2g-logit", "fedgen", "fedsa"}


@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_method_trains_privately_with_the_payload_it_sends_without(run_config, method):
    from common.protocol import PAYLOAD

    if method in REFUSE_DP:
        with pytest.raises(ConfigError, match="'dp.epsilon'"):
            build_run(RunConfig.from_dict(run_config(method=method, **{"dp.epsilon": 1e3})))
        return

    group = {"model-group": "mh-lenet"} if method.startswith("mh-") else {}
    small = {"num-clients": 2, "num-server-rounds": 1, "max-examples-per-client": 60}
    shapes = {}
    for eps in (0.0, 1e3):
        rc = run_config(method=method, dataset="mnist", partitioner="iid", **small, **group, **{"dp.epsilon": eps})
        strategy, grid, replies = captured_federation(rc)
        strategy.start(grid)
        shapes[eps] = sorted(
            (r.metadata.message_type, shapes_of(r))
            for r in replies
            if r.metadata.message_type.startswith("train") and PAYLOAD in r.content.array_records
        )
        assert strategy.rows[-1]["num_clients"] == 2
    assert 0 < strategy.rows[-1]["dp_epsilon_max"] <= 1e3
    if method == "fedkd":  # its SVD keeps a weight-dependent rank: same arrays, not the same ranks
        assert [(t, sorted(s)) for t, s in shapes[0.0]] == [(t, sorted(s)) for t, s in shapes[1e3]]
    else:
        assert shapes[0.0] == shapes[1e3]


def test_the_server_receives_the_noised_payload(run_config):
    """The noise is drawn in the ClientApp from the OS's entropy: two DP runs with the same seed send the
    server different prototypes, where two runs without DP send the same bytes. Under DP the set of classes
    a client keeps is itself a noisy release, so prototypes are paired by (client, class)."""
    from common.protocol import PAYLOAD

    def sent(eps):
        rc = run_config(method="fedtgp", dataset="mnist", **{"dp.epsilon": eps, "num-server-rounds": 1})
        strategy, grid, replies = captured_federation(rc)
        strategy.start(grid)
        ups = [r.content.array_records[PAYLOAD] for r in replies if r.metadata.message_type == "train"]
        srcs = [r.metadata.src_node_id for r in replies if r.metadata.message_type == "train"]
        return {
            (node, int(c)): row
            for node, up in zip(srcs, ups)
            for c, row in zip(up["proto_labels"].numpy(), up["protos"].numpy())
        }

    def pairs(first, second):
        """Both runs' prototypes of the (client, class) pairs present in both (a client may time out on a
        loaded machine; a DP client may drop a class whose noisy count is small)."""
        common = sorted(first.keys() & second.keys())
        assert common, (sorted(first), sorted(second))
        return [(first[k], second[k]) for k in common]

    assert all(np.array_equal(a, b) for a, b in pairs(sent(0.0), sent(0.0)))
    noised = pairs(sent(8.0), sent(8.0))
    assert all(a.shape == b.shape and a.size for a, b in noised)
    assert not any(np.allclose(a, b) for a, b in noised)


@pytest.mark.parametrize("method", ["fedproto", "lg-fedavg"])
def test_a_vector_and_a_weight_payload_method_learn_at_a_loose_epsilon(run_config, method):
    from conftest import chance

    private = {"dp.epsilon": 1e3, "dp.clip-norm": 10.0, "dp.payload-clip": 10.0, "lr": 0.05, "local-epochs": 2}
    small = {"num-clients": 2, "num-server-rounds": 1, "max-examples-per-client": 300}
    rc = run_config(method=method, dataset="mnist", partitioner="iid", **small, **private)
    strategy, grid = federation(rc)
    strategy.start(grid)
    assert strategy.rows[-1]["accuracy_mean"] > chance(rc, 2) + 0.1, strategy.rows[-1]["accuracy_mean"]
    assert "train_loss" not in strategy.rows[-1]  # not noised: the clients keep it


def test_a_run_whose_target_cannot_be_met_fails_at_the_handshake_before_any_training(run_config):
    from client_app.app import app as client_app
    from fakegrid import FakeGrid
    from methods.registry import build_run

    # the server's pre-flight passes (its config is looser: the clients' sizes are unknown to it), the clients,
    # who know their n, refuse at the handshake with the pre-flight's one line
    rc = run_config(method="fedgh", dataset="mnist", **{"dp.epsilon": 1e-4, "num-server-rounds": 50})
    strategy = build_run(RunConfig.from_dict({**rc, "dp.epsilon": 8.0}))
    replies = []
    grid = FakeGrid(client_app, rc, 4, lambda node, reply: replies.append(reply) or reply)
    with pytest.raises(ConfigError, match="'dp.epsilon' = 0.0001 cannot be met by a client of"):
        strategy.start(grid)
    assert replies and all(r.metadata.message_type == "query" for r in replies)


def test_the_apps_start_without_the_accountant_library():
    # dp_accounting pulls in scipy (1-2 s of every ClientApp's and the ServerApp's start-up): it is imported
    # only when a DP plan is made, and the control line shows that making one does import it
    code = """
import sys
sys.path.insert(0, "tests")
import client_app.handlers, server_app.app
print("apps", "dp_accounting" in sys.modules, "scipy" in sys.modules)
from common.config import RunConfig
from common.dp import make_plan
from conftest import make_run_config
make_plan(RunConfig.from_dict(make_run_config(**{"dp.epsilon": 4.0})), 200, 4, 1, 1)
print("plan", "dp_accounting" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["apps", "False", "False", "plan", "True"]


def test_the_default_clips_are_the_models_scale_the_committed_measurement_gives():
    from bench.dp_clip_scale import gradient_norms
    from common.dp import DPOptions

    # the bench's per-example gradient norms are each example's own backward pass
    model = client_runtime(make_run_config(dataset="mnist", **{"max-examples-per-client": 40})).model.eval()
    x, y = torch.randn(3, 1, 28, 28), torch.tensor([0, 3, 7])
    alone = []
    for i in range(3):
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        alone.append(float(torch.sqrt(sum(p.grad.pow(2).sum() for p in model.parameters()))))
    assert gradient_norms(model, x, y).tolist() == pytest.approx(alone, rel=1e-4)
    # the defaults: the default group's medians after 5 local trainings, rounded down
    rows = (ROOT / "results" / "dp-clip-scale" / "cifar10.txt").read_text().splitlines()
    median = next(r.split() for r in rows if r.split()[:3] == ["hetero-cnn5", "median", "5"])
    gradient, representation = float(median[3]), float(median[4])
    assert (DPOptions().clip_norm, DPOptions().payload_clip) == (math.floor(gradient), math.floor(representation))


def test_a_budget_in_the_hundreds_lets_each_client_train_every_round_it_was_planned_for():
    """dp-accounting's PLD ``get_epsilon`` overflows (inf) where e^ε exceeds float64 (ε ≈ 709): at ε = 1000 the
    clients stopped after 5 of their 10 calibrated rounds, the ledger reading inf for the sixth. The smallest ε
    whose δ is at most the target stands in: between its neighbours, and what get_epsilon gives where it can."""
    sigma = 0.11232170831790984  # the σ of ε = 1000 over 10 rounds of 7 steps at n = 400
    spent = [epsilon_of(((sigma, 0.16, steps),), 1e-5) for steps in (35, 42, 49)]
    assert spent[0] < spent[1] < spent[2] and math.isfinite(spent[1])
    assert spent[0] == pytest.approx(637.6305, rel=1e-6)  # get_epsilon's own number, finite there
    rc = make_run_config(method="lg-fedavg", **{"dp.epsilon": 1000.0, "num-server-rounds": 10, "batch-size": 64})
    plan = make_plan(RunConfig.from_dict(rc), 400, 10, 1, 0)
    assert plan.rounds == 10 and plan.epsilon(10, 0) <= 1000.0
    for done in range(10):
        assert plan.rounds_left(plan.spend(done, 0)) == 10 - done, done
