"""CNN-1..5 match the parameter counts of FedGH's Table 2 (docs/methods/fedgh.md §7); every model is
extractor (500-d) + linear head."""

from pathlib import Path

import pytest
import torch

from models.cnn import build_cnn
from models.groups import MODEL_GROUPS

ROOT = Path(__file__).resolve().parents[1]

# docs/methods/fedgh.md §7: #params for C=10 and C=100
SPEC_PARAMS = {
    "cnn1": (2_621_558, 2_666_648),
    "cnn2": (1_815_142, 1_860_232),
    "cnn3": (1_320_558, 1_365_648),
    "cnn4": (1_060_358, 1_105_448),
    "cnn5": (670_058, 715_148),
}


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
    assert not torch.equal(a.extractor[0].weight, b.extractor[0].weight)  # fedgh.md P10: no shared weights
    again = group.build(0, 10, 3, 32, seed=1)
    assert torch.equal(a.extractor[0].weight, again.extractor[0].weight)  # same seed, same model
    assert all(MODEL_GROUPS["cnn1"].architecture_for(k) == "cnn1" for k in range(5))


ZOO_GROUPS = {
    "htfe2": (3, 32),
    "htfe3": (3, 32),
    "htfe4": (3, 32),
    "htfe8": (3, 32),
    "htfe9": (3, 32),
    "htcnn8": (1, 28),
    "htfe8-htc4": (3, 32),
    "res34-htc4": (3, 32),
}


@pytest.mark.parametrize("group_name", ZOO_GROUPS)
def test_every_zoo_member_builds_and_gives_k_features(group_name):
    channels, size = ZOO_GROUPS[group_name]
    group = MODEL_GROUPS[group_name]
    members = max(len(group.architectures), len(group.heads))
    x = torch.randn(2, channels, size, size)
    for k in range(members):
        model = group.build(k, 10, channels, size, seed=0, k=512).eval()
        with torch.no_grad():
            feats = model.extractor(x)
            assert feats.shape == (2, 512), (group_name, group.architecture_for(k))
            assert model(x).shape == (2, 10)


def test_fixed_pooling_is_parameter_free_average():
    from models.zoo import FixedPool, build_extractor

    pool = FixedPool(512)
    assert not list(pool.parameters())
    x = torch.arange(2048.0).view(1, 2048)
    assert torch.equal(pool(x)[0, :2], torch.tensor([1.5, 5.5]))  # windows of 4
    assert torch.equal(
        FixedPool(512)(torch.arange(64.0).view(1, 64))[0, :9], torch.tensor([0.0] * 8 + [1.0])
    )  # 64 -> 512 repeats each value 8x
    assert build_extractor("resnet18", 64, 3, 32)(torch.randn(2, 3, 32, 32)).shape == (2, 64)


def test_htcnn8_and_small_resnets_match_spec_shapes():
    from models.zoo import build_extractor

    # HtCNN8 CNN1: one conv -> 32*12*12 = 4608 -> 512
    net = build_extractor("htcnn1", 512, 1, 28)[0]
    assert [m.in_features for m in net if isinstance(m, torch.nn.Linear)] == [4608]
    net = build_extractor("htcnn8", 512, 1, 28)[0]
    assert [m.out_features for m in net if isinstance(m, torch.nn.Linear)] == [1024, 512, 512]
    # ResNet4 ends at 64 channels, ResNet8 at 256 (pre-pool D), then pooled to K
    from models.zoo import small_resnet

    assert small_resnet(1)(torch.randn(2, 3, 32, 32)).shape == (2, 64)
    assert small_resnet(3)(torch.randn(2, 3, 32, 32)).shape == (2, 256)


def _first_of_each_architecture() -> dict[str, tuple[str, int]]:
    """architecture -> (a model group that has it, a partition id it is built for)."""
    found = {}
    for name, group in MODEL_GROUPS.items():
        members = max(len(getattr(group, "architectures", ())), len(getattr(group, "heads", ())), 1)
        for pid in range(members):
            found.setdefault(group.architecture_for(pid), (name, pid))
    return found


def test_a_model_built_on_the_meta_device_and_loaded_equals_the_built_one():
    """ClientRuntime.model builds a model with a stored state on the meta device and loads the state
    into it: for every architecture the state dict covers every buffer, and the loaded model has the
    built one's every parameter and buffer."""
    for arch, (group_name, pid) in _first_of_each_architecture().items():
        group = MODEL_GROUPS[group_name]
        channels, size = (1, 28) if arch.startswith("htcnn") or arch == "lenet" else (3, 32)
        built = group.build(pid, 10, channels, size, seed=3, k=512)
        with torch.device("meta"):
            skeleton = group.build(pid, 10, channels, size, seed=3, k=512)
        assert set(dict(skeleton.named_buffers())) <= set(skeleton.state_dict()), arch
        skeleton.to_empty(device="cpu").load_state_dict(built.state_dict())
        loaded, want = skeleton.state_dict(), built.state_dict()
        assert loaded.keys() == want.keys(), arch
        assert all(torch.equal(loaded[k], want[k]) for k in want), arch


def test_models_without_torchvision_architectures_do_not_import_it():
    """torchvision's import brings torch._dynamo, sympy and triton (about 90 MiB a process): a process
    that builds only FedAvgCNN and HtCNN8 models never imports it; one that builds a ResNet does."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from models.zoo import build_extractor\n"
        "build_extractor('fedavgcnn', 512, 3, 32); build_extractor('htcnn8', 512, 1, 28)\n"
        "print('torchvision' in sys.modules, 'torch._dynamo' in sys.modules)\n"
        "build_extractor('resnet4', 512, 3, 32)\n"
        "print('torchvision' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.split() == ["False", "False", "True"]
