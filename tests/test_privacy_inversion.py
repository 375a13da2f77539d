"""privacy.inversion and privacy.scores: the reconstruction attacks recover what a vector holds, and
the scores are the numbers computed by hand.

Tiny random-initialised CNNs on smooth synthetic images (random 4x4 patterns upsampled bicubically),
so every test is self-contained and takes seconds on the CPU; every seed is fixed.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from models.base import SplitModel
from privacy.inversion import DeepImagePrior, decode, fit_surrogate, invert_representation, train_decoder
from privacy.scores import image_scores, reconstruction_figure, summarize

MEAN, STD = (0.5,), (0.25,)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread for these microsecond-sized ops: with two, on a loaded 2-core machine,
    the pool's synchronisation took 100 times the arithmetic (47 s against 0.45 s for one test)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def gen(seed: int) -> torch.Generator:
    """A CPU generator seeded with ``seed``."""
    return torch.Generator().manual_seed(seed)


def smooth_images(n: int, channels: int, side: int, seed: int) -> torch.Tensor:
    """uint8 [n, channels, side, side]: uniform random 4x4 patterns upsampled bicubically."""
    low = torch.rand(n, channels, 4, 4, generator=gen(seed))
    x = F.interpolate(low, size=(side, side), mode="bicubic", align_corners=True).clamp(0, 1)
    return (x * 255).round().to(torch.uint8)


def represent(extractor: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """The extractor's representations float32 [n, d] of uint8 images, normalised as the attacks do."""
    with torch.no_grad():
        return extractor((images.float() / 255 - MEAN[0]) / STD[0])


def tiny_cnn(channels: int, side: int, dim: int, stride: int) -> nn.Module:
    """conv-relu-conv-relu-flatten-linear, drawn from seed 0."""
    torch.manual_seed(0)
    s = side // stride // stride
    return nn.Sequential(
        nn.Conv2d(channels, 8, 3, padding=1, stride=stride),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1, stride=stride),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * s * s, dim),
    )


def test_white_box_inversion_recovers_one_image_but_not_a_mean_of_many():
    # d = 512 > 256 pixels, full resolution until the linear layer: one image's representation
    # determines it. Measured (CPU): 53.1 dB for the single image; for the mean of 64 images' the
    # best match over the 64 scores 14.7 dB, the mean over them 11.6 dB.
    extractor = tiny_cnn(1, 16, 512, stride=1)
    images = smooth_images(65, 1, 16, seed=1)
    reps = represent(extractor, images)
    kw = dict(steps=300, lr=0.1, tv_weight=0.0)
    single = invert_representation(extractor, reps[:1], (1, 16, 16), MEAN, STD, generator=gen(0), **kw)
    mixed = invert_representation(
        extractor, reps[1:].mean(0, keepdim=True), (1, 16, 16), MEAN, STD, generator=gen(0), **kw
    )
    own = image_scores(single, images[:1])["best_psnr"][0]
    of_mean = image_scores(mixed, images[1:])
    assert own > 40.0
    assert of_mean["best_psnr"][0] < 20.0 and own - of_mean["best_psnr"][0] > 20.0
    assert of_mean["mean_psnr"][0] < of_mean["best_psnr"][0]


def test_white_box_inversion_of_logits_is_deterministic_and_leaves_the_model_as_it_was():
    # FD's payload: per-class mean logits, inverted through the whole model.
    torch.manual_seed(0)
    model = SplitModel(tiny_cnn(1, 16, 32, stride=2), 32, 5).train()
    model.head.bias.requires_grad_(False)  # a mixed set of flags must come back as it was
    before = {k: v.clone() for k, v in model.state_dict().items()}
    logits = torch.randn(3, 5, generator=gen(1))
    runs = [
        invert_representation(model, logits, (1, 16, 16), MEAN, STD, steps=5, lr=0.1, tv_weight=0.01, generator=gen(2))
        for _ in range(2)
    ]
    assert runs[0].shape == (3, 1, 16, 16) and runs[0].dtype == torch.float32
    assert float(runs[0].min()) >= 0.0 and float(runs[0].max()) <= 1.0
    assert torch.equal(runs[0], runs[1])
    assert model.training
    assert [p.requires_grad for p in model.parameters()] == [True, True, True, True, True, True, True, False]
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match=r"\(3, 5\)"):
        invert_representation(
            model, torch.zeros(3, 7), (1, 16, 16), MEAN, STD, steps=1, lr=0.1, tv_weight=0.0, generator=gen(0)
        )


def test_deep_image_prior_inversion_recovers_one_image_but_not_a_mean_of_many():
    # The same targets through the generator's weights (Ulyanov et al. 2018). Measured (CPU, 200
    # steps, lr 3e-3): 42.2 dB for the single image (lr 1e-2: 41.2; 300 steps: 46.4); for the mean
    # of 64 images' the best match over the 64 scores 15.1 dB, the mean over them 11.8 dB.
    extractor = tiny_cnn(1, 16, 512, stride=1)
    images = smooth_images(65, 1, 16, seed=1)
    reps = represent(extractor, images)
    kw = dict(steps=200, lr=3e-3, tv_weight=0.0, prior="dip")
    single = invert_representation(extractor, reps[:1], (1, 16, 16), MEAN, STD, generator=gen(0), **kw)
    mixed = invert_representation(
        extractor, reps[1:].mean(0, keepdim=True), (1, 16, 16), MEAN, STD, generator=gen(0), **kw
    )
    own = image_scores(single, images[:1])["best_psnr"][0]
    of_mean = image_scores(mixed, images[1:])
    assert own > 35.0
    assert of_mean["best_psnr"][0] < 20.0 and own - of_mean["best_psnr"][0] > 15.0


def test_deep_image_prior_is_deterministic_one_generator_per_row_and_checks_its_arguments():
    extractor = tiny_cnn(3, 28, 16, stride=2)
    targets = torch.randn(2, 16, generator=gen(1))
    mean3, std3 = MEAN * 3, STD * 3
    kw = dict(steps=3, lr=1e-2, tv_weight=0.01, prior="dip")
    args = (extractor, targets, (3, 28, 28), mean3, std3)
    runs = [invert_representation(*args, generator=gen(2), **kw) for _ in range(2)]
    assert runs[0].shape == (2, 3, 28, 28) and runs[0].dtype == torch.float32
    assert float(runs[0].min()) >= 0.0 and float(runs[0].max()) <= 1.0
    assert torch.equal(runs[0], runs[1])
    other = invert_representation(*args, generator=gen(3), **kw)
    assert not torch.equal(runs[0], other)
    # copy 0's image has no gradient in copy 1's weights: each row has its own generator
    net = DeepImagePrior(2, 3, (28, 28), gen(0)).train()
    net()[0].sum().backward()
    for p in net.parameters():
        assert p.grad is not None and p.grad.shape[0] % 2 == 0
        half = p.grad.shape[0] // 2
        assert float(p.grad[:half].abs().sum()) > 0 and float(p.grad[half:].abs().sum()) == 0
    with pytest.raises(ValueError, match="init"):
        invert_representation(*args, init=torch.rand(2, 3, 28, 28), generator=gen(0), **kw)
    with pytest.raises(ValueError, match="prior"):
        invert_representation(*args, steps=1, lr=0.1, tv_weight=0.0, generator=gen(0), prior="gan")


def test_decoder_learns_to_invert_held_out_representations():
    # Measured (CPU): decoded held-out images 20.6 dB on average against 12.9 dB for the constant
    # mean auxiliary image.
    extractor = tiny_cnn(1, 28, 64, stride=2)
    aux, held_out = smooth_images(256, 1, 28, seed=1), smooth_images(64, 1, 28, seed=2)
    decoder = train_decoder(extractor, aux, MEAN, STD, epochs=4, batch_size=32, lr=3e-3, generator=gen(0))
    decoded = decode(decoder, represent(extractor, held_out))
    assert decoded.shape == (64, 1, 28, 28) and float(decoded.min()) >= 0.0 and float(decoded.max()) <= 1.0
    constant = (aux.float() / 255).mean(0, keepdim=True)
    psnr = summarize([image_scores(decoded[i : i + 1], held_out[i : i + 1])["best_psnr"][0] for i in range(64)])
    baseline = summarize([image_scores(constant, held_out[i : i + 1])["best_psnr"][0] for i in range(64)])
    assert psnr["mean"] > baseline["mean"] + 4.0
    # 32x32 RGB decodes at its own size (CIFAR-10's)
    rgb = smooth_images(8, 3, 32, seed=3)
    extractor3 = tiny_cnn(3, 32, 16, stride=2)
    mean3, std3 = MEAN * 3, STD * 3
    decoder3 = train_decoder(extractor3, rgb, mean3, std3, epochs=1, batch_size=8, lr=1e-3, generator=gen(0))
    assert decode(decoder3, torch.zeros(2, 16)).shape == (2, 3, 32, 32)


def labelled_images(n: int, classes: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 images whose class is a smooth template (60 %) under smooth noise (40 %), and int64 labels."""
    templates = smooth_images(classes, 1, side, seed=5).float() / 255
    labels = torch.randint(0, classes, (n,), generator=gen(3))
    noise = smooth_images(n, 1, side, seed=6).float() / 255
    return ((0.6 * templates[labels] + 0.4 * noise) * 255).round().to(torch.uint8), labels


def test_surrogate_learns_through_a_frozen_head_and_leaves_it_unchanged():
    # Measured (CPU): accuracy 0.25 before (chance) and 1.0 after on the auxiliary data (4 classes).
    images, labels = labelled_images(256, 4, 16)
    extractor = tiny_cnn(1, 16, 32, stride=2)
    torch.manual_seed(1)
    head = nn.Linear(32, 4)
    before = {k: v.clone() for k, v in head.state_dict().items()}
    original = {k: v.clone() for k, v in extractor.state_dict().items()}

    def accuracy(ext):
        with torch.no_grad():
            return float((head(represent(ext, images)).argmax(1) == labels).float().mean())

    surrogate = fit_surrogate(
        extractor, head, None, images, labels, MEAN, STD, epochs=5, batch_size=32, lr=3e-3, generator=gen(0)
    )
    assert accuracy(extractor) < 0.4 and accuracy(surrogate) > 0.8
    assert all(torch.equal(before[k], v) for k, v in head.state_dict().items())
    assert all(p.requires_grad for p in head.parameters()) and head.training
    assert all(torch.equal(original[k], v) for k, v in extractor.state_dict().items())  # a copy was trained


def test_surrogate_is_pulled_to_the_valid_prototypes_only():
    # Measured (CPU): mean squared distance to the class prototype 133.6 -> 12.9 for the classes
    # with one; 144.4 -> 210.4 for the class without (no pull).
    images, labels = labelled_images(256, 4, 16)
    extractor = tiny_cnn(1, 16, 32, stride=2)
    protos = 2 * torch.randn(4, 32, generator=gen(4))
    valid = torch.tensor([True, True, True, False])

    def distances(ext):
        sq = (represent(ext, images) - protos[labels]).pow(2).sum(1)
        return float(sq[valid[labels]].mean()), float(sq[~valid[labels]].mean())

    surrogate = fit_surrogate(
        extractor, None, (protos, valid), images, labels, MEAN, STD, epochs=5, batch_size=32, lr=3e-3,
        generator=gen(0),
    )  # fmt: skip
    (kept_before, free_before), (kept_after, free_after) = distances(extractor), distances(surrogate)
    assert kept_after < 0.25 * kept_before
    assert free_after > 0.8 * free_before
    with pytest.raises(ValueError, match="head, prototypes"):
        fit_surrogate(
            extractor, None, None, images, labels, MEAN, STD, epochs=1, batch_size=32, lr=1e-3, generator=gen(0)
        )


def test_image_scores_by_hand():
    refs = torch.rand(5, 1, 16, 16, generator=gen(0))
    same = image_scores(refs[[3]], refs)
    assert same["best_index"] == [3] and same["best_mse"] == [0.0] and same["best_psnr"] == [math.inf]
    assert same["best_ssim"][0] == pytest.approx(1.0, abs=1e-5)
    # a checkerboard of +-0.1 on flat grey: MSE 0.01 on [0, 1], 650.25 on 0-255, PSNR 10 log10(1 / 0.01) = 20 dB
    grey = torch.full((1, 1, 16, 16), 0.5)
    signs = (torch.arange(16)[:, None] + torch.arange(16)[None, :]) % 2 * 2 - 1
    noisy = grey + 0.1 * signs
    other = torch.full((1, 1, 16, 16), 0.8)  # MSE 0.09 + 0.01 = 0.1: 10 dB
    s = image_scores(noisy, torch.cat([other, grey]))
    assert s["best_index"] == [1]
    assert s["best_psnr"][0] == pytest.approx(10 * math.log10(1 / 0.01), abs=1e-3)
    assert s["best_mse"][0] == pytest.approx(0.01 * 255**2, rel=1e-4)
    assert s["mean_psnr"][0] == pytest.approx((20.0 + 10.0) / 2, abs=1e-3)
    assert s["mean_mse"][0] == pytest.approx((0.01 + 0.1) / 2 * 255**2, rel=1e-4)
    # uint8 references are read as pixels / 255
    as_uint8 = (refs * 255).round().to(torch.uint8)
    assert image_scores(as_uint8.float()[[1, 4]] / 255, as_uint8)["best_index"] == [1, 4]
    with pytest.raises(ValueError, match=r"\(2, 1, 16, 16\).*\(5, 3, 16, 16\)"):
        image_scores(torch.zeros(2, 1, 16, 16), torch.zeros(5, 3, 16, 16))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        image_scores(torch.full((1, 1, 16, 16), 2.0), refs)
    agg = summarize([1.0, 2.0, 3.0])
    assert agg["mean"] == 2.0 and agg["std"] == pytest.approx(math.sqrt(2 / 3)) and agg["n"] == 3


def test_reconstruction_figure_writes_a_png_with_a_column_per_pair(tmp_path):
    from matplotlib.image import imread

    pairs = [(smooth_images(1, 3, 32, seed=i)[0], torch.rand(3, 32, 32), f"{i} dB") for i in range(3)]
    path = reconstruction_figure(pairs, tmp_path / "fig.png", "test")
    one = reconstruction_figure(pairs[:1], tmp_path / "one.png", "test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert imread(path).shape[1] > imread(one).shape[1] * 1.5  # wider with more columns
