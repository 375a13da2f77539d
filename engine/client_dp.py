"""Client-level differential privacy of the model uploads (run config table ``[client-dp]``, off by default).

What is protected: one client's whole data (add or remove one client, dp-accounting's
``NeighboringRelation.ADD_OR_REMOVE_ONE`` with the client as the unit), in everything the server
releases from the uploads: the shared model it broadcasts (LG-FedAvg's head, FML's meme model,
FedKD's mentee, FedMRL's small model) and the hypernetwork that generates MH-pFedHN's and
MH-pFedHNGD's weights. Against whom: the other clients and anyone who sees what the server sends,
not the server, which sees each upload before the noise (the trusted aggregator of central DP). The
record-level DP of ``[dp]`` (``common.dp``) protects one example of a client against the server too;
the two can run together, each guarantee for its own unit.

The mechanism is DP-FedAvg (McMahan et al., "Learning Differentially Private Recurrent Language
Models", ICLR 2018, Algorithm 1 with the fixed-denominator estimator f̃_f and flat clipping):

- every round each training client is sampled independently with probability q = K / N (Poisson
  sampling, from the operating system's entropy: ``engine.roster.Roster.sample``), K =
  max(1, floor(``fraction-train`` · N)) and N the training partitions;
- each sampled client's update Δ_k = w_k − w_sent (the shared part's change from what the server
  sent, all payload arrays flattened into one vector) is clipped to L2 norm C = ``client-dp.clip-norm``:
  Δ̄_k = Δ_k · min(1, C / ‖Δ_k‖₂) (Flower's ``compute_clip_model_update``);
- the server adds z ~ N(0, σ²C² I) to the sum and divides by the expected number of clients K,
  w = w_sent + (Σ_k Δ̄_k + z) / K: one client moves the sum by at most C, so this is the Gaussian
  mechanism of noise multiplier σ on a Poisson sample of rate q, whatever the others sent. The noise
  is drawn even when no client replied: otherwise an unchanged model would tell that nobody took part.
- MH-pFedHN steps its hypernetwork once per client, with no sum to hide a client in: each clipped
  ``delta_theta`` gets its own z ~ N(0, σ²C² I) before its step, and a sampled client without a valid
  reply is stepped on z alone (its upload zeroed). That is the Gaussian mechanism of σ for that client
  with its data replaced by none (the "zero-out" neighbouring relation of Kairouz et al., ICML 2021; ε as
  for add or remove), but who was sampled shows in the hypernetwork (its embedding moves), so no amplification by
  sampling is credited: the accountant uses rate 1 for it. MH-pFedHNGD's clients take part twice a round
  (the global model's ``delta_w_g`` in the sum above, and their own ``delta_theta``): two Gaussian
  mechanisms of σ on one client compose to one of σ / √2 exactly (Gaussian DP: μ-GDP mechanisms compose to
  √(Σμ²)-GDP, Dong, Roth & Su, JRSS-B 2022, Cor. 3.3), which the accountant composes per round.

Accounting: dp-accounting's PLD accountant (RDP beside it) over the rounds, each a Poisson-sampled
Gaussian event of rate q (1 for MH-pFedHN/GD) and noise multiplier σ (σ / √2 for MH-pFedHNGD). σ is
calibrated so that ``num-server-rounds`` rounds spend ``client-dp.epsilon`` at ``client-dp.delta``
(``common.dp._calibrate``, the calibration of the record-level plan), and every round row records σ,
C, q, K and the ε spent by rounds 1..t (a resumed run continues the count).

Flower's ``DifferentialPrivacyServerSideFixedClipping`` implements the same mechanism, but as a
wrapper of a Flower ``Strategy`` (``configure_train`` / ``aggregate_train`` over ``Message`` s, FedAvg
with equal weights and exactly the configured number of replies): it cannot wrap these methods' own
round loops and server steps (FedKD aggregates rebuilt SVDs, MH-pFedHN takes one hypernetwork step per
reply, MH-pFedHNGD a step from a mean delta). So the mechanism is written here once, with Flower's
clipping helper; its noise helper is not used because it draws float32 noise from numpy's global
generator, which any code in the server process may seed, where the noise here comes from the
operating system's entropy as the record-level noise does (``common.dp.secret_generator``).

A table of its own rather than a ``dp.level`` switch: the two guarantees protect different units
(an example against everyone vs a whole client against all but the server), are given by different
parties (each client vs the server) and accounted differently (per client over its own DP-SGD steps
vs once for the federation over rounds); a switch would let one ``dp.epsilon`` mean either, and
would rule out running both.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np
import torch
from flwr.supercore.differential_privacy import compute_clip_model_update

from common.config import ConfigError, RunConfig, read_options, sample_size
from common.dp import MAX_NOISE_MULTIPLIER, Event, _calibrate, epsilon_of, merge_events, secret_generator
from common.options import option
from common.payload import ClientReply

#: the run config table of the keys below
TABLE = "client-dp"
#: ``client-dp.clip-norm``'s default: at the models' scale, measured on the tests' small setting (4 pathological
#: clients of 200 MNIST or CIFAR-10 examples, 1 local epoch of the default recipe, ``aggregation = "mean"``, seed 0,
#: rounds 1-3; MH-pFedHN/GD on ``mh-lenet``): the median L2 norm of one client's update is 0.155 over LG-FedAvg,
#: FML, FedMRL, MH-pFedHN and MH-pFedHNGD (120 updates; quartiles 0.120 and 0.222; per method 0.155, 0.111,
#: 0.122, 0.206, 0.399), rounded down as ``common.dp``'s clips are. FedKD's is 3.0 (2.3-3.6) and the same for every
#: client to three digits (3.626-3.628 in round 1): the truncated SVDs of upload and broadcast set it, not the
#: training, so FedKD needs a clip of its own (docs/privacy.md, "Client-level differential privacy")
DEFAULT_CLIP_NORM = 0.15
#: the ``aggregation`` values client-level DP replaces by its own mean of clipped updates: both are
#: averages whose only bound is a magnitude; the other rules select or combine several uploads per
#: coordinate, so one client could change what the others contribute and the sum's bound C would not hold
REPLACEABLE_AGGREGATIONS = ("mean", "norm-bound")


@dataclass(frozen=True)
class ClientDPOptions:
    """``[tool.flwr.app.config.client-dp]``: client-level DP of model uploads (module docstring)."""

    epsilon: float = option(
        0.0,
        "ε of the whole run, client-level (add or remove one client's whole data) for the methods whose upload is "
        "a model (DP-FedAvg: each update clipped, Gaussian noise at the server); 0: off",
        low=0,
    )
    delta: float = option(
        1e-5, "δ of the client-level guarantee; must be below 1/N (N: training clients)", low=0, high=0.1, low_open=True
    )
    clip_norm: float = option(
        DEFAULT_CLIP_NORM,
        "C: each client's update (the shared part's change from what the server sent) is clipped to this L2 norm",
        low=0,
        low_open=True,
    )

    @property
    def enabled(self) -> bool:
        return self.epsilon > 0

    def check(self, cfg: RunConfig) -> None:
        """Refuse, before the run, a client-level DP run that cannot give its guarantee.

        Raises:
            ConfigError: naming the key: ``num-clients`` is 0 (q = K / N unknown); ``handshake`` is ``sampled``
                (it draws nodes its own way); ``generalization.held-out-clients`` > 0 (their personalisation is
                outside the accounted mechanism); ``aggregation`` is not one of :data:`REPLACEABLE_AGGREGATIONS`.
                What depends on the method is :func:`check_run`'s.
        """
        if not self.enabled:
            return
        from common.heldout import generalization_options

        for key, bad, why in (
            (
                "num-clients",
                cfg.num_clients == 0,
                "0: σ is calibrated before the run to q = K / N and δ < 1/N, which need N; set it to the federation's "
                "size (e.g. num-clients=10, tools.run's default)",
            ),
            ("handshake", cfg.handshake == "sampled", "'sampled': client-level DP samples the clients itself"),
            (
                "generalization.held-out-clients",
                generalization_options(cfg).enabled,
                "> 0: held-out clients' personalisation is outside the accounted mechanism",
            ),
            (
                "aggregation",
                cfg.aggregation not in REPLACEABLE_AGGREGATIONS,
                f"{cfg.aggregation!r}: the clipped updates' sum bounds one client only when every upload is averaged "
                f"alike; use one of {', '.join(repr(a) for a in REPLACEABLE_AGGREGATIONS)}",
            ),
        ):
            if bad:
                raise ConfigError(f"run config key {key!r} cannot be used with 'client-dp.epsilon' > 0: {why}")


@lru_cache(maxsize=64)
def client_dp_options(cfg: RunConfig) -> ClientDPOptions:
    """The validated ``client-dp.*`` keys of ``cfg``.

    Raises:
        ConfigError: an unknown key, a value outside its declaration, or :meth:`ClientDPOptions.check`.
    """
    return read_options(ClientDPOptions, cfg, TABLE)


@dataclass(frozen=True)
class ClientDPPlan:
    """The run's client-level mechanism.

    Attributes:
        noise_multiplier: σ; the noise on a sum of clipped updates has standard deviation σ·C per coordinate.
        clip_norm: C, the L2 bound of one client's update.
        sample_rate: q = K / N, the probability that a training client is sampled in a round.
        expected_clients: K, the fixed denominator of the noisy mean.
        rounds: the rounds σ is calibrated for (``num-server-rounds``).
        releases: Gaussian mechanisms of σ per round on each sampled client (MH-pFedHNGD: 2).
        amplified: whether the accountant credits the sampling (False: who was sampled is visible).
        delta: δ of the reported ε.
    """

    noise_multiplier: float
    clip_norm: float
    sample_rate: float
    expected_clients: int
    rounds: int
    releases: int
    amplified: bool
    delta: float

    @property
    def accounted_rate(self) -> float:
        """The sampling rate the accountant composes: q when :attr:`amplified`, else 1."""
        return self.sample_rate if self.amplified else 1.0

    @property
    def noise_std(self) -> float:
        """The noise's standard deviation on the mean of the clipped updates: σ·C / K (Flower's ``compute_stdv``)."""
        return self.noise_multiplier * self.clip_norm / self.expected_clients

    def events(self, rounds: int) -> tuple[Event, ...]:
        """``rounds`` rounds as ``common.dp.Event`` s: Poisson-sampled Gaussians of rate :attr:`accounted_rate` and
        noise multiplier σ / √releases (that many Gaussians of σ on one client compose to one)."""
        return merge_events((self.noise_multiplier / math.sqrt(self.releases), self.accounted_rate, rounds))

    def epsilon(self, rounds: int, accountant: str = "pld") -> float:
        """ε at δ after ``rounds`` rounds (``common.dp.epsilon_of``: ``pld`` or ``rdp``)."""
        return epsilon_of(self.events(rounds), self.delta, accountant)

    def row(self, server_round: int) -> dict[str, float]:
        """The round row's keys of the mechanism and of what rounds 1..``server_round`` spent."""
        return {
            "client-dp-noise-multiplier": self.noise_multiplier,
            "client-dp-clip-norm": self.clip_norm,
            "client-dp-sample-rate": self.sample_rate,
            "client-dp-accounted-rate": self.accounted_rate,
            "client-dp-expected-clients": self.expected_clients,
            "client-dp-delta": self.delta,
            "client-dp-epsilon": self.epsilon(server_round),
            "client-dp-epsilon-rdp": self.epsilon(server_round, "rdp"),
        }


@lru_cache(maxsize=64)
def client_plan(cfg: RunConfig, releases: int, amplified: bool) -> ClientDPPlan:
    """The calibrated :class:`ClientDPPlan` of ``cfg`` for a method with ``releases`` Gaussian mechanisms per
    sampled client and round, sampling credited when ``amplified``: N = ``num-clients``, K = max(1,
    floor(``fraction-train`` · N)), q = K / N, and σ the smallest whose ``num-server-rounds`` rounds
    (:meth:`ClientDPPlan.events`) spend ``client-dp.epsilon`` at ``client-dp.delta`` (PLD).

    Raises:
        ConfigError: ``client-dp.delta`` >= 1/N (naming it); no σ up to :data:`common.dp.MAX_NOISE_MULTIPLIER`
            meets ``client-dp.epsilon`` (naming it).
    """
    options = client_dp_options(cfg)
    n = int(cfg.num_clients)
    if options.delta >= 1.0 / n:
        raise ConfigError(
            f"run config key 'client-dp.delta' = {options.delta:g} with {n} clients: δ must be below 1/N = {1 / n:g} "
            "(a larger δ allows releasing one client's update outright)"
        )
    k = expected_clients(cfg)
    plan = ClientDPPlan(
        0.0, options.clip_norm, k / n, k, int(cfg.num_server_rounds), releases, amplified, options.delta
    )
    try:
        sigma = _calibrate(
            lambda s: replace(plan, noise_multiplier=s).events(plan.rounds), options.epsilon, options.delta
        )
    except ValueError as exc:
        raise ConfigError(
            f"run config key 'client-dp.epsilon' = {options.epsilon:g} cannot be met over {plan.rounds} rounds at "
            f"q = {plan.sample_rate:g} with a noise multiplier of at most {MAX_NOISE_MULTIPLIER:g} ({exc}); raise "
            "'client-dp.epsilon' or train fewer rounds"
        ) from exc
    return replace(plan, noise_multiplier=sigma)


def expected_clients(cfg: RunConfig) -> int:
    """K = max(1, floor(``fraction-train`` · N)), N = ``num-clients`` (:func:`common.config.sample_size`, the
    roster's draw): the clients a round samples, on average under client-level DP."""
    return sample_size(cfg.fraction_train, cfg.num_clients)


def check_run(cfg: RunConfig, server: type) -> None:
    """Before the run (``engine.runner.build_run``): refuse client-level DP that a run of the method's
    ``server`` half cannot give. Nothing is checked with it off.

    Raises:
        ConfigError: naming the key: as :meth:`ClientDPOptions.check`; ``client-dp.epsilon`` with a method whose
            upload is not a model (its server half has no ``client_dp_releases``); as :func:`client_plan`.
    """
    options = client_dp_options(cfg)
    if not options.enabled:
        return
    if not getattr(server, "client_dp_releases", 0):
        raise ConfigError(
            f"run config key 'client-dp.epsilon' = {options.epsilon:g} with method '{cfg.method}', whose upload is "
            "not a model: client-level DP clips and noises model updates (lg-fedavg, fml, fedkd, fedmrl, "
            "mh-pfedhn, mh-pfedhngd); use 'dp.epsilon' (record-level) for this method"
        )
    client_plan(cfg, server.client_dp_releases, server.client_dp_amplified)


def attach(server) -> ClientDPAggregator | None:
    """The server step of client-level DP for ``server`` (a ``MethodServer`` whose class sets
    ``client_dp_releases`` and ``client_dp_amplified``), its federation switched to Poisson sampling at q
    (``engine.federation.Federation.use_poisson_sampling``); None with client-level DP off.

    Raises:
        ConfigError: as :func:`client_plan`.
    """
    cfg = server.cfg
    if not client_dp_options(cfg).enabled:
        return None
    plan = client_plan(cfg, server.client_dp_releases, server.client_dp_amplified)
    server.federation.use_poisson_sampling(plan.sample_rate)
    return ClientDPAggregator(plan)


def flat(arrays: Mapping[str, np.ndarray], keys: Sequence[str]) -> list[np.ndarray]:
    """``arrays[k]`` for ``keys``, as float64 arrays (the vector the clip and the noise act on)."""
    return [np.asarray(arrays[k], np.float64) for k in keys]


def clip_update(
    upload: list[np.ndarray], reference: list[np.ndarray], clip_norm: float
) -> tuple[list[np.ndarray], bool]:
    """Δ̄ = (upload − reference) · min(1, C / ‖upload − reference‖₂), the norm over all arrays together.

    Args:
        upload, reference: float64 arrays of equal shapes (one payload each, :func:`flat`).
        clip_norm: C > 0.

    Returns:
        (Δ̄ as float64 arrays of the same shapes, whether it was scaled down).
    """
    update = [u - r for u, r in zip(upload, reference)]
    norm = math.sqrt(sum(float(np.sum(d * d)) for d in update))
    if norm == 0.0:  # Flower's helper divides by the norm; a zero update needs no clip
        return update, False
    clipped = [u.copy() for u in upload]
    compute_clip_model_update(clipped, reference, clip_norm)  # in place: reference + clipped change
    return [c - r for c, r in zip(clipped, reference)], norm > clip_norm


def gaussian(shapes: Sequence[tuple[int, ...]], std: float) -> list[np.ndarray]:
    """float64 arrays of ``shapes`` with i.i.d. N(0, std²) entries, from the operating system's entropy
    (``common.dp.secret_generator``: never the run's seed, which every client knows)."""
    generator = secret_generator()
    return [std * torch.randn(shape, generator=generator, dtype=torch.float64).numpy() for shape in shapes]


class ClientDPAggregator:
    """DP-FedAvg's server step (module docstring) for one run's :class:`ClientDPPlan`."""

    def __init__(self, plan: ClientDPPlan) -> None:
        self.plan = plan

    def aggregate(
        self, reference: Mapping[str, np.ndarray], uploads: Sequence[Mapping[str, np.ndarray]], server_round: int
    ) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """w = w_sent + (Σ_k clip_C(w_k − w_sent) + N(0, σ²C² I)) / K, every upload weighted alike.

        Args:
            reference: name -> array the server sent this round (w_sent; all zeros for uploads that are
                changes already, MH-pFedHNGD's ``delta_w_g``).
            uploads: each valid upload's name -> array, at least the names of ``reference``, same shapes.
            server_round: the round, for the ε spent after it.

        Returns:
            (name -> float32 array in ``reference``'s shapes, always: the noise is released even without an
            upload; the round row's keys: :meth:`ClientDPPlan.row` and ``client-dp-clipped``, how many updates
            were scaled down).
        """
        keys = list(reference)
        ref = flat(reference, keys)
        total = gaussian([r.shape for r in ref], self.plan.noise_multiplier * self.plan.clip_norm)
        clipped = 0
        for upload in uploads:
            update, scaled = clip_update(flat(upload, keys), ref, self.plan.clip_norm)
            clipped += scaled
            total = [t + d for t, d in zip(total, update)]
        out = {k: (r + t / self.plan.expected_clients).astype(np.float32) for k, r, t in zip(keys, ref, total)}
        return out, {**self.plan.row(server_round), "client-dp-clipped": clipped}

    def replies(
        self, reference: Mapping[str, np.ndarray], replies: list[ClientReply], server_round: int
    ) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """:meth:`aggregate` over the replies' arrays."""
        return self.aggregate(reference, [r.arrays for r in replies], server_round)

    def privatize(self, delta: np.ndarray) -> np.ndarray:
        """One client's own release (MH-pFedHN's ``delta_theta``, float32 [K_i]): clip_C(delta) + N(0, σ²C² I),
        float32 [K_i]."""
        (update,), _ = clip_update([np.asarray(delta, np.float64)], [np.zeros(delta.shape)], self.plan.clip_norm)
        noise = gaussian([delta.shape], self.plan.noise_multiplier * self.plan.clip_norm)[0]
        return (update + noise).astype(np.float32)
