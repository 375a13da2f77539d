"""Class prototypes: per-class mean representations, the payload of FedProto and FedTGP (and, as
per-class mean logits, of FD).

- :func:`class_set_schemas`: the payload of a per-class set of rows, both ways;
- :class:`RegularizerOptions` and :class:`PrototypeRegularizer`: the client's prototype term
  (FedTGP Eq. 11 and its official-code form, which FedProto's client uses too);
- :class:`ClassMeanCollector`: exact class means of the representations seen in training;
- :func:`nearest_prototype_correct`: inference by the nearest global prototype;
- :func:`unpack_global_set`: a received per-class set as full [C, w] rows and a mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from common.data import batches, normalize
from common.options import option
from common.payload import ROW_NORM_FACTOR, ArraySpec, PayloadError, PayloadSchema


def class_set_schemas(values: str, labels: str, width: str) -> tuple[PayloadSchema, PayloadSchema]:
    """Schemas of a per-class payload (FedProto's prototypes, FD's logits).

    Up: ``values`` [k, width] float32, one row per class the client holds, and ``labels``
    [k] int64 (unique class ids). Down: ``values`` [a, width] float32, the rows of the
    classes marked in ``mask`` [C] bool (``a`` = number of marked classes); optional, since
    nothing exists before the first upload.
    """

    def mask_matches_rows(arrays, dims) -> None:
        if int(arrays["mask"].sum()) != arrays[values].shape[0]:
            raise PayloadError(
                f"mask marks {int(arrays['mask'].sum())} classes but {arrays[values].shape[0]} "
                f"'{values}' rows were sent"
            )

    upload = PayloadSchema(
        {
            values: ArraySpec(("k", width), "float32", row_norm_factor=ROW_NORM_FACTOR),
            labels: ArraySpec(("k",), "int64", labels=True),
        }
    )
    global_set = PayloadSchema(
        {values: ArraySpec(("a", width), "float32"), "mask": ArraySpec(("C",), "bool")},
        optional=True,
        check=mask_matches_rows,
    )
    return upload, global_set


REG_FORMS = ("mse-mean", "paper-l2")


@dataclass(frozen=True)
class RegularizerOptions:
    """The client's prototype term, keys ``lambda`` and ``reg-form`` of FedProto's and FedTGP's tables.

    ``mse-mean`` (official code, default): lambda * (1/(B*K)) * sum_b ||f(x_b) - P^{y_b}||^2.
    ``paper-l2`` (FedTGP Eq. 11): lambda * mean over the batch's classes c of
    ||mean_{b: y_b = c} f(x_b) - P^c||_2. Rows whose class has no global prototype add 0.
    """

    lambda_: float = option(10.0, "weight of the prototype term (official code; the paper's: 0.1 with paper-l2)", low=0)
    reg_form: str = option(
        "mse-mean", "mse-mean: official code's squared error; paper-l2: FedTGP Eq. 11", choices=REG_FORMS
    )


class PrototypeRegularizer:
    """The prototype term added to the client's CE loss; P is a constant (no gradient).

    Args:
        protos: float32 [C, K] global prototypes (rows of masked-out classes are ignored), or None.
        mask: bool [C], True where class c has a global prototype.
        options: lambda and form.
    """

    def __init__(self, protos: torch.Tensor | None, mask: torch.Tensor | None, options: RegularizerOptions) -> None:
        self.protos, self.mask = protos, mask
        self.lam, self.form = options.lambda_, options.reg_form

    def __call__(self, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The term for representations ``[B, K]`` and labels ``[B]`` (0 without prototypes)."""
        if self.protos is None or self.lam == 0:
            return features.new_zeros(())
        known = self.mask[labels]
        if self.form == "mse-mean":
            diff = (features - self.protos[labels]) * known[:, None]
            return self.lam * diff.pow(2).sum() / features.numel()
        distances = []
        for c in torch.unique(labels[known]):
            mean = features[labels == c].mean(0)
            distances.append((mean - self.protos[c]).pow(2).sum().clamp_min(1e-12).sqrt())
        if not distances:
            return features.new_zeros(())
        return self.lam * torch.stack(distances).mean()


class ClassMeanCollector:
    """Accumulates per-class sums of representations (float64) and returns exact class means."""

    def __init__(self, num_classes: int) -> None:
        self.num_classes = num_classes
        self.sums: torch.Tensor | None = None
        self.counts = torch.zeros(num_classes, dtype=torch.float64)

    def add(self, features: torch.Tensor, labels: torch.Tensor) -> None:
        """Add a batch: ``features`` [B, K] (detached here), ``labels`` [B] int64."""
        f = features.detach().double().cpu()
        if self.sums is None:
            self.sums = torch.zeros(self.num_classes, f.shape[1], dtype=torch.float64)
        self.sums.index_add_(0, labels.cpu(), f)
        self.counts += torch.bincount(labels.cpu(), minlength=self.num_classes).double()

    def means(self, dim: int) -> tuple[np.ndarray, np.ndarray]:
        """``(protos float32 [C_i, dim], labels int64 [C_i])`` for the classes seen; [0, dim] if none."""
        labels = torch.nonzero(self.counts).flatten()
        if self.sums is None or len(labels) == 0:
            return np.zeros((0, dim), np.float32), np.zeros(0, np.int64)
        return (self.sums[labels] / self.counts[labels, None]).float().numpy(), labels.numpy().astype(np.int64)


@torch.no_grad()
def nearest_prototype_correct(client, protos: torch.Tensor | None, mask: torch.Tensor | None) -> tuple[int, int]:
    """Top-1 correct count of the nearest-prototype rule on the local test split.

    ŷ = argmin over classes with a prototype of ||f(x) - P^c||^2 (FedProto/FedTGP inference);
    the head is not used. Without prototypes nothing counts as correct.

    Returns:
        ``(correct, n_test)``.
    """
    data = client.data
    if protos is None or not bool(mask.any()):
        return 0, len(data.test_y)
    extractor = client.model.extractor.eval()
    protos, mask = protos.to(client.device), mask.to(client.device)
    correct = 0
    for idx in batches(len(data.test_y), 512, None):
        feats = extractor(normalize(data.test_x[idx].to(client.device), data.info))
        dist = torch.cdist(feats, protos).masked_fill(~mask[None], float("inf"))
        correct += int((dist.argmin(1).cpu() == data.test_y[idx]).sum())
    return correct, len(data.test_y)


def unpack_global_set(
    payload: dict[str, np.ndarray], num_classes: int, values: str = "protos"
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A global class set (``values`` [C_avail, w], ``mask`` [C]) -> full [C, w] float32 (zeros where
    masked) and mask [C] bool; Nones if absent."""
    if not payload:
        return None, None
    mask = torch.from_numpy(payload["mask"].copy())
    full = torch.zeros(num_classes, payload[values].shape[1])
    full[mask] = torch.from_numpy(payload[values])
    return full, mask
