"""Local (Standalone): nothing travels either way, the server keeps no state, and every client learns alone."""

from common.protocol import PAYLOAD
from conftest import assert_learns, run_method


def test_local_exchanges_no_arrays_and_learns(run_config):
    rc, strategy, grid, replies = run_method(run_config, "local")
    assert all(PAYLOAD not in m.content.array_records for m in [*grid.sent, *replies])
    assert all(r["bytes_up"] == r["bytes_down"] == 0 for r in strategy.rows)
    assert strategy.method.server_state() == {} and strategy.method.global_arrays() == {}
    assert_learns(rc, strategy)
