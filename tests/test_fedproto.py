"""FedProto: the server's unweighted per-class mean."""

import numpy as np

from common.config import RunConfig
from common.payload import ClientReply, tensor_bytes
from conftest import make_run_config
from methods.registry import build_run

K = 512


def test_fedproto_server_is_unweighted_class_mean():
    strategy = build_run(
        RunConfig.from_dict(make_run_config(method="fedproto", aggregation="mean", **{"model-group": "htfe2"}))
    )
    rng = np.random.default_rng(0)
    replies = [
        ClientReply(
            i,
            i,
            {
                "protos": rng.normal(size=(len(labels), K)).astype(np.float32),
                "proto_labels": np.array(labels, np.int64),
            },
            {},
        )
        for i, labels in enumerate([[0, 2], [2], [2, 5]])
    ]
    strategy.method.aggregate_train(1, replies)
    out = strategy.method.global_arrays()
    assert out["mask"].tolist() == [c in (0, 2, 5) for c in range(10)]
    expected2 = (replies[0].arrays["protos"][1] + replies[1].arrays["protos"][0] + replies[2].arrays["protos"][0]) / 3
    np.testing.assert_allclose(out["protos"][1], expected2, atol=1e-6)
    np.testing.assert_allclose(out["protos"][0], replies[0].arrays["protos"][0], atol=1e-6)
    assert (
        tensor_bytes(strategy.federation.transport.message("train", 1, out, strategy.method.train_config(1), 1).content)
        == 4 * K * 3 + 10
    )
