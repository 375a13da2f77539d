"""privacy.gradients (iDLG, multi-step Inverting Gradients) and privacy.labels (label leakage), on tiny models."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parameters_to_vector

from common.data import ClientData
from common.datasets import DATASETS
from common.training import train_supervised
from methods.fedre import entangling_weights
from models.base import SplitModel
from privacy.gradients import idlg, idlg_label, invert_update, parameter_update
from privacy.labels import distribution_l1, from_class_ids, from_head_update, from_soft_label, label_set_scores

SIDE = 16
MEAN, STD = (0.5,), (0.5,)
#: single-channel 16x16 images normalised with 0.5/0.5, no augmentation (what the attacker cannot simulate)
INFO = dataclasses.replace(DATASETS["mnist"], image_size=SIDE, mean=MEAN, std=STD, crop_padding=0)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread: these ops are tiny, and on a loaded 2-core machine a two-thread pool's
    synchronisation cost this file 209 s instead of about 15."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    """PSNR in dB of two images in [0, 1]."""
    return 10 * math.log10(1 / F.mse_loss(a, b).item())


def sigmoid_net(seed: int, num_classes: int = 10) -> SplitModel:
    """DLG's kind of network (Zhu et al. 2019): strided 5x5 convs with sigmoids, weights U(-0.5, 0.5)."""
    torch.manual_seed(seed)
    extractor = nn.Sequential(
        nn.Conv2d(1, 12, 5, 2, 2), nn.Sigmoid(), nn.Conv2d(12, 12, 5, 2, 2), nn.Sigmoid(), nn.Flatten()
    )
    model = SplitModel(extractor, 12 * (SIDE // 4) ** 2, num_classes)
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-0.5, 0.5)
    return model


def smooth_image(seed: int) -> torch.Tensor:
    """A smooth synthetic image float32 [1, 16, 16] in [0, 1]: a random plane wave plus a blob."""
    a = torch.rand(4, generator=torch.Generator().manual_seed(seed))
    yy, xx = torch.meshgrid(torch.linspace(0, 1, SIDE), torch.linspace(0, 1, SIDE), indexing="ij")
    wave = 0.25 * torch.sin(2 * math.pi * (1.5 * a[0] * xx + a[1] * yy))
    blob = 0.2 * torch.exp(-((xx - a[2]) ** 2 + (yy - a[3]) ** 2) / 0.05)
    return (0.5 + wave + blob).clamp(0, 1)[None]


def train_config(batch_size: int, epochs: int, batch_order: str = "shuffle", lr: float = 0.05) -> dict:
    """A train instruction's config with the run config's default momentum, weight decay and clipping."""
    return {
        "lr": lr,
        "momentum": 0.9,
        "weight-decay": 1e-3,
        "clip-norm": 50.0,
        "precision": "fp32",
        "batch-size": batch_size,
        "batch-order": batch_order,
        "local-epochs": epochs,
    }


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_idlg_recovers_label_and_image_of_one_example(seed):
    model, image, label = sigmoid_net(seed), smooth_image(seed), (3 * seed + 1) % 10
    loss = F.cross_entropy(model(((image - 0.5) / 0.5)[None]), torch.tensor([label]))
    names = [name for name, _ in model.named_parameters()]
    gradients = dict(zip(names, torch.autograd.grad(loss, list(model.parameters())), strict=True))
    before = parameters_to_vector(model.parameters()).detach().clone()
    got_label, rec = idlg(
        model, gradients, (1, SIDE, SIDE), MEAN, STD, steps=10, lr=1.0, generator=torch.Generator().manual_seed(seed)
    )
    assert got_label == label
    assert rec.shape == (1, SIDE, SIDE) and rec.dtype == torch.float32 and rec.min() >= 0 and rec.max() <= 1
    # measured 91-100 dB for seeds 0-3 (a random image: 9-10 dB)
    assert psnr(rec, image) > 40
    assert torch.equal(parameters_to_vector(model.parameters()), before)


def test_idlg_label_does_not_need_non_negative_features():
    """The true row is the one pointing against all others, whatever the sign of h (argmin of row sums is not)."""
    h = torch.tensor([-3.0, -1.0, 0.5, -2.0])  # mostly negative: the row-sum rule would pick a wrong class
    p = torch.tensor([0.1, 0.5, 0.2, 0.15, 0.05])
    for label in range(5):
        grad = (p - F.one_hot(torch.tensor(label), 5))[:, None] * h[None]
        assert idlg_label(grad) == label
    assert int(((p - F.one_hot(torch.tensor(0), 5))[:, None] * h[None]).sum(1).argmin()) != 0


@pytest.mark.parametrize("seed", [0, 1])
def test_invert_update_reconstructs_two_images_from_three_local_steps(seed):
    """The client trains with the project's loop (momentum 0.9, weight decay, clipping); the attacker
    simulates that SGD with the batch size, lr and steps it is assumed to know."""
    model = sigmoid_net(seed)
    images = torch.stack([smooth_image(seed), smooth_image(seed + 10)])
    pixels = (images * 255).round().to(torch.uint8)
    labels = torch.tensor([seed, seed + 3])
    data = ClientData(pixels, labels, pixels[:0], labels[:0], INFO)
    start = {name: p.detach().clone() for name, p in model.named_parameters()}
    config = train_config(batch_size=2, epochs=3, batch_order="fixed", lr=0.1)
    train_supervised(model, data, config, torch.device("cpu"), torch.Generator().manual_seed(seed))
    update = parameter_update(model, {name: p.detach() - start[name] for name, p in model.named_parameters()})
    rec = invert_update(
        model,
        start,
        update,
        num_images=2,
        labels=labels,
        local_steps=3,
        lr=0.1,
        batch_size=2,
        image_shape=(1, SIDE, SIDE),
        mean=MEAN,
        std=STD,
        steps=150,
        attack_lr=0.1,
        tv_weight=1e-3,
        generator=torch.Generator().manual_seed(seed),
        momentum=0.9,
        weight_decay=1e-3,
    )
    truth = pixels.float() / 255
    noise = torch.rand(2, 1, SIDE, SIDE, generator=torch.Generator().manual_seed(99))
    assert rec.shape == (2, 1, SIDE, SIDE) and rec.min() >= 0 and rec.max() <= 1
    for i in range(2):
        # uniform noise scores 9.1-9.6 dB; with the L1 TV of the normalised image at 1e-3 (1e-2 held seed 0's
        # first image at 28.7 dB: these smooth 16x16 images need little of the paper's CIFAR-10 prior)
        assert psnr(rec[i], truth[i]) > psnr(noise[i], truth[i]) + 20


def test_parameter_update_from_flat_vector_and_state_difference():
    model = sigmoid_net(0)
    state = {name: torch.randn(p.shape) for name, p in model.named_parameters()}
    flat = torch.cat([state[name].flatten() for name, _ in model.named_parameters()])
    from_flat = parameter_update(model, flat.numpy())
    from_dict = parameter_update(model, {**state, "some.buffer": torch.zeros(3)})
    assert list(from_flat) == list(from_dict) == [name for name, _ in model.named_parameters()]
    for name in state:
        assert torch.equal(from_flat[name], state[name]) and torch.equal(from_dict[name], state[name])
    with pytest.raises(ValueError, match="entries"):
        parameter_update(model, flat[:-1])
    with pytest.raises(ValueError, match="head.bias"):
        parameter_update(model, {k: v for k, v in state.items() if k != "head.bias"})


def test_class_ids_give_the_class_set():
    counts = np.array([0, 5, 0, 7, 1, 0, 0, 0, 0, 3])
    lar_labels = np.array([1, 3, 4, 9], dtype=np.int32)
    inference = from_class_ids(lar_labels, 10)
    assert inference.classes.tolist() == [1, 3, 4, 9] and inference.distribution is None
    assert label_set_scores(inference.classes, counts) == (1.0, 1.0)
    assert label_set_scores([1, 2], counts) == (0.5, 0.25)
    with pytest.raises(ValueError, match="lie in"):
        from_class_ids([10], 10)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fedre_soft_label_gives_set_and_distribution(seed):
    rng, generator = np.random.default_rng(seed), torch.Generator().manual_seed(seed)
    classes = np.sort(rng.choice(10, 4, replace=False))
    labels = torch.from_numpy(np.repeat(classes, rng.integers(20, 300, 4)))
    counts = np.bincount(labels.numpy(), minlength=10)

    def soft_label(mode: str) -> torch.Tensor:  # as methods.fedre.entangle builds y
        alpha = entangling_weights(labels, mode, generator)
        return torch.zeros(10, dtype=torch.float64).index_add_(0, labels, alpha).float()[None]

    for mode in ("rap", "var", "rar"):
        assert from_soft_label(soft_label(mode)).classes.tolist() == classes.tolist()
    assert distribution_l1(from_soft_label(soft_label("var")).distribution, counts) < 1e-6
    # rar: unbiased for n_c / n and concentrated with hundreds of samples (measured 0.018-0.034)
    assert distribution_l1(from_soft_label(soft_label("rar")).distribution, counts) < 0.08
    # rap (the paper): averaged over 200 rounds, y tends to the uniform law over the present
    # classes (measured 0.026-0.040 from it), not to the counts (measured 0.44-0.67 from them)
    rounds = from_soft_label(torch.cat([soft_label("rap") for _ in range(200)]))
    assert distribution_l1(rounds.distribution, counts > 0) < 0.1
    assert distribution_l1(rounds.distribution, counts) > 0.3


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
def test_head_update_reveals_class_set_after_real_local_steps(seed):
    """A 3-class client of a 10-class model trains one epoch (4 SGD steps with momentum) with the project's loop."""
    torch.manual_seed(seed)
    model = SplitModel(nn.Sequential(nn.Flatten(), nn.Linear(SIDE * SIDE, 32), nn.ReLU()), 32, 10)
    classes = np.sort(np.random.default_rng(seed).choice(10, 3, replace=False))
    labels = torch.from_numpy(np.repeat(classes, [30, 20, 10]))
    patterns = torch.rand(10, 1, SIDE, SIDE, generator=torch.Generator().manual_seed(100)) * 150
    noise = torch.rand(len(labels), 1, SIDE, SIDE, generator=torch.Generator().manual_seed(seed)) * 100
    pixels = (patterns[labels] + noise).to(torch.uint8)
    data = ClientData(pixels, labels, pixels[:0], labels[:0], INFO)
    bias = model.head.bias.detach().clone()
    train_supervised(
        model, data, train_config(batch_size=16, epochs=1), torch.device("cpu"), torch.Generator().manual_seed(seed)
    )
    inference = from_head_update(model.head.bias.detach() - bias)
    counts = np.bincount(labels.numpy(), minlength=10)
    precision, recall = label_set_scores(inference.classes, counts)
    assert recall == 1.0
    assert precision == 1.0  # measured 1.0 for seeds 0-4
    assert inference.distribution is not None and inference.distribution.sum() == pytest.approx(1.0)
    assert set(np.nonzero(inference.distribution)[0]) == set(classes)
    # the magnitudes order the counts 30/20/10 (measured L1 0.14-0.29 to 0.5/0.33/0.17; the uniform
    # law over the set has 0.33): the largest class gets the largest share
    assert int(inference.distribution.argmax()) == classes[0]
    assert distribution_l1(inference.distribution, counts) < 0.35


def test_scores_reject_bad_input():
    with pytest.raises(ValueError, match="distribution"):
        distribution_l1([0.5, 0.6], [1, 1])
    with pytest.raises(ValueError, match="true_counts"):
        label_set_scores([0], [0, 0])
    assert distribution_l1([1.0, 0.0], [0, 3]) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="delta_bias or delta_weight"):
        from_head_update()


@pytest.mark.parametrize("seed", [5, 6])
def test_invert_update_keeps_the_restart_of_the_lowest_objective(seed):
    """Three trials from one generator: the result is the trial, run alone (from the generator's next
    draw), whose final cosine distance to the observed update is lowest: the first trial with seed 5, the
    last with seed 6, so neither keeping the first nor the last passes both."""
    model = sigmoid_net(0)
    image, label = smooth_image(0)[None], torch.tensor([2])
    start = {name: p.detach().clone() for name, p in model.named_parameters()}
    loss = F.cross_entropy(model((image - 0.5) / 0.5), label)
    names = [name for name, _ in model.named_parameters()]
    update = {n: -0.1 * g for n, g in zip(names, torch.autograd.grad(loss, list(model.parameters())), strict=True)}
    kw = dict(
        num_images=1, labels=label, local_steps=1, lr=0.1, batch_size=1, image_shape=(1, SIDE, SIDE),
        mean=MEAN, std=STD, steps=4, tv_weight=0.0,
    )  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    trials = []
    for _ in range(3):  # trial k alone: the generator advanced past the k earlier starts
        state = g.get_state()
        trials.append(invert_update(model, start, update, generator=g, **kw))
        g.set_state(state)
        torch.rand((1, 1, SIDE, SIDE), generator=g)

    def distance(x: torch.Tensor) -> float:
        loss = F.cross_entropy(model((x - 0.5) / 0.5), label)
        grads = torch.autograd.grad(loss, list(model.parameters()))
        simulated = torch.cat([-0.1 * gr.flatten() for gr in grads])
        return 1 - float(F.cosine_similarity(simulated, torch.cat([update[n].flatten() for n in names]), dim=0))

    best = min(range(3), key=lambda k: distance(trials[k]))
    assert len({round(distance(t), 6) for t in trials}) == 3  # the trials differ
    got = invert_update(model, start, update, generator=torch.Generator().manual_seed(seed), restarts=3, **kw)
    assert torch.equal(got, trials[best])
    with pytest.raises(ValueError, match="restarts"):
        invert_update(model, start, update, generator=g, restarts=0, **kw)


def test_idlg_without_line_search_keeps_the_lowest_loss_image_when_a_step_overshoots():
    """At lr 1e4 an L-BFGS step without a line search overshoots far outside [0, 1] (clamped, that image
    scores 5.8 dB, below the random start's 6.4); the image returned is the lowest-loss one evaluated."""
    model, image = sigmoid_net(0), smooth_image(0)
    loss = F.cross_entropy(model(((image - 0.5) / 0.5)[None]), torch.tensor([4]))
    names = [name for name, _ in model.named_parameters()]
    gradients = dict(zip(names, torch.autograd.grad(loss, list(model.parameters())), strict=True))
    g = torch.Generator().manual_seed(0)
    label, rec = idlg(model, gradients, (1, SIDE, SIDE), MEAN, STD, steps=3, lr=1e4, generator=g)
    assert label == 4 and torch.isfinite(rec).all() and rec.min() >= 0 and rec.max() <= 1
    start = torch.randn((1, 1, SIDE, SIDE), generator=torch.Generator().manual_seed(0))
    assert psnr(rec, image) > psnr(start[0].clamp(0, 1), image) - 1e-6  # no worse than where it started


@pytest.mark.parametrize("method", ["fml", "fedkd", "fedmrl"])
def test_the_simulated_update_of_a_shared_module_is_its_training_with_the_methods_own_loss(run_config, method):
    """The attack on FML's, FedKD's and FedMRL's shared module simulated it trained alone under cross-entropy,
    where the client trains it together with its private models under the method's own loss. Unrolled in
    the whole module the client's ``local_training`` builds, under that loss, the update of the shared
    module is the training loop's (two epochs of SGD with momentum and weight decay, 2 batches of 3, no
    augmentation); simulated alone under cross-entropy it points elsewhere."""
    from common.config import RunConfig
    from methods.registry import client_procedure
    from models.groups import MODEL_GROUPS
    from privacy.gradients import _sgd_unroll, cross_entropy_loss, training_loss
    from tools.privacy_attacks import StartOfTraining

    cfg = RunConfig.from_dict(run_config(method=method, augment="none"))
    info = dataclasses.replace(DATASETS[cfg.dataset], flip=False, erase=False, crop_padding=0)
    procedure = client_procedure(cfg)
    torch.manual_seed(0)
    private = MODEL_GROUPS[cfg.model_group].build(0, info.num_classes, info.channels, info.image_size, 0, 64)
    shared = procedure.build_shared(cfg, procedure.options)
    trained, supervised = procedure.local_training(StartOfTraining(private), shared)
    start = {name: w.detach().clone() for name, w in trained.named_parameters()}
    shared_start = {name: w.detach().clone() for name, w in shared.named_parameters()}
    g = torch.Generator().manual_seed(0)
    pixels = torch.randint(0, 256, (6, info.channels, info.image_size, info.image_size), generator=g, dtype=torch.uint8)
    labels = torch.tensor([0, 3, 3, 7, 1, 0])
    config = {**train_config(batch_size=3, epochs=2, batch_order="fixed"), "clip-norm": 0.0}
    data = ClientData(pixels, labels, pixels[:0], labels[:0], info)
    train_supervised(trained, data, config, torch.device("cpu"), g, supervised_loss=supervised)
    names = {id(w): name for name, w in trained.named_parameters()}
    matched = [names[id(w)] for w in shared.parameters()]
    observed = torch.cat([(dict(trained.named_parameters())[n].detach() - start[n]).flatten() for n in matched])
    x = (pixels.float() / 255 - torch.tensor(info.mean).view(1, -1, 1, 1)) / torch.tensor(info.std).view(1, -1, 1, 1)
    sgd = dict(local_steps=4, lr=0.05, batch_size=3, momentum=0.9, weight_decay=1e-3)
    leaves = {name: w.clone().requires_grad_(True) for name, w in start.items()}  # as invert_update's
    own = _sgd_unroll(trained, leaves, x, labels, loss=training_loss(supervised), matched=matched, **sgd)
    leaves = {name: w.clone().requires_grad_(True) for name, w in shared_start.items()}
    alone = _sgd_unroll(shared, leaves, x, labels, loss=cross_entropy_loss, matched=list(leaves), **sgd)
    own_flat = torch.cat([own[n].detach().flatten() for n in matched])
    alone_flat = torch.cat([v.detach().flatten() for v in alone.values()])
    error = (own_flat - observed).norm() / observed.norm()
    assert F.cosine_similarity(own_flat, observed, dim=0) > 0.99999 and error < 1e-4  # measured 1.3e-6-2.4e-6
    # alone under cross-entropy: cosine 0.95 (FML), 0.9987 (FedKD: its distillation terms are scaled by
    # 1 / (CE_t + CE_s), small beside the cross-entropy at initialisation), 0.40 (FedMRL)
    assert (alone_flat - observed).norm() / observed.norm() > 1000 * error
