"""FedKD: adaptive mutual distillation with an SVD-compressed shared mentee.

Wu et al., "Communication-efficient federated learning via knowledge distillation", Nature
Communications 2022; a baseline of FedMRL and FedGH (HtFLlib ``clientkd.py`` / ``serverkd.py``);
docs/methods/fedkd.md.

Payload: the mentee (``fedkd.shared-model``, default CNN-5), every weight with two or more
dims sent as its truncated SVD. A weight W of shape [m, ...] is flattened to M [m, n] and
sent as ``<key>.u`` [m, r], ``<key>.s`` [r], ``<key>.v`` [r, n] with the smallest rank r
whose squared singular values exceed the fraction T of the total energy (bias vectors go
as they are). T rises linearly from ``energy-start`` (0.95) to ``energy-end`` (0.98):
T_t = start + (end − start)·t/T for round t of T. As in HtFLlib, the *parameters* are
compressed both ways (the original paper compresses the updates; parameters need no client
to track the server's state, which partial participation would break): the client uploads
its compressed trained mentee; the server reconstructs, averages (sample-weighted; run config
``aggregation`` bounds or replaces the average on the rebuilt weights, :mod:`engine.robust`)
and broadcasts the compressed average. Its bytes are 4·Σ(m·r + r + r·n) + the biases.

Client step (mentor t = the private model, mentee s), per augmented batch:
    L_t = CE_t + KL(p_s ‖ p_t)/(CE_t+CE_s) + MSE(H_t, W_h H_s)/(CE_t+CE_s)
    L_s = CE_s + KL(p_t ‖ p_s)/(CE_t+CE_s) + MSE(W_h H_s, H_t)/(CE_t+CE_s)
W_h = Linear(d_s -> d_t, no bias) is private and persists with the mentor. Each loss treats
the other model's outputs as fixed targets and the adaptive factor 1/(CE_t+CE_s) as a
constant (detached; the paper does not say, HtFLlib lets gradients through both). One SGD
step on L_t + L_s, gradient norms clipped per module. Inference: the mentor.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from common.config import RunConfig
from common.options import option
from common.payload import BASE_SCHEMAS, MAX_ABS, ArraySpec, ClientReply, PayloadError, PayloadSchema
from common.protocol import SERVER_ROUND, Arrays, Reply
from common.runtime import ClientRuntime
from common.training import SupervisedLoss, kd_loss, train_personal_model
from engine.contract import Method, MethodBinding, MethodContext
from methods.blocks.shared_model import (
    SHARED_LAYOUTS,
    SharedModelClient,
    SharedModelServer,
    WithCompanions,
    load_arrays,
    shared_module,
)

ALIGN_STATE = "fedkd-align"


@dataclass(frozen=True)
class FedKDOptions:
    """``[tool.flwr.app.config.fedkd]``: the mentee and the SVD energy schedule (fractions in (0, 1])."""

    shared_model: str = option(
        "cnn5",
        "the mentee: CNN-1..5 (cnn5: heterogeneous setting, cnn1: homogeneous) | group-first: client 0's model "
        "of the run's model group (HtFLlib's)",
        choices=SHARED_LAYOUTS,
    )
    energy_start: float = option(0.95, "SVD energy kept in round 1, rising linearly to", low=0, high=1, low_open=True)
    energy_end: float = option(0.98, "the SVD energy kept in the last round", low=0, high=1, low_open=True)


def mentee_model(cfg: RunConfig, options: FedKDOptions):
    """The shared mentee (``fedkd.shared-model``)."""
    return shared_module(cfg, options.shared_model, "fedkd.shared-model")


def energy_threshold(options: FedKDOptions, num_rounds: int, server_round: int) -> float:
    """T_t = start + (end − start)·t/T: the energy fraction kept in round t of T (``energy-start``, ``energy-end``)."""
    return options.energy_start + (options.energy_end - options.energy_start) * server_round / num_rounds


def compressed(shape: tuple[int, ...]) -> bool:
    """Whether a tensor of ``shape`` travels as a truncated SVD (two or more dims)."""
    return len(shape) >= 2


def svd_compress(state: Mapping[str, torch.Tensor], energy: float) -> dict[str, np.ndarray]:
    """Truncated SVD of every weight with >= 2 dims, keeping the smallest rank r with
    Σ_{i<=r} σ_i² > energy · Σ σ_i² (r = 1 for an all-zero weight); others unchanged.

    Returns:
        float32 payload arrays: ``<key>.u`` [m, r], ``<key>.s`` [r], ``<key>.v`` [r, n] or ``<key>``.
    """
    out: dict[str, np.ndarray] = {}
    for key, w in state.items():
        w = w.detach().cpu()
        if not compressed(tuple(w.shape)):
            out[key] = w.numpy().copy()
            continue
        u, s, vh = torch.linalg.svd(w.reshape(w.shape[0], -1).double(), full_matrices=False)
        cumulative = s.pow(2).cumsum(0)
        r = min(int((cumulative <= energy * cumulative[-1]).sum()) + 1, len(s))
        out[key + ".u"] = u[:, :r].float().numpy()
        out[key + ".s"] = s[:r].float().numpy()
        out[key + ".v"] = vh[:r].float().numpy()
    return out


def svd_decompress(arrays: Mapping[str, np.ndarray], shapes: Mapping[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """Inverse of :func:`svd_compress`: (U·diag(s))·V reshaped to ``shapes[key]``, float32."""
    out = {}
    for key, shape in shapes.items():
        if compressed(shape):
            u, s, v = (arrays[key + part] for part in (".u", ".s", ".v"))
            out[key] = ((u * s) @ v).reshape(shape).astype(np.float32)
        else:
            out[key] = arrays[key]
    return out


def rank_limits(module: nn.Module) -> dict[str, int]:
    """The rank symbol of each compressed weight of ``module`` (``r:<key>``) -> its largest rank,
    min(m, n) of the weight as an m x n matrix."""
    shapes = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    return {f"r:{k}": min(shape[0], int(np.prod(shape[1:]))) for k, shape in shapes.items() if compressed(shape)}


def compressed_schema(module: nn.Module) -> PayloadSchema:
    """Schema of :func:`svd_compress`'s output for ``module``: a free rank symbol per weight,
    checked to lie in [1, min(m, n)], and factors that cannot rebuild an entry beyond ``MAX_ABS``.

    The bound needs no rebuild (the server rebuilds once, in its update): an entry of
    (U·diag(s))·V is at most max_i Σ_k |u_ik s_k| · max |v| in magnitude. Honest factors stay
    orders of magnitude below it (|u|, |v| <= 1 and Σ s_k is small), so no honest reply is refused."""
    shapes = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    specs: dict[str, ArraySpec] = {}
    limits = rank_limits(module)
    for key, shape in shapes.items():
        if not compressed(shape):
            specs[key] = ArraySpec(shape, "float32")
            continue
        m, n, rank = shape[0], int(np.prod(shape[1:])), f"r:{key}"
        specs.update(
            {
                key + ".u": ArraySpec((m, rank), "float32"),
                key + ".s": ArraySpec((rank,), "float32"),
                key + ".v": ArraySpec((rank, n), "float32"),
            }
        )

    def ranks_and_weights_in_range(arrays, dims) -> None:
        for rank, limit in limits.items():
            if not 1 <= dims[rank] <= limit:
                raise PayloadError(f"rank {rank} = {dims[rank]} outside [1, {limit}]")
        # factors within the entry bound can still multiply to a huge (or infinite) weight
        for key in shapes:
            if key + ".u" in arrays:
                u, s, v = (arrays[key + part].astype(np.float64) for part in (".u", ".s", ".v"))
                bound = float(np.abs(u * s).sum(axis=1).max() * np.abs(v).max())
                if bound > MAX_ABS:
                    raise PayloadError(
                        f"'{key}' rebuilt from its SVD factors could have entries of magnitude "
                        f"{bound:.3g}, beyond {MAX_ABS:.3g}"
                    )

    return PayloadSchema(specs, check=ranks_and_weights_in_range)


def schemas(cfg: RunConfig, options: FedKDOptions) -> dict:
    """FedKD's message schemas: the compressed mentee both ways in ``train``."""
    with torch.device("meta"):  # shapes only
        schema = compressed_schema(mentee_model(cfg, options))
    return {**BASE_SCHEMAS, "train": (schema, schema)}


class FedKDServer(SharedModelServer):
    """FedKD server: reconstructs the clients' mentees, averages them, broadcasts the compressed average."""

    build_shared = staticmethod(mentee_model)

    def __init__(self, ctx: MethodContext) -> None:
        super().__init__(ctx)
        self._broadcast: tuple[int, dict[str, np.ndarray]] = (0, {})

    def recording_dims(self, model: nn.Module) -> dict[str, int]:
        """Every rank symbol at its largest (:func:`rank_limits`: nothing cut)."""
        return {**super().recording_dims(model), **rank_limits(self.shared)}

    def training_companions(self, model: nn.Module) -> list[nn.Module]:
        """The mentee and the alignment map W_h (d_s -> d_t), trained with the mentor ``model``
        (:meth:`FedKDClient.local_training`)."""
        return [self.shared, nn.Linear(self.shared.feature_dim, model.feature_dim, bias=False)]

    def configure_train(self, node_id: int, server_round: int) -> dict[str, np.ndarray]:
        """The mentee compressed at T_t (computed once per round)."""
        if self._broadcast[0] != server_round:
            self._broadcast = (
                server_round,
                svd_compress(self.shared.state_dict(), self.energy(server_round)),
            )
        return self._broadcast[1]

    def aggregate_train(self, server_round: int, replies: list[ClientReply]) -> dict[str, float]:
        """θ^t = the run's ``aggregation`` of the reconstructed mentees (``mean``: their sample-weighted
        mean; client-level DP's noisy mean of clipped updates with ``client-dp.epsilon`` > 0), the reference
        being the mentee the clients rebuilt from this round's broadcast."""
        shapes = {k: tuple(v.shape) for k, v in self.shared.state_dict().items()}
        full = [ClientReply(r.node_id, r.partition_id, svd_decompress(r.arrays, shapes), r.metrics) for r in replies]
        # what every client started from: the broadcast compressed at T_t, rebuilt as they rebuilt it
        sent = svd_decompress(self.configure_train(0, server_round), shapes)
        averaged, metrics = self.aggregate(sent, full, server_round)
        if averaged is not None:  # unchanged when no reply trained on an example
            load_arrays(self.shared, averaged)
        return {"server-num-averaged": len(full), "svd-energy": self.energy(server_round), **metrics}

    def energy(self, server_round: int) -> float:
        """T_t of this run (:func:`energy_threshold`)."""
        return energy_threshold(self.options, self.cfg.num_server_rounds, server_round)


class FedKDClient(SharedModelClient):
    """FedKD client: mentor (private) and mentee (shared) distil into each other adaptively."""

    build_shared = staticmethod(mentee_model)

    def __init__(self, cfg: RunConfig, binding: MethodBinding) -> None:
        super().__init__(cfg, binding)
        with torch.device("meta"):
            mentee = mentee_model(cfg, self.options)
        self.shapes = {k: tuple(v.shape) for k, v in mentee.state_dict().items()}

    def received(self, client, payload):
        """The mentee reconstructed from the compressed payload, on the client's device."""
        return super().received(client, svd_decompress(payload, self.shapes))

    def local_training(self, client: ClientRuntime, mentee: nn.Module) -> tuple[WithCompanions, SupervisedLoss]:
        """(the mentor with ``mentee`` and the alignment map W_h as companions, the adaptive mutual
        distillation loss of both) that local training optimises; W_h restored from this client's state
        (its seed's initialisation the first time). The privacy evaluation's attack on the mentee's update
        simulates the same."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.cfg.seed)
            align = nn.Linear(mentee.feature_dim, client.model.feature_dim, bias=False)
        client.restore(ALIGN_STATE, align)
        align = align.to(client.device)

        def adaptive_loss(x, features, logits, labels):
            h_s = mentee.extractor(x)
            mentee_logits = mentee.head(h_s)
            mapped = align(h_s)
            ce_t, ce_s = F.cross_entropy(logits, labels), F.cross_entropy(mentee_logits, labels)
            scale = 1.0 / (ce_t + ce_s).detach().clamp_min(1e-8)
            mentor = ce_t + scale * (kd_loss(logits, mentee_logits.detach()) + F.mse_loss(features, mapped.detach()))
            student = ce_s + scale * (kd_loss(mentee_logits, logits.detach()) + F.mse_loss(mapped, features.detach()))
            return mentor + student

        return WithCompanions(client.model, mentee=mentee, align=align), adaptive_loss

    def train(self, client: ClientRuntime, payload: Arrays, config: dict[str, Any]) -> Reply:
        """Returns the trained mentee compressed at T_t and the mentor's training metrics."""
        mentee = self.received(client, payload)
        model, adaptive_loss = self.local_training(client, mentee)
        stats = train_personal_model(
            client, config, supervised_loss=adaptive_loss, model=model, clip_groups=model.groups
        )
        client.store(ALIGN_STATE, model.align)
        return svd_compress(
            mentee.state_dict(), energy_threshold(self.options, self.cfg.num_server_rounds, int(config[SERVER_ROUND]))
        ), stats


METHOD = Method("fedkd", FedKDServer, FedKDClient, schemas, FedKDOptions)
