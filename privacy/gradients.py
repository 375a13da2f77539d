"""Image reconstruction from shared gradients and weight updates.

What is attacked is a weight payload: MH-pFedHN's ``delta_theta`` and MH-pFedHNGD's ``delta_w_g``
(flat weights after local training minus the flat weights the client was sent), the shared model
of FML / FedKD / FedMRL and LG-FedAvg's head (the uploaded state minus what the server sent).
:func:`parameter_update` turns either form into the per-parameter dict the attacks take.

Two attacks:

- :func:`idlg`: a single example's gradient. Zhao, Mopuri & Bilen, "iDLG: Improved Deep Leakage
  from Gradients", 2020: the label from the last layer's weight gradient, then the image by
  gradient matching (Zhu, Liu & Han, "Deep Leakage from Gradients", NeurIPS 2019).
- :func:`invert_update`: a multi-step local update. Geiping, Bauermeister, Dröge & Moeller,
  "Inverting Gradients - How easy is it to break privacy in federated learning?", NeurIPS 2020,
  Section 5 (the "FedAvg" setting): unroll the local SGD steps on dummy images and match the
  simulated update to the observed one in cosine distance, under the local training's own loss where
  the caller gives it (FML's and FedKD's distillation, FedMRL's two heads: ``loss`` and ``matched``).

Both run the model in eval mode (BatchNorm with running statistics, no Dropout): the attacker
cannot reproduce the client's dropout masks, and neither the client's data augmentation nor its
batch order is simulated. Images are pixels in [0, 1]; the network sees them normalised per
channel with ``mean``/``std`` (``common.data.normalize``). Everything runs on the device of the
model's parameters and returns CPU tensors; deterministic given the ``torch.Generator`` (CPU).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from common.optim import Adam
from privacy.inversion import total_variation


def parameter_update(model: nn.Module, update) -> dict[str, torch.Tensor]:
    """A weight payload as a dict parameter name -> float32 tensor of that parameter's shape.

    Args:
        model: the network whose parameters the payload covers (for LG-FedAvg's head, the head
            module, whose parameters are ``weight`` and ``bias``).
        update: either a flat vector (numpy array or tensor, 1-D) in the canonical order of
            ``model.parameters()`` (``torch.nn.utils.parameters_to_vector``: the layout of
            MH-pFedHN's ``theta``/``delta_theta`` and MH-pFedHNGD's ``w_g``/``delta_w_g``,
            ``methods.blocks.hypernetwork.load_flat``), or a mapping name -> array (a state-dict
            difference, e.g. a shared model's uploaded state minus the state sent). Keys of the
            mapping that are not parameters (BatchNorm buffers) are ignored.

    Returns:
        ``{name: tensor}`` for every parameter of ``model``, in ``named_parameters`` order, on
        the device of the model.

    Raises:
        ValueError: a flat vector whose length is not the model's parameter count, a mapping
            missing a parameter, or an entry whose shape differs from its parameter's (named).
    """
    params = dict(model.named_parameters())
    device = next(iter(params.values())).device
    if isinstance(update, Mapping):
        missing = [name for name in params if name not in update]
        if missing:
            raise ValueError(f"update lacks parameters {missing}; it has {sorted(update)}")
        out = {name: torch.as_tensor(np.asarray(update[name]), dtype=torch.float32) for name in params}
    else:
        flat = torch.as_tensor(np.asarray(update), dtype=torch.float32)
        total = sum(p.numel() for p in params.values())
        if flat.dim() != 1 or flat.numel() != total:
            raise ValueError(f"a flat update must be 1-D with {total} entries (the model's), got {tuple(flat.shape)}")
        out, start = {}, 0
        for name, p in params.items():
            out[name] = flat[start : start + p.numel()].view(p.shape)
            start += p.numel()
    for name, p in params.items():
        if out[name].shape != p.shape:
            raise ValueError(f"update {name!r} has shape {tuple(out[name].shape)}, the parameter {tuple(p.shape)}")
    return {name: value.to(device) for name, value in out.items()}


def _stats(mean: Sequence[float], std: Sequence[float], channels: int, device: torch.device):
    """``mean``/``std`` as float32 ``[1, C, 1, 1]``; ValueError unless both have one value per channel."""
    if len(mean) != channels or len(std) != channels:
        raise ValueError(f"mean {tuple(mean)} and std {tuple(std)} need one value per image channel ({channels})")
    shape = (1, channels, 1, 1)
    return (
        torch.tensor(mean, dtype=torch.float32, device=device).view(shape),
        torch.tensor(std, dtype=torch.float32, device=device).view(shape),
    )


def _last_weight(model: nn.Module) -> str:
    """The name of the last 2-D parameter of ``model`` (``head.weight`` of a SplitModel)."""
    names = [name for name, p in model.named_parameters() if p.dim() == 2]
    if not names:
        raise ValueError("the model has no 2-D (linear) parameter to read a label from")
    return names[-1]


def idlg_label(weight_gradient: torch.Tensor) -> int:
    """The label of a single example from its last linear layer's weight gradient ``[C, d]``.

    Zhao et al. 2020, Section 3: with softmax cross-entropy, row i of the gradient is
    ``(p_i - y_i) h`` for the layer's input h, so the true class's row points the other way
    from every other row: it is the row with the most negative inner products with the others
    (all C - 1 of them; any other row has exactly one). The sign of h does not matter. With
    C = 2 both rows have one; then, as the paper (for non-negative h: ReLU or sigmoid
    representations), the row with the smaller (negative) sum.
    """
    g = weight_gradient.detach().double().flatten(1)
    gram = g @ g.T
    negatives = (gram < 0).sum(1)
    candidates = torch.nonzero(negatives == negatives.max()).flatten()
    return int(candidates[g[candidates].sum(1).argmin()])


def idlg(
    model: nn.Module,
    gradients: Mapping[str, torch.Tensor],
    image_shape: Sequence[int],
    mean: Sequence[float],
    std: Sequence[float],
    *,
    steps: int = 300,
    lr: float = 1.0,
    generator: torch.Generator,
) -> tuple[int, torch.Tensor]:
    """iDLG: the label and the image of a single example from its gradient.

    The label is :func:`idlg_label` of the last 2-D parameter's gradient (``head.weight`` of a
    SplitModel). The image x in [0, 1] minimises ``sum_k ||grad_k(x) - gradients_k||^2`` over every
    parameter k, where ``grad(x)`` is the gradient of the mean cross-entropy of
    ``model(normalize(x))`` with that label (DLG's objective with iDLG's known label). Optimiser as
    the iDLG authors run it: ``torch.optim.LBFGS`` with lr 1 and PyTorch's defaults (up to 20
    evaluations per step, history 100, no line search), 300 steps, from x ~ N(0, 1) (their dummy
    image). The pixels are optimised unconstrained; the image returned is the one of the lowest
    matching loss evaluated (without a line search an L-BFGS step can overshoot, even to NaN),
    clamped to [0, 1].

    Args:
        model: the network at the weights the gradient was taken at (its parameters are not
            changed; its train/eval mode is restored).
        gradients: parameter name -> gradient (every name of ``model.named_parameters()``).
        image_shape: ``(C, H, W)``.
        mean, std: per-channel normalisation of the model's input (C values each).
        steps: L-BFGS steps (>= 1; the authors' 300); lr: its step size (the authors' 1);
            generator: draws the start image.

    Returns:
        ``(label, image)``: int and float32 ``[C, H, W]`` in [0, 1] on the CPU.

    Raises:
        ValueError: a parameter without gradient, or a gradient of another shape (named), or
            mean/std of the wrong length.
    """
    params = {name: p.detach() for name, p in model.named_parameters()}
    for name, p in params.items():
        if name not in gradients or tuple(gradients[name].shape) != tuple(p.shape):
            got = tuple(gradients[name].shape) if name in gradients else "missing"
            raise ValueError(f"gradient of {name!r} must have shape {tuple(p.shape)}, got {got}")
    device = next(iter(params.values())).device
    target = [gradients[name].detach().to(device, torch.float32) for name in params]
    label = idlg_label(gradients[_last_weight(model)])
    m, s = _stats(mean, std, image_shape[0], device)
    y = torch.tensor([label], device=device)
    x = torch.randn((1, *image_shape), generator=generator).to(device).requires_grad_(True)
    weights = [p.requires_grad_(True) for p in params.values()]
    opt = torch.optim.LBFGS([x], lr=lr)
    best = [float("inf"), x.detach().clone()]
    training = model.training
    model.eval()

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(functional_call(model, params, ((x - m) / s,)), y)
        grads = torch.autograd.grad(loss, weights, create_graph=True)
        match = sum(((g - t) ** 2).sum() for g, t in zip(grads, target, strict=True))
        x.grad = torch.autograd.grad(match, x)[0]
        value = float(match.detach())
        if value < best[0]:  # NaN compares False: a diverged point is never kept
            best[:] = [value, x.detach().clone()]
        return match.detach()

    try:
        for _ in range(steps):
            opt.step(closure)
            if not torch.isfinite(x).all():  # diverged: later steps only compute NaNs
                break
    finally:
        model.train(training)
    return label, best[1].clamp(0, 1)[0].float().cpu()


#: the loss a client's local training minimises: ``(model, normalised images [B, C, H, W], labels [B]) -> scalar``,
#: called inside :func:`torch.func.functional_call` of ``model``, so every submodule it reaches (a companion
#: model, a projector) runs with the unrolled parameters
TrainingLoss = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def cross_entropy_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The plain local training's loss: the mean cross-entropy of ``model(x)`` (float [B, C]) with ``y``."""
    return F.cross_entropy(model(x), y)


def training_loss(supervised: Callable[..., torch.Tensor]) -> TrainingLoss:
    """``supervised`` (``common.training.SupervisedLoss``: ``(images, representations, logits, labels) ->
    scalar``, a method's own loss, e.g. a client procedure's ``local_training``) as the training loop calls
    it, as a :data:`TrainingLoss`: representations ``model.extractor(x)``, logits ``model.head`` of them."""

    def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        features = model.extractor(x)
        return supervised(x, features, model.head(features), y)

    return loss


class _Objective(nn.Module):
    """``model`` with ``loss`` as its forward pass, so one :func:`functional_call` swaps the parameters
    of every submodule the loss reaches (parameter names gain the prefix ``model.``)."""

    def __init__(self, model: nn.Module, loss: TrainingLoss) -> None:
        super().__init__()
        self.model, self.loss = model, loss

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.loss(self.model, x, y)


def _sgd_unroll(
    model: nn.Module,
    start: dict[str, torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    local_steps: int,
    lr: float,
    batch_size: int,
    momentum: float,
    weight_decay: float,
    loss: TrainingLoss,
    matched: Sequence[str],
) -> dict[str, torch.Tensor]:
    """The update (parameters after minus before) of the parameters ``matched`` after ``local_steps``
    differentiable SGD steps of every parameter in ``start`` on ``loss`` over (x, y), summed step by step
    (not the end minus the start, which costs a subtraction of every parameter and rounds the small update
    against the large weights).

    PyTorch's SGD (dampening 0, no Nesterov): ``d = g + weight_decay * w``; ``b = d`` on the first
    step, then ``b = momentum * b + d``; ``w -= lr * b``. Batches of ``batch_size`` in the images'
    own order, cycling through them (step t takes batch t mod ceil(n / batch_size)).
    """
    objective = _Objective(model, loss)
    params = {f"model.{name}": w for name, w in start.items()}
    buffers = {f"model.{name}": b.detach() for name, b in model.named_buffers()}
    keep = {f"model.{name}" for name in matched}
    velocity: dict[str, torch.Tensor] = {}
    update: dict[str, torch.Tensor] = {}
    n = len(x)
    starts = list(range(0, n, batch_size))
    for t in range(local_steps):
        lo = starts[t % len(starts)]
        value = functional_call(objective, {**params, **buffers}, (x[lo : lo + batch_size], y[lo : lo + batch_size]))
        # allow_unused: a parameter the loss does not reach (a companion's unused layer) takes no gradient
        grads = torch.autograd.grad(value, list(params.values()), create_graph=True, allow_unused=True)
        for (name, w), g in zip(list(params.items()), grads, strict=True):
            g = torch.zeros_like(w) if g is None else g
            d = g + weight_decay * w if weight_decay else g
            velocity[name] = momentum * velocity[name] + d if name in velocity and momentum else d
            step = -lr * velocity[name]
            if name in keep:
                update[name] = update[name] + step if name in update else step
            if t + 1 < local_steps:  # the last step's weights are never read
                params[name] = w + step
    return {name: update[f"model.{name}"] for name in matched}


def invert_update(
    model: nn.Module,
    start_state: Mapping[str, torch.Tensor],
    update: Mapping[str, torch.Tensor],
    *,
    num_images: int,
    labels: torch.Tensor,
    local_steps: int,
    lr: float,
    batch_size: int,
    image_shape: Sequence[int],
    mean: Sequence[float],
    std: Sequence[float],
    generator: torch.Generator,
    steps: int = 4000,
    attack_lr: float = 0.1,
    tv_weight: float = 0.2,
    restarts: int = 1,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    loss: TrainingLoss = cross_entropy_loss,
    matched: Sequence[str] | None = None,
) -> torch.Tensor:
    """Inverting Gradients, multi-step ("FedAvg") variant: images whose simulated local update
    matches an observed weight update.

    Geiping et al., NeurIPS 2020, Eq. 4 and Section 5: minimise over x in [0, 1]
    ``1 - <dW(x), dW> / (||dW(x)|| ||dW||) + tv_weight * TV(normalize(x))``, where dW is ``update``
    flattened over every parameter of ``matched``, dW(x) = (those parameters after ``local_steps`` SGD
    steps of every parameter of ``model`` from ``start_state`` on ``loss`` over (normalize(x), labels)) -
    (their start values), differentiated through the unrolled steps, and TV is the paper's anisotropic
    L1 total variation of the normalised image (:func:`privacy.inversion.total_variation` with beta 1;
    the paper's CIFAR-10 weight 0.2). The optimiser is the paper's: Adam (lr ``attack_lr``) on the sign
    of the gradient, the step size divided by 10 at 3/8, 5/8 and 7/8 of ``steps``, pixels clamped to
    [0, 1] after every step (the box constraint), ``restarts`` trials from independent uniform-noise
    starts of which the one with the lowest final objective is returned. The paper's budget is 24,000
    iterations (the default 4,000 is a sixth of it, for CPU time; the control tests measure what
    smaller budgets recover).

    A method whose client trains the shared module together with private ones (FML's meme model beside
    the private model, FedKD's mentee with the mentor and the alignment map, FedMRL's small model in the
    fused one) is simulated as it trains: ``model`` is the whole module its local training optimises,
    ``loss`` the method's own loss, ``matched`` the shared module's parameters (the only ones uploaded);
    the private parameters train in the simulation from their ``start_state`` values and are not matched.
    Knowing them is the white-box attacker's assumption (the victim's models at the start of the round).

    What the attacker assumes: the start parameters (what the server sent), the client's
    learning rate, number of SGD steps and batch size, and the labels (from the payload's label
    leakage, :mod:`privacy.labels`, or known); with ``momentum``/``weight_decay`` > 0 also those
    (PyTorch's SGD, as ``common.training``; both cost nothing extra in the unrolled graph). Not
    simulated: the real batch order (the dummy images go in their own order), the training
    augmentation, gradient-norm clipping (``clip-norm``), BatchNorm's batch statistics and
    Dropout (eval mode). ``num_images`` is the attacker's guess of the number of images trained
    on; the real number is typically far larger than what can be recovered.

    Args:
        model: the architecture (its own parameters are not used or changed; its buffers, e.g.
            BatchNorm running statistics, are).
        start_state: parameter name -> value at the start of local training, for every parameter of
            ``model`` (extra keys such as buffers are ignored).
        update: parameter name -> end minus start (:func:`parameter_update`), for every name of
            ``matched``.
        num_images: images to reconstruct; labels: int64 ``[num_images]``.
        local_steps: SGD steps of the client; lr, batch_size, momentum, weight_decay: its SGD.
        image_shape: ``(C, H, W)``; mean, std: per-channel normalisation.
        generator: draws the start images of every trial.
        steps: attack iterations per trial; attack_lr: Adam step size; tv_weight: L1 TV weight
            (>= 0); restarts: trials (>= 1).
        loss: the local training's loss (:data:`TrainingLoss`; default :func:`cross_entropy_loss`).
        matched: the parameters ``update`` covers (default every parameter of ``model``).

    Returns:
        float32 ``[num_images, C, H, W]`` in [0, 1] on the CPU.

    Raises:
        ValueError: labels not ``[num_images]``, a parameter missing from ``start_state`` or a
            ``matched`` one from ``update``, or of another shape (named), a ``matched`` name that is
            no parameter of ``model``, mean/std of the wrong length, ``steps`` or ``restarts`` < 1.
    """
    names = [name for name, _ in model.named_parameters()]
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    matched = names if matched is None else list(matched)
    unknown = [name for name in matched if name not in shapes]
    if unknown:
        raise ValueError(f"matched names {unknown} are no parameters of the model; it has {names}")
    for source, label, needed in ((start_state, "start_state", names), (update, "update", matched)):
        for name in needed:
            if name not in source or tuple(source[name].shape) != shapes[name]:
                got = tuple(source[name].shape) if name in source else "missing"
                raise ValueError(f"{label}[{name!r}] must have shape {shapes[name]}, got {got}")
    if tuple(labels.shape) != (num_images,):
        raise ValueError(f"labels must be [num_images] = [{num_images}], got {tuple(labels.shape)}")
    if steps < 1 or restarts < 1:
        raise ValueError(f"steps and restarts must be >= 1, got steps={steps}, restarts={restarts}")
    device = next(model.parameters()).device
    start = {name: torch.as_tensor(start_state[name]).detach().to(device, torch.float32) for name in names}
    observed = {name: torch.as_tensor(update[name]).to(device, torch.float32) for name in matched}
    observed_norm = torch.sqrt(sum(o.square().sum() for o in observed.values()))
    m, s = _stats(mean, std, image_shape[0], device)
    y = labels.to(device, torch.int64)
    leaves = {name: w.clone().requires_grad_(True) for name, w in start.items()}
    sgd = dict(
        local_steps=local_steps,
        lr=lr,
        batch_size=batch_size,
        momentum=momentum,
        weight_decay=weight_decay,
        loss=loss,
        matched=matched,
    )

    def objective(x: torch.Tensor) -> torch.Tensor:
        simulated = list(_sgd_unroll(model, leaves, (x - m) / s, y, **sgd).values())
        # the cosine of the two updates flattened, summed parameter by parameter: one vector of every
        # parameter (torch.cat) and F.cosine_similarity over it cost 2x the whole iteration on CNN-1
        dot = sum((d * observed[name]).sum() for name, d in zip(matched, simulated, strict=True))
        norm = torch.sqrt(sum(d.square().sum() for d in simulated))
        tv = total_variation((x - m) / s, beta=1).mean()
        return 1 - dot / (norm * observed_norm).clamp_min(1e-12) + tv_weight * tv

    training = model.training
    model.eval()
    best: tuple[float, torch.Tensor] = (float("inf"), torch.empty(0))
    try:
        for _ in range(restarts):
            x = torch.rand((num_images, *image_shape), generator=generator).to(device).requires_grad_(True)
            opt = Adam([x], lr=attack_lr)
            milestones = [int(steps * f) for f in (3 / 8, 5 / 8, 7 / 8)]
            scheduler = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=milestones, gamma=0.1)
            for _ in range(steps):
                opt.zero_grad()
                x.grad = torch.autograd.grad(objective(x), x)[0].sign()
                opt.step()
                scheduler.step()
                with torch.no_grad():
                    x.clamp_(0, 1)
            final = float(objective(x).detach())
            if final < best[0] or best[1].numel() == 0:
                best = (final, x.detach())
    finally:
        model.train(training)
    return best[1].float().cpu()
