"""Run config ``dp.adaptive-clip``: DP-SGD's clip follows a quantile of the per-example gradient norms (Andrew et al.,
NeurIPS 2021), its noisy count is paid for inside the calibrated σ (their Theorem 1), each client keeps its clip
between rounds and reports it, and with the switch off DP-SGD is Opacus's per-example step (to float
rounding: tests/test_dp_ghost_clipping.py)."""

import math

import pytest
import torch
import torch.nn.functional as F
from opacus import GradSampleModule
from opacus.grad_sample import GradSampleModuleFastGradientClipping
from opacus.optimizers import AdaClipDPOptimizer, DPOptimizerFastGradientClipping
from opacus.utils.fast_gradient_clipping_utils import DPTensorFastGradientClipping
from opacus.utils.uniform_sampler import UniformWithReplacementSampler
from torch import nn

import common.training
from common.adaptive_clip import GhostQuantileClip, QuantileClipDPOptimizer
from common.config import ConfigError, RunConfig
from common.dp import epsilon_of, make_plan, merge_events
from conftest import client_runtime, federation, make_run_config, reference_dp_sgd, train_config

ADAPTIVE = {"dp.adaptive-clip": True}


def per_example_norms(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """float [n]: the L2 norm over all parameters of each example's own cross-entropy gradient, one backward each
    (independent of Opacus's per-example gradients)."""
    norms = []
    for i in range(len(y)):
        model.zero_grad()
        F.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        norms.append(float(torch.sqrt(sum(p.grad.pow(2).sum() for p in model.parameters()))))
    return torch.tensor(norms)


def tiny_problem(n: int = 256):
    """A two-layer net and n examples whose gradient norms spread over about a decade (input scales 0.1-10)."""
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 3))
    scales = torch.logspace(-1.0, 1.0, n)[torch.randperm(n, generator=generator)]
    x = torch.randn(n, 10, generator=generator) * scales[:, None]
    return model, x, torch.randint(3, (n,), generator=generator)


def adapted_clip(
    model, x, y, start: float, steps: int, quantile: float = 0.5, batch: int = 64, ghost: bool = False
) -> float:
    """C after ``steps`` adaptive DP-SGD steps (σ = 1, the paper's η_C = 0.2 and σ_b = B/20, Poisson batches of
    expected size ``batch``) on a model that does not move (lr 0), so the norms' quantiles stay put; ``ghost``:
    by ghost clipping, the count from the first pass's norms (``GhostQuantileClip``)."""
    if ghost:
        return ghost_adapted_clip(model, x, y, start, steps, quantile, batch)
    sampled = GradSampleModule(model)
    private = QuantileClipDPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.0),
        noise_multiplier=1.0,
        target_quantile=quantile,
        clip_lr=0.2,
        count_noise=batch / 20,
        max_grad_norm=start,
        expected_batch_size=batch,
        generator=torch.Generator().manual_seed(1),
    )
    sampler = UniformWithReplacementSampler(
        num_samples=len(y), sample_rate=batch / len(y), generator=torch.Generator().manual_seed(2), steps=steps
    )
    for idx in sampler:
        private.zero_grad(set_to_none=True)
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        private.step()
    sampled._close()
    return private.max_grad_norm


def ghost_steps(model, start, quantile, batch, count_noise=None, sigma=1.0):
    """(module, optimiser, clip) of adaptive DP-SGD by ghost clipping as ``common.training`` builds them (lr 0)."""
    sampled = GradSampleModuleFastGradientClipping(model, max_grad_norm=start, use_ghost_clipping=True)
    count_noise = batch / 20 if count_noise is None else count_noise
    private = DPOptimizerFastGradientClipping(
        torch.optim.SGD(model.parameters(), lr=0.0),
        noise_multiplier=sigma and (sigma**-2 - (2 * count_noise) ** -2) ** -0.5,
        max_grad_norm=start,
        expected_batch_size=batch,
        generator=torch.Generator().manual_seed(1),
    )
    clip = GhostQuantileClip(
        target_quantile=quantile,
        clip_lr=0.2 if count_noise > 1e-6 else 0.5,
        count_noise=count_noise,
        expected_batch_size=batch,
        generator=torch.Generator().manual_seed(3),
    )
    return sampled, private, clip


def ghost_step(sampled, private, clip, x, y):
    """One step on (x, y) (empty: a pure noise step), then the clip's update."""
    private.zero_grad(set_to_none=True)
    if len(y) == 0:
        for p in sampled.parameters():
            p.grad = torch.zeros_like(p)
        private.step()
        clip.step(sampled, private, None)
        return
    losses = F.cross_entropy(sampled(x), y, reduction="none")
    DPTensorFastGradientClipping(sampled, private, losses, "mean").backward()
    private.step()
    clip.step(sampled, private, sampled.per_sample_gradient_norms)


def ghost_adapted_clip(model, x, y, start, steps, quantile, batch):
    sampled, private, clip = ghost_steps(model, start, quantile, batch)
    sampler = UniformWithReplacementSampler(
        num_samples=len(y), sample_rate=batch / len(y), generator=torch.Generator().manual_seed(2), steps=steps
    )
    for idx in sampler:
        ghost_step(sampled, private, clip, x[idx], y[idx])
    sampled._close()
    return private.max_grad_norm


@pytest.mark.parametrize("ghost", [False, True], ids=["per-example", "ghost"])
@pytest.mark.parametrize("start", [0.01, 1000.0])
def test_the_clip_moves_to_the_target_quantile_of_the_per_example_gradient_norms(start, ghost):
    model, x, y = tiny_problem()
    norms = per_example_norms(model, x, y)
    median = float(norms.median())
    assert norms.max() / norms.min() > 5 and not 0.01 < start / median < 100  # far off, on a spread of norms
    after = {steps: adapted_clip(model, x, y, start, steps, ghost=ghost) for steps in (20, 200)}
    # geometric steps of at most exp(0.2 · 0.5) each: it heads for the median from either side ...
    assert (after[20] > start) == (start < median) and abs(math.log(after[20] / start)) > 1.0
    # ... and settles within a factor of 2 of it, with about half the examples unclipped
    assert 0.5 < after[200] / median < 2.0, (after, median)
    assert 0.3 < float((norms <= after[200]).double().mean()) < 0.7
    # another target quantile settles at its own quantile of the norms
    high = adapted_clip(model, x, y, start, 200, quantile=0.9, ghost=ghost)
    assert 0.75 < float((norms <= high).double().mean()) <= 1.0 and high > after[200]


def test_the_update_is_the_papers_on_the_centred_count_over_the_expected_batch():
    # σ_b tiny and σ = 0: b̃ is the exact count. 10 examples, 4 of them unclipped, against an expected batch of 20:
    # b̃ = (4 - 10/2) / 20 + 1/2 = 0.45 (Opacus's AdaClipDPOptimizer divides by the 10 sampled, which the Poisson
    # sampling keeps secret: 0.4)
    model = nn.Linear(4, 1, bias=False)
    sampled = GradSampleModule(model)
    private = QuantileClipDPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.0),
        noise_multiplier=0.0,
        target_quantile=0.6,
        clip_lr=0.5,
        count_noise=1e-12,
        max_grad_norm=2.0,
        expected_batch_size=20,
        generator=torch.Generator().manual_seed(0),
    )
    # loss = w·x_i summed over the batch / B: per-example gradients x_i (norms 1, 1, 1, 1, 3, ...)
    x = torch.tensor([[1.0, 0, 0, 0]] * 4 + [[3.0, 0, 0, 0]] * 6)
    private.zero_grad(set_to_none=True)
    model(x).mean().backward()
    private.step()
    assert private.max_grad_norm == pytest.approx(2.0 * math.exp(-0.5 * (0.45 - 0.6)), rel=1e-6)
    # an empty Poisson sample counts nothing (b̃ = 1/2) and still steps; Opacus's own optimiser fails on it
    private.zero_grad(set_to_none=True)
    model(x[:0]).sum().backward()
    before = private.max_grad_norm
    private.step()
    assert private.max_grad_norm == pytest.approx(before * math.exp(-0.5 * (0.5 - 0.6)), rel=1e-6)
    opacus_own = AdaClipDPOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.0),
        noise_multiplier=0.0,
        target_unclipped_quantile=0.6,
        clipbound_learning_rate=0.5,
        max_clipbound=1e9,
        min_clipbound=0.0,
        unclipped_num_std=1e-12,
        max_grad_norm=2.0,
        expected_batch_size=20,
    )
    opacus_own.zero_grad(set_to_none=True)
    model(x[:0]).sum().backward()
    with pytest.raises(RuntimeError):
        opacus_own.step()
    sampled._close()


def test_under_ghost_clipping_the_update_is_the_same_centred_count_over_the_expected_batch():
    # as above: 10 examples, 4 unclipped (norm 1 against C = 2), an expected batch of 20: b̃ = 0.45
    model = nn.Linear(4, 1, bias=False)
    sampled, private, clip = ghost_steps(model, 2.0, 0.6, 20, count_noise=1e-12, sigma=0.0)
    x = torch.tensor([[1.0, 0, 0, 0]] * 4 + [[3.0, 0, 0, 0]] * 6)
    private.zero_grad(set_to_none=True)
    DPTensorFastGradientClipping(sampled, private, model(x)[:, 0], "mean").backward()
    private.step()
    clip.step(sampled, private, sampled.per_sample_gradient_norms)
    assert private.max_grad_norm == sampled.max_grad_norm == pytest.approx(2.0 * math.exp(-0.5 * (0.45 - 0.6)))
    before = private.max_grad_norm
    ghost_step(sampled, private, clip, x[:0], torch.zeros(0, dtype=torch.int64))  # counts nothing: b̃ = 1/2
    assert private.max_grad_norm == pytest.approx(before * math.exp(-0.5 * (0.5 - 0.6)), rel=1e-6)
    sampled._close()


def private_client(rc, partition=0):
    """A ClientRuntime of ``partition`` for a train message of round 1, its DP plan made as the ClientApp makes it."""
    from common.runtime import ClientRuntime
    from methods.registry import client_procedure

    client = ClientRuntime(client_runtime(rc, partition).context, "in-memory", 1, trains=True)
    client.dp = client_procedure(RunConfig.from_dict(rc)).dp_plan(client)
    return client


def test_the_recorded_epsilon_is_an_independent_accountants_of_the_noise_actually_drawn(run_config, monkeypatch):
    import dp_accounting
    import opacus.optimizers.optimizer_fast_gradient_clipping as ghost

    import common.adaptive_clip

    rc = run_config(
        method="local", dataset="mnist", **ADAPTIVE, **{"dp.epsilon": 8.0, "num-server-rounds": 1, "local-epochs": 2}
    )
    client = private_client(rc)
    plan, n = client.dp, len(client.data.train_y)
    # adaptive clipping leaves the calibration alone: the same σ as without it, planned to spend ε = 8
    assert (
        plan.noise_multiplier
        == make_plan(RunConfig.from_dict({**rc, "dp.adaptive-clip": False}), n, 4, 1, 0).noise_multiplier
    )
    # record every noise the training draws (DP-SGD by ghost clipping: the optimiser's on the gradients, the count's
    # in GhostQuantileClip), and the clip it draws the gradients' noise for
    draws, clips, original_noise = [], [], ghost._generate_noise
    original_add = ghost.DPOptimizerFastGradientClipping.add_noise
    for module in (ghost, common.adaptive_clip):
        monkeypatch.setattr(
            module,
            "_generate_noise",
            lambda std, reference, **kw: draws.append((std, reference.dim())) or original_noise(std, reference, **kw),
        )
    monkeypatch.setattr(
        ghost.DPOptimizerFastGradientClipping,
        "add_noise",
        lambda self: clips.append(self.max_grad_norm) or original_add(self),
    )
    common.training.train_personal_model(client, train_config(rc, 1))
    recorded = client.privacy_metrics()
    steps = len(clips)
    assert steps == plan.steps_per_training == 2 * math.ceil(n / 32)
    count_stds = [std for std, dim in draws if dim == 0]
    gradient_stds = [std for std, dim in draws if dim > 0]
    assert len(count_stds) == steps and len(gradient_stds) == steps * len(list(client.model.parameters()))
    per_step = len(gradient_stds) // steps
    sigma_gradient = {gradient_stds[t * per_step + i] / clips[t] for t in range(steps) for i in range(per_step)}
    sigma_count = set(count_stds)
    assert len(sigma_count) == 1 and max(sigma_gradient) / min(sigma_gradient) < 1 + 1e-9
    sigma_gradient, sigma_count = min(sigma_gradient), sigma_count.pop()
    assert sigma_count == 32 / 20 and recorded["dp-count-noise"] == sigma_count
    assert recorded["dp-gradient-noise-multiplier"] == pytest.approx(sigma_gradient, rel=1e-12)
    # the drawn noise as one Gaussian mechanism (gradient sum at sensitivity C, count at 1/2; Theorem 1), accounted
    # independently by dp-accounting's PLD accountant at its default (finer) grid
    joint = (sigma_gradient**-2 + (2 * sigma_count) ** -2) ** -0.5
    q = 32 / n
    relation = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE

    def pld(*events):
        parts = [
            dp_accounting.SelfComposedDpEvent(
                dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(s)), steps
            )
            for s in events
        ]
        accountant = dp_accounting.pld.PLDAccountant(relation)
        return accountant.compose(dp_accounting.ComposedDpEvent(parts)).get_epsilon(1e-5)

    assert recorded["dp-epsilon"] == pytest.approx(pld(joint), rel=2e-3)
    assert 8.0 * (1 - 2e-3) <= recorded["dp-epsilon"] <= 8.0  # the whole budget: calibration still holds
    # the count is not free: the gradients' noise alone would claim a smaller ε. Nor can it be accounted as an event
    # of its own beside the gradients': two events each Poisson-sampled on their own claim less too (7.63 against
    # 8.00 here), but both mechanisms see the same sample, so they are one mechanism
    assert pld(sigma_gradient) < 0.97 * recorded["dp-epsilon"]
    assert pld(sigma_gradient, 2 * sigma_count) < 0.97 * recorded["dp-epsilon"]
    # the rows' RDP beside it, of the same events
    assert recorded["dp-epsilon-rdp"] == epsilon_of(merge_events((plan.noise_multiplier, q, steps)), 1e-5, "rdp")


def test_with_adaptive_clip_off_dp_sgd_is_opacus_per_example_dp_sgd_and_its_epsilon_the_plain_one(monkeypatch):
    plain = make_run_config(method="local", dataset="mnist", **{"dp.epsilon": 8.0, "max-examples-per-client": 80})
    # the adaptive keys set, the switch off: they change nothing
    off = {**plain, "dp.target-quantile": 0.9, "dp.clip-lr": 1.0, "dp.count-noise": 0.1}
    client = client_runtime(plain)
    n = len(client.data.train_y)
    plans = [make_plan(RunConfig.from_dict(rc), n, 4, 1, 1) for rc in (plain, off)]
    assert plans[0].noise_multiplier == plans[1].noise_multiplier == plans[1].gradient_noise_multiplier
    assert plans[0].release_noise_multiplier == plans[1].release_noise_multiplier
    assert plans[0].epsilon(2, 2) == plans[1].epsilon(2, 2) and plans[0].epsilon(2, 2, "rdp") == plans[1].epsilon(
        2, 2, "rdp"
    )

    # the same training, the OS's entropy replaced by seeded generators in both: the same weights
    def seeded():
        seeds = iter(range(10, 20))
        return lambda device="cpu": torch.Generator(device).manual_seed(next(seeds))

    config = train_config(off, 1)
    initial = {k: v.clone() for k, v in client.model.state_dict().items()}
    monkeypatch.setattr(common.training, "secret_generator", seeded())
    stats = common.training.train_supervised(
        client.model, client.data, config, torch.device("cpu"), torch.Generator().manual_seed(3), dp=plans[1]
    )
    assert "dp-clip-norm" not in stats
    reference = client_runtime(plain).model
    reference.load_state_dict(initial)
    reference.train()
    reference_dp_sgd(reference, client.data, config, plans[0], torch.Generator().manual_seed(3), seeded())
    trained = client.model.state_dict()
    # ghost clipping sums the clipped gradients in another order than the materialised per-example gradients:
    # the same weights to float rounding
    for k, v in reference.state_dict().items():
        torch.testing.assert_close(trained[k], v, rtol=1e-5, atol=1e-6)
    assert any(not torch.equal(trained[k], v) for k, v in initial.items())  # it did train


def test_each_client_keeps_its_clip_between_rounds_and_the_rows_record_it(run_config):
    rc = run_config(
        method="local",
        dataset="mnist",
        **ADAPTIVE,
        **{"dp.epsilon": 1e3, "dp.clip-norm": 0.01, "num-clients": 2, "num-server-rounds": 3},
    )
    strategy, grid = federation(rc)
    strategy.start(grid)
    for partition in ("0", "1"):
        entries = [row["dp_per_client"][partition] for row in strategy.rows]
        clips = [entry["clip_norm"] for entry in entries]
        # far below the norms, it rises every round from where the round before left it (5 steps of at most
        # exp(0.2 · 0.5) each from 0.01: without the state it would restart at 0.01 and stay below 0.0165)
        assert 0.01 < clips[0] < clips[1] < clips[2] and clips[2] > 0.0165 * 1.2, clips
        plan = make_plan(RunConfig.from_dict(rc), 160, 2, 1, 0)
        assert entries[-1]["count_noise"] == 32 / 20 == plan.count_noise
        assert entries[-1]["gradient_noise_multiplier"] == plan.gradient_noise_multiplier > plan.noise_multiplier
        assert entries[-1]["noise_multiplier"] == plan.noise_multiplier


@pytest.mark.parametrize(
    "key, value, allowed",
    [
        ("dp.target-quantile", 1.5, "finite numbers >= 0.01 and <= 0.99"),
        ("dp.target-quantile", 0.0, "finite numbers >= 0.01 and <= 0.99"),
        ("dp.clip-lr", 0.0, "finite numbers > 0 and <= 10"),
        ("dp.count-noise", -1.0, "finite numbers >= 0"),
        ("dp.adaptive-clip", "yes", "true, false"),
    ],
)
def test_a_bad_adaptive_clip_value_is_refused_before_the_run_naming_the_key_and_its_range(key, value, allowed):
    from methods.registry import build_run

    rc = make_run_config(**{**ADAPTIVE, "dp.epsilon": 8.0, key: value})
    with pytest.raises(ConfigError, match=f"'{key}' = .* is invalid: allowed values are {allowed}"):
        build_run(RunConfig.from_dict(rc))


def test_a_count_noise_too_small_for_the_calibrated_sigma_is_refused_before_the_run():
    from methods.registry import build_run

    # σ_b = 0.1 leaves no room: σ must stay below 2·σ_b (Theorem 1), and ε = 8 here needs σ near 1
    rc = make_run_config(**ADAPTIVE, **{"dp.epsilon": 8.0, "dp.count-noise": 0.1})
    with pytest.raises(
        ConfigError, match=r"'dp.count-noise' = 0.1 with 'dp.adaptive-clip' = true: .* below 2·σ_b = 0.2"
    ):
        build_run(RunConfig.from_dict(rc))
    build_run(RunConfig.from_dict({**rc, "dp.count-noise": 0.0}))  # the paper's B/20 = 1.6 leaves room
