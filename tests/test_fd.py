"""FD: per-class mean logits up, global per-class logits down, distillation, learning."""

import numpy as np
import pytest

from common.config import RunConfig
from common.payload import tensor_bytes
from common.protocol import PAYLOAD
from conftest import assert_learns, client_runtime, run_method, shapes_of, train_config
from methods.fd import METHOD as FD_METHOD


def test_fd_uploads_per_class_logits_and_learns(run_config):
    rc, strategy, grid, replies = run_method(run_config, "fd")
    for r in replies:
        arrays = r.content.array_records[PAYLOAD]
        k = arrays["logit_labels"].numpy().size
        assert shapes_of(r) == {"logits": (k, 10), "logit_labels": (k,)} and tensor_bytes(r.content) == 48 * k
    rounds = [m for m in grid.sent if m.metadata.message_type == "train"]
    assert PAYLOAD not in rounds[0].content.array_records  # round 1: no global logits yet
    # the distillation term pulls towards the global logit of the label
    client = client_runtime(rc, 0)
    payload = {
        "logits": np.eye(10, dtype=np.float32)[client.data.train_y[:1].numpy()] * 20,
        "mask": np.eye(10, dtype=bool)[client.data.train_y[0].item()],
    }
    assert FD_METHOD.build_client(RunConfig.from_dict(rc)).train(client, payload, train_config(rc))[1]["train-loss"] > 0
    assert_learns(rc, strategy)


def test_both_distillation_targets_equal_an_independent_computation():
    """``softmax``: KL towards softmax(ẑ_y), summed over the samples with a global logit, / B;
    ``logits`` (HtFLlib's): -Σ_c t_c log softmax(z)_c with t = ẑ_y or z itself, mean over B."""
    import math

    import torch

    from methods.fd import fd_loss

    z = torch.tensor([[1.0, 0.0, -1.0], [0.5, 0.5, 0.0], [0.0, 2.0, 1.0]])
    y = torch.tensor([0, 1, 2])
    targets = torch.tensor([[3.0, -1.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([True, False, False])  # only class 0 has a global logit

    def log_softmax(v):
        m = math.log(sum(math.exp(a) for a in v))
        return [a - m for a in v]

    rows = z.tolist()
    ce = -sum(log_softmax(r)[c] for r, c in zip(rows, y.tolist())) / 3
    p = [math.exp(a) for a in log_softmax([3.0, -1.0, 0.0])]
    kl = sum(pi * (math.log(pi) - q) for pi, q in zip(p, log_softmax(rows[0])))
    assert float(fd_loss(z, y, targets, mask, 0.5, "softmax")) == pytest.approx(ce + 0.5 * kl / 3, rel=1e-5)
    soft = [[3.0, -1.0, 0.0], rows[1], rows[2]]
    raw = -sum(sum(t * q for t, q in zip(ts, log_softmax(r))) for ts, r in zip(soft, rows)) / 3
    assert float(fd_loss(z, y, targets, mask, 0.5, "logits")) == pytest.approx(ce + 0.5 * raw, rel=1e-5)
    assert float(fd_loss(z, y, None, None, 0.5, "logits")) == pytest.approx(ce, rel=1e-5)  # before any global logit
