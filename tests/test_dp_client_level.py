"""Client-level DP of the model uploads (``engine.client_dp``, run config ``[client-dp]``): the clip, the
server's noise, the accountant, the pre-flight refusals and an end-to-end run that still learns."""

import math

import dp_accounting
import numpy as np
import pytest
import torch
from flwr.app import Error, Message

from common.config import ConfigError, RunConfig
from common.errors import RunFailed
from common.run_folder import client_privacy_spent
from conftest import chance, federation
from engine.client_dp import (
    ClientDPAggregator,
    ClientDPPlan,
    client_plan,
    clip_update,
)
from engine.roster import poisson_sample
from methods.registry import build_run

#: every key a round row of a client-level DP run carries (``ClientDPPlan.row``)
ROW_KEYS = {
    "client_dp_noise_multiplier",
    "client_dp_clip_norm",
    "client_dp_sample_rate",
    "client_dp_accounted_rate",
    "client_dp_expected_clients",
    "client_dp_delta",
    "client_dp_epsilon",
    "client_dp_epsilon_rdp",
}


def plan(sigma: float, clip: float, k: int, q: float = 1.0, releases: int = 1, amplified: bool = True):
    return ClientDPPlan(sigma, clip, q, k, 10, releases, amplified, 1e-5)


def test_a_clipped_update_has_at_most_the_clip_norm_and_keeps_its_direction():
    rng = np.random.default_rng(0)
    reference = [rng.normal(size=(10, 5)), rng.normal(size=(10,))]
    for scale, clip in [(3.0, 0.15), (100.0, 1.0), (1e-3, 0.15)]:
        change = [scale * rng.normal(size=a.shape) for a in reference]
        norm = math.sqrt(sum(float(np.sum(c * c)) for c in change))
        clipped, scaled = clip_update([r + c for r, c in zip(reference, change)], reference, clip)
        out = math.sqrt(sum(float(np.sum(c * c)) for c in clipped))
        assert out <= clip * (1 + 1e-12)
        assert scaled == (norm > clip)
        assert out == pytest.approx(min(norm, clip), rel=1e-9)
        for c, d in zip(clipped, change):  # the same direction: a positive multiple of the change
            np.testing.assert_allclose(c, d * min(1.0, clip / norm), rtol=1e-9, atol=1e-15)
    zero, scaled = clip_update(reference, reference, 0.15)  # no change: nothing to clip, no division by 0
    assert not scaled and all(not z.any() for z in zero)


def test_one_client_moves_the_server_mean_by_c_over_k_however_large_its_change():
    # a change of norm 40 moves the mean by C / K = 0.125, up to the noise (σ·C/K·√d = 0.0125 in norm at σ = 0.1)
    aggregator = ClientDPAggregator(plan(0.1, 0.5, 4))
    reference = {"w": np.zeros(100, np.float32)}
    out, metrics = aggregator.aggregate(reference, [{"w": np.full(100, 4.0, np.float32)}], 1)
    assert abs(float(np.linalg.norm(out["w"])) - 0.5 / 4) < 3 * 0.1 * 0.5 / 4 * math.sqrt(100)
    assert float(np.mean(out["w"])) > 0  # towards the client's change
    assert metrics["client-dp-clipped"] == 1


def test_the_noise_at_the_server_has_std_sigma_c_over_the_sampled_clients():
    # zero updates: what the server releases is its noise alone, N(0, (σ·C/K)²) in every coordinate
    sigma, clip, k = 1.3, 0.5, 4
    aggregator = ClientDPAggregator(plan(sigma, clip, k))
    reference = {"a": np.zeros((50, 20), np.float32), "b": np.zeros(1000, np.float32)}
    draws = [aggregator.aggregate(reference, [reference] * k, 1)[0] for _ in range(100)]
    noise = np.concatenate([np.concatenate([d["a"].ravel(), d["b"].ravel()]) for d in draws]).astype(np.float64)
    # 200,000 draws: the sample std's relative standard error is 1/sqrt(2n) = 0.16 %, so 1 % is six of them
    assert noise.std() == pytest.approx(sigma * clip / k, rel=0.01)
    assert abs(noise.mean()) < 5 * sigma * clip / k / math.sqrt(noise.size)
    assert aggregator.plan.noise_std == sigma * clip / k
    assert not np.array_equal(draws[0]["b"], draws[1]["b"])  # fresh entropy every round, never the run's seed


def test_a_client_released_alone_gets_noise_of_std_sigma_c():
    # MH-pFedHN's per-client release: clip_C(delta) + N(0, (σC)²), nothing divided
    aggregator = ClientDPAggregator(plan(2.0, 0.25, 4, amplified=False))
    released = aggregator.privatize(np.zeros(200_000, np.float32)).astype(np.float64)
    assert released.std() == pytest.approx(2.0 * 0.25, rel=0.01)
    big = aggregator.privatize(np.full(10, 1e6, np.float32))
    assert np.linalg.norm(big) < 0.25 + 6 * 2.0 * 0.25 * math.sqrt(10)  # clipped before the noise


def test_poisson_sampling_draws_each_client_alone_at_the_rate():
    counts = [len(poisson_sample(1000, 0.3)) for _ in range(20)]
    # Binomial(1000, 0.3): std 14.5; the mean of 20 draws within 4 standard errors of 300
    assert abs(np.mean(counts) - 300) < 4 * 14.5 / math.sqrt(20)
    assert len(set(counts)) > 1  # the sample size varies: not a fixed-size draw
    assert poisson_sample(7, 1.0) == list(range(7))


def test_the_expected_clients_are_the_rosters_k(run_config):
    from engine.client_dp import expected_clients
    from engine.roster import sample_size

    for n, fraction in [(100, 0.29), (10, 0.3), (4, 0.5), (3, 0.1), (7, 1.0)]:
        cfg = RunConfig.from_dict(run_config(**{"num-clients": n, "fraction-train": fraction}))
        assert expected_clients(cfg) == sample_size(fraction, n)


def independent_epsilon(sigma: float, q: float, rounds: int, delta: float, accountant: str) -> float:
    """ε of ``rounds`` Poisson-sampled Gaussians composed, straight from dp-accounting."""
    relation = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
    if accountant == "rdp":
        acc = dp_accounting.rdp.RdpAccountant(neighboring_relation=relation)
    else:  # the library's default discretisation (1e-4), finer than the project's: an independent grid
        acc = dp_accounting.pld.PLDAccountant(relation)
    event = dp_accounting.GaussianDpEvent(sigma)
    if q < 1:
        event = dp_accounting.PoissonSampledDpEvent(q, event)
    return acc.compose(dp_accounting.SelfComposedDpEvent(event, rounds)).get_epsilon(delta)


@pytest.mark.parametrize(
    "releases, amplified, fraction", [(1, True, 0.3), (1, False, 0.3), (2, False, 1.0)], ids=["sum", "alone", "gd"]
)
def test_the_recorded_epsilon_is_dp_accountings_for_the_same_rate_sigma_and_rounds(
    run_config, releases, amplified, fraction
):
    rc = run_config(method="lg-fedavg", **{"num-clients": 10, "fraction-train": fraction, "num-server-rounds": 20})
    rc["client-dp.epsilon"] = 4.0
    cfg = RunConfig.from_dict(rc)
    p = client_plan(cfg, releases, amplified)
    q = 0.3 if fraction < 1 else 1.0
    assert (p.sample_rate, p.expected_clients) == (q, round(10 * q))
    rate, sigma = (q if amplified else 1.0), p.noise_multiplier / math.sqrt(releases)
    for rounds in (1, 7, 20):
        row = p.row(rounds)
        assert row["client-dp-epsilon-rdp"] == pytest.approx(
            independent_epsilon(sigma, rate, rounds, 1e-5, "rdp"), 1e-9
        )
        # the PLD accountant is an upper bound at any grid: the project's coarser grid within 1 % above the finer one
        fine = independent_epsilon(sigma, rate, rounds, 1e-5, "pld")
        assert fine <= row["client-dp-epsilon"] <= 1.01 * fine
    # calibrated: the planned rounds spend the target, and a σ 2 % smaller would overspend it
    assert 0.97 * 4.0 <= p.epsilon(20) <= 4.0
    assert independent_epsilon(0.98 * sigma, rate, 20, 1e-5, "pld") > 4.0


@pytest.mark.parametrize(
    "overrides, key",
    [
        ({"method": "fedgh"}, "client-dp.epsilon"),  # its upload is per-class representations, not a model
        ({"method": "fedproto"}, "client-dp.epsilon"),
        ({"num-clients": 0}, "num-clients"),
        ({"aggregation": "krum", "byzantine-clients": 0}, "aggregation"),
        ({"handshake": "sampled", "eval-clients": "trained"}, "handshake"),
        ({"generalization.held-out-clients": 1}, "generalization.held-out-clients"),
        ({"client-dp.delta": 0.075, "num-clients": 20}, "client-dp.delta"),  # not below 1/N = 0.05
        ({"client-dp.epsilon": 1e-6}, "client-dp.epsilon"),
    ],
)
def test_a_run_that_cannot_give_client_level_dp_is_refused_before_it_starts(run_config, overrides, key):
    rc = run_config(**{"method": "lg-fedavg", "client-dp.epsilon": 8.0, **overrides})
    with pytest.raises(ConfigError, match=f"'{key}'"):
        build_run(RunConfig.from_dict(rc))


def test_model_upload_methods_accept_it_and_the_default_aggregation_is_replaced(run_config):
    for method in ("lg-fedavg", "fml", "fedkd", "fedmrl", "mh-pfedhn", "mh-pfedhngd"):
        extra = {"model-group": "mh-lenet"} if method.startswith("mh-") else {}
        strategy = build_run(RunConfig.from_dict(run_config(method=method, **{"client-dp.epsilon": 8.0}, **extra)))
        assert strategy.method.client_dp is not None, method
        assert strategy.method.client_dp.plan.releases == (2 if method == "mh-pfedhngd" else 1)
        assert strategy.method.client_dp.plan.amplified == (not method.startswith("mh-"))


@pytest.mark.parametrize("method", ["fml", "fedkd", "fedmrl", "mh-pfedhn", "mh-pfedhngd"])
def test_every_model_upload_method_runs_with_it_and_records_it(run_config, method):
    extra = {"model-group": "mh-lenet"} if method.startswith("mh-") else {}
    small = {"num-clients": 2, "num-server-rounds": 1, "max-examples-per-client": 100}
    rc = run_config(
        method=method, dataset="mnist", **small, **extra, **{"client-dp.epsilon": 50.0, "client-dp.delta": 1e-3}
    )
    strategy, grid = federation(rc)
    before = (
        {k: v.detach().clone() for k, v in strategy.method.hn.state_dict().items()} if hasattr(strategy, "hn") else None
    )
    strategy.start(grid)
    row, p = strategy.rows[-1], strategy.method.client_dp.plan
    assert set(row) >= ROW_KEYS and row["num_clients"] == 2
    assert row["client_dp_accounted_rate"] == (1.0 if method.startswith("mh-") else p.sample_rate)
    assert row["client_dp_epsilon"] == pytest.approx(p.epsilon(1), rel=1e-12)
    assert 0.97 * 50.0 <= row["client_dp_epsilon"] <= 50.0  # the one planned round spends the whole target
    if before is not None:  # the hypernetwork took its steps from the noisy deltas
        assert any(not torch.equal(before[k], v) for k, v in strategy.method.hn.state_dict().items())


def drop(grid, reply):
    """An error reply in place of every train reply (the message it answers is the grid's last sent)."""
    if reply.metadata.message_type != "train":
        return reply
    return Message(Error(code=2, reason="dropped by the test"), reply_to=grid.sent[-1])


def test_a_sampled_client_without_a_reply_is_stepped_on_noise_alone(run_config, monkeypatch):
    # MH-pFedHN: with the reply dropped, its embedding still moves, by noise of std σC (its upload zeroed)
    from methods import mh_pfedhn

    rc = run_config(
        method="mh-pfedhn",
        dataset="mnist",
        **{"model-group": "mh-lenet", "num-clients": 2, "num-server-rounds": 1, "max-examples-per-client": 100},
        **{"client-dp.epsilon": 50.0, "client-dp.delta": 1e-3},
    )
    steps = []
    real = mh_pfedhn.hn_step
    monkeypatch.setattr(
        mh_pfedhn, "hn_step", lambda hn, opt, key, delta, clip: steps.append(delta) or real(hn, opt, key, delta, clip)
    )
    strategy, grid = federation(rc, tamper=lambda node, reply: drop(grid, reply))
    with pytest.raises(RunFailed):  # no client trained: the run fails after its round, having stepped on noise
        strategy.start(grid)
    std = strategy.method.client_dp.plan.noise_multiplier * strategy.method.client_dp.plan.clip_norm
    assert len(steps) == 2
    for delta in steps:
        assert delta.double().std().item() == pytest.approx(std, rel=0.05)


def lg_fedavg_run(run_config, epsilon: float):
    """(run config, strategy) of a finished 2-round LG-FedAvg run at client-level ``epsilon``: 2 IID MNIST clients
    of 300 examples (δ = 1e-3 < 1/N), 2 local epochs at lr 0.05, the global head evaluated after each round."""
    rc = run_config(
        method="lg-fedavg",
        dataset="mnist",
        partitioner="iid",
        **{"num-clients": 2, "max-examples-per-client": 300, "lr": 0.05, "local-epochs": 2, "num-server-rounds": 2},
        **{"lg-fedavg.eval-global-head": True, "client-dp.epsilon": epsilon, "client-dp.delta": 1e-3},
    )
    strategy, grid = federation(rc)
    strategy.start(grid)
    return rc, strategy


def test_a_run_at_a_large_epsilon_still_learns_and_its_rows_say_how_private_it_was(run_config):
    # LG-FedAvg's global head, evaluated after the server's noisy mean with every client's own extractor, is the
    # released model itself. Without DP this setting reaches 0.59 (both accuracies) against a prior of 0.12; at
    # ε = 1000 0.59 and 0.63; at ε = 0.1 (σ·C/K dwarfs the head) both fall to 0.10 (the contrast below)
    rc, strategy = lg_fedavg_run(run_config, 1000.0)
    prior = chance(rc, 2)
    last = strategy.rows[-1]
    assert last["accuracy_mean"] > prior + 0.25, (last["accuracy_mean"], prior)
    assert last["accuracy_mean_global_head"] > prior + 0.25, (last["accuracy_mean_global_head"], prior)
    p = strategy.method.client_dp.plan
    for server_round, row in enumerate(strategy.rows, 1):
        assert set(row) >= ROW_KEYS
        assert row["client_dp_noise_multiplier"] == p.noise_multiplier > 0
        assert (row["client_dp_clip_norm"], row["client_dp_sample_rate"], row["client_dp_expected_clients"]) == (
            0.15,
            1.0,
            2,
        )
        assert row["client_dp_epsilon"] == pytest.approx(p.epsilon(server_round), rel=1e-12)
        assert row["client_dp_epsilon_rdp"] == pytest.approx(
            independent_epsilon(p.noise_multiplier, 1.0, server_round, 1e-3, "rdp")
        )
    assert strategy.rows[0]["client_dp_epsilon"] < last["client_dp_epsilon"] <= 1000.0 < 1.1 * last["client_dp_epsilon"]
    summary = client_privacy_spent(strategy.rows)["client_dp"]  # what summary.json keeps
    assert summary["round"] == 2 and summary["epsilon"] == last["client_dp_epsilon"]
    assert summary["noise_multiplier"] == p.noise_multiplier and summary["sample_rate"] == 1.0
    assert client_privacy_spent([{"round": 1, "accuracy_mean": 0.5}]) == {}


def test_at_a_small_epsilon_the_noise_reaches_the_released_head(run_config):
    rc, strategy = lg_fedavg_run(run_config, 0.1)
    assert strategy.rows[-1]["accuracy_mean_global_head"] < chance(rc, 2) + 0.1
    assert strategy.method.client_dp.plan.noise_std > 1.0  # σ·C/K per coordinate of a head whose weights are ~0.05
