"""bench.engine_scan measures Flower's engine as the docs describe it: each look walks every stored
message for every node (it reaches into Flower's state, so a Flower upgrade that changes it fails here)."""

from bench.engine_scan import one_look


def test_a_look_grows_with_the_stored_messages():
    few, many = one_look(200, 1), one_look(200, 64)
    assert few["nodes"] == many["nodes"] == 200 and many["messages"] == 64
    # each look walks the stored messages for every node: 64 of them cost far more than one
    assert many["next_look_s"] > 8 * few["next_look_s"] > 0
