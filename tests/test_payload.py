"""Schema validation rejects malformed payloads; bytes are tensor bytes."""

import numpy as np
import pytest
from flwr.app import ArrayRecord, RecordDict

from common.payload import PayloadError, array_record, tensor_bytes
from methods.fedgh import HEADER, LARS

DIMS = {"C": 10, "d": 500}


def lars(k=2, d=500, labels=None):
    labels = np.arange(k, dtype=np.int32) if labels is None else np.asarray(labels, dtype=np.int32)
    return {"lar": np.ones((len(labels), d), np.float32), "lar_labels": labels}


def test_valid_payload_binds_free_symbol():
    assert LARS.validate(lars(3), DIMS)["k"] == 3


@pytest.mark.parametrize(
    "payload,fragment",
    [
        ({**lars(2), "lar": np.ones((2, 499), np.float32)}, "expected d=500"),
        ({**lars(2), "lar": np.ones((3, 500), np.float32)}, "expected k=3"),
        ({**lars(2), "lar": np.full((2, 500), np.nan, np.float32)}, "non-finite"),
        (lars(labels=[0, 10]), "outside [0, 10)"),
        (lars(labels=[-1, 3]), "outside [0, 10)"),
        (lars(labels=[4, 4]), "repeated"),
        ({**lars(2), "lar": np.ones((2, 500), np.float64)}, "dtype float64"),
        ({**lars(2), "counts": np.ones(2, np.int32)}, "keys"),
        ({"lar": np.ones((2, 500), np.float32)}, "keys"),
    ],
)
def test_malformed_payload_is_rejected(payload, fragment):
    with pytest.raises(PayloadError) as err:
        LARS.validate(payload, DIMS)
    assert fragment in str(err.value)


def test_tensor_bytes_is_numel_times_itemsize():
    header = {"head.weight": np.zeros((10, 500), np.float32), "head.bias": np.zeros(10, np.float32)}
    content = HEADER.to_record(header)
    assert tensor_bytes(content) == 4 * 10 * (500 + 1) == 20_040
    assert tensor_bytes(LARS.to_record(lars(2))) == 4 * 2 * (500 + 1) == 4_008
    content["other"] = ArrayRecord([np.zeros(3, np.int64)])
    assert tensor_bytes(content) == 20_040 + 24
    assert tensor_bytes(RecordDict()) == 0


def test_sender_cannot_leak_undeclared_arrays():
    with pytest.raises(PayloadError):
        LARS.to_record({**lars(2), "extractor.0.weight": np.zeros(3, np.float32)})
    assert list(array_record({"b": np.zeros(1), "a": np.zeros(1)}).keys()) == ["b", "a"]
