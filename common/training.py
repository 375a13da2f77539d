"""Local computations shared by the methods' client procedures: train, extract, evaluate.

All take uint8 image tensors ``[n, C_in, H, W]`` and int64 labels ``[n]`` (a
:class:`common.data.ClientData` split), normalise on the fly on ``device`` and never
keep gradients outside the training loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from common.data import ClientData, augment, batches, normalize
from common.datasets import DatasetInfo
from common.dp import DPPlan, noisy_class_means, secret_generator
from common.optim import SGD
from common.protocol import RECORD, SERVER_ROUND, start_snapshot_name
from models.base import SplitModel

EVAL_BATCH = 512


def make_sgd(params, config: Mapping[str, Any]) -> SGD:
    """A fresh SGD optimiser from the message config (``lr``, ``momentum``, ``weight-decay``).

    Fresh every round: no optimiser state persists (docs/methods/fedgh.md P9).
    """
    return SGD(
        params, lr=float(config["lr"]), momentum=float(config["momentum"]), weight_decay=float(config["weight-decay"])
    )


Regularizer = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
#: ``supervised_loss(images [B, C_in, H, W], representations [B, d], logits [B, C], labels [B]) -> scalar``; one
#: that runs a companion model may carry ``per_example``, the same arguments giving the float [B] terms whose mean
#: it is, so that DP-SGD clips it by ghost clipping (:func:`private_training`)
SupervisedLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def train_supervised(
    model: SplitModel,
    data: ClientData,
    config: Mapping[str, Any],
    device: torch.device,
    generator: torch.Generator,
    regularizer: Regularizer | None = None,
    supervised_loss: SupervisedLoss | None = None,
    clip_groups: list[list[nn.Parameter]] | None = None,
    dp: DPPlan | None = None,
    dp_clip_norm: float | None = None,
) -> dict[str, float]:
    """Train all of ``model`` with cross-entropy for ``local-epochs`` epochs on the train split.

    Mini-batches of ``batch-size`` in ``batch-order``: ``shuffle`` reshuffles every epoch and keeps
    the last partial batch (except a 1-sample one in a model with BatchNorm, which cannot train on
    it); ``fixed`` takes the partition's own order every epoch and drops the last partial batch
    (HtFLlib's training loader: a client with fewer than ``batch-size`` samples trains on nothing);
    ``shuffle-drop`` reshuffles every epoch and drops the last partial batch (PFLlib's loader).
    Then training augmentation, SGD from
    :func:`make_sgd` over all of ``model.parameters()`` (modules registered on ``model``
    besides extractor and head, e.g. a companion model, train too), gradient-norm clipping
    at ``clip-norm`` (<= 0: off) of each parameter list in ``clip_groups`` separately
    (default: one group, all parameters).
    ``supervised_loss(images, representations, logits, labels)`` replaces the cross-entropy
    when given (e.g. MH-pFedHNGD's CE + distillation from a teacher that sees the same
    augmented images, FML's mutual learning with a companion model).
    ``regularizer(representations [B, d], labels [B])`` is added to the loss when given
    (e.g. FedProto/FedTGP's prototype term); it sees the train-mode representations.
    ``precision`` ``bf16`` runs the forward pass and the loss under bfloat16 autocast (weights,
    gradients and the optimiser stay float32); ``fp32`` (the papers' recipe) does not.
    With ``dp`` (run config ``dp.epsilon`` > 0) the training is DP-SGD (:func:`private_training`):
    Poisson-sampled batches instead of ``batch-order``, each example's gradient clipped to
    ``dp.clip-norm`` instead of ``clip-norm``, and Gaussian noise on each step's sum; with
    ``dp.adaptive-clip`` the clip starts at ``dp_clip_norm`` (default ``dp.clip-norm``) and adapts.

    Returns:
        ``train-loss`` (mean over samples of the last epoch), ``train-acc`` (fraction, last
        epoch), ``train-seconds`` (wall time of the loop, synchronised on CUDA); with
        ``dp.adaptive-clip`` also ``dp-clip-norm``, the clip the training ended at.
    """
    start = time.perf_counter()
    model.train()
    opt = make_sgd(model.parameters(), config)
    if dp is not None:
        clip = dp.options.clip_norm if dp_clip_norm is None else dp_clip_norm
        return private_training(
            model, data, config, device, generator, opt, dp, clip, regularizer, supervised_loss, start
        )
    clip = float(config["clip-norm"])
    clip_groups = clip_groups or [list(model.parameters())]
    x_all, y_all = data.train_x.to(device), data.train_y.to(device)
    bf16 = config["precision"] == "bf16"
    min_batch = 2 if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()) else 1
    batch_size, order = int(config["batch-size"]), config["batch-order"]
    fixed = order == "fixed"
    if order != "shuffle":  # fixed and shuffle-drop drop the last partial batch
        min_batch = max(min_batch, batch_size)
    loss_sum, correct, seen = 0.0, 0, 0
    for _ in range(int(config["local-epochs"])):
        loss_sum, correct, seen = 0.0, 0, 0
        for idx in batches(len(y_all), batch_size, None if fixed else generator):
            if len(idx) < min_batch:
                continue
            idx = idx.to(device)
            x = augment(normalize(x_all[idx], data.info), data.info, generator)
            y = y_all[idx]
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                features = model.extractor(x)
                logits = model.head(features)
                loss = (
                    F.cross_entropy(logits, y) if supervised_loss is None else supervised_loss(x, features, logits, y)
                )
                if regularizer is not None:
                    loss = loss + regularizer(features, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if clip > 0:
                for group in clip_groups:
                    nn.utils.clip_grad_norm_(group, clip)
            opt.step()
            loss_sum += float(loss.detach()) * len(y)
            correct += int((logits.detach().argmax(1) == y).sum())
            seen += len(y)
    _sync(device)
    return {
        "train-loss": loss_sum / max(seen, 1),
        "train-acc": correct / max(seen, 1),
        "train-seconds": time.perf_counter() - start,
    }


def private_training(
    model: nn.Module,
    data: ClientData,
    config: Mapping[str, Any],
    device: torch.device,
    generator: torch.Generator,
    opt: torch.optim.Optimizer,
    dp: DPPlan,
    clip_norm: float,
    regularizer: Regularizer | None,
    supervised_loss: SupervisedLoss | None,
    start: float,
) -> dict[str, float]:
    """:func:`train_supervised`'s loop as DP-SGD (Abadi et al. 2016) with Opacus: ``local-epochs`` epochs of
    ceil(n / B) steps, each on a Poisson sample of rate q = B / n (``UniformWithReplacementSampler``),
    per-example gradients clipped to ``dp.clip-norm``, summed, noised with standard deviation
    σ·``dp.clip-norm`` and divided by B before ``opt``'s step. Augmentation (``generator``) is per example,
    so it keeps the per-example bound; the sampling and the noise draw from the operating system's entropy
    (``common.dp.secret_generator``). The losses must be per-example means (cross-entropy, the prototype term
    ``mse-mean``, KL ``batchmean``).

    How the clipped sum is computed (the same sum up to float rounding):

    - when the loss reaches the model's parameters only through the representations and logits
      (:func:`reads_only_outputs`: cross-entropy, the prototype term, FD's and MH-pFedHNGD's distillation),
      by ghost clipping (Li et al. 2022; Opacus's ``GradSampleModuleFastGradientClipping``): one backward pass
      gives each example's gradient norm without materialising its gradient, a second one the sum of the
      gradients each scaled by min(1, C / norm). Opacus's second pass reweights per-example losses; here
      example i's loss is the surrogate B·(⟨∂L/∂h_i, h_i⟩ + ⟨∂L/∂z_i, z_i⟩) with the gradients held constant,
      whose parameter gradient is that of example i's term of the mean loss L (h: representation, z: logits).
      Per-example gradients of a 2M-parameter CNN-1 at B = 64 are 0.5 GB a step; this is 12x faster on CPU
      (``python -m bench.dp_overhead``);
    - a loss that runs a companion model (FML) by the same ghost clipping over the per-example terms its
      ``per_example`` attribute gives (Opacus's own second pass);
    - otherwise (FedKD, FedMRL) from materialised per-example gradients (``GradSampleModule``).

    With ``dp.adaptive-clip`` the clip starts at ``clip_norm`` and every step moves it towards the
    ``dp.target-quantile`` of the per-example gradient norms (Andrew et al. 2021: under ghost clipping
    ``common.adaptive_clip.GhostQuantileClip`` counts the norms of the step's first pass, otherwise
    ``QuantileClipDPOptimizer`` those of the per-example gradients), the gradients noised at σ_Δ
    (``DPPlan.gradient_noise_multiplier``) to pay for the count; without, the clip is ``dp.clip-norm`` throughout.

    Returns:
        as :func:`train_supervised`, with ``dp-clip-norm`` (the clip after the last step) when adaptive.
    """
    from opacus.utils.fast_gradient_clipping_utils import DPTensorFastGradientClipping
    from opacus.utils.uniform_sampler import UniformWithReplacementSampler

    from common.adaptive_clip import GhostQuantileClip

    def objective(x: torch.Tensor, features: torch.Tensor, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(logits, y) if supervised_loss is None else supervised_loss(x, features, logits, y)
        return loss if regularizer is None else loss + regularizer(features, y)

    n = len(data.train_y)
    x_all, y_all = data.train_x.to(device), data.train_y.to(device)
    outputs_only = reads_only_outputs(model, objective, normalize(x_all[:1], data.info), y_all[:1])
    per_example = getattr(supervised_loss, "per_example", None) if regularizer is None else None
    ghost = outputs_only or per_example is not None
    sampled, private = _dp_optimizer(model, opt, dp, clip_norm, min(dp.batch_size, n), device, ghost)
    adapt = None
    if ghost and dp.options.adaptive_clip:
        adapt = GhostQuantileClip(
            target_quantile=dp.options.target_quantile,
            clip_lr=dp.options.clip_lr,
            count_noise=dp.count_noise,
            expected_batch_size=min(dp.batch_size, n),
            generator=secret_generator(),
        )
    sampler = UniformWithReplacementSampler(
        num_samples=n,
        sample_rate=dp.sample_rate,
        generator=secret_generator(),
        steps=dp.steps_per_training // int(config["local-epochs"]),
    )
    params = [p for p in model.parameters() if p.requires_grad]
    loss_sum, correct, seen = 0.0, 0, 0
    try:
        for _ in range(int(config["local-epochs"])):
            loss_sum, correct, seen = 0.0, 0, 0
            for idx in sampler:
                idx = torch.as_tensor(idx, dtype=torch.int64, device=device)
                x = augment(normalize(x_all[idx], data.info), data.info, generator)
                y = y_all[idx]
                private.zero_grad(set_to_none=True)
                if ghost and len(y) == 0:  # an empty Poisson sample still takes a (pure noise) step
                    for p in params:
                        p.grad = torch.zeros_like(p)
                    private.step()
                    if adapt is not None:
                        adapt.step(sampled, private, None)
                    continue
                features = model.extractor(x)
                logits = model.head(features)
                if ghost and outputs_only:
                    loss = _ghost_clipped_backward(sampled, private, objective, x, features, logits, y)
                elif ghost:
                    losses = per_example(x, features, logits, y)
                    DPTensorFastGradientClipping(sampled, private, losses, "mean").backward()
                    loss = losses.mean()
                else:
                    loss = logits.sum() if len(y) == 0 else objective(x, features, logits, y)
                    loss.backward()
                private.step()
                if adapt is not None:
                    adapt.step(sampled, private, sampled.per_sample_gradient_norms)
                loss_sum += float(loss.detach()) * len(y)
                correct += int((logits.detach().argmax(1) == y).sum())
                seen += len(y)
    finally:
        sampled._close()  # the model leaves as it came: no hooks, no per-example gradients
    _sync(device)
    stats = {
        "train-loss": loss_sum / max(seen, 1),
        "train-acc": correct / max(seen, 1),
        "train-seconds": time.perf_counter() - start,
    }
    if dp.options.adaptive_clip:
        stats["dp-clip-norm"] = float(private.max_grad_norm)
    return stats


def _dp_optimizer(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    dp: DPPlan,
    clip_norm: float,
    expected_batch: int,
    device: torch.device,
    ghost: bool,
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """(the model wrapped by Opacus's hooks, the DP optimiser over ``opt``) for :func:`private_training`."""
    from opacus import GradSampleModule
    from opacus.grad_sample import GradSampleModuleFastGradientClipping
    from opacus.optimizers import DPOptimizer, DPOptimizerFastGradientClipping

    from common.adaptive_clip import QuantileClipDPOptimizer

    common = {"max_grad_norm": clip_norm, "expected_batch_size": expected_batch, "generator": secret_generator(device)}
    if ghost:  # adaptive: the count is GhostQuantileClip's, paid for by noising the gradients at σ_Δ
        sampled = GradSampleModuleFastGradientClipping(model, max_grad_norm=clip_norm, use_ghost_clipping=True)
        sigma = dp.gradient_noise_multiplier if dp.options.adaptive_clip else dp.noise_multiplier
        return sampled, DPOptimizerFastGradientClipping(opt, noise_multiplier=sigma, **common)
    sampled = GradSampleModule(model)  # hooks on model's own layers: model.extractor(x) records too
    if dp.options.adaptive_clip:
        return sampled, QuantileClipDPOptimizer(
            opt,
            noise_multiplier=dp.noise_multiplier,
            target_quantile=dp.options.target_quantile,
            clip_lr=dp.options.clip_lr,
            count_noise=dp.count_noise,
            **common,
        )
    return sampled, DPOptimizer(opt, noise_multiplier=dp.noise_multiplier, **common)


def _ghost_clipped_backward(
    sampled: nn.Module,
    private: torch.optim.Optimizer,
    objective: SupervisedLoss,
    x: torch.Tensor,
    features: torch.Tensor,
    logits: torch.Tensor,
    y: torch.Tensor,
) -> torch.Tensor:
    """Leave Σ_i min(1, C / ‖g_i‖)·g_i in the parameters' ``.grad`` (g_i: example i's gradient) by Opacus's
    two-pass ghost clipping, over per-example surrogate losses (:func:`private_training`); returns the
    mean loss L, a scalar, for the rows."""
    from opacus.utils.fast_gradient_clipping_utils import DPTensorFastGradientClipping

    outputs = (features.detach().requires_grad_(), logits.detach().requires_grad_())
    loss = objective(x, *outputs, y)
    grads = torch.autograd.grad(loss, outputs, allow_unused=True)
    surrogate = sum(
        (g * out).flatten(1).sum(1) for g, out in zip(grads, (features, logits), strict=True) if g is not None
    )
    DPTensorFastGradientClipping(sampled, private, len(y) * surrogate, "mean").backward()
    return loss


def reads_only_outputs(model: SplitModel, objective: SupervisedLoss, x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether ``objective(x, representations, logits, labels)`` (a scalar) reaches no trainable tensor
    other than the model's representations and logits, checked by walking its autograd graph on ``x``
    (one or a few normalised images ``[b, C_in, H, W]``) with both outputs detached: a loss that runs a
    companion model on ``x`` (FML's meme, FedKD's mentee, FedMRL's global header) reaches that model's
    parameters. Global RNG state is left as it was (dropout in the probe's forward pass)."""
    with torch.random.fork_rng(devices=[x.device] if x.device.type == "cuda" else []):
        features = model.extractor(x)
        outputs = (features.detach().requires_grad_(), model.head(features).detach().requires_grad_())
        loss = objective(x, *outputs, y)
    stack, seen = [loss.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        leaf = getattr(node, "variable", None)  # AccumulateGrad: a tensor gradients flow into
        if leaf is not None and not any(leaf is out for out in outputs):
            return False
        stack.extend(fn for fn, _ in node.next_functions)
    return True


def kd_loss(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0, per_example: bool = False
) -> torch.Tensor:
    """T² · KL(softmax(z_t/T) ‖ softmax(z_s/T)), mean over the batch (``per_example``: float [B], each row's);
    the teacher's side gets no gradient only if the caller detaches it (MH-pFedHNGD Eq. 8 with the code's
    weighting; FML, FedKD, FD)."""
    student = F.log_softmax(student_logits / temperature, dim=1)
    teacher = F.log_softmax(teacher_logits / temperature, dim=1)
    if per_example:
        return F.kl_div(student, teacher, reduction="none", log_target=True).sum(1) * temperature**2
    return F.kl_div(student, teacher, reduction="batchmean", log_target=True) * temperature**2


def train_personal_model(
    client,
    config: Mapping[str, Any],
    regularizer: Regularizer | None = None,
    supervised_loss: SupervisedLoss | None = None,
    model: SplitModel | None = None,
    clip_groups: list[list[nn.Parameter]] | None = None,
    data: ClientData | None = None,
) -> dict[str, float]:
    """Train the client's personal model (:func:`train_supervised`) with this round's RNG and persist it.

    ``model`` replaces the personal model in training when it is a wrapper around it (e.g.
    FedMRL's fused model); the personal model is what gets persisted either way. In a round whose
    payloads are recorded (config ``record``) such a wrapper is kept as it was before training
    (:func:`common.protocol.start_snapshot_name`): the white-box attacker's start of the companions.
    ``data`` replaces the client's data when the method trains on part of its train split (FedL2G keeps a
    quiz set out).

    Args:
        client: the :class:`common.runtime.ClientRuntime` of this message.
        config: the train instruction's config (``server-round`` and the training settings).

    Returns:
        The training metrics plus ``num-examples`` (local training samples).
    """
    if model is not None and config.get(RECORD):
        # the companions' start is not in the payload: the attack on the shared module's update needs it
        client.keep_snapshot(start_snapshot_name(int(config[SERVER_ROUND])), model)
    client.spend_privacy(trainings=1)  # with DP on: counted, durably, before the training runs
    clip = client.dp_clip_norm()  # dp.adaptive-clip: where the last round's training left the clip
    data = data or client.data
    stats = train_supervised(
        model or client.model,
        data,
        config,
        client.device,
        client.generator(int(config[SERVER_ROUND])),
        regularizer,
        supervised_loss,
        clip_groups,
        client.dp,
        clip,
    )
    if clip is not None:
        client.keep_dp_clip_norm(stats["dp-clip-norm"])
    client.save_model()
    return {**stats, "num-examples": len(data.train_y)}


def trained_class_means(
    client, stats: dict[str, float], module: nn.Module | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`class_means` of the client's (trained) extractor, or of ``module`` (e.g. the whole
    model, for per-class mean logits), over the train examples an epoch of local training sees: all
    of them, but with run config ``batch-order = "fixed"`` the first ⌊n / B⌋·B (B = ``batch-size``;
    all n when n < B). Why: ``fixed`` is HtFLlib's training loader (commit e959261,
    ``system/flcore/clients/clientbase.py::load_train_data``: ``DataLoader(drop_last=True,
    shuffle=False)``), and its FedTGP and FedGH clients take their prototypes over that loader
    (``clienttgp.py`` / ``clientgh.py::collect_protos``), so the last partial batch is in no prototype:
    with every example, ours started apart from HtFLlib's in round 1 of the paired cross-check
    (Fashion-MNIST ``htcnn8``, 120 examples, seed 0: 21.47 % against 15.53 %), without it the same
    to the printed digit (docs/methods/fedtgp.md, section 12).

    Its time is added to ``stats["train-seconds"]``: the payload computation is part of the
    client's training compute. With run config ``dp.epsilon`` > 0 the means are released by
    :func:`common.dp.noisy_class_means` (clipped rows, noisy sums and counts, the classes whose
    noisy count passes its threshold) and the release is charged to the client's budget.
    """
    start = time.perf_counter()
    data = client.data
    extractor = module or client.model.extractor
    n, batch = len(data.train_y), client.cfg.batch_size
    if client.cfg.batch_order == "fixed" and n >= batch:
        n -= n % batch
    train_x, train_y = data.train_x[:n], data.train_y[:n]
    if client.dp is None:
        out = class_means(extractor, train_x, train_y, data.info, client.device)
    else:
        rows = representations(extractor, train_x, data.info, client.device)
        dp = client.dp
        client.spend_privacy(releases=1)  # counted, durably, before the release is computed
        out = noisy_class_means(
            rows, train_y, data.info.num_classes, dp.options.payload_clip, dp.release_noise_multiplier
        )
    stats["train-seconds"] += time.perf_counter() - start
    return out


@torch.no_grad()
def representations(
    extractor: nn.Module, x: torch.Tensor, info: DatasetInfo, device: torch.device, batch_size: int = EVAL_BATCH
) -> torch.Tensor:
    """float64 [n, d] on the CPU: ``extractor``'s output for every image of ``x`` (eval mode, no augmentation)."""
    was_training = extractor.training
    extractor.eval()
    out = [extractor(normalize(x[idx].to(device), info)).double().cpu() for idx in batches(len(x), batch_size, None)]
    extractor.train(was_training)
    return torch.cat(out) if out else torch.zeros(0, 0, dtype=torch.float64)


@torch.no_grad()
def class_means(
    extractor: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    info: DatasetInfo,
    device: torch.device,
    batch_size: int = EVAL_BATCH,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact per-class mean representation over all of ``x`` (eval mode, no augmentation).

    FedGH Eq. 3 (local averaged representations), FedProto/FedTGP Eq. 2 (prototypes).
    Sums accumulate in float64 over batches and are divided once at the end, so the result
    does not depend on ``batch_size`` (docs/methods/fedgh.md P5).

    Returns:
        ``(means, labels)``: float32 ``[k, d]`` on the CPU, rows in ascending class order,
        and int64 ``[k]``, the k distinct classes present in ``y``. No row for absent classes.
    """
    was_training = extractor.training
    extractor.eval()
    sums: torch.Tensor | None = None
    counts = torch.zeros(info.num_classes, dtype=torch.float64, device=device)
    for idx in batches(len(y), batch_size, None):
        feats = extractor(normalize(x[idx].to(device), info)).double()
        yb = y[idx].to(device)
        if sums is None:
            sums = torch.zeros(info.num_classes, feats.shape[1], dtype=torch.float64, device=device)
        sums.index_add_(0, yb, feats)
        counts += torch.bincount(yb, minlength=info.num_classes).double()
    extractor.train(was_training)
    labels = torch.nonzero(counts).flatten()
    return (sums[labels] / counts[labels, None]).float().cpu(), labels.cpu()


@torch.no_grad()
def evaluate_model(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, info: DatasetInfo, device: torch.device
) -> tuple[int, int, float]:
    """Top-1 ``(correct, n, summed cross-entropy)`` of ``model`` on ``x``/``y`` in eval mode."""
    model.eval()
    correct, loss_sum = 0, 0.0
    for idx in batches(len(y), EVAL_BATCH, None):
        logits = model(normalize(x[idx].to(device), info))
        yb = y[idx].to(device)
        correct += int((logits.argmax(1) == yb).sum())
        loss_sum += float(F.cross_entropy(logits, yb, reduction="sum"))
    return correct, len(y), loss_sum


def evaluation_metrics(correct: int, n: int, loss_sum: float | None = None) -> dict[str, float]:
    """The metrics of an evaluate reply: ``test-correct`` of ``num-examples`` test samples, ``test-acc``
    (a fraction) and, given the summed cross-entropy ``loss_sum``, the mean ``test-loss``."""
    metrics = {"test-correct": correct, "num-examples": n, "test-acc": correct / max(n, 1)}
    if loss_sum is not None:
        metrics["test-loss"] = loss_sum / max(n, 1)
    return metrics


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
