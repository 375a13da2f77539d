"""DP-SGD whose per-example clip follows a quantile of the gradient norms (run config ``dp.adaptive-clip``).

Andrew, Thakkar, McMahan & Ramaswamy, "Differentially Private Learning with Adaptive Clipping", NeurIPS 2021
(Algorithm 1 and Theorem 1), applied to example-level DP-SGD: each step also releases how many of its
per-example gradients the clip C left unclipped, with Gaussian noise of std σ_b, and moves C geometrically
towards the target quantile γ of their norms,

    b̃ = (Σ_i (b_i − 1/2) + N(0, σ_b²)) / B + 1/2,    C ← C · exp(−η_C · (b̃ − γ)),

with b_i = 1[‖g_i‖₂ ≤ C] and B the expected (not the sampled) batch size, so b̃ depends on the examples only
through the noisy sum. Each example moves Σ (b_i − 1/2) by 1/2, which makes the step's gradient sum and count
one Gaussian mechanism of noise multiplier σ when the gradients get σ_Δ = (σ⁻² − (2σ_b)⁻²)^(-1/2)
(``common.dp.DPPlan.gradient_noise_multiplier``): the accountant keeps σ's events.

Opacus's ``AdaClipDPOptimizer`` draws the noise this way, and is used for it, but counts b_i instead of b_i − 1/2
(a sensitivity of 1, where its σ_Δ assumes 1/2) and divides by the sampled batch size, which the Poisson
sampling keeps secret, and fails on an empty sample: :class:`QuantileClipDPOptimizer` replaces those two parts.
Under ghost clipping no per-example gradient exists to count: :class:`GhostQuantileClip` counts the norms.
"""

from __future__ import annotations

import math

import torch
from opacus.optimizers import AdaClipDPOptimizer, DPOptimizer
from opacus.optimizers.optimizer import _generate_noise  # Opacus's Gaussian draw, as AdaClipDPOptimizer's count


class QuantileClipDPOptimizer(AdaClipDPOptimizer):
    """Opacus's adaptive-clipping DP optimiser with the paper's count (module docstring).

    Args:
        optimizer: the wrapped optimiser (its step uses the noised, clipped mean gradient).
        noise_multiplier: σ, what the accountant charges for a step (gradient sum and count together).
        target_quantile: γ in (0, 1), the share of per-example gradients the clip aims to leave unclipped.
        clip_lr: η_C > 0.
        count_noise: σ_b > σ / 2, noise std of the count of unclipped gradients, in examples.
        max_grad_norm: C at the first step, > 0; :attr:`max_grad_norm` is the current one (a float).
        expected_batch_size: B, the divisor of the gradient sum and of the count.
        generator: the source of every noise draw.

    Raises:
        ValueError: σ >= 2·σ_b (Opacus's check; ``common.dp.make_plan`` refuses it first, naming the key).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        noise_multiplier: float,
        target_quantile: float,
        clip_lr: float,
        count_noise: float,
        max_grad_norm: float,
        expected_batch_size: int,
        generator: torch.Generator,
    ) -> None:
        # no bounds on C: the paper's update has none, and a geometric step never reaches 0
        super().__init__(
            optimizer,
            noise_multiplier=noise_multiplier,
            target_unclipped_quantile=target_quantile,
            clipbound_learning_rate=clip_lr,
            max_clipbound=math.inf,
            min_clipbound=0.0,
            unclipped_num_std=count_noise,
            max_grad_norm=max_grad_norm,
            expected_batch_size=expected_batch_size,
            generator=generator,
        )

    def clip_and_accumulate(self) -> None:
        """Adds Σ (b_i − 1/2) over this batch's examples (float32 scalar tensor on the gradients' device) to
        :attr:`unclipped_num`, which the parent's ``add_noise`` noises with std σ_b, then clips and sums as
        plain DP-SGD does (an empty Poisson sample counts nothing)."""
        samples = self.grad_samples
        counted = torch.zeros((), device=samples[0].device)
        if len(samples[0]):
            norms = torch.stack([g.reshape(len(g), -1).norm(2, dim=-1) for g in samples], dim=1).norm(2, dim=1)
            counted = centred_count(norms, self.max_grad_norm)
        self.unclipped_num = self.unclipped_num + counted
        DPOptimizer.clip_and_accumulate(self)

    def update_max_grad_norm(self) -> None:
        """C ← C·exp(−η_C·(b̃ − γ)) (:func:`next_clip`)."""
        self.max_grad_norm = next_clip(
            self.max_grad_norm,
            float(self.unclipped_num),
            self.expected_batch_size,
            self.target_unclipped_quantile,
            self.clipbound_learning_rate,
        )


def centred_count(norms: torch.Tensor, clip: float) -> torch.Tensor:
    """Σ (b_i − 1/2) with b_i = 1 where the example's gradient norm (``norms``, float ``[b]``) is at most
    ``clip``: the count Andrew et al. 2021 (Algorithm 1) noise, centred so that its sensitivity is 1/2; a
    float32 scalar tensor on ``norms``' device."""
    return ((norms <= clip).float() - 0.5).sum()


def next_clip(clip: float, noisy_count: float, expected_batch: int, target_quantile: float, clip_lr: float) -> float:
    """C·exp(−η_C·(b̃ − γ)) with b̃ = ``noisy_count`` / B + 1/2, ``noisy_count`` the noisy Σ (b_i − 1/2) of a step
    (Andrew et al. 2021, Algorithm 1; module docstring)."""
    unclipped = noisy_count / expected_batch + 0.5
    return float(clip * math.exp(-clip_lr * (unclipped - target_quantile)))


class GhostQuantileClip:
    """The same clip update for DP-SGD by ghost clipping (``common.training.private_training``), where no
    per-example gradient exists for the optimiser to count: each step counts b_i from the per-example gradient
    norms Opacus's ``GradSampleModuleFastGradientClipping`` computed in its first backward pass, adds
    N(0, σ_b²) and moves the clip of both the module and the optimiser (whose noise multiplier must be σ_Δ,
    ``common.dp.DPPlan.gradient_noise_multiplier``, for the step's σ to be what the accountant charges).

    Args:
        target_quantile: γ in (0, 1).
        clip_lr: η_C > 0.
        count_noise: σ_b, in examples.
        expected_batch_size: B, the divisor of the count.
        generator: the source of the count's noise (a CPU generator).
    """

    def __init__(
        self,
        *,
        target_quantile: float,
        clip_lr: float,
        count_noise: float,
        expected_batch_size: int,
        generator: torch.Generator,
    ) -> None:
        self.target_quantile, self.clip_lr, self.count_noise = target_quantile, clip_lr, count_noise
        self.expected_batch_size, self.generator = expected_batch_size, generator

    def step(self, sampled: torch.nn.Module, private: DPOptimizer, norms: torch.Tensor | None) -> None:
        """After ``private``'s step: count the step's ``norms`` (float [b], None or empty for an empty Poisson
        sample) at most ``private.max_grad_norm``, noise the centred count and set the next clip on ``private``
        and ``sampled``."""
        counted = 0.0 if norms is None or not len(norms) else float(centred_count(norms, private.max_grad_norm))
        noisy = counted + float(_generate_noise(self.count_noise, torch.zeros(()), generator=self.generator))
        clip = next_clip(private.max_grad_norm, noisy, self.expected_batch_size, self.target_quantile, self.clip_lr)
        private.max_grad_norm = sampled.max_grad_norm = clip
