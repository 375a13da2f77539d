"""CNN-1..5 match the spec's table; every model is extractor (500-d) + linear head."""

import pytest
import torch

from models.cnn import build_cnn
from models.groups import MODEL_GROUPS

# spec fedgh.md section 7: #params for C=10 and C=100
SPEC_PARAMS = {"cnn1": (2_621_558, 2_666_648), "cnn2": (1_815_142, 1_860_232), "cnn3": (1_320_558, 1_365_648),
               "cnn4": (1_060_358, 1_105_448), "cnn5": (670_058, 715_148)}


@pytest.mark.parametrize("name", SPEC_PARAMS)
def test_parameter_counts_match_spec(name):
    for classes, expected in zip((10, 100), SPEC_PARAMS[name]):
        model = build_cnn(name, classes)
        assert sum(p.numel() for p in model.parameters()) == expected
        assert model.head.weight.shape == (classes, 500)


@pytest.mark.parametrize("name", SPEC_PARAMS)
@pytest.mark.parametrize("channels,size", [(3, 32), (1, 28)])
def test_representation_is_500d_and_non_negative(name, channels, size):
    model = build_cnn(name, 10, channels, size)
    feats = model.extractor(torch.randn(3, channels, size, size))
    assert feats.shape == (3, 500) and bool((feats >= 0).all())
    assert model(torch.randn(3, channels, size, size)).shape == (3, 10)


def test_hetero_group_assignment_and_independent_inits():
    group = MODEL_GROUPS["hetero-cnn5"]
    assert [group.architecture_for(k) for k in range(7)] == ["cnn1", "cnn2", "cnn3", "cnn4", "cnn5", "cnn1", "cnn2"]
    a, b = group.build(0, 10, 3, 32, seed=1), group.build(5, 10, 3, 32, seed=1)
    assert type(a.extractor) is type(b.extractor)
    assert not torch.equal(a.extractor[0].weight, b.extractor[0].weight)  # spec P10: no shared weights
    again = group.build(0, 10, 3, 32, seed=1)
    assert torch.equal(a.extractor[0].weight, again.extractor[0].weight)  # same seed, same model
    assert all(MODEL_GROUPS["cnn1"].architecture_for(k) == "cnn1" for k in range(5))
