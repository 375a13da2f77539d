"""MH-pFedHN / MH-pFedHNGD: payloads, bytes, the client and server steps, degenerate cases and determinism
(docs/methods/mh-pfedhn.md)."""

import copy
import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from common.config import RunConfig
from common.payload import array_record
from common.protocol import PAYLOAD
from common.runtime import MODEL_STATE
from common.training import kd_loss
from conftest import client_runtime, federation, train_config
from methods.blocks.hypernetwork import HyperNetwork, flat_delta, hn_step, load_flat
from methods.mh_pfedhn import METHOD as MHPFEDHN_METHOD
from methods.mh_pfedhn import METHOD_GD as MHPFEDHNGD_METHOD
from methods.mh_pfedhn import TEACHER_STATE, HNOptions
from models.mh import build_mh_model

# docs/methods/mh-pfedhn.md §7: generated parameter counts for 3x32x32 input
K_C10 = {"lenet": 234_006, "vgg8": 268_814, "mhresnet10": 347_178, "mhresnet12": 523_242, "mhresnet18": 565_386}
K_C100 = {
    "lenet": 239_856,
    "vgg8": 274_664,
    "mhresnet10": 353_028,
    "mhresnet12": 529_092,
    "mhresnet18": 571_236,
    "mlp": 408_100,
}
FAST = {"mh-pfedhn.hidden-dim": 16, "mh-pfedhngd.hidden-dim": 16}  # HN size ~ H * K: keep tests light


def opts(**kw):
    """HNOptions with their declared defaults, ``kw`` overriding."""
    return HNOptions(**kw)


def hn_with(sizes, **kw):
    torch.manual_seed(0)
    hn = HyperNetwork(opts(**kw))
    params = list(hn.trunk.parameters())
    for key, k in sizes.items():
        params += hn.register(key, k)
    return hn, torch.optim.Adam(params, lr=2e-4)


def mh_config(run_config, method="mh-pfedhn", **kw):
    return run_config(
        **{
            "method": method,
            "model-group": "mh-lenet",
            "lr": 0.005,
            "momentum": 0.9,
            "weight-decay": 5e-4,
            **FAST,
            **{k.replace("_", "-"): v for k, v in kw.items()},
        }
    )


def snapshot(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


# docs/methods/mh-pfedhn.md §7: the zoo's generated parameter counts
@pytest.mark.parametrize("name", K_C100)
def test_parameter_counts_match_spec(name):
    assert sum(p.numel() for p in build_mh_model(name, 100).parameters()) == K_C100[name]
    if name in K_C10:
        assert sum(p.numel() for p in build_mh_model(name, 10).parameters()) == K_C10[name]
    model = build_mh_model(name, 10, 1, 28)  # MNIST-sized input works too
    assert model(torch.zeros(2, 1, 28, 28)).shape == (2, 10) and model.feature_dim == 64


# 1: heads per distinct tau, embeddings, output lengths, HN size
def test_hn_shapes():
    hn = HyperNetwork(opts())
    assert sorted(hn.tau(k) for k in K_C100.values() if k != 408_100) == [79, 90, 115, 173, 186]
    small = dict(chunk_size=64, hidden_dim=8, embedding_dim=4)
    sizes = {"a": 1000, "b": 1000, "c": 1700, "d": 64, "e": 63, "f": 5000}
    hn, _ = hn_with(sizes, **small)
    taus = {hn.tau(k) for k in sizes.values()}
    assert sorted(int(t) for t in hn.heads) == sorted(taus)
    for key, k in sizes.items():
        assert hn.embeddings[key].shape == (hn.tau(k), 4)
        assert hn.generate(key).shape == (k,)  # tau = 1 (K < B) and K a multiple of B included
    trunk = sum(p.numel() for p in hn.trunk.parameters())
    total = sum(p.numel() for p in hn.parameters())
    assert total == trunk + (8 * 64 + 64) * sum(taus) + 4 * sum(hn.tau(k) for k in sizes.values())
    assert sum(p.numel() for p in HyperNetwork(opts()).trunk.parameters()) == 41_344


# 2: sharing by tau only, locality of one update (parameters and Adam state)
def test_heads_shared_by_tau_and_updates_are_local():
    hn = HyperNetwork(opts(hidden_dim=4))
    hn.register("A", 239_856), hn.register("B", 239_956), hn.register("C", 242_689)
    assert hn.head_of("A") is hn.head_of("B") and hn.head_of("C") is not hn.head_of("A")
    hn, adam = hn_with({"A": 300, "B": 310, "C": 500}, chunk_size=64, hidden_dim=8, embedding_dim=4)
    before = snapshot(hn)
    hn_step(hn, adam, "A", torch.randn(300), 50.0)
    after = snapshot(hn)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    head_a = f"heads.{hn.tau(300)}."
    assert changed == {k for k in before if k.startswith("trunk.") or k.startswith(head_a) or k == "embeddings.A"}
    stepped = {id(p) for p in adam.state}
    assert id(hn.embeddings["B"]) not in stepped and id(hn.head_of("C").weight) not in stepped
    assert id(hn.embeddings["A"]) in stepped


# 3: update direction; the paper's literal sign fails it; zero delta leaves φ unchanged
def test_update_moves_generated_weights_towards_the_trained_ones():
    hn, adam = hn_with({"A": 400}, chunk_size=64, hidden_dim=8, embedding_dim=4)
    delta = torch.randn(400)
    with torch.no_grad():
        before = hn.generate("A").clone()
    hn_step(hn, adam, "A", delta, 50.0)
    with torch.no_grad():
        assert float((hn.generate("A") - before) @ delta) > 0
    # Algorithm 1 taken literally (φ <- φ - lr * J^T Δθ) moves the weights the other way
    literal, adam2 = hn_with({"A": 400}, chunk_size=64, hidden_dim=8, embedding_dim=4)
    hn_step(literal, adam2, "A", -delta, 50.0)
    with torch.no_grad():
        assert float((literal.generate("A") - before) @ delta) < 0
    fresh, adam3 = hn_with({"A": 400}, chunk_size=64, hidden_dim=8, embedding_dim=4)
    state = snapshot(fresh)
    hn_step(fresh, adam3, "A", torch.zeros(400), 50.0)
    assert all(torch.equal(v, fresh.state_dict()[k]) for k, v in state.items())


# 4: the gradient is -J^T Δθ: autograd of the surrogate and finite differences agree
def test_exact_gradient_on_a_tiny_hn():
    hn, _ = hn_with({"A": 20}, chunk_size=8, hidden_dim=6, embedding_dim=3)
    hn.double()
    delta = torch.randn(20, dtype=torch.float64)
    grads = {}

    class Capture(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {})

        def step(self, closure=None):
            grads.update({name: p.grad.clone() for name, p in hn.named_parameters() if p.grad is not None})

    hn_step(hn, Capture(hn.parameters()), "A", delta, 0.0)

    def surrogate():
        with torch.no_grad():
            return float(-(hn.generate("A") * delta).sum())

    for name, param in hn.named_parameters():
        flat = param.data.view(-1)
        for i in range(0, flat.numel(), max(1, flat.numel() // 3)):
            old = float(flat[i])
            flat[i] = old + 1e-6
            up = surrogate()
            flat[i] = old - 1e-6
            down = surrogate()
            flat[i] = old
            numeric = (up - down) / 2e-6
            assert abs(numeric - float(grads[name].view(-1)[i])) <= 1e-4 * max(1.0, abs(numeric)), name


# 5, 11, 12: payloads, bytes, one step per reply, evaluation of the post-round h(v_i)
@pytest.mark.parametrize(
    "method,schedule", [("mh-pfedhn", "sequential"), ("mh-pfedhn", "parallel"), ("mh-pfedhngd", "sequential")]
)
def test_rounds_payloads_steps_and_evaluation(run_config, method, schedule):
    rc = mh_config(run_config, method, **{"num-clients": 3, "num-server-rounds": 2, f"{method}.schedule": schedule})
    strategy, grid = federation(rc)
    strategy.start(grid)
    k = K_C10["lenet"]
    gd = method == "mh-pfedhngd"
    per_client = 8 * k * (2 if gd else 1)
    for row in strategy.rows:
        assert row["bytes_up"] + row["bytes_down"] == 3 * per_client
        assert row["eval_bytes_down"] == 3 * 4 * k and row["eval_bytes_up"] == 0
        assert row["server_hn_steps"] == 3 + gd
    trunk_param = next(strategy.method.hn.trunk.parameters())
    assert int(strategy.method.optimizer.state[trunk_param]["step"]) == 2 * (3 + gd)
    for m in grid.sent:
        arrays = {n: a for n, a in m.content.array_records[PAYLOAD].items()} if PAYLOAD in m.content else {}
        expected = {"query": {}, "train": {"theta": (k,)}, "evaluate": {"theta": (k,)}, "train.global": {"w_g": (k,)}}[
            m.metadata.message_type
        ]
        assert {n: tuple(a.shape) for n, a in arrays.items()} == expected
    if schedule == "sequential":  # one client per exchange: sent one at a time in a shuffled order
        order = [m.metadata.dst_node_id for m in grid.sent if m.metadata.message_type == "train"]
        assert sorted(order[:3]) == sorted(grid.contexts)
    last_eval = {m.metadata.dst_node_id: m for m in grid.sent if m.metadata.message_type == "evaluate"}
    for node, m in last_eval.items():
        assert np.array_equal(
            m.content.array_records[PAYLOAD]["theta"].numpy(), strategy.method.weights_for(node)["theta"]
        )
    for metrics in strategy.federation.roster.clients.values():  # the handshake disclosed sizes only
        assert metrics["num-params"] == k and all(isinstance(v, (int, float)) for v in metrics.values())


def test_cifar100_bytes_formula():
    assert 8 * K_C100["lenet"] == 1_918_848 and 16 * K_C100["lenet"] == 3_837_696


# 7, 8: flat round trip, lr = 0, BN statistics stay local and persist
def test_flat_round_trip_and_zero_lr(run_config):
    model = build_mh_model("mhresnet10", 10)
    theta = torch.randn(K_C10["mhresnet10"]).numpy()
    received = load_flat(model, theta, torch.device("cpu"))
    assert np.array_equal(torch.nn.utils.parameters_to_vector(model.parameters()).detach().numpy(), theta)
    assert np.array_equal(flat_delta(model, received), np.zeros_like(theta))
    rc = mh_config(run_config, lr=0.0)
    client = client_runtime(rc)
    arrays, _ = MHPFEDHN_METHOD.build_client(RunConfig.from_dict(rc)).train(
        client, {"theta": theta[: K_C10["lenet"]].copy()}, train_config(rc)
    )
    assert not arrays["delta_theta"].any()


def test_bn_statistics_persist_locally(run_config):
    rc = mh_config(run_config, model_group="mh-zoo", **{"num-clients": 5})
    client = client_runtime(rc, partition_id=2)  # mhresnet10
    procedure = MHPFEDHN_METHOD.build_client(RunConfig.from_dict(rc))
    _, metrics = procedure.query(client, {}, {})
    k = metrics["num-params"]
    assert k == K_C10["mhresnet10"]
    theta = (torch.randn(k) * 0.05).numpy()
    arrays, _ = procedure.train(client, {"theta": theta}, train_config(rc))
    assert arrays["delta_theta"].shape == (k,)  # buffers are not in the vector
    saved = client.context.state.array_records[MODEL_STATE]
    mean = saved["extractor.1.running_mean"].numpy()
    assert np.abs(mean).sum() > 0  # trained statistics, not the defaults
    again = client_runtime(rc, partition_id=2)
    again.context.state = client.context.state
    procedure.evaluate(again, {"theta": theta}, {})
    assert np.array_equal(again.model.extractor[1].running_mean.cpu().numpy(), mean)  # restored, not generated
    assert np.array_equal(client.context.state.array_records[MODEL_STATE]["extractor.1.running_mean"].numpy(), mean)


# 9: distillation
def test_kd_loss_definition():
    s, t = torch.randn(5, 10), torch.randn(5, 10)
    assert float(kd_loss(s, s.clone(), 15.0)) == pytest.approx(0.0, abs=1e-6)
    for temp in (1.0, 4.0):
        p = F.softmax(t / temp, 1)
        manual = (p * (p.log() - F.log_softmax(s / temp, 1))).sum(1).mean() * temp**2
        assert float(kd_loss(s, t, temp)) == pytest.approx(float(manual), rel=1e-5)


def test_gd_with_zero_alpha_equals_hn_update(run_config):
    outs = []
    for method in ("mh-pfedhn", "mh-pfedhngd"):
        rc = mh_config(run_config, method, **{"mh-pfedhngd.kd-alpha": 0.0})
        client = client_runtime(rc)
        procedure = (MHPFEDHNGD_METHOD if method == "mh-pfedhngd" else MHPFEDHN_METHOD).build_client(
            RunConfig.from_dict(rc)
        )
        theta = (torch.randn(K_C10["lenet"], generator=torch.Generator().manual_seed(1)) * 0.05).numpy()
        if method == "mh-pfedhngd":
            procedure.train_global(client, {"w_g": theta.copy()}, train_config(rc))
        cfg = train_config(rc, **{"kd-alpha": 0.0, "kd-temperature": 20.0})
        outs.append(procedure.train(client, {"theta": theta}, cfg)[0]["delta_theta"])
    assert np.array_equal(outs[0], outs[1])


def test_gd_teacher_is_this_rounds_untrained_global_model(run_config):
    rc = mh_config(run_config, "mh-pfedhngd")
    client = client_runtime(rc)
    procedure = MHPFEDHNGD_METHOD.build_client(RunConfig.from_dict(rc))
    w_g = (torch.randn(K_C10["lenet"]) * 0.05).numpy()
    arrays, metrics = procedure.train_global(client, {"w_g": w_g.copy()}, train_config(rc, 3))
    assert arrays["delta_w_g"].shape == w_g.shape and np.abs(arrays["delta_w_g"]).sum() > 0
    assert np.array_equal(client.context.state.array_records[TEACHER_STATE]["w_g"].numpy(), w_g)
    assert procedure.supervised_loss(client, train_config(rc, 3, **{"kd-alpha": 0.5, "kd-temperature": 4.0}))
    # a teacher cached in another round is not used
    assert procedure.supervised_loss(client, train_config(rc, 4, **{"kd-alpha": 0.5, "kd-temperature": 4.0})) is None


# 10: GD's global step: data-weighted, one Adam step touching trunk, head(tau_g) and v_g only
def test_gd_global_step_is_data_weighted_and_local(run_config):
    rc = mh_config(
        run_config,
        "mh-pfedhngd",
        model_group="mh-zoo",
        aggregation="mean",
        **{"num-clients": 3, "num-server-rounds": 1},
    )
    strategy, grid = federation(rc)
    strategy.federation.transport.open(grid, "in-memory")
    strategy.federation.handshake()
    strategy.method.joined()
    pre_step = copy.deepcopy(strategy.method.hn)
    deltas = {}

    def capture(node, reply):
        if reply.metadata.message_type == "train.global":
            deltas[node] = (
                reply.content.array_records[PAYLOAD]["delta_w_g"].numpy(),
                reply.content.metric_records["metrics"]["num-examples"],
            )
        return reply

    grid.tamper = capture
    strategy.method.personal_phase = lambda r, n, c: ([], {"server-hn-steps": 0}, 0.0)  # the global phase only
    strategy.train_round(1)
    before, after = snapshot(pre_step), snapshot(strategy.method.hn)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    tau_g = strategy.method.hn.tau(strategy.method.hn.sizes["global"])
    assert changed == {
        k for k in before if k.startswith("trunk.") or k.startswith(f"heads.{tau_g}.") or k == "embeddings.global"
    }
    assert len(deltas) == 3
    # the same single step from the data-weighted mean delta, replayed on the pre-step HN
    sizes = np.array([n for _, n in deltas.values()], dtype=np.float64)
    weights = sizes / sizes.sum()
    assert abs(weights.sum() - 1) < 1e-12
    mean = sum(w * d.astype(np.float64) for w, (d, _) in zip(weights, deltas.values()))
    hn_step(
        pre_step,
        torch.optim.Adam(pre_step.parameters(), lr=2e-4),
        "global",
        torch.from_numpy(mean.astype(np.float32)),
        50.0,
    )
    assert all(torch.allclose(v, after[k], atol=1e-7) for k, v in snapshot(pre_step).items())


# 11: a failed reply gives no step and no crash
def test_failed_reply_gives_no_step(run_config):
    def fail(node, reply):
        if node == 1001 and reply.metadata.message_type == "train":  # a delta of the wrong length
            reply.content[PAYLOAD] = array_record({"delta_theta": np.zeros(5, np.float32)})
        return reply

    rc = mh_config(run_config, **{"num-clients": 3, "num-server-rounds": 1})
    strategy, grid = federation(rc, fail)
    strategy.start(grid)
    assert strategy.rows[0]["server_hn_steps"] == 2 and strategy.counters.dropped["train"] == 1
    assert strategy.rows[0]["accuracy_mean"] is not None


# 13: degenerate clients train and reply
def test_single_class_and_tiny_clients(run_config):
    rc = mh_config(run_config, "mh-pfedhngd")
    client = client_runtime(rc)
    data = client.data
    keep = torch.nonzero(data.train_y == data.train_y[0]).flatten()[:10]
    client.__dict__["data"] = dataclasses.replace(
        data, train_x=data.train_x[keep], train_y=data.train_y[keep], test_x=data.test_x[:0], test_y=data.test_y[:0]
    )
    procedure = MHPFEDHNGD_METHOD.build_client(RunConfig.from_dict(rc))
    theta = (torch.randn(K_C10["lenet"]) * 0.05).numpy()
    procedure.train_global(client, {"w_g": theta.copy()}, train_config(rc))
    arrays, metrics = procedure.train(
        client, {"theta": theta}, train_config(rc, **{"kd-alpha": 0.1, "kd-temperature": 20.0})
    )
    assert arrays["delta_theta"].shape == theta.shape and metrics["num-examples"] == 10
    _, ev = procedure.evaluate(client, {"theta": theta}, {})
    assert ev["num-examples"] == 0 and ev["test-acc"] == 0


# 15: determinism
def test_same_seed_same_weights_and_metrics(run_config):
    rc = mh_config(run_config, **{"num-clients": 2, "num-server-rounds": 2})
    runs = []
    for _ in range(2):
        strategy, grid = federation(rc)
        strategy.start(grid)
        first = [
            m.content.array_records[PAYLOAD]["theta"].numpy() for m in grid.sent if m.metadata.message_type == "train"
        ][:2]
        runs.append((first, [r["accuracy_per_client"] for r in strategy.rows], strategy.rows[-1]["train_loss"]))
    assert all(np.array_equal(a, b) for a, b in zip(runs[0][0], runs[1][0]))
    assert runs[0][1:] == runs[1][1:]


# 14 (scaled down): the generated models learn. At Adam lr 2e-4 the hypernetwork needs hundreds of
# client steps before its models beat a 2-class chance level (a 30-round check is a
# benchmark, see docs/methods/mh-pfedhn.md); here a larger server lr shows the trend within the test budget.
def test_generated_models_learn(run_config):
    rc = mh_config(
        run_config,
        **{
            "num-clients": 3,
            "num-server-rounds": 8,
            "max-examples-per-client": 400,
            "local-epochs": 2,
            "mh-pfedhn.hidden-dim": 32,
            "mh-pfedhn.server-lr": 0.003,
        },
    )
    strategy, grid = federation(rc)
    strategy.start(grid)
    rows = strategy.rows
    assert rows[-1]["accuracy_weighted"] > rows[0]["accuracy_weighted"] + 0.05
    assert rows[-1]["train_loss"] < rows[0]["train_loss"] - 0.05
