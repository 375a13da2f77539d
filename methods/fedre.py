"""FedRE: one entangled representation per client trains the global classifier.

"FedRE: A Representation Entanglement Framework for Model-Heterogeneous Federated
Learning", CVPR 2026; docs/methods/fedre.md (section numbers below refer to it).

Payload (section 2):
- down (train and evaluate): the global head ``head.weight`` [C, d], ``head.bias`` [C],
  float32: 4*C*(d+1) bytes per client (20,520 B for CIFAR-10, d=512).
- up (train): ``z`` [1, d] (the entangled representation) and ``y`` [1, C] (its entangled
  soft label: non-negative, sums to 1, non-zero on the client's present classes only),
  float32: 4*(d+C) bytes (2,088 B for CIFAR-10). A client without training samples sends
  nothing (P8). Nothing else travels: no per-sample representation, no prototype, no count.
- up (train, ``head-source = "client-0"`` only, partition 0 only): its trained head beside (z, y),
  ``head.weight`` [C, d] and ``head.bias`` [C], float32: +4*C*(d+1) bytes (P13).

Client step (section 3): overwrite the head with the global head, train the whole model,
then in eval mode entangle the trained extractor's representations with fresh random
weights (Eq. 2 with RAP, Appendix A Eq. 12). Server step (section 4, Eq. 3): one epoch of
SGD on the soft-label cross-entropy of the head over the round's (z, y) pairs, averaged over
each server batch (revised P6: the authors' HtFLlib tree sums at lr 0.01 and overshoots, so
FedRE fell below Local here; a batch of exactly 10 uploads makes the mean at lr 0.01 equal the
PFLlib tree's summed step at lr 0.001, which produced the paper's homogeneous table: N = 10, all
clients every round; a batch of K uploads makes it a sum at lr 0.01 / K).
Run config ``aggregation``: ``mean`` is that step on the pairs as uploaded; ``norm-bound``
(default) first scales each ``z`` to at most the round's median ``z`` norm (:func:`bound_entangled`).
Why: a pair's gradient on the head is (softmax(W z + b) - y) zᵀ, linear in ‖z‖, and one step moves
the logits of any representation r by lr·(p - y)·⟨z, r⟩. A constant z of 100 (scaled by the
transport's outlier bound to 100 times the longest honest z: 183 against 1.8 in round 1 of
``bench.byzantine``'s attack at seed 0) makes one pair's step about 100 times an honest pair's, and
lr·‖z‖²/K ≈ 84 for K = 4 pairs is far beyond a stable step (about 2), so the head swings each round
along that direction; honest representations (ReLU outputs, all non-negative) share it, so every
honest sample lands on the attacker's classes (0.0 accuracy for the clients without them). With
‖z‖ at most the median, a pair's gradient on W is at most √2 times the median z's length, and its
soft label, a point of the simplex (section 4's check), weighs as one pair of the batch.
Evaluation (section 6): own extractor + the newest global head, sent to every client after
the server step; the client keeps that head (P11). It is sent in every train and evaluate
instruction. Of the authors' two released trees (P1), the HtFLlib tree never sends the head back,
which makes FedRE Local there; the PFLlib tree, behind Table 12, sends every client client 0's
locally trained head after the server step (``head-source = "client-0"`` below).

Option ``head-source`` (P13): ``server`` (default) is the paper's method above. ``client-0`` is the
authors' released PFLlib tree behind the paper's Table 12, whose server head *is* client 0's head
object: partition 0 is sent a ``train.head`` instruction instead of ``train`` and uploads its locally
trained head beside its pair; the server replaces its head by that upload, then runs its step on it
and broadcasts the result. When partition 0 gives no valid reply in a round (not sampled, failed,
late, or dropped by the checks), the server runs its step on its own head, as the PFLlib tree does
with client 0's untouched head. This hands one client control of the global head: not robust.
The upload passes only the transport's schema checks (float32, [C, d] and [C], finite, entries at
most :data:`common.payload.MAX_ABS`; otherwise the whole reply is dropped and logged and the round
goes on without partition 0); ``aggregation``'s bound applies to z, never to the head, and the
only other guard is the server's rollback of a state whose RMS grows beyond 100 x max(RMS before, 1)
in one round (``engine.checkpoint.broken_state``). Partition 0's reply is checked in a call of
its own, so the transport's outlier bound on z (:data:`common.payload.ROW_NORM_FACTOR`, over at least
3 uploads) does not compare its z with the other clients'; under ``norm-bound`` its z is bounded by
the round's median with all others.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from common.config import RunConfig
from common.data import batches, normalize
from common.datasets import DatasetInfo
from common.dp import dp_options
from common.errors import ConfigError
from common.metrics import count
from common.optim import SGD
from common.options import option
from common.payload import BASE_SCHEMAS, ROW_NORM_FACTOR, ArraySpec, ClientReply, PayloadError, PayloadSchema
from common.protocol import SERVER_ROUND, TRAIN_HEAD, Arrays, Reply
from common.runtime import ClientRuntime
from common.training import EVAL_BATCH, train_personal_model, trained_class_means
from engine.contract import ClientProcedure, Method, MethodContext, MethodServer
from engine.robust import BOUNDED, bound_by_median, require_aggregation
from engine.round_rows import round_metrics
from methods.blocks.heads import HEADER, header_arrays, initial_header, load_header, require_linear_heads
from methods.blocks.prototypes import MEDIAN_VOTES, ROW_AGGREGATIONS

#: how the client turns its representations into one (z, y) pair (section 3, Appendix A)
RE_MODES = ("rap", "vap", "rsp", "rar", "var", "rsr", "rap-fixed")
#: the modes that entangle class prototypes (z = Σ_c w_c p_c), the only ones with DP on
CLASS_MODES = ("rap", "rap-fixed", "vap", "rsp")
LOSS_REDUCTIONS = ("mean", "sum")
#: where the head of the server step comes from (P13): the server's own | partition 0's upload
HEAD_SOURCES = ("server", "client-0")
#: message type of partition 0's train instruction under ``head-source = "client-0"``
SOFT_LABEL_TOLERANCE = 1e-4  # |sum(y) - 1| accepted by the server (section 4)
_ENTANGLE_RNG = 7  # ``purpose`` of the client's entangling RNG (independent of training's)


def _check_soft_label(arrays: Mapping[str, np.ndarray], dims: Mapping[str, int]) -> None:
    y = arrays["y"]
    if (y < 0).any() or abs(float(y.sum(dtype=np.float64)) - 1.0) >= SOFT_LABEL_TOLERANCE:
        raise PayloadError(f"'y' must be non-negative and sum to 1, got min {y.min():.3g} sum {y.sum():.6f}")


ENTANGLED = PayloadSchema(
    {"z": ArraySpec((1, "d"), "float32", row_norm_factor=ROW_NORM_FACTOR), "y": ArraySpec((1, "C"), "float32")},
    optional=True,
    check=_check_soft_label,
)
#: partition 0's reply under ``head-source = "client-0"``: its pair and its trained head (nothing
#: without training samples, as :data:`ENTANGLED`)
ENTANGLED_AND_HEAD = PayloadSchema({**ENTANGLED.arrays, **HEADER.arrays}, optional=True, check=_check_soft_label)
SCHEMAS = {
    **BASE_SCHEMAS,
    "train": (HEADER, ENTANGLED),
    TRAIN_HEAD: (HEADER, ENTANGLED_AND_HEAD),
    "evaluate": (HEADER, PayloadSchema()),
}


@dataclass(frozen=True)
class FedREOptions:
    """``[tool.flwr.app.config.fedre]`` (sections 3, 4, 9, P6 and P13): the entangling mode, the
    head's SGD on the server (η_s, B_s, epochs, loss reduction over a server batch) and where the
    head of that step comes from."""

    re_mode: str = option(
        "rap", "entangling weights: rap (the paper) | vap, rsp, rar, var, rsr, rap-fixed (ablations)", choices=RE_MODES
    )
    server_lr: float = option(0.01, "η_s, learning rate of the head's SGD", low=0)
    server_batch_size: int = option(10, "B_s, entangled pairs per server step", low=1)
    server_epochs: int = option(1, "passes over the round's pairs", low=1)
    server_loss_reduction: str = option(
        "mean",
        "mean over a server batch (the PFLlib tree behind the paper's Table 12) | sum (the HtFLlib tree; overshoots)",
        choices=LOSS_REDUCTIONS,
    )
    head_source: str = option(
        "server",
        "head of the server step: server (the paper) | client-0 (the PFLlib tree: partition 0's trained head; "
        "one client controls the global head, not robust)",
        choices=HEAD_SOURCES,
    )

    def check(self, cfg: RunConfig) -> None:
        """Raises ConfigError: the model group has a non-linear head (FedRE exchanges a linear one),
        ``aggregation`` is not one of :data:`methods.blocks.prototypes.ROW_AGGREGATIONS`, or DP is on with a
        sample-level ``re-mode``."""
        require_linear_heads(cfg, "head")
        require_aggregation(cfg, ROW_AGGREGATIONS)
        if dp_options(cfg).enabled and self.re_mode not in CLASS_MODES:
            raise ConfigError(
                f"run config key 'fedre.re-mode' = {self.re_mode!r} with 'dp.epsilon' > 0: DP releases noisy class "
                f"means and entangles those, which only the class-level modes do ({', '.join(CLASS_MODES)})"
            )


def entangling_weights(labels: torch.Tensor, mode: str, generator: torch.Generator) -> torch.Tensor:
    """Per-sample weights α [n] float64 (non-negative, summing to 1) of one entanglement.

    With α the client uploads z = Σ_i α_i r_i and y = Σ_i α_i e_{y_i} (Appendix A, Eq. 12).
    Class-level modes give α_i = w_{y_i} / n_{y_i}, i.e. z = Σ_c w_c p_c over prototypes p_c:

    - ``rap`` (default): w_c = u_c / Σ u, u_c ~ U(0, 1) i.i.d. per present class, no
      temperature (not Dirichlet, not softmax: P12); ``rap-fixed`` the same with weights
      drawn once and reused every round (the caller passes the same RNG seed; paper Q9 "FS").
    - ``vap``: w_c = 1/m (the average prototype).
    - ``rsp``: one present class uniformly, w = e_c (a single prototype).

    Sample-level modes: ``var`` α_i = 1/n; ``rar`` α_i = u_i / Σ u with u_i ~ U(0, 1) per
    sample; ``rsr`` one sample uniformly (one raw representation with its one-hot label).

    Args:
        labels: int64 [n] class ids of the client's training samples, n >= 1.
        mode: one of :data:`RE_MODES`.
        generator: CPU RNG of this draw.
    """
    n = len(labels)
    classes, inverse, counts = torch.unique(labels, return_inverse=True, return_counts=True)
    if mode in CLASS_MODES:
        if mode == "vap":
            w = torch.full((len(classes),), 1.0 / len(classes), dtype=torch.float64)
        elif mode == "rsp":
            w = torch.zeros(len(classes), dtype=torch.float64)
            w[torch.randint(len(classes), (1,), generator=generator)] = 1.0
        else:
            u = torch.rand(len(classes), generator=generator, dtype=torch.float64)
            w = u / u.sum()
        return w[inverse] / counts[inverse].double()
    if mode == "var":
        return torch.full((n,), 1.0 / n, dtype=torch.float64)
    if mode == "rar":
        u = torch.rand(n, generator=generator, dtype=torch.float64)
        return u / u.sum()
    if mode == "rsr":
        alpha = torch.zeros(n, dtype=torch.float64)
        alpha[torch.randint(n, (1,), generator=generator)] = 1.0
        return alpha
    raise ValueError(f"unknown re-mode {mode!r}; allowed: {RE_MODES}")


@torch.no_grad()
def entangle(
    extractor: nn.Module,
    x: torch.Tensor,
    labels: torch.Tensor,
    alpha: torch.Tensor,
    info: DatasetInfo,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The entangled pair (z, y) = (Σ_i α_i r_i, Σ_i α_i e_{y_i}) (FedRE Eq. 2, Appendix A Eq. 12).

    r_i = the extractor's representation of image i in eval mode without augmentation
    (section 3); sums accumulate in float64 over every sample (no ``drop_last``, P8),
    so the result does not depend on the batch size. Samples with α_i = 0 are skipped.

    Args:
        x: uint8 images [n, C_in, H, W]; labels: int64 [n]; alpha: float64 [n] (sums to 1).

    Returns:
        ``z`` float32 [1, d] and ``y`` float32 [1, C], on the CPU.
    """
    was_training = extractor.training
    extractor.eval()
    used = torch.nonzero(alpha).flatten()
    z: torch.Tensor | None = None
    for idx in batches(len(used), EVAL_BATCH, None):
        rows = used[idx]
        reps = extractor(normalize(x[rows].to(device), info)).double()
        part = alpha[rows].to(device) @ reps
        z = part if z is None else z + part
    extractor.train(was_training)
    y = torch.zeros(info.num_classes, dtype=torch.float64).index_add_(0, labels, alpha)
    return z.float().cpu()[None], y.float()[None]


def entangle_private(
    client: ClientRuntime, mode: str, generator: torch.Generator, stats: dict[str, float]
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """FedRE's (z, y) with DP on (run config ``dp.epsilon``): z = Σ_c w_c p̃_c, y = Σ_c w_c e_c over the
    noisy class means p̃_c and the classes ``common.dp.noisy_class_means`` keeps (a class-level ``mode``:
    w drawn over those classes as :func:`entangling_weights` does), so the pair is post-processing of
    one release charged to the budget. ``(None, None)`` when no class passes its noisy-count threshold.

    Returns:
        ``z`` float32 [1, d] and ``y`` float32 [1, C] on the CPU.
    """
    means, classes = trained_class_means(client, stats)
    if len(classes) == 0:
        return None, None
    w = entangling_weights(classes, mode, generator)  # one "sample" per class: α_c = w_c
    z = (w @ means.double()).float()[None]
    y = torch.zeros(client.info.num_classes, dtype=torch.float64).index_add_(0, classes, w).float()[None]
    return z, y


def soft_label_ce(head: nn.Linear, z: torch.Tensor, y: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
    """Σ_k (or mean over k of) -Σ_c y_kc log softmax(W z_k + b)_c: FedRE Eq. 3 on z [K, d], y [K, C]."""
    loss = -(y * F.log_softmax(head(z), dim=1)).sum(dim=1)
    return loss.sum() if reduction == "sum" else loss.mean()


def train_head(
    head: nn.Linear, replies: list[ClientReply], opts: FedREOptions, generator: torch.Generator
) -> dict[str, float]:
    """The FedRE server step (Eq. 3): SGD on the head over this round's (z, y) pairs, in place.

    Pairs are ordered by partition id, then shuffled with ``generator`` every epoch and split
    into batches of ``server_batch_size``; one step of plain SGD (lr ``server_lr``, no
    momentum, no weight decay, so stateless) per batch on the ``server_loss_reduction`` of
    :func:`soft_label_ce`. Only this round's uploads are used; replies without a pair
    (clients without training samples) are skipped.

    Returns:
        ``server-num-uploads``, and when there was at least one pair ``server-loss-before`` /
        ``server-loss-after``: the mean soft-label CE over the round's pairs before and after.
    """
    replies = sorted((r for r in replies if r.arrays), key=lambda r: r.partition_id)
    if not replies:
        return {"server-num-uploads": 0}
    z = torch.from_numpy(np.concatenate([r.arrays["z"] for r in replies]))
    y = torch.from_numpy(np.concatenate([r.arrays["y"] for r in replies]))
    with torch.no_grad():
        before = float(soft_label_ce(head, z, y, "mean"))
    opt = SGD(head.parameters(), lr=opts.server_lr)
    for _ in range(opts.server_epochs):
        for idx in torch.split(torch.randperm(len(z), generator=generator), opts.server_batch_size):
            opt.zero_grad()
            soft_label_ce(head, z[idx], y[idx], opts.server_loss_reduction).backward()
            opt.step()
    with torch.no_grad():
        after = float(soft_label_ce(head, z, y, "mean"))
    return {"server-num-uploads": len(z), "server-loss-before": before, "server-loss-after": after}


def bound_entangled(replies: list[ClientReply]) -> tuple[list[ClientReply], int]:
    """``aggregation = "norm-bound"``: every ``z`` scaled to at most the median ``z`` norm of the round.

    FLAME's clipping (Nguyen et al. 2022, §4.3; :func:`engine.robust.bound_by_median`) over the
    round's uploads, one z each: with an honest majority the bound is an honest norm, so one pair's
    gradient on the head is no larger than an honest pair's (see the module docstring). ``y`` needs
    no bound (non-negative, summing to 1). With fewer than
    :data:`methods.blocks.prototypes.MEDIAN_VOTES` pairs nothing is bounded.

    Returns:
        (the replies, those with a scaled ``z`` as copies, float32; how many ``z`` were scaled).
    """
    pairs = [i for i, r in enumerate(replies) if r.arrays]
    if len(pairs) < MEDIAN_VOTES:
        return replies, 0
    bounded, scaled = bound_by_median([replies[i].arrays["z"] for i in pairs])
    out = list(replies)
    for i, z in zip(pairs, bounded):
        out[i] = replace(replies[i], arrays={**replies[i].arrays, "z": np.asarray(z, np.float32)})
    return out, scaled


class FedREServer(MethodServer):
    """FedRE server: holds the global head φ = Linear(d, C), trains it on (z, y), sends it to all.

    φ⁰ is PyTorch's default Linear init drawn from ``seed`` (section 5). The evaluated
    model uses the head after this round's server step, so evaluation is a separate
    exchange with every client carrying the head (sections 4 steps 6-7, 6).
    """

    checkpointed = ("head", "head_generator")

    def __init__(self, ctx: MethodContext) -> None:
        super().__init__(ctx)
        self.head = initial_header(self.dims["d"], self.dims["C"], self.cfg.seed)
        self.head_generator = torch.Generator().manual_seed(self.cfg.seed)

    def global_arrays(self) -> dict[str, np.ndarray]:
        """The global head (:func:`methods.blocks.heads.header_arrays`)."""
        return header_arrays(self.head)

    def configure_evaluate(self, node_id: int, server_round: int) -> dict[str, np.ndarray]:
        """The head after this round's server step: clients evaluate (and keep) it."""
        return self.global_arrays()

    def train_round(self, server_round: int) -> tuple[dict[str, Any], list[ClientReply]]:
        """Its own round (``engine.contract.OwnRound``): one train exchange and :meth:`aggregate_train`;
        under ``head-source = "client-0"`` partition 0 is sent :data:`TRAIN_HEAD` (its reply adds its
        trained head) in the same exchange, and its reply is checked against that message type's schema."""
        config = self.train_config(server_round)
        nodes = self.federation.sample()
        payloads = {n: self.configure_train(n, server_round) for n in nodes}
        if self.options.head_source == "server":
            valid = self.federation.send("train", payloads, config, server_round)
        else:
            kinds = {n: TRAIN_HEAD if self.federation.partition_of(n) == 0 else "train" for n in nodes}
            valid = self.federation.send_each(kinds, payloads, config, server_round)
        start = time.perf_counter()
        server = self.aggregate_train(server_round, valid)
        return round_metrics(valid, server, time.perf_counter() - start), valid

    def aggregate_train(self, server_round: int, replies: list[ClientReply]) -> dict[str, float]:
        """Train the head on the round's entangled pairs (:func:`train_head`), under ``norm-bound``
        with each ``z`` bounded first (:func:`bound_entangled`). Under ``head-source = "client-0"``
        the head is first replaced by partition 0's uploaded head when its reply carries one (row
        ``server_head_from_client_0``: 1, else 0)."""
        server = {}
        if self.options.head_source == "client-0":
            uploaded = [r.arrays for r in replies if r.partition_id == 0 and "head.weight" in r.arrays]
            if uploaded:
                load_header(self.head, uploaded[0])
            server["server-head-from-client-0"] = len(uploaded)
        if self.cfg.aggregation == "norm-bound":
            replies, server[BOUNDED] = bound_entangled(replies)
        return {**train_head(self.head, replies, self.options, self.head_generator), **server}


class FedREClient(ClientProcedure):
    """FedRE client: replace head, train the whole model, upload one entangled (z, y) (section 3)."""

    dp_releases = 1

    def train(self, client: ClientRuntime, payload: Arrays, config: dict[str, Any]) -> Reply:
        """Returns ``z`` float32 [1, d], ``y`` float32 [1, C] of the trained extractor (none without data)."""
        load_header(client.model.head, payload)
        stats = train_personal_model(client, config)
        data = client.data
        if client.dp is None:  # with DP on the class set is released only through the noisy release
            stats["num-classes-present"] = len(torch.unique(data.train_y))
        if len(data.train_y) == 0:
            return {}, stats
        start = time.perf_counter()
        # rap-fixed: the same seed every round gives the same weights (present classes are fixed)
        draw_round = 0 if self.options.re_mode == "rap-fixed" else int(config[SERVER_ROUND])
        generator = client.generator(draw_round, _ENTANGLE_RNG)
        if client.dp is not None:
            z, y = entangle_private(client, self.options.re_mode, generator, stats)
            return ({"z": z.numpy(), "y": y.numpy()} if z is not None else {}), stats
        alpha = entangling_weights(data.train_y, self.options.re_mode, generator)
        z, y = entangle(client.model.extractor, data.train_x, data.train_y, alpha, data.info, client.device)
        stats["train-seconds"] += time.perf_counter() - start
        return {"z": z.numpy(), "y": y.numpy()}, stats

    def train_head(self, client: ClientRuntime, payload: Arrays, config: dict[str, Any]) -> Reply:
        """:data:`TRAIN_HEAD` (``head-source = "client-0"``, sent to partition 0 only): :meth:`train`'s
        ``z``, ``y`` plus the trained head ``head.weight`` float32 [C, d], ``head.bias`` float32 [C]
        (nothing without training samples: the head is then the received one)."""
        arrays, stats = self.train(client, payload, config)
        if arrays:
            # a copy on the CPU: the model may be on a GPU, and header_arrays reads CPU tensors
            arrays.update(header_arrays(copy.deepcopy(client.model.head).cpu()))
        return arrays, stats

    def evaluate(self, client: ClientRuntime, payload: Arrays, config: dict[str, Any]) -> Reply:
        """Accuracy with the client's extractor and the received global head, which the client keeps (P11)."""
        load_header(client.model.head, payload)
        client.save_model()
        return super().evaluate(client, payload, config)


METHOD = Method(
    "fedre",
    FedREServer,
    FedREClient,
    SCHEMAS,
    FedREOptions,
    metrics={"train": {"num-classes-present": count("classes in the client's training split")}},
)
