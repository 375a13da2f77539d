"""FML: the meme model is the payload both ways, and the federation learns."""

import pytest

from common.payload import tensor_bytes
from conftest import assert_learns, captured_federation, run_method, shapes_of
from models.cnn import SmallCNN


def test_fml_shares_the_cnn5_meme_model_and_learns(run_config):
    # at alpha = 0.5 the private model is pulled towards the averaged meme model and learns slowly
    # (the paper reports FML failing in this setting); the check uses a CE-heavy private loss
    rc, strategy, grid, replies = run_method(run_config, "fml", **{"fml.alpha": 0.9})
    meme = SmallCNN("cnn5", 500, 10)
    for m in [*grid.sent[4:], *replies]:  # after the handshake
        if m.metadata.message_type == "train":
            assert shapes_of(m) == {k: tuple(v.shape) for k, v in meme.state_dict().items()}
            assert tensor_bytes(m.content) == 4 * 670_058
    assert_learns(rc, strategy)


def test_htflib_kl_is_per_element_and_undetached_when_asked():
    """``fml.kl-reduction = "mean"`` equals ``nn.KLDivLoss()`` over B x C elements (HtFLlib's
    clientfml.py), i.e. the per-example KL / C; ``detach-targets = false`` lets the gradient reach
    the target's logits, the default does not."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    from methods.fml import FMLOptions, mutual_kl

    g = torch.Generator().manual_seed(0)
    student = torch.randn(8, 10, generator=g, requires_grad=True)
    target = torch.randn(8, 10, generator=g, requires_grad=True)
    with pytest.warns(UserWarning, match="batchmean"):  # torch's own warning about reduction 'mean'
        htflib = nn.KLDivLoss()(F.log_softmax(student, dim=1), F.softmax(target, dim=1))
    ours = mutual_kl(student, target, FMLOptions(kl_reduction="mean", detach_targets=False))
    assert torch.allclose(ours, htflib, atol=1e-7)
    per_example = (F.softmax(target, 1) * (F.log_softmax(target, 1) - F.log_softmax(student, 1))).sum(1).mean()
    assert torch.allclose(mutual_kl(student, target, FMLOptions()), per_example, atol=1e-6)
    assert torch.allclose(ours * 10, per_example, atol=1e-6)
    ours.backward()
    assert target.grad is not None and target.grad.abs().sum() > 0
    target.grad = student.grad = None
    mutual_kl(student, target, FMLOptions()).backward()
    assert target.grad is None and student.grad.abs().sum() > 0


@pytest.mark.parametrize("key", ["fml.shared-model", "fedkd.shared-model", "fedmrl.small-model"])
def test_group_first_over_a_batchnorm_client_zero_is_refused_naming_the_key(run_config, key):
    """htfe3's client 0 is a ResNet-10 with BatchNorm: its int64 counters cannot be averaged."""
    from common.config import ConfigError, RunConfig
    from methods.registry import build_run

    rc = run_config(method=key.split(".")[0], model_group="htfe3", **{key: "group-first"})
    with pytest.raises(ConfigError, match=rf"{key}='group-first'.*'htfe3'.*num_batches_tracked"):
        build_run(RunConfig.from_dict(rc))


@pytest.mark.parametrize("method", ["fml", "fedkd"])
def test_group_first_shares_client_zeros_model_of_the_group(run_config, method):
    """``shared-model = "group-first"`` (HtFLlib's global model when its model family names none):
    the shared module is client 0's architecture of the run's model group, built with the group's
    feature dim from ``seed``; one round runs on it and the payload carries exactly its tensors."""
    import torch

    from common.config import RunConfig
    from models.groups import MODEL_GROUPS

    rc = run_config(
        method=method, model_group="htcnn8", **{"num-server-rounds": 1, f"{method}.shared-model": "group-first"}
    )
    strategy, grid, replies = captured_federation(rc)
    strategy.start(grid)
    client0 = MODEL_GROUPS["htcnn8"].build(0, 10, 3, 32, rc["seed"], k=rc["feature-dim"], identical=True)
    from methods.registry import build_run

    built = build_run(RunConfig.from_dict(rc)).method.shared
    assert list(built.state_dict()) == list(client0.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(built.state_dict().values(), client0.state_dict().values()))
    assert built.extractor(torch.zeros(2, 3, 32, 32)).shape == (2, rc["feature-dim"])
    trains = [r for r in replies if r.metadata.message_type == "train"]
    assert len(trains) == 4 and not strategy.counters.dropped and strategy.rows[-1]["train_loss"] > 0
    if method == "fml":  # FedKD's payload is the SVD-compressed mentee
        assert all(shapes_of(m) == {k: tuple(v.shape) for k, v in client0.state_dict().items()} for m in trains)
