"""The multi-head hypernetwork of MH-pFedHN/GD and the flat weight vectors it generates.

"Multi-head hypernetwork for model-heterogeneous personalized federated learning" (Eq. 3, Algorithms
1-2); docs/methods/mh-pfedhn.md (section numbers below refer to it). The server half
(:class:`HyperNetwork`, :func:`hn_step`) never sees a model: it generates flat vectors [K]; the client
half (:func:`load_flat`, :func:`flat_delta`) maps them to and from a model's parameters in canonical
order. ``methods.mh_pfedhn`` is the only user.
"""

from __future__ import annotations

import math
from typing import Protocol

import numpy as np
import torch
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from common.payload import PayloadError


class HyperNetworkShape(Protocol):
    """The sizes a :class:`HyperNetwork` is built with (``methods.mh_pfedhn.HNOptions`` has them)."""

    embedding_dim: int
    hidden_dim: int
    chunk_size: int
    embedding_std: float


class ChunkHead(nn.Module):
    """tau independent ``Linear(H, B)`` output channels: weight [tau, B, H], bias [tau, B] float32.

    Initialised like PyTorch's Linear (uniform ±1/sqrt(H) for weight and bias, section 5).
    """

    def __init__(self, tau: int, hidden_dim: int, chunk_size: int) -> None:
        super().__init__()
        bound = 1.0 / math.sqrt(hidden_dim)
        self.weight = nn.Parameter(torch.empty(tau, chunk_size, hidden_dim).uniform_(-bound, bound))
        self.bias = nn.Parameter(torch.empty(tau, chunk_size).uniform_(-bound, bound))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """Chunks [tau, B] of trunk outputs ``features`` [tau, H]: chunk j = W_j g(v[j]) + b_j."""
        return torch.einsum("tbh,th->tb", self.weight, features) + self.bias


class HyperNetwork(nn.Module):
    """h(v; φ): trunk φ_f, heads φ_H[tau] keyed by chunk count, private embeddings (section 4, Eq. 3).

    ``register(key, K)`` adds a client: an embedding [ceil(K/B), D_e] ~ Normal(0, std) and,
    when its tau is new, a head (or a head of its own name, ``head``: a new architecture of a
    generalisation phase, §4.4). ``generate(key)`` gives that client's flat weights [K].
    """

    def __init__(self, opts: HyperNetworkShape) -> None:
        super().__init__()
        self.opts = opts
        h = opts.hidden_dim
        self.trunk = nn.Sequential(
            nn.Linear(opts.embedding_dim, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU()
        )
        self.heads = nn.ModuleDict()
        self.embeddings = nn.ParameterDict()
        self.sizes: dict[str, int] = {}  # key -> K
        self.head_names: dict[str, str] = {}  # key -> name of its head in ``heads``

    def tau(self, num_params: int) -> int:
        """Chunk count ceil(K / B)."""
        return -(-num_params // self.opts.chunk_size)

    def register(self, key: str, num_params: int, head: str | None = None) -> list[nn.Parameter]:
        """Add client ``key`` with K = ``num_params``, on the head of its tau or on head ``head``; returns
        the new parameters (for the optimiser).

        Raises:
            ValueError: if ``key`` is known with another K.
        """
        if key in self.sizes:
            if self.sizes[key] != num_params:
                raise ValueError(f"client {key} re-registered with K={num_params}, was {self.sizes[key]}")
            return []
        tau, new = self.tau(num_params), []
        name = head or str(tau)
        if name not in self.heads:
            self.heads[name] = ChunkHead(tau, self.opts.hidden_dim, self.opts.chunk_size)
            new += list(self.heads[name].parameters())
        self.embeddings[key] = nn.Parameter(torch.randn(tau, self.opts.embedding_dim) * self.opts.embedding_std)
        self.sizes[key], self.head_names[key] = num_params, name
        return [*new, self.embeddings[key]]

    def head_of(self, key: str) -> ChunkHead:
        """The head client ``key`` shares with every client of the same tau (or its own named head)."""
        return self.heads[self.head_names[key]]

    def generate(self, key: str) -> torch.Tensor:
        """θ = [W_1 g(v[1]) + b_1; ...; W_tau g(v[tau]) + b_tau][:K], float32 [K] (Eq. 3), with graph."""
        return self.head_of(key)(self.trunk(self.embeddings[key])).flatten()[: self.sizes[key]]


def hn_step(
    hn: HyperNetwork, optimizer: torch.optim.Optimizer, key: str, delta: torch.Tensor, clip_norm: float
) -> None:
    """One Adam step of the hypernetwork from a client's weight change (section 4).

    Sets grad = ∇_φ -<h(v_key; φ), sg(delta)> = -J^T delta on the trunk, the head of the
    client's tau and its embedding (all other parameters keep grad None, so Adam leaves them
    and their state untouched), clips the gradient norm at ``clip_norm`` (<= 0: off), steps.

    Args:
        delta: float32 [K], trained minus received weights (the wire's sign; the descent on
            the surrogate moves h(v) towards the trained weights).
    """
    optimizer.zero_grad(set_to_none=True)
    (-(hn.generate(key) * delta).sum()).backward()
    if clip_norm > 0:
        nn.utils.clip_grad_norm_([p for p in hn.parameters() if p.grad is not None], clip_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def num_params(model: nn.Module) -> int:
    """K: the number of generated (trainable) parameters, buffers excluded."""
    return sum(p.numel() for p in model.parameters())


def load_flat(model: nn.Module, theta: np.ndarray, device: torch.device) -> torch.Tensor:
    """Load flat weights into ``model``'s parameters in canonical order; returns them as a tensor.

    The order is ``model.parameters()`` (registration order), each tensor row-major; buffers
    (BatchNorm statistics) are not part of it (section 3, "Canonical flat order").

    Raises:
        PayloadError: if ``theta`` does not have exactly as many entries as the model has parameters.
    """
    count = num_params(model)
    if theta.shape != (count,):
        raise PayloadError(f"received {theta.shape[0]} weights for a model with {count} parameters")
    flat = torch.from_numpy(theta).to(device)
    with torch.no_grad():
        vector_to_parameters(flat.clone(), model.parameters())
    return flat


def flat_delta(model: nn.Module, received: torch.Tensor) -> np.ndarray:
    """Trained minus received weights, float32 [K] on the CPU, canonical order."""
    with torch.no_grad():
        return (parameters_to_vector(model.parameters()) - received).cpu().numpy()
