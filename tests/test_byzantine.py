"""Byzantine clients against the averaging methods: run config ``aggregation`` (engine.robust),
the server's rollback of an exploded state, and clients that never store a non-finite model.

The attacks are those of ``bench.byzantine.ATTACKS``: one client (partition 1) of 4 uploads a
well-formed payload within every schema check, every round, on MNIST with model group ``cnn1``.
With plain ``mean`` each of them broke the run (the FedAvg finite but huge in round 1, every
reply NaN from round 2, the clients' models on disk NaN; LG-FedAvg's honest accuracy halved).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Array
from torch import nn

from bench.byzantine import ATTACKER, ATTACKS, HONEST, tamper_of
from common.config import ConfigError, RunConfig
from common.payload import ClientReply
from common.protocol import PAYLOAD
from conftest import client_runtime, federation, make_run_config
from engine.aggregation import fedavg
from engine.checkpoint import GROWTH, broken_state, exploded
from engine.robust import BOUNDED, FALLBACK, RobustAggregator, bound_by_median, check_aggregation

ROUNDS = 2
#: the attacks of bench.byzantine on the methods whose server averages models or heads
AVERAGING = ["fedkd-1e6", "fedmrl-100", "fml-10", "fml-zero", "lg-fedavg-1e6"]
#: honest clients may lose at most this much accuracy to the attacker (fraction)
TOLERANCE = 0.05


def mnist(tmp_path, method: str, options: dict, **overrides) -> dict:
    """4 MNIST clients with ``cnn1``, 200 examples each, ``ROUNDS`` rounds, client state on disk."""
    return make_run_config(
        **{
            "output-dir": str(tmp_path / "outputs"),
            "state-dir": str(tmp_path / "state"),
            "dataset": "mnist",
            "model-group": "cnn1",
            "num-server-rounds": ROUNDS,
            "method": method,
            **options,
            **overrides,
        }
    )


def honest_accuracy(rows) -> float:
    final = rows[-1]["accuracy_per_client"]
    return float(np.mean([final[str(p)] for p in HONEST]))


def stored_tensors(folder):
    """(file, key, tensor) of every float tensor the clients stored under ``folder``."""
    for path in sorted(folder.rglob("*.pt")):
        saved = torch.load(path, map_location="cpu", weights_only=True)
        for key, value in saved["state"].items():
            if value.is_floating_point():
                yield path, key, value


def record_steps(strategy) -> list[tuple[float, float]]:
    """Wraps ``strategy.method.aggregate_train`` of a shared-module method: per round (L2 norm of the server's
    step, the longest honest upload's change), both from what the server sent (FedKD: the
    broadcast as the clients rebuilt it)."""
    from methods.blocks.shared_model import module_arrays
    from methods.fedkd import svd_decompress

    original, steps = strategy.method.aggregate_train, []
    shapes = {k: tuple(v.shape) for k, v in strategy.method.shared.state_dict().items()}
    rebuilt = type(strategy.method).__name__ == "FedKDServer"

    def norm(arrays, sent) -> float:
        return float(np.sqrt(sum(np.sum((arrays[k].astype(np.float64) - sent[k]) ** 2) for k in sent)))

    def aggregate_train(server_round, replies):
        sent = (
            svd_decompress(strategy.method.configure_train(0, server_round), shapes)
            if rebuilt
            else strategy.method.global_arrays()
        )
        uploads = {r.partition_id: svd_decompress(r.arrays, shapes) if rebuilt else r.arrays for r in replies}
        metrics = original(server_round, replies)
        honest = max((norm(uploads[p], sent) for p in HONEST if p in uploads), default=0.0)
        steps.append((norm(module_arrays(strategy.method.shared), sent), honest))
        return metrics

    strategy.method.aggregate_train = aggregate_train
    return steps


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """Honest accuracy of each attacked method's run without the attacker (computed once)."""
    cache = {}

    def of(method: str, options: dict) -> float:
        key = (method, tuple(sorted(options.items())))
        if key not in cache:
            strategy, grid = federation(mnist(tmp_path_factory.mktemp(method), method, options))
            strategy.start(grid)
            cache[key] = honest_accuracy(strategy.rows)
        return cache[key]

    return of


@pytest.mark.parametrize("attack", AVERAGING)
def test_one_byzantine_client_costs_the_honest_ones_little(tmp_path, clean, attack):
    """Under the default ``norm-bound`` the attacker's replies stay in (bounded), no reply is ever
    dropped, the honest clients end within ``TOLERANCE`` of the run without the attacker, and
    nothing non-finite reaches a client's state on disk."""
    method, options, factory = ATTACKS[attack]
    strategy, grid = federation(mnist(tmp_path, method, options), tamper_of(factory(0)))
    steps = record_steps(strategy)
    strategy.start(grid)
    rows = strategy.rows
    assert [r["num_clients"] for r in rows] == [4] * ROUNDS, [r.get("dropped_clients") for r in rows]
    # the server's step is no longer than the longest honest change (mean: ~1/4 of the attacker's)
    assert all(step <= honest * (1 + 1e-4) for step, honest in steps), steps
    assert honest_accuracy(rows) >= clean(method, options) - TOLERANCE
    assert all(r["server_bounded"] >= 1 for r in rows)  # at least the attacker, every round
    tensors = list(stored_tensors(tmp_path / "state"))
    assert {p.name for p, _, _ in tensors} >= {"model.pt", "model.prev.pt"}
    assert all(torch.isfinite(v).all() for _, _, v in tensors), [(p, k) for p, k, v in tensors]


def cfg_of(**overrides) -> RunConfig:
    return RunConfig.from_dict(make_run_config(**overrides))


def test_norm_bound_scales_exactly_the_longer_changes_to_the_median():
    """Five uploads whose changes from the reference have norms 1, 2, 3, 4 and 1e6 (over both arrays):
    the median is 3, so the last two are scaled to norm 3 and the others are untouched; the
    aggregate is reference + the sample-weighted mean of the bounded changes."""
    rng = np.random.default_rng(0)
    ref = {"w": rng.normal(size=(2, 3)).astype(np.float32), "b": rng.normal(size=2).astype(np.float32)}
    direction = rng.normal(size=8)
    direction /= np.linalg.norm(direction)
    norms, weights = [1.0, 2.0, 3.0, 4.0, 1e6], [1.0, 2.0, 3.0, 4.0, 5.0]
    uploads = [{"w": ref["w"] + (n * direction[:6]).reshape(2, 3), "b": ref["b"] + n * direction[6:]} for n in norms]
    out, metrics = RobustAggregator(cfg_of(aggregation="norm-bound")).aggregate(ref, uploads, weights)
    assert metrics == {BOUNDED: 2}
    bounded = [min(n, 3.0) for n in norms]
    step = sum(w * n for w, n in zip(weights, bounded)) / sum(weights) * direction
    assert np.allclose(out["w"], ref["w"] + step[:6].reshape(2, 3), atol=1e-6)
    assert np.allclose(out["b"], ref["b"] + step[6:], atol=1e-6)
    assert out["w"].dtype == np.float32 and out["w"].shape == (2, 3)

    vectors = [n * direction for n in norms]
    kept, scaled = bound_by_median(vectors)
    assert scaled == 2 and all(kept[i] is vectors[i] for i in range(3))
    assert [float(np.linalg.norm(v)) for v in kept] == pytest.approx(bounded)
    assert bound_by_median([]) == ([], 0)


def reply(i: int, arrays: dict, n: float) -> ClientReply:
    return ClientReply(1000 + i, i, arrays, {"num-examples": n})


def test_mean_is_fedavg_bit_for_bit_and_rows_say_nothing_new():
    rng = np.random.default_rng(1)
    replies = [reply(i, {"w": rng.normal(size=(3, 4)).astype(np.float32)}, n) for i, n in enumerate([3, 50, 7])]
    out, metrics = RobustAggregator(cfg_of(aggregation="mean")).replies({"w": np.zeros((3, 4), np.float32)}, replies)
    assert np.array_equal(out["w"], fedavg(replies, ["w"])["w"]) and metrics == {}
    # no evidence (every weight 0) keeps the state, under any rule
    idle = [reply(i, {"w": np.ones((3, 4), np.float32)}, 0) for i in range(3)]
    for rule in ("mean", "norm-bound", "median"):
        assert RobustAggregator(cfg_of(aggregation=rule)).replies({"w": np.zeros((3, 4), np.float32)}, idle)[0] is None


@pytest.mark.parametrize("rule", ["median", "trimmed-mean", "krum", "multi-krum", "bulyan"])
def test_flower_rules_ignore_one_outlier(rule):
    """Seven uploads near 1 and one of 1e6 (n = 8 satisfies Bulyan's n > 4f + 2 with f = 1): every
    Flower rule lands among the honest values; Krum returns one honest upload exactly, Multi-Krum
    leaves out f = 1 (the outlier)."""
    rng = np.random.default_rng(2)
    honest = [{"w": (1 + 0.01 * rng.normal(size=(4, 3))).astype(np.float32)} for _ in range(7)]
    uploads = [*honest, {"w": np.full((4, 3), 1e6, np.float32)}]
    cfg = cfg_of(aggregation=rule, **{"trim-fraction": 0.2, "byzantine-clients": 1, "num-clients": 8})
    out, metrics = RobustAggregator(cfg).aggregate({"w": np.zeros((4, 3), np.float32)}, uploads, [1.0] * 8)
    low, high = np.min([h["w"] for h in honest], axis=0), np.max([h["w"] for h in honest], axis=0)
    assert (out["w"] >= low - 1e-6).all() and (out["w"] <= high + 1e-6).all()
    if rule == "krum":
        assert any(np.array_equal(out["w"], h["w"]) for h in honest) and metrics[BOUNDED] == 7
    if rule == "multi-krum":
        assert np.allclose(out["w"], np.mean([h["w"] for h in honest], axis=0), atol=1e-6)
        assert metrics[BOUNDED] == 1


def test_selecting_rules_need_enough_clients_and_fall_back_when_too_few_answer():
    """Krum needs n > 2f + 2 and Bulyan n > 4f + 2 sampled clients, refused before the run naming
    the keys; a round with fewer valid uploads runs norm-bound and says so."""
    from methods.registry import build_run

    with pytest.raises(ConfigError, match="'aggregation' = 'krum' with 'byzantine-clients' = 1"):
        build_run(cfg_of(method="fml", aggregation="krum", **{"num-clients": 4}))
    with pytest.raises(ConfigError, match="'aggregation' = 'bulyan'"):
        check_aggregation(cfg_of(aggregation="bulyan", **{"num-clients": 6}))
    with pytest.raises(ConfigError, match="'aggregation' = 'multi-krum'"):
        check_aggregation(cfg_of(aggregation="multi-krum", **{"num-clients": 10, "fraction-train": 0.4}))
    check_aggregation(cfg_of(aggregation="krum", **{"num-clients": 5}))
    check_aggregation(cfg_of(aggregation="bulyan", **{"num-clients": 7}))
    check_aggregation(cfg_of(aggregation="bulyan", **{"num-clients": 0}))  # N unknown before the nodes connect

    aggregator = RobustAggregator(cfg_of(aggregation="krum", **{"num-clients": 0}))
    uploads = [{"w": np.full(3, v, np.float32)} for v in (1.0, 2.0, 30.0)]
    out, metrics = aggregator.aggregate({"w": np.zeros(3, np.float32)}, uploads, [1.0, 1.0, 1.0])
    assert metrics == {FALLBACK: 1, BOUNDED: 1} and np.allclose(out["w"], (1 + 2 + 2) / 3)


def test_an_exploding_server_state_is_rolled_back(tmp_path):
    """A finite update that blows the head up 1e4-fold is undone like a non-finite one, the row says
    so, and the next round sends the last sound head; ordinary steps never trip the bound."""
    rc = mnist(tmp_path, "lg-fedavg", {}, aggregation="mean", **{"num-server-rounds": 3})
    strategy, grid = federation(rc)
    original = strategy.method.aggregate_train
    heads = []

    def aggregate_train(server_round, replies):
        metrics = original(server_round, replies)
        if server_round == 2:
            strategy.method.shared.head.weight.data *= 1e4
        heads.append(strategy.method.global_arrays()["head.weight"].copy())
        return metrics

    strategy.method.aggregate_train = aggregate_train
    strategy.start(grid)
    assert [r.get("server_rolled_back", 0) for r in strategy.rows] == [0, 1, 0]
    round3 = [m for m in grid.sent if m.metadata.message_type == "train"][8:12]
    sent = round3[0].content.array_records[PAYLOAD]["head.weight"].numpy()
    assert np.array_equal(sent, heads[0])

    before = {"shared": {"w": torch.full((10,), 0.05), "b": torch.zeros(3)}, "step": [torch.tensor(7.0)]}
    ordinary = {"shared": {"w": torch.full((10,), 0.2), "b": torch.full((3,), 5.0)}, "step": [torch.tensor(8.0)]}
    assert exploded(before, ordinary) == [] and broken_state(before, ordinary) is None
    blown = {"shared": {"w": torch.full((10,), GROWTH * 1.01), "b": torch.zeros(3)}, "step": [torch.tensor(8.0)]}
    assert exploded(before, blown) == ["shared.w"] and "explode" in broken_state(before, blown)
    assert broken_state(before, {**ordinary, "step": [torch.tensor(float("nan"))]}) == "non-finite"


@pytest.mark.parametrize("state_dir", [True, False])
def test_a_client_never_stores_a_non_finite_model(tmp_path, state_dir):
    """Storing a model with a NaN raises (the reply becomes an error the server drops) and keeps the
    previous state, in ``context.state`` and on disk."""
    rc = make_run_config(**({"state-dir": str(tmp_path / "state")} if state_dir else {}))
    client = client_runtime(rc)
    model = nn.Linear(3, 2)
    client.store("model", model)
    good = {k: v.clone() for k, v in model.state_dict().items()}
    model.weight.data[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="non-finite values in \\['weight'\\]; its previous state is kept"):
        client.store("model", model)
    restored = nn.Linear(3, 2)
    assert client_runtime(rc).restore("model", restored) if state_dir else client.restore("model", restored)
    assert all(torch.equal(restored.state_dict()[k], good[k]) for k in good)


def test_a_checkpoint_from_before_aggregation_existed_resumes_only_as_mean(tmp_path):
    """Such a run averaged plainly: its checkpoint resumes with ``aggregation = "mean"`` (what the
    presets say), and is refused with the default ``norm-bound``, which would change the method."""
    from common.options import declared_defaults
    from common.run_folder import CHECKPOINT
    from engine.checkpoint import Checkpoints
    from engine.round_rows import RoundCounters

    rc = make_run_config(method="lg-fedavg", aggregation="mean")
    saved = Checkpoints(cfg_of(**rc), None).build(1, "key", np.random.default_rng(0), RoundCounters(), [], {})
    assert saved["config"].pop("aggregation") == "mean"
    torch.save(saved, tmp_path / CHECKPOINT)
    for rule, fits in (("mean", True), ("norm-bound", False)):
        cfg = cfg_of(**{**rc, "aggregation": rule, "resume-from": str(tmp_path)})
        checkpoints = Checkpoints(cfg, None, declared_defaults(RunConfig))
        if fits:
            assert checkpoints.load()["round"] == 1
        else:
            with pytest.raises(ConfigError, match=r"'aggregation' \(None, now 'norm-bound'\)"):
                checkpoints.load()


def test_mh_pfedhngd_global_step_follows_the_bounded_mean(run_config, monkeypatch):
    """MH-pFedHNGD: a ``delta_w_g`` 1000 times an honest one moves the global step no further than
    the longest honest delta (its reference is zero: the uploads are changes already)."""
    import methods.mh_pfedhn as mh

    rc = run_config(
        method="mh-pfedhngd",
        **{"model-group": "mh-lenet", "num-server-rounds": 1, "mh-pfedhngd.hidden-dim": 16},
    )
    uploads, steps = {}, []

    def tamper(node, reply):
        if reply.metadata.message_type == "train.global" and not reply.has_error():
            delta = reply.content.array_records[PAYLOAD]["delta_w_g"].numpy()
            if node == 1000 + ATTACKER:
                delta = delta * 1e3
                reply.content.array_records[PAYLOAD]["delta_w_g"] = Array(delta)
            uploads[node - 1000] = delta.astype(np.float64)
        return reply

    original = mh.hn_step

    def hn_step(hn, optimizer, key, delta, clip_norm):
        if key == "global":
            steps.append(delta.numpy().copy())
        original(hn, optimizer, key, delta, clip_norm)

    monkeypatch.setattr(mh, "hn_step", hn_step)
    strategy, grid = federation(rc, tamper)
    strategy.start(grid)
    assert strategy.rows[0]["server_bounded"] >= 1 and len(steps) == 1
    honest = max(np.linalg.norm(uploads[p]) for p in HONEST)
    assert np.linalg.norm(steps[0]) <= honest * (1 + 1e-5) < np.linalg.norm(uploads[ATTACKER]) / 100
