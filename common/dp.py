"""Record-level differential privacy of every upload (run config table ``[dp]``, off by default).

What is protected: one training example of one client (add or remove one example, the relation
of Flower's accountant ``NeighboringRelation.ADD_OR_REMOVE_ONE``), against everyone who sees what
the client sends: the server, the other clients and the wire. The mechanisms run inside the
ClientApp, on the SuperNode, before the reply exists (docs/privacy.md, "Differential privacy"):

- **DP-SGD** (Abadi et al., CCS 2016) in every local training of every method, with Opacus
  (``GradSampleModule`` + ``DPOptimizer``, Poisson sampling ``UniformWithReplacementSampler``):
  each example's gradient is clipped to ``dp.clip-norm`` and Gaussian noise of standard deviation
  σ·``clip-norm`` is added to each step's sum. Everything computed from the trained model alone
  (a shared model, a head, MH-pFedHN's update, the model that computes a prototype) is then
  post-processing of DP-SGD.
- **The Gaussian mechanism on per-class sums** for a payload computed from the examples themselves
  (FedGH's LARs, FedProto/FedTGP prototypes, FD's logits, FedRE's entangled representation):
  :func:`noisy_class_means`. The class counts and the set of classes a client holds are released
  through the same mechanism, never exactly.

Accounting is Flower's ``RdpAccountant`` (dp-accounting's RDP): per client, every DP-SGD step is a
Poisson-sampled Gaussian event (q = batch-size / n) and every payload release a Gaussian event
(q = 1). The client's server-side sampling (``fraction-train``) gives no amplification: the
server chooses, and sees, who trains, so the accountant composes exactly the rounds the client
took part in. σ is calibrated per client (it depends on n) with dp-accounting's
``calibrate_dp_mechanism`` so that the rounds the client is expected to train
(:func:`planned_rounds`) spend ``dp.epsilon`` at ``dp.delta``; a client sampled more often stops
training once its next round would exceed ``dp.epsilon`` (:class:`PrivacyLedger`).

The noise and the Poisson sampling draw from the operating system's entropy, not from the run's
seed: the server knows the seed and could otherwise subtract the noise. DP runs are therefore
not bit-reproducible.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, replace
from functools import lru_cache

import torch
from flwr.serverapp import (
    GaussianPrivacyEvent,
    NeighboringRelation,
    PrivacyConfig,
    RdpAccountant,
    SamplingMethod,
)
from torch import nn

from common.config import RunConfig, read_options
from common.errors import ConfigError
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
    clip_norm: float = option(1.0, "DP-SGD: each example's gradient is clipped to this L2 norm", low=0, low_open=True)
    payload_clip: float = option(
        1.0,
        "a payload computed from examples (prototypes, LARs, logits, FedRE's representation): each example's row "
        "is clipped to this L2 norm before the per-class sums are noised",
        low=0,
        low_open=True,
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


@dataclass(frozen=True)
class DPPlan:
    """One client's mechanisms for the run: what every one of its rounds spends.

    Attributes:
        noise_multiplier: σ, the same for DP-SGD (noise std σ·clip_norm) and for a payload release
            (noise std σ·√2·payload_clip); calibrated by :func:`make_plan`.
        num_train: n, the client's training examples (the accountant's population).
        batch_size: the expected Poisson batch size B (sample rate q = B / n, at most 1).
        steps_per_training: DP-SGD steps of one local training: local-epochs · ceil(n / B).
        trainings: local trainings per round (MH-pFedHNGD: 2, the global and the personal model).
        releases: payload releases computed from examples per round (0 or 1).
        rounds: the rounds the budget is planned for (:func:`planned_rounds`).
        options: the ``dp.*`` keys.
    """

    noise_multiplier: float
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

    def epsilon(self, trainings: int, releases: int) -> float:
        """ε at ``dp.delta`` after ``trainings`` local trainings and ``releases`` payload releases
        (Flower's ``RdpAccountant``; 0.0 before any)."""
        return _epsilon(self, trainings, releases)

    def rounds_within_budget(self) -> int:
        """The most whole rounds whose composition stays within ``dp.epsilon`` (>= :attr:`rounds`)."""
        return _rounds_within_budget(self)


@lru_cache(maxsize=4096)
def _epsilon(plan: DPPlan, trainings: int, releases: int) -> float:
    """:meth:`DPPlan.epsilon`, cached: one RDP composition takes ~0.1 s and every train reply asks."""
    if trainings == 0 and releases == 0:
        return 0.0
    return _accountant(plan, trainings, releases).get_epsilon(plan.options.delta)


@lru_cache(maxsize=256)
def _rounds_within_budget(plan: DPPlan) -> int:
    """:meth:`DPPlan.rounds_within_budget`, cached."""
    low, high = plan.rounds, 2 * plan.rounds
    while plan.epsilon(high * plan.trainings, high * plan.releases) <= plan.options.epsilon:
        low, high = high, 2 * high
    while high - low > 1:  # ε(low rounds) <= target < ε(high rounds)
        mid = (low + high) // 2
        if plan.epsilon(mid * plan.trainings, mid * plan.releases) <= plan.options.epsilon:
            low = mid
        else:
            high = mid
    return low


def _accountant(plan: DPPlan, trainings: int, releases: int) -> RdpAccountant:
    """Flower's RDP accountant with ``trainings`` local trainings and ``releases`` releases composed."""
    n = plan.num_train
    accountant = RdpAccountant(
        PrivacyConfig(
            target_delta=plan.options.delta,
            population_size=n,
            neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
            sampling_method=SamplingMethod.POISSON,
        )
    )
    if trainings:
        step = GaussianPrivacyEvent(plan.noise_multiplier, min(plan.batch_size, n), n)
        accountant.compose(step, trainings * plan.steps_per_training)
    if releases:
        accountant.compose(GaussianPrivacyEvent(plan.noise_multiplier, n, n), releases)
    return accountant


@lru_cache(maxsize=256)
def make_plan(cfg: RunConfig, num_train: int, num_partitions: int, trainings: int, releases: int) -> DPPlan | None:
    """The calibrated :class:`DPPlan` of a client with ``num_train`` examples, or None with DP off.

    σ is the smallest noise multiplier (dp-accounting's ``calibrate_dp_mechanism`` on the same RDP
    events Flower's accountant composes) for which :func:`planned_rounds` rounds of ``trainings``
    DP-SGD trainings and ``releases`` payload releases spend at most ``dp.epsilon`` at ``dp.delta``.

    Raises:
        ConfigError: the target cannot be met: ``dp.delta`` >= 1/n, no training example, or the
            calibrated σ would exceed :data:`MAX_NOISE_MULTIPLIER`.
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
        num_train,
        batch,
        int(cfg.local_epochs) * math.ceil(num_train / batch),
        trainings,
        releases,
        planned_rounds(cfg, num_partitions),
        options,
    )
    q = plan.sample_rate
    # imported here: it pulls in scipy.stats and scipy.signal (~1-2 s), which every ClientApp and ServerApp
    # process would otherwise pay at start-up, DP or not
    import dp_accounting

    def composed(sigma: float) -> dp_accounting.DpEvent:
        gaussian = dp_accounting.GaussianDpEvent(sigma)
        step = dp_accounting.PoissonSampledDpEvent(q, gaussian)
        events = [dp_accounting.SelfComposedDpEvent(step, plan.rounds * trainings * plan.steps_per_training)]
        if releases:
            release = dp_accounting.PoissonSampledDpEvent(1.0, gaussian)
            events.append(dp_accounting.SelfComposedDpEvent(release, plan.rounds * releases))
        return dp_accounting.ComposedDpEvent(events)

    def spent(sigma: float) -> float:
        accountant = dp_accounting.rdp.RdpAccountant()
        return accountant.compose(composed(sigma)).get_epsilon(options.delta)

    if spent(MIN_NOISE_MULTIPLIER) <= options.epsilon:
        return replace(plan, noise_multiplier=MIN_NOISE_MULTIPLIER)
    try:
        sigma = dp_accounting.calibrate_dp_mechanism(
            dp_accounting.rdp.RdpAccountant,
            composed,
            options.epsilon,
            options.delta,
            dp_accounting.ExplicitBracketInterval(MIN_NOISE_MULTIPLIER, MAX_NOISE_MULTIPLIER),
            tol=1e-4,
        )
    except (dp_accounting.mechanism_calibration.NoBracketIntervalFoundError, ValueError) as exc:
        raise ConfigError(
            f"run config key 'dp.epsilon' = {options.epsilon:g} cannot be met by a client of {num_train} examples over "
            f"{plan.rounds} rounds with a noise multiplier of at most {MAX_NOISE_MULTIPLIER:g} ({exc}); raise "
            "'dp.epsilon', or train fewer rounds, epochs or steps"
        ) from exc
    return replace(plan, noise_multiplier=float(sigma))


class PrivacyLedger(nn.Module):
    """A client's spent budget, kept in its state like a model (so a resumed run rolls it back with
    the rest of the client's state): local trainings and payload releases so far, the rounds they
    fell in and the last of them, and the σ they ran at."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("rounds", torch.zeros((), dtype=torch.int64))
        self.register_buffer("last_round", torch.zeros((), dtype=torch.int64))
        self.register_buffer("trainings", torch.zeros((), dtype=torch.int64))
        self.register_buffer("releases", torch.zeros((), dtype=torch.int64))
        self.register_buffer("noise_multiplier", torch.zeros((), dtype=torch.float64))


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
