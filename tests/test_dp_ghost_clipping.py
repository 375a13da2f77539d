"""DP-SGD by ghost clipping (``common.training.private_training``): the clipped and noised sum of per-example
gradients without materialising them, equal to Opacus's per-example DP-SGD to float rounding whatever the clip
and whichever per-example loss; a loss that runs a companion model takes the per-example path."""

import pytest
import torch
import torch.nn.functional as F

import common.training
from common.config import RunConfig
from common.dp import make_plan
from conftest import client_runtime, make_run_config, reference_dp_sgd, train_config
from models.cnn import build_cnn


def seeded():
    """A stand-in for ``common.dp.secret_generator``: seeded generators, in the order the code asks."""
    seeds = iter(range(10, 20))
    return lambda device="cpu": torch.Generator(device).manual_seed(next(seeds))


def prototype_term(x, features, logits, y):
    """cross-entropy plus a FedProto-style term pulling each representation to a fixed per-class point."""
    targets = torch.linspace(-1.0, 1.0, 10)[y, None].expand_as(features)
    return F.cross_entropy(logits, y) + 10.0 * F.mse_loss(features, targets)


def distillation(x, features, logits, y):
    """FD-style: cross-entropy plus KL to fixed per-class logits (reaches the model through its logits only)."""
    teacher = torch.eye(10)[y] * 3.0
    return F.cross_entropy(logits, y) + common.training.kd_loss(logits, teacher)


COMPANION = build_cnn("cnn5", 10, 1, 28)


def companion_loss(x, features, logits, y):
    """FML-style: the loss also trains a companion model on the same images."""
    return F.cross_entropy(logits, y) + F.cross_entropy(COMPANION(x), y)


def companion_terms(x, features, logits, y):
    """``companion_loss`` with its per-example terms, as FML's loss carries them."""
    return F.cross_entropy(logits, y) + F.cross_entropy(COMPANION(x), y)


companion_terms.per_example = lambda x, features, logits, y: (
    F.cross_entropy(logits, y, reduction="none") + (F.cross_entropy(COMPANION(x), y, reduction="none"))
)


def train_both(monkeypatch, clip: float, objective):
    """(ghost-or-per-example weights as ``train_supervised`` trains them, Opacus's per-example weights, initial) on
    an MNIST client of CNN-1, one round at ε = 8, the same seeded secrets and augmentation in both."""
    rc = make_run_config(
        method="local",
        dataset="mnist",
        model_group="cnn1",
        **{"dp.epsilon": 8.0, "dp.clip-norm": clip, "max-examples-per-client": 80},
    )
    client = client_runtime(rc)
    plan = make_plan(RunConfig.from_dict(rc), len(client.data.train_y), 4, 1, 1)
    config = train_config(rc, 1)
    initial = {k: v.clone() for k, v in client.model.state_dict().items()}
    monkeypatch.setattr(common.training, "secret_generator", seeded())
    common.training.train_supervised(
        client.model,
        client.data,
        config,
        torch.device("cpu"),
        torch.Generator().manual_seed(3),
        supervised_loss=objective,
        dp=plan,
    )
    reference = client_runtime(rc).model
    reference.load_state_dict(initial)
    reference.train()
    reference_dp_sgd(reference, client.data, config, plan, torch.Generator().manual_seed(3), seeded(), objective)
    return client.model.state_dict(), reference.state_dict(), initial


@pytest.mark.parametrize("objective", [None, prototype_term, distillation], ids=["ce", "prototype", "distillation"])
@pytest.mark.parametrize("clip", [0.05, 1000.0], ids=["every-example-clipped", "none-clipped"])
def test_ghost_clipping_trains_as_per_example_dp_sgd(monkeypatch, clip, objective):
    trained, reference, initial = train_both(monkeypatch, clip, objective)
    for k, v in reference.items():
        torch.testing.assert_close(trained[k], v, rtol=1e-4, atol=1e-6)
    # it trained, and the clip mattered: the same run unclipped moves the weights elsewhere
    assert any(not torch.equal(trained[k], v) for k, v in initial.items())


def test_the_clip_is_applied_a_run_at_another_clip_differs(monkeypatch):
    tight, _, initial = train_both(monkeypatch, 0.05, prototype_term)
    loose, _, _ = train_both(monkeypatch, 1000.0, prototype_term)
    moved = [float((tight[k] - initial[k]).norm() / (loose[k] - initial[k]).norm()) for k in initial if "weight" in k]
    assert max(moved) < 0.5, moved  # the clipped steps are far shorter (noise is σ·C: small at C = 0.05)


def test_a_loss_that_runs_a_companion_model_takes_the_per_example_path_bit_for_bit(monkeypatch):
    probe = build_cnn("cnn1", 10, 1, 28)
    x, y = torch.rand(2, 1, 28, 28), torch.tensor([1, 2])
    assert common.training.reads_only_outputs(probe, prototype_term, x, y)
    assert common.training.reads_only_outputs(probe, distillation, x, y)
    assert not common.training.reads_only_outputs(probe, companion_loss, x, y)
    rng = torch.get_rng_state()
    common.training.reads_only_outputs(probe, companion_loss, x, y)
    assert torch.equal(rng, torch.get_rng_state())  # the probe leaves the global RNG as it was
    trained, reference, _ = train_both(monkeypatch, 0.05, companion_loss)
    # the companion's parameters are not the client model's: the model trains as Opacus's loop trains it
    assert all(torch.equal(trained[k], v) for k, v in reference.items())


def test_a_companion_loss_with_its_per_example_terms_is_ghost_clipped_as_per_example_dp_sgd(monkeypatch):
    calls = []
    original = companion_terms.per_example
    monkeypatch.setattr(companion_terms, "per_example", lambda *a: calls.append(1) or original(*a))
    trained, reference, _ = train_both(monkeypatch, 0.05, companion_terms)
    assert calls  # the ghost path ran on the per-example terms
    for k, v in reference.items():
        torch.testing.assert_close(trained[k], v, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("reduction", ["mean", "batchmean"])
def test_the_per_example_distillation_terms_average_to_the_loss(reduction):
    from methods.fml import FMLOptions, mutual_kl

    student, target = torch.randn(6, 10), torch.randn(6, 10)
    options = FMLOptions(kl_reduction=reduction)
    per_example = mutual_kl(student, target, options, per_example=True)
    assert per_example.shape == (6,)
    torch.testing.assert_close(per_example.mean(), mutual_kl(student, target, options))
    torch.testing.assert_close(
        common.training.kd_loss(student, target, 2.0, per_example=True).mean(),
        common.training.kd_loss(student, target, 2.0),
    )
