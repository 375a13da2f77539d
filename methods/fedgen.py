"""FedGen: a server generator of representations from labels, the heads averaged (HtFLlib's heterogeneous FedGen).

Zhu, Hong, Zhou, "Data-Free Knowledge Distillation for Heterogeneous Federated Learning", ICML 2021; as HtFLlib
e959261 (``servergen.py``, ``clientgen.py``) adapts it to heterogeneous models; docs/methods/fedgen.md (section
numbers below refer to it).

Payload (§2), C classes, K the heads' input size, P_G the generator's parameters:
- down (train): the global head ``head.weight`` [C, K], ``head.bias`` [C] float32, the generator's parameters
  ``generator.*`` (P_G floats), ``label_counts`` int64 [C], the per-class training counts the last round's
  clients reported (zero before any): 4·C·(K + 1) + 4·P_G + 8·C bytes.
- up (train): the trained head (4·C·(K + 1) bytes) and ``class_counts`` int64 [C], the client's per-class
  training counts (8·C bytes).
- evaluate: nothing, unless ``fedgen.eval-global-head`` sends the averaged head (as LG-FedAvg).

Generator G (HtFLlib's ``Generator``): ``Linear(d_ε + C, H)`` -> ``BatchNorm1d(H)`` -> ReLU -> ``Linear(H, K)`` on
[ε, one_hot(y)], ε ~ Uniform[0, 1)^{d_ε}; P_G = (d_ε + C + 1)·H + 2·H + (H + 1)·K. It runs in train mode on both
sides (BatchNorm over the generated batch), so its running statistics never travel.

Client step (§3, HtFLlib's ``clientGen.train``): overwrite the head with the global one, then train the whole
model with, per batch of B, CE(h(φ(x)), y) + CE(h(ẑ), ŷ), ŷ_1..ŷ_B drawn from ``label_counts`` (by frequency),
ẑ = G(ŷ, ε): the second term trains the head alone. No second term while ``label_counts`` is all zero (round 1;
HtFLlib's server reads every client's counts before its first round). Upload the head and the counts.

Server step (§4): the head is the run's ``aggregation`` of the uploaded heads (``mean``: the n_k-weighted
average, HtFLlib's); with ``fedgen.generator = "trained"`` G then takes ``server-epochs`` Adam steps (a fresh
Adam each round, HtFLlib's) of CE(Σ_k w_k·h_k(G(ŷ)), ŷ) on ``batch-size`` labels drawn by frequency. The heads
being linear, Σ_k w_k·h_k(z) = h̄(z) with h̄ the n_k-weighted average head, so G trains on the aggregated
head (exactly HtFLlib's ensemble under ``mean``; bounded by the robust rule otherwise). ``"initial"`` leaves G
at its initialisation, as HtFLlib e959261 does (its trained generator is never stored, §4).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from common.config import ConfigError, RunConfig
from common.datasets import DATASETS
from common.dp import dp_options
from common.options import option
from common.payload import ArraySpec, ClientReply, PayloadError, PayloadSchema, Schemas
from common.protocol import SERVER_ROUND, Arrays, Reply
from common.runtime import ClientRuntime
from common.training import train_personal_model
from engine.contract import Method, MethodContext
from methods.blocks.heads import GLOBAL_HEAD_METRICS, add_global_head_accuracy, require_linear_heads, shared_head
from methods.blocks.shared_model import (
    SharedModelClient,
    SharedModelServer,
    load_arrays,
    module_arrays,
    shared_schemas,
)

_GENERATED_RNG = 13  # ``purpose`` of the client's generated labels and noise (independent of training's)
#: ``fedgen.generator`` values: G trained by the server each round, or left at its initialisation
GENERATOR_MODES = ("trained", "initial")
#: the payload prefix of the generator's parameters
GENERATOR = "generator."


@dataclass(frozen=True)
class FedGenOptions:
    """``[tool.flwr.app.config.fedgen]`` (HtFLlib's script ``total.sh`` for the generator; §9, §11)."""

    generator: str = option(
        "trained",
        "trained: the server trains G every round and sends it (the paper); initial: G stays at its "
        "initialisation (HtFLlib e959261, whose trained generator is never stored)",
        choices=GENERATOR_MODES,
    )
    noise_dim: int = option(32, "size d_ε of the generator's uniform noise (HtFLlib's script -nd)", low=1)
    hidden_dim: int = option(512, "hidden size H of the generator (HtFLlib's script -hd)", low=1)
    generator_lr: float = option(
        0.005,
        "Adam step size of the server on the generator (HtFLlib main.py default; its script: 0.1, unstable)",
        low=0,
    )
    server_epochs: int = option(100, "Adam steps on the generator per round (HtFLlib's script -se)", low=0)
    eval_global_head: bool = option(
        False, "also report accuracy with the current global head (HtFLlib's metric: every client, after the broadcast)"
    )

    def check(self, cfg: RunConfig) -> None:
        """Raises ConfigError: the model group has a non-linear head, or ``dp.epsilon`` > 0: the per-class
        counts and the head trained on generated representations have no DP release here."""
        require_linear_heads(cfg, "head")
        if dp_options(cfg).enabled:
            raise ConfigError(
                f"run config key 'dp.epsilon' > 0 with method '{cfg.method}': its upload carries the client's exact "
                "per-class training counts, which no DP mechanism here releases; set 'dp.epsilon' = 0"
            )


class RepresentationGenerator(nn.Module):
    """G(y, ε) = Linear(H, K)(ReLU(BN(Linear(d_ε + C, H)([ε, one_hot(y)])))) (HtFLlib's ``Generator``, §2).

    Args:
        num_classes: C.
        noise_dim: d_ε.
        hidden_dim: H.
        out_dim: K, the heads' input size.
    """

    def __init__(self, num_classes: int, noise_dim: int, hidden_dim: int, out_dim: int) -> None:
        super().__init__()
        self.num_classes, self.noise_dim = num_classes, noise_dim
        self.hidden = nn.Sequential(
            nn.Linear(noise_dim + num_classes, hidden_dim), nn.BatchNorm1d(hidden_dim), nn.ReLU()
        )
        self.output = nn.Linear(hidden_dim, out_dim)

    def forward(self, labels: torch.Tensor, rng: torch.Generator) -> torch.Tensor:
        """Representations float32 [B, K] for ``labels`` int64 [B], ε drawn from ``rng`` (a CPU generator)."""
        noise = torch.rand(len(labels), self.noise_dim, generator=rng).to(labels.device)
        one_hot = F.one_hot(labels, self.num_classes).to(noise.dtype)
        return self.output(self.hidden(torch.cat([noise, one_hot], dim=1)))


def build_generator(cfg: RunConfig, options: FedGenOptions) -> RepresentationGenerator:
    """G for ``cfg``'s dataset and heads (K = ``cfg.representation_dim``), PyTorch's default init."""
    num_classes = DATASETS[cfg.dataset].num_classes
    return RepresentationGenerator(num_classes, options.noise_dim, options.hidden_dim, cfg.representation_dim)


def generator_arrays(generator: nn.Module) -> dict[str, np.ndarray]:
    """G's parameters as payload arrays ``generator.<name>`` (float32 copies; no BatchNorm buffer)."""
    return {GENERATOR + n: p.detach().cpu().numpy().copy() for n, p in generator.named_parameters()}


def _counts_are_counts(arrays: Mapping[str, np.ndarray], dims: Mapping[str, int]) -> None:
    """A schema check: per-class counts are non-negative. Raises PayloadError."""
    for name in ("class_counts", "label_counts"):
        if name in arrays and (np.asarray(arrays[name]) < 0).any():
            raise PayloadError(f"'{name}' has a negative count")


def schemas(cfg: RunConfig, options: FedGenOptions) -> Schemas:
    """Train: head, generator parameters and ``label_counts`` down; head and ``class_counts`` up (§2)."""
    base = shared_schemas(shared_head, evaluate_payload=options.eval_global_head)(cfg, options)
    head = base["train"][0].arrays
    with torch.device("meta"):
        generator = build_generator(cfg, options)
    params = {GENERATOR + n: ArraySpec(tuple(p.shape), "float32") for n, p in generator.named_parameters()}
    counts = ArraySpec(("C",), "int64")
    down = PayloadSchema({**head, **params, "label_counts": counts}, check=_counts_are_counts)
    up = PayloadSchema({**head, "class_counts": counts}, check=_counts_are_counts)
    return {**base, "train": (down, up)}


def draw_labels(counts: torch.Tensor, size: int, rng: torch.Generator) -> torch.Tensor:
    """``size`` labels int64 drawn with replacement in proportion to ``counts`` [C] (HtFLlib draws from its list of
    every client's labels, ``qualified_labels``: the same distribution). ``counts`` must have a positive sum."""
    return torch.multinomial(counts.double(), size, replacement=True, generator=rng)


def train_generator(
    generator: RepresentationGenerator,
    head: nn.Linear,
    counts: torch.Tensor,
    steps: int,
    batch_size: int,
    lr: float,
    rng: torch.Generator,
) -> float:
    """``steps`` Adam steps (a fresh Adam of step size ``lr``, betas (0.9, 0.999)) on G of CE(h̄(G(ŷ)), ŷ), ŷ
    ``batch_size`` labels drawn by ``counts`` from ``rng`` (§4; HtFLlib's ``FedGen.train_generator`` with the
    ensemble of linear heads Σ_k w_k·h_k = h̄). G in train mode; ``head`` is not updated.

    Returns:
        The last step's loss (nan when ``steps`` is 0).
    """
    optimizer = torch.optim.Adam(generator.parameters(), lr=lr, betas=(0.9, 0.999))
    generator.train()
    weight, bias = head.weight.detach(), head.bias.detach()
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        labels = draw_labels(counts, batch_size, rng)
        loss = F.cross_entropy(F.linear(generator(labels, rng), weight, bias), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return float(loss.detach())


class FedGenServer(SharedModelServer):
    """The global head (FedAvg under run config ``aggregation``), the generator and the label counts."""

    checkpointed = ("shared", "generator", "label_counts", "generator_rng")
    #: the upload carries per-class counts beside the head: client-level DP (which clips models) does not cover it
    client_dp_releases = 0

    build_shared = staticmethod(shared_head)

    def __init__(self, ctx: MethodContext) -> None:
        super().__init__(ctx)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.cfg.seed + 1)  # a draw of its own, not a copy of the head's stream
            self.generator = build_generator(self.cfg, self.options)
        self.generator_rng = torch.Generator().manual_seed(self.cfg.seed)  # the generator's labels and noise
        self.label_counts: dict[str, np.ndarray] = {"label_counts": np.zeros(self.dims["C"], np.int64)}

    def evaluates_after_training(self) -> bool:
        """Not with ``eval-global-head``: the secondary metric needs the head *after* this round's average."""
        return not self.options.eval_global_head

    def global_arrays(self) -> dict[str, np.ndarray]:
        """The head, G's parameters and ``label_counts`` (§2)."""
        return {**module_arrays(self.shared), **generator_arrays(self.generator), **self.label_counts}

    def configure_evaluate(self, node_id: int, server_round: int) -> dict[str, np.ndarray]:
        """The head with ``eval-global-head``, else nothing."""
        return module_arrays(self.shared) if self.options.eval_global_head else {}

    def aggregate_train(self, server_round: int, replies: list[ClientReply]) -> dict[str, float]:
        """The head: the run's ``aggregation`` of the uploaded heads; ``label_counts``: the sum of the replies'
        counts, each scaled down to at most its ``num-examples`` (a client cannot claim more labels than it
        trained on); then, with ``generator = "trained"``, :func:`train_generator` on the new head (§4).
        Row metrics: ``server-num-averaged``, the aggregator's, and ``server-generator-loss``."""
        averaged, metrics = self.aggregate(module_arrays(self.shared), replies, server_round)
        if averaged is not None:
            load_arrays(self.shared, averaged)
        total = np.zeros(self.dims["C"], np.float64)
        for r in replies:
            counts = r.arrays["class_counts"].astype(np.float64)
            total += counts * min(1.0, float(r.metrics.get("num-examples", 0)) / max(counts.sum(), 1.0))
        if replies and total.sum() > 0:
            self.label_counts["label_counts"] = np.rint(total).astype(np.int64)
        metrics = {"server-num-averaged": len(replies), **metrics}
        counts = torch.from_numpy(self.label_counts["label_counts"])
        if self.options.generator == "trained" and averaged is not None and counts.sum() > 0:
            metrics["server-generator-loss"] = train_generator(
                self.generator,
                self.shared["head"],
                counts,
                self.options.server_epochs,
                self.cfg.batch_size,
                self.options.generator_lr,
                self.generator_rng,
            )
        return metrics


class FedGenClient(SharedModelClient):
    """FedGen client: global head in, whole model trained with the generated term, head and counts out."""

    build_shared = staticmethod(shared_head)

    def train(self, client: ClientRuntime, payload: Arrays, config: dict[str, Any]) -> Reply:
        """Returns the trained head's tensors, ``class_counts`` int64 [C] and the training metrics."""
        head = nn.ModuleDict({"head": client.model.head})
        load_arrays(head, {k: v for k, v in payload.items() if k.startswith("head.")})
        counts = torch.from_numpy(np.asarray(payload["label_counts"]))
        supervised_loss = None
        if counts.sum() > 0:
            with torch.device("meta"):
                generator = build_generator(self.cfg, self.options)
            generator = generator.to_empty(device=client.device)
            received = {k[len(GENERATOR) :]: torch.from_numpy(v) for k, v in payload.items() if k.startswith(GENERATOR)}
            # every parameter comes from the payload (its schema names them all); only BatchNorm's buffers stay
            missing = set(generator.load_state_dict(received, strict=False).missing_keys)
            assert not missing & {n for n, _ in generator.named_parameters()}, missing
            for bn in generator.modules():
                if isinstance(bn, nn.BatchNorm1d):
                    bn.reset_running_stats()
            generator.train().requires_grad_(False)
            rng = client.generator(int(config[SERVER_ROUND]), _GENERATED_RNG)
            size = int(config["batch-size"])
            model = client.model

            def supervised_loss(x, features, logits, y):
                labels = draw_labels(counts, size, rng).to(y.device)
                return F.cross_entropy(logits, y) + F.cross_entropy(model.head(generator(labels, rng)), labels)

        stats = train_personal_model(client, config, supervised_loss=supervised_loss)
        return {**module_arrays(head), "class_counts": self.class_counts(client, config)}, stats

    def class_counts(self, client: ClientRuntime, config: dict[str, Any]) -> np.ndarray:
        """int64 [C]: the labels of the examples training visits. With ``batch-order = "fixed"`` the first
        ⌊n/B⌋·B in partition order (HtFLlib counts over its drop-last loader), else all n."""
        labels = client.data.train_y
        if config["batch-order"] == "fixed":
            size = int(config["batch-size"])
            labels = labels[: len(labels) // size * size]
        return np.bincount(labels.numpy(), minlength=DATASETS[self.cfg.dataset].num_classes).astype(np.int64)

    def evaluate(self, client: ClientRuntime, payload: Arrays, config: dict[str, Any]) -> Reply:
        """Personal model accuracy; with the global head in the payload also ``test-acc-global-head``."""
        return add_global_head_accuracy(super().evaluate(client, payload, config), client, payload)


METHOD = Method("fedgen", FedGenServer, FedGenClient, schemas, FedGenOptions, metrics=GLOBAL_HEAD_METRICS)
