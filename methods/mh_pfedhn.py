"""MH-pFedHN and MH-pFedHNGD: a server-side multi-head hypernetwork generates every client's weights.

"Multi-head hypernetwork for model-heterogeneous personalized federated learning" (Algorithms
1-2); docs/methods/mh-pfedhn.md (section numbers below refer to it); official code
DangDang1895/MH-pFL, extending pFedHN.

Payload (section 2), per participating client and round:
- handshake (``query``): the client reports only its parameter count K_i (``num-params``) and
  data sizes; GD clients also the public global model's K_g (``global-num-params``). The
  server never learns layer names, shapes or order, and imports no model class.
- personal phase (``train``): ``theta`` float32 [K_i] down, ``delta_theta`` = trained minus
  received, float32 [K_i] up: 8*K_i bytes (1,918,848 B for the LeNet-style CNN on CIFAR-100).
- GD global phase (``train.global``): ``w_g`` float32 [K_g] down, ``delta_w_g`` [K_g] up.
- evaluate: ``theta`` = the current h(v_i) down (counted as evaluation traffic), scalars up.
BatchNorm running statistics never travel: they stay in the client's state.

Server (section 4): trunk 64-128-128-128 (ReLU after each layer), one head per distinct chunk
count tau = ceil(K/B) of B-sized chunks, a private embedding [tau_i, 64] per client. For each
reply one Adam step on the surrogate -<h(v_i), sg(delta_theta_i)> (the official sign: the
paper's literal Algorithm 1 sign pushes weights away from the trained ones, P1), gradients
only on the trunk, the client's head and its embedding. ``sequential`` (default, the official
code): generate, send, receive and step one client at a time in a random order; ``parallel``:
send all at once, then step per reply in a random order, each regenerated at the current φ.
GD adds one data-weighted step from the global model's deltas before the personal phase; the
clients distil from that round's untrained global model (section 3, P8). Run config
``aggregation`` applies to that step's mean delta (:mod:`engine.robust`; ``mean``: the paper's);
a personal reply's influence is one Adam step whose gradient is clipped at ``server-clip-norm``,
so however large its ``delta_theta`` (within the payload's entry bound), its step is bounded.

Project choice: embeddings are keyed by partition id, not Flower node id, so a client that
reconnects under a new node id keeps its embedding.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from flwr.app import ConfigRecord
from torch import nn

from common.config import RunConfig
from common.datasets import DATASETS
from common.dp import dp_options, require_private_module
from common.metrics import count
from common.optim import Adam
from common.options import option
from common.payload import BASE_SCHEMAS, ArraySpec, ClientReply, PayloadError, PayloadSchema, array_record
from common.protocol import SERVER_ROUND, TRAIN_GLOBAL, Arrays, Reply
from common.runtime import ClientRuntime
from common.training import kd_loss, train_personal_model, train_supervised
from engine import client_dp
from engine.contract import ClientProcedure, Method, MethodContext, MethodServer
from engine.robust import RobustAggregator
from engine.round_rows import round_metrics
from methods.blocks.hypernetwork import HyperNetwork, flat_delta, hn_step, load_flat, num_params
from models.groups import MODEL_GROUPS
from models.mh import build_mh_model

log = logging.getLogger("flwr." + __name__)  # streamed with Flower's own log

SCHEDULES = ("sequential", "parallel")
#: the public architectures a GD global model may use (the client builds it; the server never does)
GLOBAL_MODELS = ("lenet", "vgg8", "mhresnet10", "mhresnet12", "mhresnet18", "mlp")
THETA = PayloadSchema({"theta": ArraySpec(("K",), "float32")})
SCHEMAS = {
    **BASE_SCHEMAS,
    "train": (THETA, PayloadSchema({"delta_theta": ArraySpec(("K",), "float32")})),
    "evaluate": (THETA, PayloadSchema()),
}
SCHEMAS_GD = {
    **SCHEMAS,
    TRAIN_GLOBAL: (
        PayloadSchema({"w_g": ArraySpec(("G",), "float32")}),
        PayloadSchema({"delta_w_g": ArraySpec(("G",), "float32")}),
    ),
}
GLOBAL_KEY = "global"
TEACHER_STATE = "global-teacher"  # client state: this round's untrained w_g, the KD teacher
GLOBAL_CLIP_RECORD = "global-model"  # dp.adaptive-clip: the global phase's clip, apart from the personal model's


@dataclass(frozen=True)
class HNOptions:
    """``[tool.flwr.app.config.mh-pfedhn]``: the hypernetwork and its server step (sections 4, 9)."""

    chunk_size: int = option(3072, "B: hypernetwork output chunk; tau = ceil(K / B) chunks, one head per tau", low=1)
    embedding_dim: int = option(64, "D_e: size of a client embedding row", low=1)
    hidden_dim: int = option(128, "H: width of the hypernetwork's trunk", low=1)
    embedding_std: float = option(0.002, "std of the Normal init of the client embeddings", low=0)
    server_lr: float = option(0.0002, "learning rate of the server's Adam", low=0)
    server_clip_norm: float = option(50.0, "gradient norm clip of a server step (<= 0: off)")
    schedule: str = option(
        "sequential",
        "sequential (official code: one client at a time) | parallel (all at once, still one step each)",
        choices=SCHEDULES,
    )


@dataclass(frozen=True)
class HNGDOptions(HNOptions):
    """``[tool.flwr.app.config.mh-pfedhngd]``: MH-pFedHN's keys plus the public global model and its KD."""

    global_model: str = option("lenet", "public global architecture", choices=GLOBAL_MODELS)
    kd_alpha: float = option(
        0.01, "weight a of the KD term: (1 - a) CE + a T^2 KL (0: the MH-pFedHNG ablation)", low=0, high=1
    )
    kd_temperature: float = option(
        20.0, "T: 20 for CIFAR-10 (code comments), 15 for CIFAR-100 (paper)", low=0, low_open=True
    )

    def check(self, cfg: RunConfig) -> None:
        """Raises ConfigError: with DP on, ``global-model`` has a layer DP-SGD cannot train (BatchNorm)."""
        if dp_options(cfg).enabled:
            info = DATASETS[cfg.dataset]
            model = build_mh_model(self.global_model, info.num_classes, info.channels, info.image_size)
            require_private_module(model, "mh-pfedhngd.global-model", self.global_model, self.global_model)


class MHpFedHNServer(MethodServer):
    """MH-pFedHN server: hypernetwork, Adam over all its parameters, sequential or parallel steps.

    Built after the handshake (section 5): one embedding per partition id, heads per tau.
    """

    checkpointed = ("hn", "optimizer")  # and the registry (server_state): key -> K in registration order
    #: the upload is a model change: client-level DP applies, each ``delta_theta`` noised alone before its step;
    #: the step shows who was sampled, so the sampling is not credited (``engine.client_dp``)
    client_dp_releases = 1
    client_dp_amplified = False

    def __init__(self, ctx: MethodContext) -> None:
        super().__init__(ctx)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.cfg.seed)
            self.hn = HyperNetwork(self.options)
        # fused: one kernel over all tensors, ~4x faster than the per-tensor loop on CPU (same maths)
        self.optimizer = Adam(self.hn.trunk.parameters(), lr=self.options.server_lr, fused=True)
        self.client_dp = client_dp.attach(self)
        #: during a generalisation phase: a copy of the hypernetwork with the held-out clients' new
        #: embeddings (and new heads), and the optimiser of only those (:meth:`begin_generalization`)
        self.phase: tuple[HyperNetwork, torch.optim.Optimizer] | None = None

    @property
    def serving(self) -> HyperNetwork:
        """The hypernetwork that generates clients' weights: the phase's copy during a generalisation phase."""
        return self.phase[0] if self.phase is not None else self.hn

    # ----------------------------------------------------------- registry
    def key(self, node_id: int) -> str:
        """The hypernetwork key of a node: its partition id."""
        return f"p{self.federation.partition_of(node_id)}"

    def joined(self) -> None:
        """Every training client's K_i registered after the handshake (embedding, head if tau is new);
        held-out clients get theirs in each generalisation phase only.

        Raises:
            RuntimeError: a client did not report a positive integer ``num-params``.
        """
        self.register_clients()
        size = sum(p.numel() for p in self.hn.parameters())
        # the heads hold ~H weights per client weight: a group of large models can outgrow the server's
        # memory (Adam keeps two moments and a gradient beside each weight), and the kernel kills it silently
        log.info(
            "Hypernetwork: %d parameters in %d heads, %.2f GiB float32 (about 4x with gradients and Adam's moments)",
            size,
            len(self.hn.heads),
            size * 4 / 2**30,
        )

    def register_clients(self) -> None:
        """Register every training client's K_i, embeddings drawn from the run's seed."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.cfg.seed + 1)
            for node in self.federation.training_nodes:
                self.register(self.key(node), self._reported(node, "num-params"))

    def admitted(self, nodes: list[int]) -> None:
        """A training client that joined after the handshake is registered as at the handshake, its
        embedding drawn from the run's seed and its partition id."""
        held = self.federation.held_out
        for node in nodes:
            if node in held:
                continue
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.cfg.seed + 1 + 7919 * (1 + self.federation.partition_of(node)))
                self.register(self.key(node), self._reported(node, "num-params"))

    def begin_generalization(self, nodes: list[int], server_round: int) -> None:
        """§4.4's protocol on a copy of the hypernetwork, the trained one frozen and untouched: every
        held-out client gets a new embedding (drawn from the run's seed and ``server_round``); one whose
        K_i no training client has (a new architecture) also gets a new head of its own. Only these are
        optimised (Adam, ``server-lr``) by :meth:`personalize`."""
        copy_ = copy.deepcopy(self.hn).requires_grad_(False)
        trained = {self.hn.sizes[self.key(n)] for n in self.federation.training_nodes if self.key(n) in self.hn.sizes}
        params: list[nn.Parameter] = []
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.cfg.seed + 3 + server_round)
            for node in nodes:
                size = self._reported(node, "num-params")
                head = None if size in trained else f"new-{self.key(node)}"
                params += copy_.register(self.key(node), size, head=head)
        self.phase = (copy_, Adam(params, lr=self.options.server_lr) if params else None)

    def end_generalization(self) -> None:
        self.phase = None

    def personalize(self, nodes: list[int], step: int, scope: str, server_round: int) -> list[ClientReply]:
        """One personalisation round: each held-out client trains from its generated weights and its
        reply steps only its embedding (and new head) on the phase's copy, in a random order."""
        config = self.personal_config(step)
        config["record"] = False
        hn, optimizer = self.phase
        payloads = {n: self.weights_for(n) for n in nodes}
        replies = {r.node_id: r for r in self.federation.send("train", payloads, config, step, scope)}
        order = np.random.default_rng([self.cfg.seed, server_round, step]).permutation(len(nodes))
        for node in [nodes[i] for i in order]:
            if node in replies:
                delta = torch.from_numpy(replies[node].arrays["delta_theta"])
                hn_step(hn, optimizer, self.key(node), delta, self.options.server_clip_norm)
        return [replies[n] for n in nodes if n in replies]

    @cached_property
    def max_params(self) -> int:
        """The largest K a client of this run can have: the largest of :meth:`client_models`,
        counted on the meta device (nothing is allocated)."""
        with torch.device("meta"):
            return max(num_params(m) for m in self.client_models())

    def client_models(self) -> list[nn.Module]:
        """One instance of every model a client of this run can hold: the model group's."""
        group, info = MODEL_GROUPS[self.cfg.model_group], self.info
        return [
            group.build(pid, info.num_classes, info.channels, info.image_size, self.cfg.seed, self.cfg.feature_dim)
            for pid in range(len(group.architectures) * len(group.heads))
        ]

    def check_reply(self, message_type: str, metrics) -> None:
        """A handshake's ``num-params`` (and GD's ``global-num-params``) must lie in [1, :attr:`max_params`]:
        the server allocates a hypernetwork head of that size (a claim of 1e8 would take ~51 GB).

        Raises:
            PayloadError: naming the metric and the bound.
        """
        if message_type != "query":
            return
        for name in ("num-params", "global-num-params"):
            value = metrics.get(name)
            if value is not None and not (isinstance(value, int) and 1 <= value <= self.max_params):
                raise PayloadError(
                    f"metric '{name}' = {value!r} is outside [1, {self.max_params}] (the largest "
                    f"model of model group '{self.cfg.model_group}')"
                )

    def server_state(self) -> dict[str, Any]:
        """``hn`` and ``optimizer``, and ``registered``: key -> K of every client (and K_g) in the order
        they were registered."""
        return {**super().server_state(), "registered": dict(self.hn.sizes)}

    def load_state(self, state: dict[str, Any]) -> None:
        """Register the clients of ``state`` not registered yet, in their order, then restore it: with
        handshake ``sampled`` a resumed run knows no client yet, and the hypernetwork's parameters and
        Adam's parameter groups must line up with the checkpoint's (the new embeddings' random draws are
        overwritten by the restore and leave the global RNG untouched)."""
        state = dict(state)
        with torch.random.fork_rng(devices=[]):
            for key, num_params in state.pop("registered", {}).items():
                self.register(key, num_params)
        super().load_state(state)

    def register(self, key: str, num_params: int) -> None:
        """Register a client (or the global model) and give its new parameters to Adam."""
        new = self.hn.register(key, num_params)
        if new:
            self.optimizer.add_param_group({"params": new})

    def _reported(self, node: int, name: str) -> int:
        value = self.federation.clients[node].get(name)
        if not isinstance(value, int) or value <= 0:
            raise RuntimeError(
                f"node {node} reported {name}={value!r} at the handshake; expected a positive "
                "integer (is the ClientApp running the same method?)"
            )
        return value

    def recording_dims(self, model: nn.Module) -> dict[str, int]:
        """``K``: the parameter count of ``model``, the client's flat weights."""
        return {**super().recording_dims(model), "K": num_params(model)}

    def reply_dims(self, node_id: int) -> dict[str, int]:
        """``K`` = the node's registered parameter count (and ``G`` = K_g for GD), once registered."""
        dims = dict(self.dims)
        hn = self.serving
        if node_id in self.federation.clients and self.key(node_id) in hn.sizes:
            dims["K"] = hn.sizes[self.key(node_id)]
        if GLOBAL_KEY in self.hn.sizes:
            dims["G"] = self.hn.sizes[GLOBAL_KEY]
        return dims

    def weights_for(self, node_id: int) -> dict[str, np.ndarray]:
        """``theta`` = h(v_i; φ) at the current φ, a detached float32 copy [K_i]."""
        with torch.no_grad():
            return {"theta": self.serving.generate(self.key(node_id)).numpy().copy()}

    def configure_evaluate(self, node_id: int, server_round: int) -> dict[str, np.ndarray]:
        """The post-round generated weights: the evaluated model (section 6)."""
        return self.weights_for(node_id)

    def personal_config(self, server_round: int) -> ConfigRecord:
        """Config of the personal phase: the training settings (GD adds its KD settings)."""
        return self.train_config(server_round)

    # --------------------------------------------------------------- round
    def train_round(self, server_round: int) -> tuple[dict[str, Any], list[ClientReply]]:
        """Its own round (``engine.contract.OwnRound``), the personal phase: |S| hypernetwork steps, one per
        valid reply (section 4)."""
        nodes = self.federation.sample()
        replies, server, seconds = self.personal_phase(server_round, nodes, self.personal_config(server_round))
        return round_metrics(replies, server, seconds), replies

    def personal_phase(
        self, server_round: int, nodes: list[int], config: ConfigRecord
    ) -> tuple[list[ClientReply], dict[str, Any], float]:
        """Send generated weights to ``nodes`` in a random order and step the HN per valid reply.

        Returns:
            (valid replies, server metrics, seconds spent generating weights and stepping the HN).
        """
        order = [nodes[i] for i in self.rng.permutation(len(nodes))]
        valid: list[ClientReply] = []
        server_seconds = 0.0

        def send(batch: list[int]) -> list[ClientReply]:
            nonlocal server_seconds
            start = time.perf_counter()
            payloads = {n: self.weights_for(n) for n in batch}
            server_seconds += time.perf_counter() - start
            return self.federation.send("train", payloads, config, server_round)

        def step(node: int, reply: ClientReply | None) -> None:
            nonlocal server_seconds
            start = time.perf_counter()
            if reply is not None:
                delta = reply.arrays["delta_theta"]
            elif self.client_dp is not None:  # sampled without a valid reply: its upload zeroed (engine.client_dp)
                delta = np.zeros(self.serving.sizes[self.key(node)], np.float32)
            else:
                return
            if self.client_dp is not None:
                delta = self.client_dp.privatize(delta)
            hn_step(self.hn, self.optimizer, self.key(node), torch.from_numpy(delta), self.options.server_clip_norm)
            server_seconds += time.perf_counter() - start

        if self.options.schedule == "sequential":
            for node in order:
                replies = send([node])
                step(node, replies[0] if replies else None)
                valid += replies
        else:
            by_node = {r.node_id: r for r in send(order)}
            for node in order:  # one step per reply, each at the current φ, in the random order
                step(node, by_node.get(node))
                if node in by_node:
                    valid.append(by_node[node])
        metrics: dict[str, Any] = {"server-hn-steps": len(valid)}
        if self.client_dp is not None:
            metrics.update(self.client_dp.plan.row(server_round))
        return valid, metrics, server_seconds


class MHpFedHNGDServer(MHpFedHNServer):
    """MH-pFedHNGD server: a global model from a global embedding, one extra data-weighted step per round.

    The global step follows the clients' mean ``delta_w_g`` under run config ``aggregation``
    (:class:`engine.robust.RobustAggregator` over the deltas, whose reference is zero; ``mean``
    is the paper's data-weighted mean), or client-level DP's noisy mean of clipped deltas with
    ``client-dp.epsilon`` > 0 (:class:`engine.client_dp.ClientDPAggregator`).

    Raises:
        ConfigError: also an ``aggregation`` the sampled clients cannot satisfy.
    """

    #: client-level DP: each sampled client's ``delta_w_g`` in the global sum and its own ``delta_theta``
    client_dp_releases = 2

    def __init__(self, ctx: MethodContext) -> None:
        super().__init__(ctx)
        self.aggregator = RobustAggregator(self.cfg)

    def client_models(self) -> list[nn.Module]:
        """The model group's models and the public global model."""
        return [*super().client_models(), self.global_model()]

    def recording_dims(self, model: nn.Module) -> dict[str, int]:
        """``K`` as MH-pFedHN's, and ``G``: the parameter count of the public global model."""
        with torch.device("meta"):
            return {**super().recording_dims(model), "G": num_params(self.global_model())}

    def global_model(self) -> nn.Module:
        """The public global model (``global-model``), freshly built."""
        info = self.info
        return build_mh_model(self.options.global_model, info.num_classes, info.channels, info.image_size)

    def register_clients(self) -> None:
        """MH-pFedHN's registration plus K_g, which every client must report alike (section 5); with
        handshake ``sampled`` no client is known yet and K_g is the server's count of the public model.

        Raises:
            RuntimeError: clients disagree on ``global-num-params``.
        """
        super().register_clients()
        sizes = {self._reported(node, "global-num-params") for node in self.federation.nodes}
        if not self.federation.nodes:
            sizes = {num_params(self.global_model())}
        if len(sizes) != 1:
            raise RuntimeError(
                f"clients report different global-num-params {sorted(sizes)}: they must share the "
                f"public global model ('{self.cfg.method}.global-model')"
            )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.cfg.seed + 2)
            self.register(GLOBAL_KEY, sizes.pop())

    def personal_config(self, server_round: int) -> ConfigRecord:
        """The training settings plus ``kd-alpha`` and ``kd-temperature`` (section 3)."""
        config = self.train_config(server_round)
        config["kd-alpha"] = self.options.kd_alpha
        config["kd-temperature"] = self.options.kd_temperature
        return config

    def personalize(self, nodes: list[int], step: int, scope: str, server_round: int) -> list[ClientReply]:
        """MH-pFedHN's personalisation round, after a global phase whose only use is the clients' teacher:
        w_g of the frozen hypernetwork is sent, and the replies' ``delta_w_g`` are not used."""
        config = self.train_config(step)
        config["record"] = False
        with torch.no_grad():
            w_g = self.serving.generate(GLOBAL_KEY).numpy().copy()
        self.federation.send(TRAIN_GLOBAL, {n: {"w_g": w_g} for n in nodes}, config, step, scope)
        return super().personalize(nodes, step, scope, server_round)

    def train_round(self, server_round: int) -> tuple[dict[str, Any], list[ClientReply]]:
        """Global phase (one HN step from the data-weighted mean delta), then the personal phase."""
        nodes = self.federation.sample()
        config = self.train_config(server_round)
        start = time.perf_counter()
        with torch.no_grad():
            w_g = self.hn.generate(GLOBAL_KEY).numpy().copy()
        seconds = time.perf_counter() - start
        replies = self.federation.send(TRAIN_GLOBAL, {n: {"w_g": w_g} for n in nodes}, config, server_round)
        start = time.perf_counter()
        server: dict[str, Any] = {"server-global-replies": len(replies)}
        zero = {"delta_w_g": np.zeros_like(w_g)}  # the deltas are changes already: their reference is zero
        mean_delta = None
        if replies:
            sizes = np.array([r.metrics.get("num-examples", 0) for r in replies], dtype=np.float64)
            weights = sizes / sizes.sum() if sizes.sum() > 0 else np.full(len(replies), 1 / len(replies))
            server["global-train-loss"] = float(np.dot(weights, [r.metrics.get("train-loss", 0.0) for r in replies]))
        if self.client_dp is not None:  # the noisy mean of clipped deltas, released even without a reply
            combined, private = self.client_dp.aggregate(zero, [r.arrays for r in replies], server_round)
            mean_delta = combined["delta_w_g"]
            server.update(private)
        elif replies and self.aggregator.rule == "mean":  # the paper's data-weighted mean, as before aggregation
            mean_delta = sum(w * r.arrays["delta_w_g"].astype(np.float64) for w, r in zip(weights, replies))
        elif replies:
            combined, robust = self.aggregator.aggregate(zero, [r.arrays for r in replies], sizes)
            mean_delta = combined["delta_w_g"] if combined is not None else np.zeros_like(w_g)
            server.update(robust)
        if mean_delta is not None:
            hn_step(
                self.hn,
                self.optimizer,
                GLOBAL_KEY,
                torch.from_numpy(mean_delta.astype(np.float32)),
                self.options.server_clip_norm,
            )
        seconds += time.perf_counter() - start
        personal, metrics, personal_seconds = self.personal_phase(
            server_round, nodes, self.personal_config(server_round)
        )
        server.update(metrics)
        server["server-hn-steps"] += int(mean_delta is not None)
        return round_metrics(personal, server, seconds + personal_seconds), personal


class MHpFedHNClient(ClientProcedure):
    """MH-pFedHN client: load generated weights, train, reply the change; BN statistics stay local."""

    def query(self, client: ClientRuntime, payload: Arrays, config: dict[str, Any]) -> Reply:
        """Handshake: data sizes and ``num-params`` K_i (the only architecture disclosure)."""
        arrays, metrics = super().query(client, payload, config)
        metrics["num-params"] = num_params(client.model)
        return arrays, metrics

    def train(self, client: ClientRuntime, payload: Arrays, config: dict[str, Any]) -> Reply:
        """Personal phase: ``delta_theta`` float32 [K_i] = trained minus received weights."""
        received = load_flat(client.model, payload["theta"], client.device)
        stats = train_personal_model(client, config, supervised_loss=self.supervised_loss(client, config))
        return {"delta_theta": flat_delta(client.model, received)}, stats

    def supervised_loss(self, client, config):
        """None: plain cross-entropy (GD distils from the global model)."""
        return None

    def evaluate(self, client: ClientRuntime, payload: Arrays, config: dict[str, Any]) -> Reply:
        """Accuracy of the received h(v_i) with the client's own BN statistics; state untouched."""
        load_flat(client.model, payload["theta"], client.device)
        return super().evaluate(client, payload, config)


class MHpFedHNGDClient(MHpFedHNClient):
    """MH-pFedHNGD client: trains the global model (global phase), then distils from it (personal phase)."""

    dp_trainings = 2  # with DP on, both phases are DP-SGD

    def global_model(self, client) -> nn.Module:
        """A fresh instance of the public global architecture (``global-model``)."""
        info = client.info
        return build_mh_model(self.options.global_model, info.num_classes, info.channels, info.image_size).to(
            client.device
        )

    def query(self, client: ClientRuntime, payload: Arrays, config: dict[str, Any]) -> Reply:
        """Also ``global-num-params`` K_g of the public global model."""
        arrays, metrics = super().query(client, payload, config)
        metrics["global-num-params"] = num_params(self.global_model(client))
        return arrays, metrics

    def train_global(self, client, payload, config):
        """Global phase: CE training of w_g (SGD, no clipping: the code); ``delta_w_g`` float32 [K_g].

        The received, untrained w_g is cached in the client's state as this round's teacher.
        """
        model = self.global_model(client)
        received = load_flat(model, payload["w_g"], client.device)
        client.context.state[TEACHER_STATE] = array_record(
            {"w_g": payload["w_g"], "round": np.array([int(config[SERVER_ROUND])], dtype=np.int64)}
        )
        client.spend_privacy(trainings=1)  # with DP on: counted, durably, before the training runs
        clip = client.dp_clip_norm(GLOBAL_CLIP_RECORD)  # dp.adaptive-clip: the global model's own clip
        stats = train_supervised(
            model,
            client.data,
            {**config, "clip-norm": 0.0},
            client.device,
            client.generator(int(config[SERVER_ROUND]), 1),
            dp=client.dp,
            dp_clip_norm=clip,
        )
        if clip is not None:
            client.keep_dp_clip_norm(stats["dp-clip-norm"], GLOBAL_CLIP_RECORD)
        return {"delta_w_g": flat_delta(model, received)}, {**stats, "num-examples": len(client.data.train_y)}

    def supervised_loss(self, client, config):
        """(1-α)·CE + α·T²·KL(teacher ‖ student) with this round's cached, untrained w_g (section 3, P2, P8).

        Plain CE when α = 0 or no teacher of this round is cached (its global reply failed).
        """
        alpha, temperature = float(config["kd-alpha"]), float(config["kd-temperature"])
        cached = client.context.state.array_records.get(TEACHER_STATE)
        if alpha == 0 or cached is None or int(cached["round"].numpy()[0]) != int(config[SERVER_ROUND]):
            return None
        teacher = self.global_model(client)
        load_flat(teacher, cached["w_g"].numpy(), client.device)
        teacher.eval()

        def loss(x: torch.Tensor, features: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                teacher_logits = teacher(x)
            return (1 - alpha) * F.cross_entropy(logits, labels) + alpha * kd_loss(logits, teacher_logits, temperature)

        return loss


#: K_i, the one fact a client discloses (bounded by the model group in ``check_reply``)
NUM_PARAMS = {"num-params": count("parameters of the client's personal model, K_i")}
METHOD = Method("mh-pfedhn", MHpFedHNServer, MHpFedHNClient, SCHEMAS, HNOptions, metrics={"query": NUM_PARAMS})
METHOD_GD = Method(
    "mh-pfedhngd",
    MHpFedHNGDServer,
    MHpFedHNGDClient,
    SCHEMAS_GD,
    HNGDOptions,
    metrics={"query": {**NUM_PARAMS, "global-num-params": count("parameters of the global model the client builds")}},
)
