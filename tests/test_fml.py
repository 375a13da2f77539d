"""FML: the meme model is the payload both ways, and the federation learns."""

from common.payload import tensor_bytes
from conftest import assert_learns, run_method, shapes_of
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
