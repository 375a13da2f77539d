"""FD: per-class mean logits up, global per-class logits down, distillation, learning."""

import numpy as np

from common.config import RunConfig
from conftest import assert_learns, client_runtime, run_method, shapes_of, train_config
from strategies.fd import FDClient
from strategies.payload import PAYLOAD, tensor_bytes


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
    assert FDClient(RunConfig.from_dict(rc)).train(client, payload, train_config(rc))[1]["train-loss"] > 0
    assert_learns(rc, strategy)
