"""Record-level differential privacy of every upload (run config table ``[dp]``, off by default).

What is protected: one training example of one client (add or remove one example, the relation
of dp-accounting's ``NeighboringRelation.ADD_OR_REMOVE_ONE``), against everyone who sees what
the client sends: the server, the other clients and the wire. The mechanisms run inside the
ClientApp, on the SuperNode, before the reply exists (docs/privacy.md, "Differential privacy"):

- **DP-SGD** (Abadi et al., CCS 2016) in every local training of every method, with Opacus
  (``GradSampleModule`` + ``DPOptimizer``, Poisson sampling ``UniformWithReplacementSampler``):
  each example's gradient is clipped to ``dp.clip-norm`` and Gaussian noise of standard deviation
  σ·``clip-norm`` is added to each step's sum (with ``dp.adaptive-clip`` the clip starts there and follows a
  quantile of the per-example gradient norms: ``common.adaptive_clip``). Everything computed from the
  trained model alone (a shared model, a head, MH-pFedHN's update, the model that computes a prototype)
  is then post-processing of DP-SGD.
- **The Gaussian mechanism on per-class sums** for a payload computed from the examples themselves
  (FedGH's LARs, FedProto/FedTGP prototypes, FD's logits, FedRE's entangled representation):
  :func:`noisy_class_means`. The class counts and the set of classes a client holds are released
  through the same mechanism, never exactly.

Accounting is dp-accounting's PLD accountant (privacy loss distributions; RDP reported beside it): per
client, every DP-SGD step is a Poisson-sampled Gaussian event (q = batch-size / n) and every payload
release a Gaussian event (q = 1). The client's server-side sampling (``fraction-train``) gives no
amplification: the server chooses, and sees, who trains. DP-SGD and the releases have a σ each,
calibrated together per client (they depend on n) so that the rounds the client is expected to train
(:func:`planned_rounds`) spend ``dp.epsilon`` at ``dp.delta``, the releases ``dp.release-share`` of it
(:func:`make_plan`). What a client has spent is its own: a :class:`PrivacyLedger` in its state folder,
outside anything the server chooses, charged before each mechanism runs, and a client refuses any
training or release that would take it past ``dp.epsilon`` (:class:`BudgetSpent`).

The noise and the Poisson sampling draw from the operating system's entropy, not from the run's
seed: the server knows the seed and could otherwise subtract the noise. DP runs are therefore
not bit-reproducible.
"""

from __future__ import annotations

import fcntl
import json
import math
import secrets
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

import torch
from flwr.app import ConfigRecord, RecordDict
from torch import nn

from common.config import RunConfig, read_options
from common.errors import ConfigError
from common.files import atomic_write
from common.options import option

#: the run config table of the keys below
TABLE = "dp"
#: the smallest noise multiplier a calibration returns: a target so loose that less noise meets it gets this
MIN_NOISE_MULTIPLIER = 0.01
#: the largest noise multiplier a calibration may return: beyond it no training learns anything,
#: and a target that needs more is refused before the run starts
MAX_NOISE_MULTIPLIER = 100.0
#: a class of a noisy per-class release is kept when its noisy count is at least this many
#: standard deviations of the count's noise (and at least 1): below, the mean is mostly noise
COUNT_THRESHOLD_STDS = 3.0
#: ``dp.release-share``'s default: the share of ``dp.epsilon`` the payload releases get (docs/privacy.md)
DEFAULT_RELEASE_SHARE = 0.25
#: ``dp.clip-norm``'s and ``dp.payload-clip``'s defaults: at the models' scale, the median per-example gradient
#: and representation L2 norms of the default model group (CNN-1..5 on CIFAR-10) after 5 local trainings,
#: 7.09 and 10.68, rounded down (``bench.dp_clip_scale``, ``results/dp-clip-scale/cifar10.txt``): a clip far
#: below them shortens every DP-SGD step and shrinks every prototype to the unit ball
DEFAULT_CLIP_NORM = 7.0
DEFAULT_PAYLOAD_CLIP = 10.0
#: ``dp.count-noise``'s default, as a share of the expected batch B: σ_b = B / 20, the choice of Andrew et al.
#: (NeurIPS 2021, §4: σ_b = m / 20 for m clients a round), so the noisy clipped fraction b̃ has noise std 0.05
DEFAULT_COUNT_NOISE_SHARE = 1 / 20


@dataclass(frozen=True)
class DPOptions:
    """``[tool.flwr.app.config.dp]``: the privacy target and the clipping bounds (module docstring)."""

    epsilon: float = option(
        0.0, "ε each client may spend over the run (record-level, add or remove one example); 0: DP off", low=0
    )
    delta: float = option(
        1e-5,
        "δ of the guarantee; must be below 1/n of every client (n: its training examples)",
        low=0,
        high=0.1,
        low_open=True,
    )
    clip_norm: float = option(
        DEFAULT_CLIP_NORM, "DP-SGD: each example's gradient is clipped to this L2 norm", low=0, low_open=True
    )
    payload_clip: float = option(
        DEFAULT_PAYLOAD_CLIP,
        "a payload computed from examples (prototypes, LARs, logits, FedRE's representation): each example's row "
        "is clipped to this L2 norm before the per-class sums are noised",
        low=0,
        low_open=True,
    )
    release_share: float = option(
        DEFAULT_RELEASE_SHARE,
        "the share of 'dp.epsilon' a method's payload releases get, alone (their σ is calibrated to it); DP-SGD "
        "is calibrated to the rest, composed with them (docs/privacy.md)",
        low=0,
        high=0.99,
        low_open=True,
    )
    adaptive_clip: bool = option(
        False,
        "DP-SGD: 'dp.clip-norm' is only where the clip starts; each step moves it towards the 'dp.target-quantile' "
        "of the per-example gradient norms from a noisy count (Andrew et al. 2021; docs/privacy.md)",
    )
    target_quantile: float = option(
        0.5,
        "with 'dp.adaptive-clip': the share γ of per-example gradients the clip aims to leave unclipped",
        low=0.01,
        high=0.99,
    )
    clip_lr: float = option(
        0.2,
        "with 'dp.adaptive-clip': η_C of the clip's geometric step C·exp(-η_C·(b̃ - γ))",
        low=0,
        high=10,
        low_open=True,
    )
    count_noise: float = option(
        0.0,
        "with 'dp.adaptive-clip': σ_b, the noise std (in examples) of each step's count of unclipped gradients; "
        "0: the expected batch size / 20 (the paper's choice); DP-SGD's σ must stay below 2·σ_b",
        low=0,
    )

    @property
    def enabled(self) -> bool:
        return self.epsilon > 0

    def check(self, cfg: RunConfig) -> None:
        """Raises ConfigError when DP is on and the run cannot give its guarantee: ``batch-order`` is
        ``fixed`` (DP-SGD's accounting needs Poisson-sampled batches), ``precision`` is not ``fp32`` or
        a model of ``model-group`` has a layer whose per-example gradient Opacus cannot compute
        (BatchNorm mixes examples)."""
        if not self.enabled:
            return
        if cfg.batch_order != "shuffle":
            raise ConfigError(
                f"run config key 'batch-order' = {cfg.batch_order!r} with 'dp.epsilon' > 0: DP-SGD samples each "
                "batch by Poisson sampling, which its accounting assumes; use 'shuffle'"
            )
        if cfg.precision != "fp32":
            raise ConfigError(f"run config key 'precision' = {cfg.precision!r} with 'dp.epsilon' > 0: use 'fp32'")
        require_private_trainable(cfg)


def require_private_trainable(cfg: RunConfig) -> None:
    """Raises ConfigError naming ``model-group`` when a member has a layer Opacus rejects."""
    from common.datasets import DATASETS
    from models.groups import MODEL_GROUPS

    info, group = DATASETS[cfg.dataset], MODEL_GROUPS[cfg.model_group]
    members = len(group.architectures) * len(group.heads)  # round-robin: every pairing within this many
    for partition in range(members):
        model = group.build(partition, info.num_classes, info.channels, info.image_size, 0, cfg.feature_dim)
        require_private_module(model, "model-group", cfg.model_group, group.architecture_for(partition))


def require_private_module(model: nn.Module, key: str, value: str, name: str) -> None:
    """Raises ConfigError naming run config ``key`` = ``value`` when ``model`` (``name``) has a layer
    whose per-example gradient Opacus cannot compute (``ModuleValidator``: BatchNorm mixes examples)."""
    from opacus.validators import ModuleValidator

    errors = ModuleValidator.validate(model, strict=False)
    if errors:
        raise ConfigError(
            f"run config key {key!r} = {value!r} with 'dp.epsilon' > 0: {name!r} has layers DP-SGD cannot train "
            f"({errors[0]}); choose models without BatchNorm (e.g. model groups 'hetero-cnn5', 'fedavgcnn', "
            "'mh-lenet')"
        )


@lru_cache(maxsize=64)
def dp_options(cfg: RunConfig) -> DPOptions:
    """The validated ``dp.*`` keys of ``cfg``.

    Raises:
        ConfigError: an unknown ``dp.*`` key or a value outside its declaration (:class:`DPOptions`).
    """
    return read_options(DPOptions, cfg, TABLE)


def planned_rounds(cfg: RunConfig, num_partitions: int) -> int:
    """The rounds a client is expected to train: ceil(R · K / N), K = max(1, floor(fraction-train · N)).

    The budget is spent over these; with ``fraction-train`` = 1 that is every round."""
    k = max(1, math.floor(round(cfg.fraction_train * num_partitions, 9)))
    return max(1, math.ceil(cfg.num_server_rounds * k / num_partitions))


#: ``(noise multiplier σ, sampling rate q, count)``: ``count`` Gaussian mechanisms of noise standard deviation
#: σ·sensitivity, each on a Poisson sample of rate q of the client's examples (q = 1: on all of them)
Event = tuple[float, float, int]
#: the width dp-accounting's PLD accountant discretizes the privacy loss in, for noise multipliers of 1 and
#: more (:func:`pld_discretization`): its estimate is pessimistic (an upper bound on ε) at any width; 1e-3
#: instead of the library's 1e-4 because a calibration composes some 20 times, and on DP-SGD events of this
#: project (q 0.08-0.16, 70-260 steps) it gave the same ε to four digits in about a tenth of the time
PLD_DISCRETIZATION = 1e-3


def merge_events(*events: Event) -> tuple[Event, ...]:
    """``events`` with the counts of equal (σ, q) summed, empty ones left out, sorted (a cache key)."""
    counts: dict[tuple[float, float], int] = {}
    for sigma, q, count in events:
        if count:
            counts[(sigma, q)] = counts.get((sigma, q), 0) + int(count)
    return tuple(sorted((sigma, q, count) for (sigma, q), count in counts.items()))


def dp_event(events: Iterable[Event]):
    """dp-accounting's ``DpEvent`` of ``events`` composed: each one a self-composed Poisson-sampled Gaussian
    (a plain Gaussian at q = 1)."""
    # imported here: it pulls in scipy.stats and scipy.signal (~1-2 s), which every ClientApp and ServerApp
    # process would otherwise pay at start-up, DP or not
    import dp_accounting

    parts = []
    for sigma, q, count in events:
        gaussian = dp_accounting.GaussianDpEvent(sigma)
        step = gaussian if q >= 1.0 else dp_accounting.PoissonSampledDpEvent(q, gaussian)
        parts.append(dp_accounting.SelfComposedDpEvent(step, count))
    return dp_accounting.ComposedDpEvent(parts)


def pld_discretization(sigma: float) -> float:
    """The PLD accountant's discretization width for events whose smallest noise multiplier is ``sigma``:
    :data:`PLD_DISCRETIZATION`, widened by 1/σ² below σ = 1. A Gaussian's privacy loss spans about 1/σ²,
    so the accountant's grid grows as 1/σ² too: at σ = 0.01 and 1e-3 one composition had not finished
    after two minutes. The ε there is in the hundreds or more, so the wider grid costs nothing relative
    to it, and it is still an upper bound."""
    return PLD_DISCRETIZATION / min(1.0, sigma) ** 2


def fresh_accountant(accountant: str = "pld", smallest_sigma: float = 1.0):
    """A new dp-accounting accountant for adding or removing one example: ``pld`` (privacy loss
    distributions, Koskela et al. AISTATS 2020, Doroshenko et al. PETS 2022: tight; it calibrates and
    enforces the budget), discretized for events of noise multipliers from ``smallest_sigma`` on
    (:func:`pld_discretization`), or ``rdp`` (Rényi DP, Mironov CSF 2017: looser; reported beside it)."""
    import dp_accounting

    relation = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
    if accountant == "pld":
        return dp_accounting.pld.PLDAccountant(relation, pld_discretization(smallest_sigma))
    return dp_accounting.rdp.RdpAccountant(neighboring_relation=relation)


@lru_cache(maxsize=4096)
def epsilon_of(events: tuple[Event, ...], delta: float, accountant: str = "pld") -> float:
    """ε at ``delta`` of ``events`` composed (:func:`fresh_accountant`; 0.0 for none), cached: every train
    message asks, and a calibration asks again for the σ it tried.

    Where the PLD accountant's ``get_epsilon`` gives no finite number, the smallest ε whose δ(ε) (its
    ``get_delta``) is at most ``delta``, to a relative 1e-12 by bisection: ``get_epsilon`` divides probability
    masses whose ratio e^ε overflows float64 from ε ≈ 709 on (σ 0.112, q 0.16, δ 1e-5: 637.6 after 35 steps,
    inf after 42, 789.9 after 49; the bisection gives 637.6, 714.8 and 788.9), and an infinite ε would end a
    client's training at a budget such as ε = 1000 halfway through the rounds it was calibrated for. RDP's ε
    is no stand-in there: 958.7 after 35 steps."""
    if not events:
        return 0.0
    smallest = min(sigma for sigma, _, _ in events)
    composed = fresh_accountant(accountant, smallest).compose(dp_event(events))
    epsilon = float(composed.get_epsilon(delta))
    if accountant != "pld" or math.isfinite(epsilon):
        return epsilon
    low, high = 0.0, 1.0
    while composed.get_delta(high) > delta:
        low, high = high, 2 * high
    while high - low > 1e-12 * high:
        mid = (low + high) / 2
        low, high = (low, mid) if composed.get_delta(mid) <= delta else (mid, high)
    return high


def unreachable(options: DPOptions, num_train: int, rounds: int, why: str) -> ConfigError:
    """The one refusal of a ``dp.epsilon`` target no noise multiplier up to :data:`MAX_NOISE_MULTIPLIER`
    meets, before the run (:func:`check_reachable`) or at a client's handshake (:func:`make_plan`)."""
    return ConfigError(
        f"run config key 'dp.epsilon' = {options.epsilon:g} cannot be met by a client of {num_train} examples over "
        f"{rounds} rounds with a noise multiplier of at most {MAX_NOISE_MULTIPLIER:g} ({why}); raise 'dp.epsilon', "
        "or train fewer rounds, epochs or steps"
    )


@dataclass(frozen=True)
class DPPlan:
    """One client's mechanisms for the run: what every one of its rounds spends.

    Attributes:
        noise_multiplier: σ of DP-SGD (noise std σ·clip-norm on each step's sum of clipped gradients).
        release_noise_multiplier: σ of a payload release (noise std σ·√2·payload-clip on the per-class sums
            and counts); 0.0 for a method without releases. Both calibrated by :func:`make_plan`.
        num_train: n, the client's training examples.
        batch_size: the expected Poisson batch size B (sample rate q = B / n, at most 1).
        steps_per_training: DP-SGD steps of one local training: local-epochs · ceil(n / B).
        trainings: local trainings per round (MH-pFedHNGD: 2, the global and the personal model).
        releases: payload releases computed from examples per round (0 or 1).
        rounds: the rounds the budget is planned for (:func:`planned_rounds`).
        options: the ``dp.*`` keys.
    """

    noise_multiplier: float
    release_noise_multiplier: float
    num_train: int
    batch_size: int
    steps_per_training: int
    trainings: int
    releases: int
    rounds: int
    options: DPOptions

    @property
    def sample_rate(self) -> float:
        return min(1.0, self.batch_size / self.num_train)

    @property
    def count_noise(self) -> float:
        """σ_b of ``dp.adaptive-clip`` (std of the noise on each step's count of unclipped gradients, in
        examples): ``dp.count-noise``, or with it 0 the expected batch min(B, n) / 20 (Andrew et al. 2021, §4)."""
        return self.options.count_noise or DEFAULT_COUNT_NOISE_SHARE * min(self.batch_size, self.num_train)

    @property
    def gradient_noise_multiplier(self) -> float:
        """The σ DP-SGD's gradient noise is drawn with (std σ·C on each step's sum of gradients clipped to C).

        Without ``dp.adaptive-clip`` it is :attr:`noise_multiplier`. With it each step also releases the count of
        unclipped gradients with noise σ_b (:attr:`count_noise`), and the pair is one Gaussian mechanism of noise
        multiplier σ when the gradients get σ_Δ = (σ⁻² − (2σ_b)⁻²)^(-1/2) (Andrew et al., NeurIPS 2021, Theorem 1:
        each example moves the count of b_i − 1/2 by 1/2). So the accountant's events stay those of σ, and the
        count costs noise on the gradients instead of ε. :func:`make_plan` ensures σ < 2σ_b."""
        if not self.options.adaptive_clip:
            return self.noise_multiplier
        return (self.noise_multiplier**-2 - (2 * self.count_noise) ** -2) ** -0.5

    def spend(self, trainings: int, releases: int) -> tuple[Event, ...]:
        """The events of ``trainings`` local trainings (each :attr:`steps_per_training` DP-SGD steps at rate
        q) and ``releases`` payload releases (q = 1)."""
        return merge_events(
            (self.noise_multiplier, self.sample_rate, trainings * self.steps_per_training),
            (self.release_noise_multiplier, 1.0, releases),
        )

    def epsilon(self, trainings: int, releases: int, accountant: str = "pld") -> float:
        """ε at ``dp.delta`` after ``trainings`` local trainings and ``releases`` payload releases."""
        return epsilon_of(self.spend(trainings, releases), self.options.delta, accountant)

    def rounds_left(self, spent: tuple[Event, ...], budget: float | None = None) -> int:
        """The most whole rounds (:attr:`trainings` trainings and :attr:`releases` releases each) that
        stay within ``budget`` (default ``dp.epsilon``; PLD) on top of the events ``spent``."""
        budget = self.options.epsilon if budget is None else budget

        def fits(rounds: int) -> bool:
            events = self.spend(rounds * self.trainings, rounds * self.releases)
            return epsilon_of(merge_events(*spent, *events), self.options.delta) <= budget

        if not fits(1):
            return 0
        # the plan's rounds fit an empty ledger exactly, so one more is the first guess that does not fit
        low, high = 1, self.rounds + 1
        while fits(high):
            low, high = high, 2 * high
        while high - low > 1:  # fits(low) and not fits(high)
            mid = (low + high) // 2
            low, high = (mid, high) if fits(mid) else (low, mid)
        return low


def _calibrate(events: Callable[[float], tuple[Event, ...]], target: float, delta: float) -> float:
    """The smallest σ in [:data:`MIN_NOISE_MULTIPLIER`, :data:`MAX_NOISE_MULTIPLIER`] (to a relative 1e-4)
    whose ``events(σ)`` spend at most ``target`` at ``delta`` (PLD): a factor-2 bracket by doubling or
    halving from σ = 1, then dp-accounting's ``calibrate_dp_mechanism`` within it, with the accountant
    discretized for the bracket's low end (:func:`pld_discretization`), raised where :func:`epsilon_of`,
    which the ledger enforces, finds it a little above ``target``.

    Raises:
        ValueError: even :data:`MAX_NOISE_MULTIPLIER` spends more than ``target``.
    """
    import dp_accounting

    def spent(sigma: float) -> float:
        return epsilon_of(events(sigma), delta)

    if spent(MIN_NOISE_MULTIPLIER) <= target:
        return MIN_NOISE_MULTIPLIER
    if spent(MAX_NOISE_MULTIPLIER) > target:
        raise ValueError(f"σ = {MAX_NOISE_MULTIPLIER:g} spends ε = {spent(MAX_NOISE_MULTIPLIER):.4g}")
    low, high = 0.5, 1.0
    while spent(high) > target:
        low, high = high, min(2 * high, MAX_NOISE_MULTIPLIER)
    while low > MIN_NOISE_MULTIPLIER and spent(low) <= target:
        low, high = max(low / 2, MIN_NOISE_MULTIPLIER), low
    sigma = dp_accounting.calibrate_dp_mechanism(
        lambda: fresh_accountant("pld", low),
        lambda s: dp_event(events(s)),
        target,
        delta,
        dp_accounting.ExplicitBracketInterval(low, high),
        tol=1e-4 * low,
    )
    # the library composed on the bracket's grid, a ledger composes on σ's (pld_discretization): the σ must
    # meet the target on the grid that enforces it
    while spent(sigma) > target:
        sigma *= 1 + 1e-4
    return float(sigma)


@lru_cache(maxsize=256)
def make_plan(cfg: RunConfig, num_train: int, num_partitions: int, trainings: int, releases: int) -> DPPlan | None:
    """The calibrated :class:`DPPlan` of a client with ``num_train`` examples, or None with DP off.

    Over the :func:`planned_rounds` rounds of ``trainings`` DP-SGD trainings and ``releases`` payload
    releases, both calibrated with dp-accounting's PLD accountant (:func:`_calibrate`):

    1. the release σ is the smallest whose releases alone spend ``dp.release-share`` · ``dp.epsilon`` at
       ``dp.delta``;
    2. the DP-SGD σ is the smallest whose steps, composed with those releases, spend ``dp.epsilon``.

    So the whole run spends ``dp.epsilon`` (PLD), and DP-SGD gets what the releases leave. With
    ``dp.adaptive-clip`` σ is unchanged: each step's noisy count is paid for by more noise on the gradients
    (:attr:`DPPlan.gradient_noise_multiplier`).

    Raises:
        ConfigError: the target cannot be met: ``dp.delta`` >= 1/n, no training example, or a calibrated
            σ would exceed :data:`MAX_NOISE_MULTIPLIER` (:func:`unreachable`); or with ``dp.adaptive-clip`` σ is
            not below 2·σ_b (naming ``dp.count-noise``).
    """
    options = dp_options(cfg)
    if not options.enabled:
        return None
    if num_train < 1 or options.delta >= 1.0 / num_train:
        raise ConfigError(
            f"run config key 'dp.delta' = {options.delta:g} with a client of {num_train} training examples: δ must be "
            f"below 1/n = {1.0 / max(num_train, 1):g} (a larger δ allows releasing one example outright)"
        )
    batch = int(cfg.batch_size)
    plan = DPPlan(
        0.0,
        0.0,
        num_train,
        batch,
        int(cfg.local_epochs) * math.ceil(num_train / batch),
        trainings,
        releases,
        planned_rounds(cfg, num_partitions),
        options,
    )
    steps, released = plan.rounds * trainings * plan.steps_per_training, plan.rounds * releases
    try:
        release_sigma = 0.0
        if released:
            release_sigma = _calibrate(
                lambda s: merge_events((s, 1.0, released)), options.release_share * options.epsilon, options.delta
            )
        sigma = _calibrate(
            lambda s: merge_events((s, plan.sample_rate, steps), (release_sigma, 1.0, released)),
            options.epsilon,
            options.delta,
        )
    except ValueError as exc:
        raise unreachable(options, num_train, plan.rounds, str(exc)) from exc
    plan = replace(plan, noise_multiplier=sigma, release_noise_multiplier=release_sigma)
    if options.adaptive_clip and sigma >= 2 * plan.count_noise:
        raise ConfigError(
            f"run config key 'dp.count-noise' = {options.count_noise:g} with 'dp.adaptive-clip' = true: a client of "
            f"{num_train} examples needs DP-SGD's σ = {sigma:.4g}, which must stay below 2·σ_b = "
            f"{2 * plan.count_noise:.4g} (the count's noise pays for part of σ: Andrew et al. 2021, Theorem 1); set "
            f"'dp.count-noise' above {sigma / 2:.4g} (0 gives the expected batch / 20), or raise 'batch-size'"
        )
    return plan


def largest_client(cfg: RunConfig) -> int:
    """The most training examples any client of ``cfg`` can hold: ``max-examples-per-client`` when set,
    else the data set's training and test splits together (the ``data-pool`` that pools them)."""
    from common.datasets import DATASETS

    info = DATASETS[cfg.dataset]
    return int(cfg.max_examples_per_client) or info.train_size + info.test_size


def check_reachable(cfg: RunConfig, trainings: int, releases: int) -> None:
    """Before the run, without data: refuse a ``dp.epsilon`` target that no client of ``cfg`` can meet.

    The needed σ falls as n grows (DP-SGD's sample rate B/n falls faster than its steps grow), so the
    target is checked for :func:`largest_client` over the rounds of ``num-clients`` partitions; a client
    with fewer examples may still fail at its handshake, with the same message (:func:`make_plan`).
    Nothing is checked with DP off or with ``num-clients`` = 0 (the federation's size is unknown).

    Raises:
        ConfigError: naming ``dp.epsilon`` (or ``dp.delta``), as :func:`make_plan`.
    """
    if dp_options(cfg).enabled and cfg.num_clients:
        make_plan(cfg, largest_client(cfg), int(cfg.num_clients), trainings, releases)


#: what sets a client's budget when its node does not cap it (``common.runtime.ClientRuntime.privacy_budget``)
EPSILON_KEY = "run config key 'dp.epsilon'"
#: the folder of the privacy ledgers in a client's state folder (:class:`PrivacyLedger`)
LEDGER_FOLDER = "dp-ledger"
#: the ``context.state`` record of the ledger of a client without any state folder
LEDGER_RECORD = "dp-ledger"


class PrivacyLedger:
    """A client's spent privacy budget: every DP mechanism it has run on its examples, over every run.

    It belongs to the client, not to a run: a JSON file ``<state folder>/dp-ledger/<dataset>-partition-<p>.json``
    (``common.runtime.ClientRuntime``: the node's ``state-dir``, else run config ``state-dir``, else the
    run's ``client-state`` folder), outside the ``state-key`` and rounds the server sends, so another
    state key, a replayed or repeated round, a resumed or a new run all continue from what was spent.
    It only grows: each charge is counted before its mechanism runs (:meth:`charge`), written and
    ``fsync``-ed (``common.files.atomic_write``), under an exclusive lock, so two messages at once cannot
    both spend the last of the budget. Only deleting the file resets it. A client without any state folder
    keeps it in ``context.state`` (record ``dp-ledger``), which lasts as long as its node.

    The file: ``{"events": [[σ, q, count], ...], "trainings": t, "releases": r}``, the composed
    :data:`Event` s and the local trainings and payload releases they came from.

    Args:
        path: the file, or None: record :data:`LEDGER_RECORD` of ``state``.
        state: the message's ``context.state`` (only read without ``path``).
    """

    def __init__(self, path: Path | None, state: RecordDict | None = None) -> None:
        self.path, self.state = path, state

    @property
    def where(self) -> str:
        """The ledger's file, or where it lives without one, for the errors."""
        return str(self.path) if self.path is not None else "record 'dp-ledger' of the node's context.state"

    def read(self) -> tuple[tuple[Event, ...], int, int]:
        """``(events, trainings, releases)`` spent so far; nothing spent when there is no ledger yet.

        Raises:
            ConfigError: the ledger cannot be read as one (naming it): the budget is unknown.
        """
        if self.path is None:
            record = self.state.config_records.get(LEDGER_RECORD) if self.state is not None else None
            text = str(record["json"]) if record is not None else None
        else:
            text = self.path.read_text() if self.path.exists() else None
        if text is None:
            return (), 0, 0
        try:
            data = json.loads(text)
            events = merge_events(*((float(s), float(q), int(c)) for s, q, c in data["events"]))
            if any(not (s > 0 and 0 < q <= 1 and c > 0) for s, q, c in events):
                raise ValueError(f"an event outside σ > 0, 0 < q <= 1, count > 0: {events}")
            return events, int(data["trainings"]), int(data["releases"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(
                f"the privacy ledger {self.where} is not a ledger ({exc}); what this client has spent is unknown, "
                "so it trains no more until a person deletes it"
            ) from exc

    def check(self, events: tuple[Event, ...], options: DPOptions, partition: int, key: str = EPSILON_KEY) -> None:
        """Refuse when ``events`` on top of what is spent would exceed ``options.epsilon`` (PLD, at ``dp.delta``),
        the budget config key ``key`` sets.

        Raises:
            BudgetSpent: naming the ledger's file.
            ConfigError: as :meth:`read`.
        """
        self._refuse_beyond(self.read(), events, options, partition, key)

    def charge(
        self,
        events: tuple[Event, ...],
        trainings: int,
        releases: int,
        options: DPOptions,
        partition: int,
        key: str = EPSILON_KEY,
    ) -> None:
        """Add ``events`` (from ``trainings`` local trainings and ``releases`` releases) to the ledger, durably,
        before the mechanisms run; refused as :meth:`check` when they would exceed the budget."""
        with self._locked():
            spent = self.read()
            self._refuse_beyond(spent, events, options, partition, key)
            data = {
                "events": [list(event) for event in merge_events(*spent[0], *events)],
                "trainings": spent[1] + trainings,
                "releases": spent[2] + releases,
            }
            text = json.dumps(data, indent=1) + "\n"
            if self.path is None:
                self.state.config_records[LEDGER_RECORD] = ConfigRecord({"json": text})
            else:
                atomic_write(self.path, lambda f: f.write(text.encode()))

    def _refuse_beyond(
        self,
        spent: tuple[tuple[Event, ...], int, int],
        events: tuple[Event, ...],
        options: DPOptions,
        partition: int,
        key: str,
    ) -> None:
        after = epsilon_of(merge_events(*spent[0], *events), options.delta)
        if after > options.epsilon:
            before = epsilon_of(spent[0], options.delta)
            raise BudgetSpent(
                f"partition {partition}: its privacy budget ({key} = {options.epsilon:g}) allows no more: "
                f"{spent[1]} local trainings and {spent[2]} payload releases spent ε = {before:.4g} at δ = "
                f"{options.delta:g}, and this message would bring it to {after:.4g}; the budget is kept in "
                f"{self.where}, and only deleting it resets it"
            )

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """An exclusive lock on the ledger's file (``<file>.lock``) while the body runs; none without a file
        (``context.state`` belongs to one message at a time)."""
        if self.path is None:
            yield
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_name(self.path.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            yield


class BudgetSpent(RuntimeError):
    """A client's next training or release would exceed ``dp.epsilon``: it sends nothing more."""


def secret_generator(device: torch.device | str = "cpu") -> torch.Generator:
    """A generator seeded from the operating system's entropy (never from the run's seed, which the
    server knows)."""
    return torch.Generator(device=device).manual_seed(secrets.randbits(63))


@torch.no_grad()
def clipped_class_sums(
    rows: torch.Tensor, labels: torch.Tensor, num_classes: int, clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """What :func:`noisy_class_means` noises: per-class sums of the rows clipped to L2 norm ``clip``,
    float64 [C, w], and the counts scaled by ``clip``, float64 [C] (so one example moves the pair by at
    most √2·clip in L2). ``rows`` float [n, w], ``labels`` int64 [n]."""
    rows = rows.double().cpu()
    norms = rows.norm(dim=1, keepdim=True).clamp_min(1e-12)
    clipped = rows * (clip / norms).clamp(max=1.0)
    sums = torch.zeros(num_classes, rows.shape[1], dtype=torch.float64).index_add_(0, labels.cpu(), clipped)
    return sums, clip * torch.bincount(labels.cpu(), minlength=num_classes).double()


@torch.no_grad()
def noisy_class_means(
    rows: torch.Tensor, labels: torch.Tensor, num_classes: int, clip: float, noise_multiplier: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-class means released by the Gaussian mechanism on clipped per-class sums and counts.

    Each example i contributes v_i = [clip_c(r_i) in row y_i, c·e_{y_i}] with clip_c(r) =
    r·min(1, c/‖r‖₂), so adding or removing one example moves the released vector (the [C, w] sums
    and the c-scaled [C] counts, every class, held or not) by at most Δ = √2·c in L2; Gaussian noise
    of standard deviation σ·Δ is added to every entry (Dwork & Roth 2014, Thm A.1 via RDP). The rest
    is post-processing: the noisy count n̂_c = (noisy scaled count)/c, a class is kept when
    n̂_c >= max(1, 3·σ·√2) (its count's noise std is σ·√2 examples), and its mean is noisy sum / n̂_c.
    So neither the counts nor which classes the client holds are released exactly.

    Args:
        rows: float [n, w], one row per example (representations, logits).
        labels: int64 [n] class ids in [0, num_classes).
        clip: c, the L2 bound of one row (``dp.payload-clip``).
        noise_multiplier: σ.

    Returns:
        ``(means float32 [k, w], classes int64 [k])`` on the CPU, classes ascending; k may be 0.
    """
    sums, counts = clipped_class_sums(rows, labels, num_classes, clip)
    std = noise_multiplier * math.sqrt(2.0) * clip
    generator = secret_generator()
    sums += std * torch.randn(sums.shape, generator=generator, dtype=torch.float64)
    counts += std * torch.randn(counts.shape, generator=generator, dtype=torch.float64)
    noisy_counts = counts / clip
    keep = noisy_counts >= max(1.0, COUNT_THRESHOLD_STDS * noise_multiplier * math.sqrt(2.0))
    classes = torch.nonzero(keep).flatten()
    return (sums[classes] / noisy_counts[classes, None]).float(), classes
