"""Image reconstruction from shared vectors: white-box optimisation, a black-box decoder, its surrogate.

What is attacked is any vector a client derives from its images and shares: FedGH's LARs and
FedProto/FedTGP's prototypes (per-class mean representations ``[k, d]``), FedRE's entangled
representation z (``[1, d]``, a random convex mix of all of a client's representations) and FD's
per-class mean logits (``[k, C]``, representations through the head). Each row is inverted as if it
were one image's vector; how far the best reconstruction is from every training image
(:mod:`privacy.scores`) measures what the payload gives away.

Two attackers:

- white box (:func:`invert_representation`): the attacker holds the network that made the vector
  (a client's extractor, or the whole model for logits) and optimises an image to reproduce it,
  Mahendran & Vedaldi, "Understanding deep image representations by inverting them", CVPR 2015,
  with their total-variation prior on the pixels or, instead, the deep image prior (the image as
  the output of a randomly initialised generator whose weights are optimised, :class:`DeepImagePrior`),
  Ulyanov, Vedaldi & Lempitsky, "Deep Image Prior", CVPR 2018.
- black box (:func:`fit_surrogate`, :func:`train_decoder`, :func:`decode`): the attacker holds only
  what the federation shares (a global head, global prototypes) and public labelled images. It
  trains a public architecture whose representation space matches the shared knowledge, then an
  up-convolutional decoder from that space to pixels, Dosovitskiy & Brox, "Inverting visual
  representations with convolutional networks", CVPR 2016.

Images enter as uint8 ``[n, C, H, W]`` (the project's decoded data) or as pixels in [0, 1]; a
network always sees them normalised per channel with ``mean``/``std`` (``common.data.normalize``,
the dataset's ``DatasetInfo.mean``/``.std``). Every function runs on the device of the extractor's
parameters and returns images on the CPU; each is deterministic given its ``torch.Generator`` (CPU
kernels; cuDNN's need not be bit-exact).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from contextlib import contextmanager, nullcontext

import torch
import torch.nn.functional as F
from torch import nn


def _device(module: nn.Module) -> torch.device:
    """The device of ``module``'s first parameter (CPU for a module without any)."""
    return next((p.device for p in module.parameters()), torch.device("cpu"))


def _channel_stats(mean: Sequence[float], std: Sequence[float], channels: int, device: torch.device):
    """``mean``/``std`` as float32 ``[1, C, 1, 1]``; ValueError unless both have one value per channel."""
    if len(mean) != channels or len(std) != channels:
        raise ValueError(f"mean {tuple(mean)} and std {tuple(std)} need one value per image channel ({channels})")
    m = torch.tensor(mean, dtype=torch.float32, device=device).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=torch.float32, device=device).view(1, -1, 1, 1)
    return m, s


def _pixels(images: torch.Tensor) -> torch.Tensor:
    """uint8 ``[n, C, H, W]`` -> float32 in [0, 1]; ValueError for another rank or dtype."""
    if images.dim() != 4 or images.dtype != torch.uint8:
        raise ValueError(f"auxiliary images must be uint8 [n, C, H, W], got {images.dtype} {tuple(images.shape)}")
    return images.float() / 255.0


@contextmanager
def _frozen(module: nn.Module):
    """Context: ``module`` in eval mode with ``requires_grad`` off; both restored on exit.

    The attacks differentiate through a network the attacker must not change (a client's
    extractor, a global head): its parameters get no gradients and BatchNorm/Dropout act as in
    inference, as when the client computed the shared vector.
    """
    training, flags = module.training, [p.requires_grad for p in module.parameters()]
    module.eval()
    for p in module.parameters():
        p.requires_grad_(False)
    try:
        yield module
    finally:
        for p, flag in zip(module.parameters(), flags, strict=True):
            p.requires_grad_(flag)
        module.train(training)


def total_variation(x: torch.Tensor, beta: int = 2) -> torch.Tensor:
    """Per-image total variation of ``x`` float ``[n, C, H, W]``: float ``[n]``.

    ``beta`` = 2: Mahendran & Vedaldi's (CVPR 2015) TV^beta regulariser, the squared differences between
    horizontally and vertically neighbouring pixels. ``beta`` = 1: the anisotropic L1 total variation of
    Geiping et al. (NeurIPS 2020, Eq. 4), the absolute differences. Both averaged over pixels and channels
    instead of summed, so one weight suits every image size. Raises ValueError for another ``beta``.
    """
    if beta not in (1, 2):
        raise ValueError(f"beta must be 1 (L1 TV) or 2 (TV^2), got {beta}")
    dh = (x[..., 1:, :] - x[..., :-1, :]).abs().pow(beta).flatten(1).mean(1)
    dw = (x[..., :, 1:] - x[..., :, :-1]).abs().pow(beta).flatten(1).mean(1)
    return dh + dw


class DeepImagePrior(nn.Module):
    """A randomly initialised hourglass generator: ``copies`` independent images from fixed noise.

    Ulyanov, Vedaldi & Lempitsky, "Deep Image Prior", CVPR 2018: the image is the output g_w(z) of
    a convolutional encoder-decoder with skip connections on a fixed noise map z, and the weights w
    are what an inversion optimises. Their feature-inversion network (the "skip" hourglass on 256 x
    256 images: 6 scales of 16-32-64-128-128-128 channels, 7/7/5/5/3/3 kernels, 4-channel 1x1 skips,
    average-pool down, nearest-neighbour up, BatchNorm, LeakyReLU 0.2, a sigmoid output, a
    32-channel noise input uniform on [0, 0.1)) is scaled down here for 28 x 28 and 32 x 32 images to
    3 scales of 16-32-64 channels with 3x3 kernels (H -> H/2 -> H/4 -> H/8, ceil), the rest as theirs.

    One generator per image: every convolution is grouped ``copies`` times and every BatchNorm
    channel belongs to one copy, so copy i's output depends only on copy i's weights and noise (the
    same as ``copies`` separate generators, run as one batch). Call :meth:`forward` in training mode
    (BatchNorm on the image's own statistics, as in the paper's optimisation).

    Args:
        copies: n, the number of independent images.
        channels: C of the output images.
        image_size: ``(H, W)`` of the output (and of the noise).
        generator: draws the noise z (the weights draw from PyTorch's global RNG: seed it, or build
            through :func:`invert_representation`, which does).
        noise_depth, widths, skip, kernel: the architecture (defaults above).
    """

    def __init__(
        self,
        copies: int,
        channels: int,
        image_size: Sequence[int],
        generator: torch.Generator,
        noise_depth: int = 32,
        widths: Sequence[int] = (16, 32, 64),
        skip: int = 4,
        kernel: int = 3,
    ) -> None:
        super().__init__()
        self.copies, self.channels = copies, channels

        def block(c_in: int, c_out: int, k: int, pool: bool = False) -> nn.Sequential:
            conv = nn.Conv2d(copies * c_in, copies * c_out, k, padding=k // 2, groups=copies)
            pooled = [conv, nn.AvgPool2d(2, ceil_mode=True)] if pool else [conv]
            return nn.Sequential(*pooled, nn.BatchNorm2d(copies * c_out), nn.LeakyReLU(0.2))

        c_in, ins = noise_depth, []
        for w in widths:
            ins.append(c_in)
            c_in = w
        self.skips = nn.ModuleList(block(c, skip, 1) for c in ins)
        self.down = nn.ModuleList(
            nn.Sequential(block(c, w, kernel, pool=True), block(w, w, kernel)) for c, w in zip(ins, widths, strict=True)
        )
        deeper = [*widths[1:], widths[-1]]  # what arrives from below: the next scale's up path, or the bottleneck
        self.up = nn.ModuleList(
            nn.Sequential(nn.BatchNorm2d(copies * (skip + d)), block(skip + d, w, kernel), block(w, w, 1))
            for w, d in zip(widths, deeper, strict=True)
        )
        self.out = nn.Conv2d(copies * widths[0], copies * channels, 1, groups=copies)
        noise = 0.1 * torch.rand(1, copies * noise_depth, *image_size, generator=generator)
        self.register_buffer("noise", noise)

    def _join(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Concatenation within each copy: ``[1, n*ca, H, W]`` and ``[1, n*cb, H, W]`` -> ``[1, n*(ca+cb), H, W]``."""
        n, (h, w) = self.copies, a.shape[-2:]
        return torch.cat([a.view(1, n, -1, h, w), b.view(1, n, -1, h, w)], 2).view(1, -1, h, w)

    def forward(self) -> torch.Tensor:
        """The images float32 ``[n, C, H, W]`` in [0, 1]."""
        x, skips = self.noise, []
        for skip, down in zip(self.skips, self.down, strict=True):
            skips.append(skip(x))
            x = down(x)
        for skip, up in zip(reversed(skips), reversed(self.up), strict=True):
            x = F.interpolate(x, size=skip.shape[-2:], mode="nearest")
            x = up(self._join(skip, x))
        return torch.sigmoid(self.out(x)).view(self.copies, self.channels, *x.shape[-2:])


PRIORS = ("tv", "dip")


def invert_representation(
    extractor: nn.Module,
    target: torch.Tensor,
    image_shape: Sequence[int],
    mean: Sequence[float],
    std: Sequence[float],
    *,
    steps: int,
    lr: float,
    tv_weight: float,
    generator: torch.Generator,
    init: torch.Tensor | None = None,
    prior: str = "tv",
) -> torch.Tensor:
    """White-box inversion: one image per target row whose vector matches that row.

    Mahendran & Vedaldi, CVPR 2015: their objective, the loss normalised by ||phi0||^2 plus the
    TV^beta regulariser with beta = 2 (:func:`total_variation`; their alpha-norm term is not needed
    with bounded pixels). For each row phi0 of ``target`` minimise over the image x

        ||phi(x) - phi0||^2 / ||phi0||^2 + tv_weight * TV(x)

    with Adam (the paper: gradient descent with momentum); ``phi`` sees ``(x - mean) / std``. What
    the optimiser moves is set by ``prior``:

    - ``"tv"``: the pixels, as ``x = sigmoid(u)`` of an unconstrained variable u, so they stay in
      [0, 1] (the paper bounds them by a penalty instead); ``lr`` is Adam's step on u.
    - ``"dip"``: the weights w of a randomly initialised generator, ``x = g_w(z)`` with a fixed noise
      input z (:class:`DeepImagePrior`, one per row), Ulyanov, Vedaldi & Lempitsky, "Deep Image
      Prior", CVPR 2018, Sec. "natural pre-image" (their inversion of AlexNet/VGG features: Adam,
      lr 1e-3, 3100 steps, no other regulariser, i.e. ``tv_weight`` 0); ``lr`` is Adam's step on w.
      On a CIFAR-10 CNN client's 500-d representations, lr 1e-2 with ``tv_weight`` 0.1 came closest
      to the true images in 3000 steps (PSNR 14.0 dB against 12.2 for the paper's setting and 13.5
      for ``"tv"`` at lr 0.1, ``tv_weight`` 0.1), at about 5 times the ``"tv"`` prior's CPU time.

    The rows are optimised together in one batch; the loss is their sum and no parameter is shared
    between rows, so each row's optimisation is its own. Assumed: the attacker holds the network
    that produced ``target``, with the weights it had then.

    Args:
        extractor: any module mapping normalised images ``[B, C, H, W]`` float32 to vectors
            ``[B, d]``: a client's extractor for representations, the whole ``SplitModel`` for
            logits. Put in eval mode; its parameters are not changed and their ``requires_grad``
            and the module's training flag are restored afterwards.
        target: float ``[n, d]``, the vectors to invert (one image per row).
        image_shape: ``(C, H, W)`` of the images to reconstruct.
        mean, std: per-channel normalisation constants of pixels in [0, 1] (``DatasetInfo``).
        steps: Adam steps (>= 1).
        lr: Adam step size (on u or on w, see above).
        tv_weight: weight of the TV term (>= 0; 0 switches it off).
        generator: draws the start u ~ 0.1 * N(0, 1) (pixels near 0.5) when ``init`` is None
            (``"tv"``), or the generator's weights and noise (``"dip"``).
        init: optional start images float ``[n, C, H, W]`` in [0, 1] (clamped to [1e-3, 1 - 1e-3]
            before the logit); ``"tv"`` only.
        prior: ``"tv"`` (pixels) or ``"dip"`` (generator weights).

    Returns:
        float32 ``[n, C, H, W]`` in [0, 1], on the CPU.

    Raises:
        ValueError: ``target`` not 2-D, ``image_shape`` not 3 numbers, ``init`` of another shape or
            given with ``"dip"``, ``steps`` < 1, ``tv_weight`` < 0, an unknown ``prior``, or the
            extractor's output not shaped like ``target``.
    """
    if target.dim() != 2:
        raise ValueError(f"target must be [n, d], got shape {tuple(target.shape)}")
    if len(image_shape) != 3:
        raise ValueError(f"image_shape must be (C, H, W), got {tuple(image_shape)}")
    if steps < 1 or tv_weight < 0:
        raise ValueError(f"steps must be >= 1 and tv_weight >= 0, got steps={steps}, tv_weight={tv_weight}")
    if prior not in PRIORS:
        raise ValueError(f"prior must be one of {PRIORS}, got {prior!r}")
    n = target.shape[0]
    shape = (n, *image_shape)
    device = _device(extractor)
    if prior == "dip":
        if init is not None:
            raise ValueError("init is for prior 'tv' (pixels); prior 'dip' starts from its generator's output")
        with _seeded(generator):
            net = DeepImagePrior(n, image_shape[0], image_shape[1:], generator).to(device).train()
        params, render = list(net.parameters()), net
    else:
        if init is None:
            u0 = 0.1 * torch.randn(shape, generator=generator)
        else:
            if tuple(init.shape) != shape:
                raise ValueError(f"init must be {shape}, got {tuple(init.shape)}")
            u0 = torch.logit(init.float().clamp(1e-3, 1 - 1e-3))
        u = u0.to(device).requires_grad_(True)
        params, render = [u], lambda: torch.sigmoid(u)
    m, s = _channel_stats(mean, std, image_shape[0], device)
    phi0 = target.detach().float().to(device)
    scale = phi0.pow(2).sum(1).clamp_min(1e-12)  # ||phi0||^2 per row; a zero row is matched absolutely
    optimiser = torch.optim.Adam(params, lr=lr)
    with _frozen(extractor):
        for _ in range(steps):
            x = render()
            phi = extractor((x - m) / s)
            if phi.shape != phi0.shape:
                raise ValueError(f"the extractor gives {tuple(phi.shape)} for targets of shape {tuple(phi0.shape)}")
            loss = ((phi - phi0).pow(2).sum(1) / scale + tv_weight * total_variation(x)).sum()
            optimiser.zero_grad(set_to_none=True)
            loss.backward()
            optimiser.step()
        with torch.no_grad():
            return render().detach().cpu()


@torch.no_grad()
def _representations(extractor: nn.Module, pixels: torch.Tensor, mean, std, batch_size: int) -> torch.Tensor:
    """``extractor`` (eval mode, frozen) on ``pixels`` float ``[n, C, H, W]`` in [0, 1]: float32 ``[n, d]``."""
    device = _device(extractor)
    m, s = _channel_stats(mean, std, pixels.shape[1], device)
    with _frozen(extractor):
        batches = [pixels[i : i + batch_size].to(device) for i in range(0, len(pixels), batch_size)]
        return torch.cat([extractor((b - m) / s).float() for b in batches])


class Decoder(nn.Module):
    """Up-convolutional decoder: representation ``[B, d]`` -> image ``[B, C, H, W]`` in [0, 1].

    After Dosovitskiy & Brox's (CVPR 2016) decoders of fully connected features: a fully connected
    layer to a coarse feature map, then stride-2 transposed convolutions (4x4 kernels) with leaky
    ReLU (slope 0.2); scaled down here to two up-convolutions (H/4 -> H, for 28x28 and 32x32
    images), then a 3x3 convolution to the channels and a sigmoid, so the output is a [0, 1] image.
    Sides not divisible by 4 are decoded at the next multiple of 4 and the top-left ``H x W`` kept.

    The input is standardised with per-feature ``shift``/``scale`` buffers (the auxiliary
    representations' mean and standard deviation, set by :func:`train_decoder`, :func:`feature_scale`),
    so one learning rate suits extractors whose outputs differ in scale by orders of magnitude.

    Args:
        feature_dim: d.
        image_shape: ``(C, H, W)`` of the output.
        width: channels of the coarse feature map (halved by each up-convolution).
    """

    def __init__(self, feature_dim: int, image_shape: Sequence[int], width: int = 128) -> None:
        super().__init__()
        self.image_shape = tuple(int(v) for v in image_shape)
        c, h, w = self.image_shape
        self.coarse = (width, -(-h // 4), -(-w // 4))
        self.register_buffer("shift", torch.zeros(feature_dim))
        self.register_buffer("scale", torch.ones(feature_dim))
        self.fc = nn.Linear(feature_dim, width * self.coarse[1] * self.coarse[2])
        self.up = nn.Sequential(
            nn.LeakyReLU(0.2),
            nn.ConvTranspose2d(width, width // 2, 4, stride=2, padding=1),
            nn.LeakyReLU(0.2),
            nn.ConvTranspose2d(width // 2, width // 4, 4, stride=2, padding=1),
            nn.LeakyReLU(0.2),
            nn.Conv2d(width // 4, c, 3, padding=1),
        )

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        """Images float32 ``[B, C, H, W]`` in [0, 1] for representations ``z`` ``[B, d]``."""
        _, h, w = self.image_shape
        x = self.fc((z - self.shift) / self.scale).view(-1, *self.coarse)
        return torch.sigmoid(self.up(x)[..., :h, :w])


@contextmanager
def _seeded(generator: torch.Generator):
    """A context in which PyTorch's global CPU RNG (module initialisation draws from it) is seeded
    from ``generator``; the caller's global RNG state is restored afterwards."""
    seed = int(torch.randint(0, 2**62, (1,), generator=generator))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def feature_scale(z: torch.Tensor) -> torch.Tensor:
    """The decoder's per-feature scale float32 ``[d]`` for representations ``z`` float ``[n, d]``: each
    feature's standard deviation (ddof 0), floored at the median of the positive ones.

    Why the floor: a ReLU unit that is dead (or nearly) on the attacker's auxiliary images has a std of 0
    (or tiny); dividing by it turns the same unit active in a victim's vector into values of 1e5 and
    more, and the decoder's sigmoid saturates almost every pixel. With the floor, such a unit is
    weighed like a typical one. With no positive std at all the scale is 1.
    """
    std = z.std(0, unbiased=False)
    positive = std[std > 0]
    floor = positive.median() if len(positive) else std.new_tensor(1.0)
    return std.clamp_min(floor)


def train_decoder(
    extractor: nn.Module,
    aux_images_uint8: torch.Tensor,
    mean: Sequence[float],
    std: Sequence[float],
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    generator: torch.Generator,
) -> Decoder:
    """Black-box inversion, training: a :class:`Decoder` from ``extractor``'s space back to pixels.

    Dosovitskiy & Brox, CVPR 2016: minimise the pixel MSE sum_i ||x_i - f(phi(x_i); w)||^2
    over the decoder weights w, on auxiliary images x_i through the frozen ``extractor`` phi (the
    attacker's surrogate of a client's extractor, :func:`fit_surrogate`, or a client's own). The
    representations are computed once (eval mode, no augmentation); Adam, shuffled batches, the last
    partial batch kept. Assumed: the auxiliary images come from a distribution like the victims'.

    Args:
        extractor: normalised images ``[B, C, H, W]`` float32 -> ``[B, d]``; unchanged.
        aux_images_uint8: uint8 ``[n, C, H, W]``; C, H, W set the decoder's output.
        mean, std: per-channel normalisation constants (``DatasetInfo``).
        epochs, batch_size, lr: Adam training schedule.
        generator: draws the decoder's initial weights and the batch order.

    Returns:
        the trained :class:`Decoder` in eval mode, on the extractor's device.

    Raises:
        ValueError: images not uint8 4-D, or mean/std not one value per channel.
    """
    pixels = _pixels(aux_images_uint8)
    z = _representations(extractor, pixels, mean, std, batch_size)
    device = z.device
    with _seeded(generator):
        decoder = Decoder(z.shape[1], pixels.shape[1:]).to(device)
    decoder.shift.copy_(z.mean(0))
    decoder.scale.copy_(feature_scale(z))
    optimiser = torch.optim.Adam(decoder.parameters(), lr=lr)
    decoder.train()
    for _ in range(epochs):
        order = torch.randperm(len(z), generator=generator)
        for i in range(0, len(z), batch_size):
            idx = order[i : i + batch_size]
            loss = F.mse_loss(decoder(z[idx.to(device)]), pixels[idx].to(device))
            optimiser.zero_grad(set_to_none=True)
            loss.backward()
            optimiser.step()
    return decoder.eval()


@torch.no_grad()
def decode(decoder: nn.Module, vectors: torch.Tensor, batch_size: int = 256) -> torch.Tensor:
    """Black-box inversion, attack: ``decoder`` on ``vectors`` float ``[n, d]`` (eval mode, no gradients).

    Returns float32 ``[n, C, H, W]`` in [0, 1] on the CPU. ``batch_size`` bounds the memory only.
    """
    decoder.eval()
    device = _device(decoder)
    v = vectors.detach().float()
    return torch.cat([decoder(v[i : i + batch_size].to(device)).cpu() for i in range(0, len(v), batch_size)])


def fit_surrogate(
    extractor: nn.Module,
    head: nn.Module | None,
    prototypes: tuple[torch.Tensor, torch.Tensor] | None,
    aux_images_uint8: torch.Tensor,
    aux_labels: torch.Tensor,
    mean: Sequence[float],
    std: Sequence[float],
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    generator: torch.Generator,
    proto_weight: float = 10.0,
) -> nn.Module:
    """The black-box attacker's surrogate extractor, aligned with what the federation shares.

    The attacker knows no client's extractor, only the shared knowledge: a global head (FedGH's
    global header, FedRE's global classifier) or global prototypes (FedProto, FedTGP). It trains a
    public architecture (``extractor``, built by the caller with the clients' representation size d)
    on auxiliary labelled images so that its representations are read by that knowledge as the
    clients' are:

    - ``head`` given: cross-entropy of ``head(extractor(x))`` with the head frozen: it is the shared
      knowledge the representations must fit, not something the attacker may change.
    - ``prototypes`` given: cross-entropy plus ``proto_weight`` times the squared distance of each
      representation to its class's prototype, summed over classes that have one and divided by the
      batch's number of entries (FedProto's local objective, Tan et al. AAAI 2022, in the
      project's ``mse-mean`` form); the cross-entropy goes through ``head`` if given, else
      through a fresh trainable Linear(d, C) that is discarded afterwards.

    Adam on the extractor (and the fresh head), shuffled batches, the last partial batch kept, no
    augmentation. Assumed: the auxiliary images and labels come from the federation's label space.

    Args:
        extractor: normalised images ``[B, C, H, W]`` float32 -> ``[B, d]``. Not changed: a deep
            copy is trained and returned.
        head: module ``[B, d]`` -> logits ``[B, C]``, or None; its parameters, ``requires_grad`` and
            training flag are restored unchanged.
        prototypes: ``(protos float [C, d], valid bool [C])``, or None; rows with ``valid`` False
            (classes without a global prototype) add no term.
        aux_images_uint8: uint8 ``[n, C_in, H, W]``.
        aux_labels: int ``[n]`` class ids in ``[0, C)``.
        mean, std: per-channel normalisation constants (``DatasetInfo``).
        epochs, batch_size, lr: Adam training schedule.
        generator: draws the fresh head's weights (prototypes only) and the batch order.
        proto_weight: lambda of the prototype term (the project's ``fedproto.lambda`` default).

    Returns:
        the trained copy of ``extractor`` in eval mode, on its device.

    Raises:
        ValueError: neither ``head`` nor ``prototypes``; images and labels of different lengths;
            prototypes not ``[C, d]`` with a ``[C]`` mask; a label outside the classes.
    """
    if head is None and prototypes is None:
        raise ValueError("fit_surrogate needs the shared knowledge to match: a head, prototypes, or both")
    pixels = _pixels(aux_images_uint8)
    labels = aux_labels.long()
    if labels.shape != (len(pixels),):
        raise ValueError(f"aux_labels must be [{len(pixels)}] (one per image), got {tuple(aux_labels.shape)}")
    device = _device(extractor)
    surrogate = copy.deepcopy(extractor).train()
    params = list(surrogate.parameters())
    protos = valid = None
    if prototypes is not None:
        protos, valid = (t.to(device) for t in prototypes)
        if protos.dim() != 2 or valid.shape != (protos.shape[0],):
            raise ValueError(f"prototypes must be ([C, d], [C] bool), got {tuple(protos.shape)}, {tuple(valid.shape)}")
        protos, valid = protos.float(), valid.bool()
        if head is None:
            with _seeded(generator):
                own = nn.Linear(protos.shape[1], protos.shape[0]).to(device)
            params += list(own.parameters())
    m, s = _channel_stats(mean, std, pixels.shape[1], device)
    optimiser = torch.optim.Adam(params, lr=lr)
    with _frozen(head) if head is not None else nullcontext(own) as classify:
        for _ in range(epochs):
            order = torch.randperm(len(pixels), generator=generator)
            for i in range(0, len(pixels), batch_size):
                idx = order[i : i + batch_size]
                y = labels[idx].to(device)
                features = surrogate((pixels[idx].to(device) - m) / s)
                logits = classify(features)
                low, high = int(y.min()), int(y.max())
                if low < 0 or high >= logits.shape[1]:
                    raise ValueError(f"aux_labels must lie in [0, {logits.shape[1]}), got {low}..{high}")
                loss = F.cross_entropy(logits, y)
                if protos is not None:
                    diff = (features - protos[y]) * valid[y, None]
                    loss = loss + proto_weight * diff.pow(2).sum() / features.numel()
                optimiser.zero_grad(set_to_none=True)
                loss.backward()
                optimiser.step()
    return surrogate.eval()
