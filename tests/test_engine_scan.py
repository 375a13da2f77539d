"""bench.engine_scan measures Flower's engine as the docs describe it: each look walks every stored
message for every node (it reaches into Flower's state, so a Flower upgrade that changes it fails here)."""

from bench.engine_scan import one_look


def test_a_look_grows_with_the_stored_messages():
    few, many = one_look(200, 1), one_look(200, 64)
    assert few["nodes"] == many["nodes"] == 200 and many["messages"] == 64
    # once delivered, no message matches, so each node's look checks every stored message: N x M steps
    assert few["next_look_checks"] == 200 and many["next_look_checks"] == 200 * 64
    assert many["next_look_s"] > 0
