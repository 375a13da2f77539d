"""FedMRL: payload, Matryoshka training, aggregation, state and the two evaluation protocols."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.optim.optimizer import register_optimizer_step_post_hook

from common.config import ConfigError, RunConfig
from common.payload import ClientReply, tensor_bytes
from common.protocol import PAYLOAD
from common.runtime import MODEL_STATE
from conftest import captured_federation, chance, client_runtime, federation, shapes_of, train_config
from engine.aggregation import fedavg
from methods.blocks.shared_model import module_arrays
from methods.fedmrl import METHOD, PROJECTOR_STATE, projector, small_model
from methods.fedmrl import METHOD as FEDMRL_METHOD
from methods.registry import build_run

SMALL_KEYS = [
    "conv1.weight",
    "conv1.bias",
    "conv2.weight",
    "conv2.bias",
    "fc1.weight",
    "fc1.bias",
    "fc2.weight",
    "fc2.bias",
    "fc3.weight",
    "fc3.bias",
]
#: shapes that only the private models (CNN-1..5 fc1, private header) and the projector have
PRIVATE_SHAPES = {(2000, 800), (2000, 400), (1000, 800), (800, 800), (500, 600), (10, 500)}


def mrl_config(run_config, **kw):
    return run_config(method="fedmrl", **kw)


# 1, 2, 3: payload schema, bytes, independence of the private architecture
def test_payload_is_exactly_the_small_model_both_ways(run_config):
    rc = mrl_config(run_config, **{"num-server-rounds": 1})
    strategy, grid, replies = captured_federation(rc)
    strategy.start(grid)
    trains = [m for m in grid.sent if m.metadata.message_type == "train"]
    expected = {
        "conv1.weight": (16, 3, 5, 5),
        "conv1.bias": (16,),
        "conv2.weight": (32, 16, 5, 5),
        "conv2.bias": (32,),
        "fc1.weight": (500, 800),
        "fc1.bias": (500,),
        "fc2.weight": (100, 500),
        "fc2.bias": (100,),
        "fc3.weight": (10, 100),
        "fc3.bias": (10,),
    }
    train_replies = [r for r in replies if r.metadata.message_type == "train"]
    assert len(trains) == len(train_replies) == 4
    for m in trains + train_replies:
        assert list(m.content.array_records) == [PAYLOAD]
        assert list(m.content.array_records[PAYLOAD]) == SMALL_KEYS and shapes_of(m) == expected
        assert all(a.dtype == "float32" for a in m.content.array_records[PAYLOAD].values())
        assert not set(shapes_of(m).values()) & PRIVATE_SHAPES
        assert tensor_bytes(m.content) == 1_862_632
    # clients 0..3 hold CNN-1..4: their replies are identical in schema
    assert strategy.rows[0]["bytes_up"] == strategy.rows[0]["bytes_down"] == 4 * 1_862_632


@pytest.mark.parametrize(
    "dataset,d1,params",
    [("cifar10", 100, 465_658), ("cifar100", 100, 474_748), ("cifar10", 200, 516_758), ("cifar10", 500, 670_058)],
)
def test_byte_formula(run_config, dataset, d1, params):
    cfg = RunConfig.from_dict(mrl_config(run_config, dataset=dataset, **{"fedmrl.d1": d1}))
    model = small_model(cfg, METHOD.read_options(cfg))
    assert sum(p.numel() for p in model.parameters()) == params
    assert list(model.state_dict()) == SMALL_KEYS


def test_schema_does_not_depend_on_the_private_model(run_config):
    schemas = [
        FEDMRL_METHOD.build_client(RunConfig.from_dict(mrl_config(run_config, model_group=g))).schemas["train"]
        for g in ("hetero-cnn5", "cnn1")
    ]
    assert schemas[0] == schemas[1]
    assert build_run(RunConfig.from_dict(mrl_config(run_config))).method.schemas["train"] == schemas[0]


def fused_model(rc, partition_id=0, seed=0):
    client = client_runtime(rc, partition_id)
    procedure = FEDMRL_METHOD.build_client(RunConfig.from_dict(rc))
    torch.manual_seed(seed)
    small = small_model(client.cfg, METHOD.read_options(client.cfg))
    return client, procedure, procedure.fused(client, small), small


# 4: forward shapes and the Matryoshka prefix
def test_forward_shapes_and_prefix(run_config):
    client, _, model, small = fused_model(mrl_config(run_config))
    x = torch.randn(6, 3, 32, 32)
    assert small.extractor(x).shape == (6, 100) and client.model.extractor(x).shape == (6, 500)
    assert model.extractor.projector.weight.shape == (500, 600)
    seen = []
    model.global_head.register_forward_hook(lambda m, inp, out: seen.append(inp[0]))
    z = model.extractor(x)
    assert z.shape == (6, 500) and (z < 0).any()  # the projector output has no activation
    model.mix_small(x)
    assert torch.equal(seen[0], z[:, :100])


def matryoshka_terms(model, small, private, x, y):
    """An independent recomputation of CE(G^hd(z[:, :d1]), y) and CE(F^hd(z), y)."""
    r = torch.cat([small.extractor(x), private.extractor(x)], 1)
    z = model.extractor.projector(r)
    return F.cross_entropy(small.fc3(z[:, : small.feature_dim]), y), F.cross_entropy(private.head(z), y)


# 5, 6, 12: the training loss, gradient flow, step count
def test_training_loss_gradients_and_step_count(run_config, monkeypatch):
    rc = mrl_config(
        run_config,
        **{"max-examples-per-client": 500, "batch-size": 512, "local-epochs": 10, "weight-decay": 0.0, "momentum": 0.0},
    )
    client, procedure, _, small = fused_model(rc)
    assert len(client.data.train_y) == 400
    seen_losses, steps = [], []

    import common.training as training

    original = training.train_supervised

    def spy(model, data, config, device, generator, regularizer=None, supervised_loss=None, *rest):
        def recorded(x, z, logits, y):
            loss = supervised_loss(x, z, logits, y)
            if not seen_losses:  # first batch, before any step: recompute independently
                g_term, f_term = matryoshka_terms(model, model.extractor.small, client.model, x, y)
                seen_losses.append((float(loss.detach()), float((g_term + f_term).detach())))
                model.zero_grad()
                (g_term + f_term).backward(retain_graph=True)
                groups = {"theta": model.extractor.small, "omega": client.model, "phi": model.extractor.projector}
                for name, module in groups.items():
                    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in module.parameters()), name
                model.zero_grad()
            return loss

        return original(model, data, config, device, generator, regularizer, recorded, *rest)

    monkeypatch.setattr(training, "train_supervised", spy)
    handle = register_optimizer_step_post_hook(lambda opt, a, k: steps.append(1))
    try:
        procedure.train(client, module_arrays(small), train_config(rc))
    finally:
        handle.remove()
    assert seen_losses[0][0] == pytest.approx(seen_losses[0][1], abs=1e-6)
    assert len(steps) == 10  # B=512 > n=400, E=10, drop_last=False


@pytest.mark.parametrize("zero,head", [("weight-global", "global"), ("weight-private", "private")])
def test_zero_weight_gives_zero_header_gradient(run_config, zero, head):
    rc = mrl_config(run_config, **{f"fedmrl.{zero}": 0.0})
    client, procedure, model, small = fused_model(rc)
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    g_term, f_term = matryoshka_terms(model, small, client.model, x, y)
    opts = procedure.options
    (opts.weight_global * g_term + opts.weight_private * f_term).backward()
    module = small.fc3 if head == "global" else client.model.head
    other = client.model.head if head == "global" else small.fc3
    assert all(p.grad is not None and p.grad.abs().sum() == 0 for p in module.parameters())
    assert all(p.grad.abs().sum() > 0 for p in other.parameters())


# 7: aggregation
def test_fedavg_weights_by_training_samples():
    def reply(value, n):
        return ClientReply(1, 0, {"w": np.full((2, 3), value, np.float32)}, {"num-examples": n})

    assert np.allclose(fedavg([reply(0, 1), reply(1, 3)], ["w"])["w"], 0.75)
    single = reply(0.3, 5)
    assert np.array_equal(fedavg([single], ["w"])["w"], single.arrays["w"])
    assert np.array_equal(fedavg([reply(0.3, 2), reply(0.3, 7)], ["w"])["w"], single.arrays["w"])


# 8, 9, 10: persistence of ω and φ, θ reset, non-participants untouched
def test_state_persists_theta_is_replaced_and_idle_clients_untouched(run_config):
    rc = mrl_config(run_config, **{"num-clients": 4, "fraction-train": 0.5, "num-server-rounds": 1})
    strategy, grid = federation(rc)
    strategy.start(grid)
    sampled = {strategy.federation.roster.clients[n]["partition-id"] for n in strategy.federation.roster.sampled}
    cfg = RunConfig.from_dict(rc)
    procedure = FEDMRL_METHOD.build_client(cfg)
    for ctx in grid.contexts.values():
        pid = ctx.node_config["partition-id"]
        if pid not in sampled:  # never trained: nothing stored, so the initial ω and φ
            assert set(ctx.state.array_records) == set()
            continue
        assert set(ctx.state.array_records) == {MODEL_STATE, PROJECTOR_STATE}  # θ is not kept
        saved = ctx.state.array_records[PROJECTOR_STATE].to_torch_state_dict()
        client = client_runtime(rc, pid)
        client.context.state = ctx.state
        fused = procedure.fused(client, small_model(cfg, METHOD.read_options(cfg)))
        initial = procedure.fused(client_runtime(rc, pid), small_model(cfg, METHOD.read_options(cfg)))
        for key, value in fused.extractor.projector.state_dict().items():
            assert torch.equal(value, saved[key])  # restored bit for bit (the HtFLlib bug fails here)
            assert not torch.equal(value, initial.extractor.projector.state_dict()[key])
        private = ctx.state.array_records[MODEL_STATE].to_torch_state_dict()
        assert all(torch.equal(v, private[k]) for k, v in client.model.state_dict().items())
    payload = {k: v + 1 for k, v in module_arrays(strategy.method.shared).items()}
    received = procedure.received(client_runtime(rc, 0), payload)
    assert all(np.array_equal(v, payload[k]) for k, v in module_arrays(received).items())


def test_htflib_projector_is_never_kept_when_asked(run_config):
    """``fedmrl.keep-projector = false`` (HtFLlib's clientmrl.py never saves ``proj``): a trained client
    stores its private model only, so every round starts from, and evaluates with, the initial projector."""
    rc = mrl_config(run_config, **{"num-clients": 2, "num-server-rounds": 1, "fedmrl.keep-projector": False})
    strategy, grid = federation(rc)
    strategy.start(grid)
    cfg = RunConfig.from_dict(rc)
    procedure = FEDMRL_METHOD.build_client(cfg)
    for ctx in grid.contexts.values():
        assert set(ctx.state.array_records) == {MODEL_STATE}
        client = client_runtime(rc, ctx.node_config["partition-id"])
        client.context.state = ctx.state
        fused = procedure.fused(client, small_model(cfg, METHOD.read_options(cfg)))
        initial = projector(cfg, METHOD.read_options(cfg).d1)
        assert all(torch.equal(v, initial.state_dict()[k]) for k, v in fused.extractor.projector.state_dict().items())
    assert strategy.rows[0]["num_clients"] == 2


# 14: what each inference path depends on
def test_inference_dependencies(run_config):
    _, _, model, small = fused_model(mrl_config(run_config))
    model.eval()
    x = torch.randn(16, 3, 32, 32)
    with torch.no_grad():
        large, mix_small = model(x), model.mix_small(x)
        small.fc3.weight.add_(torch.randn_like(small.fc3.weight))
        assert torch.equal(model(x), large)
        assert not torch.allclose(model.mix_small(x), mix_small)
        small.fc1.weight.add_(0.1 * torch.randn_like(small.fc1.weight))
        assert not torch.allclose(model(x), large)


# 15 and the protocols: smoke run, degenerate clients
def test_protocol_a_learns_and_evaluates_only_sampled_clients(run_config):
    rc = mrl_config(
        run_config,
        **{"num-server-rounds": 5, "eval-clients": "trained", "local-epochs": 2, "max-examples-per-client": 400},
    )
    strategy, grid = federation(rc)
    strategy.start(grid)
    rows = strategy.rows
    assert all(len(r["accuracy_per_client"]) == 4 for r in rows)
    assert rows[-1]["accuracy_mean"] > 0.5 and rows[-1]["accuracy_mean"] > chance(rc, 4) + 0.05
    assert rows[-1]["train_loss"] < rows[0]["train_loss"]
    assert "accuracy_mean_mix_small" in rows[-1]
    assert not [m for m in grid.sent if m.metadata.message_type == "evaluate"]
    half = mrl_config(run_config, **{"num-server-rounds": 1, "eval-clients": "trained", "fraction-train": 0.5})
    strategy, grid = federation(half)
    strategy.start(grid)
    assert len(strategy.rows[0]["accuracy_per_client"]) == 2


def test_protocol_b_evaluates_everyone_with_the_aggregated_model(run_config):
    rc = mrl_config(run_config, **{"num-server-rounds": 1, "fraction-train": 0.5, "fedmrl.eval-protocol": "deployment"})
    strategy, grid = federation(rc)
    strategy.start(grid)
    evaluates = [m for m in grid.sent if m.metadata.message_type == "evaluate"]
    assert len(evaluates) == 4 and len(strategy.rows[0]["accuracy_per_client"]) == 4
    theta = module_arrays(strategy.method.shared)
    for m in evaluates:
        assert all(np.array_equal(v.numpy(), theta[k]) for k, v in m.content.array_records[PAYLOAD].items())


def test_single_class_client_sends_the_full_model_and_empty_test_is_safe(run_config):
    import dataclasses

    rc = mrl_config(run_config)
    client, procedure, _, small = fused_model(rc)
    data = client.data
    keep = data.train_y == data.train_y[0]
    client.__dict__["data"] = dataclasses.replace(
        data, train_x=data.train_x[keep], train_y=data.train_y[keep], test_x=data.test_x[:0], test_y=data.test_y[:0]
    )
    arrays, stats = procedure.train(client, module_arrays(small), train_config(rc))
    assert list(arrays) == SMALL_KEYS and stats["num-examples"] == int(keep.sum())
    _, metrics = procedure.evaluate(client, {}, {})
    assert metrics["num-examples"] == 0 and metrics["test-acc"] == 0.0


def test_bad_options_fail_fast(run_config):
    for key, value in (("fedmrl.d1", 501), ("fedmrl.eval-protocol", "both"), ("fedmrl.small-model", "vgg")):
        with pytest.raises(ConfigError, match=key):
            build_run(RunConfig.from_dict(mrl_config(run_config, **{key: value})))
    with pytest.raises(ConfigError, match="eval-clients"):
        RunConfig.from_dict(mrl_config(run_config, **{"eval-clients": "some"}))


def test_group_first_small_model_is_client_zeros_architecture_pooled_to_d1(run_config):
    """``fedmrl.small-model = "group-first"`` (HtFLlib's small model, P4): G is client 0's architecture
    of the model group with its representation pooled to d1 and a d1 -> L header; one round trains
    and sends exactly its tensors. A group that fixes its representation size needs d1 equal to it."""
    from models.groups import MODEL_GROUPS

    rc = mrl_config(run_config, model_group="htcnn8", **{"num-server-rounds": 1, "fedmrl.small-model": "group-first"})
    cfg = RunConfig.from_dict(rc)
    small = small_model(cfg, METHOD.read_options(cfg))
    client0 = MODEL_GROUPS["htcnn8"].build(0, 10, 3, 32, rc["seed"], k=100, identical=True)
    expected = {k: tuple(v.shape) for k, v in client0.state_dict().items()}
    assert {k: tuple(v.shape) for k, v in small.state_dict().items()} == expected
    assert small.extractor(torch.zeros(2, 3, 32, 32)).shape == (2, 100) and expected["head.weight"] == (10, 100)
    strategy, grid, replies = captured_federation(rc)
    strategy.start(grid)
    trains = [m for m in [*grid.sent, *replies] if m.metadata.message_type == "train"]
    assert len(trains) == 8 and all(shapes_of(m) == expected for m in trains)
    assert not strategy.counters.dropped
    with pytest.raises(ConfigError, match="fedmrl.small-model"):
        build_run(RunConfig.from_dict({**rc, "model-group": "cnn1"}))
