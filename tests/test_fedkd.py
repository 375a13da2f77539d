"""FedKD: the SVD-compressed mentee both ways, its schema, and learning."""

import numpy as np
import pytest
import torch

from common.payload import PayloadError, tensor_bytes
from common.protocol import PAYLOAD
from conftest import assert_learns, run_method
from methods.fedkd import compressed_schema, svd_compress, svd_decompress
from models.cnn import SmallCNN


def test_svd_compression():
    g = torch.Generator().manual_seed(0)
    low_rank = torch.randn(40, 3, generator=g) @ torch.randn(3, 30, generator=g)
    state = {"w": low_rank.reshape(40, 2, 15), "b": torch.randn(40, generator=g)}
    arrays = svd_compress(state, 0.999999)
    assert arrays["w.u"].shape == (40, 3) and arrays["w.v"].shape == (3, 30) and np.array_equal(arrays["b"], state["b"])
    back = svd_decompress(arrays, {"w": (40, 2, 15), "b": (40,)})
    assert np.allclose(back["w"], state["w"].numpy(), atol=1e-4)
    # smallest rank whose energy exceeds T
    diag = torch.diag(torch.tensor([3.0, 2.0, 1.0]))
    assert svd_compress({"w": diag}, 0.70)["w.s"].shape == (2,)  # 9/14 = .64 <= .70 < 13/14
    assert svd_compress({"w": diag}, 0.60)["w.s"].shape == (1,)


def test_fedkd_payload_is_compressed_and_learns(run_config):
    rc, strategy, grid, replies = run_method(
        run_config, "fedkd", **{"fedkd.energy-start": 0.5, "fedkd.energy-end": 0.6}
    )
    full = 4 * 670_058
    for r in replies:
        arrays = {k: v.numpy() for k, v in r.content.array_records[PAYLOAD].items()}
        assert {k.rsplit(".", 1)[0] for k in arrays if k.endswith(".u")} == {
            "conv1.weight",
            "conv2.weight",
            "fc1.weight",
            "fc2.weight",
            "fc3.weight",
        }
        assert tensor_bytes(r.content) < full
    schema = compressed_schema(SmallCNN("cnn5", 500, 10))
    bad = svd_compress(SmallCNN("cnn5", 500, 10).state_dict(), 0.5)
    bad["fc3.weight.u"] = np.zeros((10, 11), np.float32)
    bad["fc3.weight.s"], bad["fc3.weight.v"] = np.zeros(11, np.float32), np.zeros((11, 500), np.float32)
    with pytest.raises(PayloadError, match="rank"):
        schema.validate(bad, {})
    assert_learns(rc, strategy)
