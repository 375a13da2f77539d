"""Run config ``[dp]``: calibrated noise, bounded per-example sensitivity, the accountant's ε in the rows,
a spent budget, and every method training privately with its payload unchanged in shape."""

import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from flwr.serverapp import GaussianPrivacyEvent, NeighboringRelation, PrivacyConfig, RdpAccountant, SamplingMethod

from common.config import ConfigError, RunConfig
from common.dp import BudgetSpent, clipped_class_sums, make_plan, noisy_class_means, planned_rounds
from conftest import ROOT, captured_federation, client_runtime, federation, make_run_config, shapes_of
from strategies.registry import METHODS


def flower_epsilon(sigma, n, batch, steps, releases, delta):
    """ε of ``steps`` Poisson-sampled Gaussian steps and ``releases`` Gaussian releases, by Flower's accountant."""
    accountant = RdpAccountant(PrivacyConfig(delta, n, NeighboringRelation.ADD_OR_REMOVE_ONE, SamplingMethod.POISSON))
    accountant.compose(GaussianPrivacyEvent(sigma, batch, n), steps)
    if releases:
        accountant.compose(GaussianPrivacyEvent(sigma, n, n), releases)
    return accountant.get_epsilon(delta)


def test_the_calibrated_noise_spends_the_target_over_the_planned_rounds():
    rc = make_run_config(**{"dp.epsilon": 4.0, "num-server-rounds": 6, "batch-size": 32, "local-epochs": 2})
    cfg = RunConfig.from_dict(rc)
    plan = make_plan(cfg, 200, 4, 1, 1)
    steps = 6 * 2 * math.ceil(200 / 32)
    assert (plan.rounds, plan.steps_per_training, plan.sample_rate) == (6, 2 * 7, 32 / 200)
    spent = flower_epsilon(plan.noise_multiplier, 200, 32, steps, 6, 1e-5)
    assert 4.0 * (1 - 2e-3) <= spent <= 4.0
    # a little less noise would overspend: the σ is the smallest that meets the target
    assert flower_epsilon(plan.noise_multiplier * 0.99, 200, 32, steps, 6, 1e-5) > 4.0
    assert plan.epsilon(6, 6) == pytest.approx(spent, rel=1e-12)
    assert plan.rounds_within_budget() == 6
    # no release (a weight payload): less is composed, so less noise meets the same target
    assert make_plan(cfg, 200, 4, 1, 0).noise_multiplier < plan.noise_multiplier


def test_the_budget_is_planned_over_the_rounds_a_client_is_expected_to_train():
    cfg = RunConfig.from_dict(make_run_config(**{"num-server-rounds": 10, "fraction-train": 0.5}))
    assert planned_rounds(cfg, 4) == 5
    assert planned_rounds(RunConfig.from_dict(make_run_config(**{"num-server-rounds": 10})), 4) == 10


def test_a_target_that_cannot_be_met_is_refused_naming_the_key():
    cfg = RunConfig.from_dict(make_run_config(**{"dp.epsilon": 1e-4, "num-server-rounds": 50}))
    with pytest.raises(ConfigError, match="'dp.epsilon'"):
        make_plan(cfg, 200, 4, 1, 1)
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
    from strategies.registry import build_strategy

    with pytest.raises(ConfigError, match=key):
        build_strategy(RunConfig.from_dict(make_run_config(**{"dp.epsilon": 8.0, **overrides})))


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


def test_a_client_refuses_to_train_past_its_budget(run_config):
    rc = run_config(method="local", dataset="mnist", **{"dp.epsilon": 20.0, "max-examples-per-client": 80})
    client = client_runtime(rc)
    from strategies.registry import client_procedure

    client.dp = client_procedure(RunConfig.from_dict(rc)).dp_plan(client)
    budget = client.dp.rounds_within_budget()
    for r in range(1, budget + 1):
        client.server_round = r
        client.check_budget()
        client.spend_privacy(trainings=1)
    client.server_round = budget + 1
    with pytest.raises(BudgetSpent, match="spent"):
        client.check_budget()
    assert client.privacy_metrics()["dp-rounds-left"] == 0
    assert client.privacy_metrics()["dp-epsilon"] <= 20.0


def test_the_reported_epsilon_is_the_accountants_for_the_rounds_trained(run_config):
    rc = run_config(method="fedgh", dataset="mnist", **{"dp.epsilon": 8.0, "num-server-rounds": 2})
    strategy, grid = federation(rc)
    strategy.start(grid)
    client = client_runtime(rc, 1)
    plan = make_plan(RunConfig.from_dict(rc), len(client.data.train_y), 4, 1, 1)
    steps = 2 * plan.steps_per_training
    expected = flower_epsilon(plan.noise_multiplier, plan.num_train, 32, steps, 2, 1e-5)
    assert strategy.rows[-1]["dp_epsilon_per_client"]["1"] == pytest.approx(expected, rel=1e-9)
    assert strategy.rows[0]["dp_epsilon_per_client"]["1"] < expected


@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_method_trains_privately_with_the_payload_it_sends_without(run_config, method):
    from common.payload import PAYLOAD

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
    from common.payload import PAYLOAD

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
    rc = run_config(method="fedgh", dataset="mnist", **{"dp.epsilon": 1e-4, "num-server-rounds": 50})
    strategy, grid, replies = captured_federation(rc)
    with pytest.raises(ConfigError, match="'dp.epsilon' = 0.0001 cannot be met"):
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
