"""What one look of Flower's simulation engine over its nodes costs, against N and waiting messages.

Usage (from the repository root):

    uv run --frozen python -m bench.engine_scan [--nodes 100,1000,10000] [--messages 1,16,64]
        [--out results/scale/engine-scan.json]

Flower 1.42's simulation engine (``flwr.server.superlink.fleet.vce.vce_api.add_messages_to_queue``)
calls ``LinkState.get_message_ins(node_id, limit=1)`` for every registered node every 0.1 s, and the
in-memory LinkState answers each call by walking every stored instruction message
(``in_memory_linkstate.InMemoryLinkState.get_message_ins``, with ``_check_stored_messages`` per
message), so one look costs about N x M steps for N nodes and M stored messages. A message is
stored from its push until its reply is pulled, so a handshake that asks all N nodes costs O(N^2)
however the messages are windowed. This bench builds the engine's own state (``_register_nodes``,
an ``InMemoryGrid``), pushes M query messages and times one look over all nodes twice: the first
look delivers the M messages, the second finds them delivered but still stored (the state while
replies are awaited). Prints one line per (N, M) and writes them as JSON rows (seconds).

The bench reaches into Flower's engine state (no public API exposes it); it measures Flower's part
only, which our code cannot change (``handshake = "sampled"`` changes how many messages we send).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from unittest import mock

from flwr.app import ConfigRecord, Message, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.proto.task_pb2 import Task
from flwr.server.superlink.fleet.vce.vce_api import _register_nodes
from flwr.server.superlink.linkstate import LinkStateFactory
from flwr.server.superlink.linkstate.in_memory_linkstate import RunRecord
from flwr.supercore.constant import FLWR_IN_MEMORY_DB_NAME, NOOP_FEDERATION_ID
from flwr.supercore.object_store import ObjectStoreFactory
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity
from flwr.superlink.federation import NoOpFederationManager
from flwr.superlink.grid.inmemory_grid import InMemoryGrid

from common.files import atomic_write
from tools.grid import git_commit


def one_look(num_nodes: int, num_messages: int) -> dict[str, float]:
    """Time two looks of the engine over ``num_nodes`` nodes with ``num_messages`` stored queries.

    Returns:
        ``{"nodes", "messages", "first_look_s", "next_look_s", "next_look_checks",
        "per_node_message_us"}`` (seconds; ``next_look_checks`` the stored-message checks of the second
        look, a count; the last in microseconds, from the second look).
    """
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, SUPERLINK_NODE_ID
    factory = LinkStateFactory(FLWR_IN_MEMORY_DB_NAME, NoOpFederationManager(), ObjectStoreFactory())
    state = factory.state()
    run = Run.create_empty(run_id=1)
    run.primary_task_id, run.federation_id = 1, NOOP_FEDERATION_ID
    state.run_ids[1] = RunRecord(run=run)
    state.task_store[1] = Task(task_id=1, run_id=1)
    nodes = list(_register_nodes(num_nodes, factory))
    grid = InMemoryGrid(state_factory=factory)
    grid.set_run(run)
    # the messages go to the last nodes, so that each look walks every node before finding them
    messages = [
        Message(RecordDict({"c": ConfigRecord({"x": 1})}), dst_node_id=nodes[-1 - i], message_type="query")
        for i in range(num_messages)
    ]
    if len(list(grid.push_messages(messages))) != num_messages:
        raise RuntimeError("Flower's grid did not store every message")
    # count the state's checks of one stored message: the work a look does, whatever the machine's load
    checks = mock.Mock(wraps=state._check_stored_messages)
    state._check_stored_messages = checks
    looks = []
    for _ in range(2):
        checks.reset_mock()
        start = time.perf_counter()
        for node in nodes:
            state.get_message_ins(node_id=node, limit=1)
        looks.append(time.perf_counter() - start)
    return {
        "nodes": num_nodes,
        "messages": num_messages,
        "first_look_s": looks[0],
        "next_look_s": looks[1],
        "next_look_checks": checks.call_count,
        "per_node_message_us": looks[1] / num_nodes / num_messages * 1e6,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", default="100,1000,10000", help="N values, comma-separated")
    parser.add_argument("--messages", default="1,16,64", help="stored messages M, comma-separated")
    parser.add_argument("--out", type=Path, default=None, help="JSON file of the rows (default: print only)")
    args = parser.parse_args(argv)
    rows = []
    for n in (int(v) for v in args.nodes.split(",")):
        for m in (int(v) for v in args.messages.split(",")):
            row = one_look(n, m)
            rows.append(row)
            print(
                f"N={n:6d} M={m:3d}: first look {row['first_look_s'] * 1e3:8.1f} ms, next look "
                f"{row['next_look_s'] * 1e3:8.1f} ms, {row['per_node_message_us']:.2f} us per node and message",
                flush=True,
            )
    if args.out is not None:
        report = {
            "command": "python -m bench.engine_scan " + " ".join(sys.argv[1:] if argv is None else argv),
            "commit": git_commit(),
            "machine": f"{platform.machine()}, {platform.python_version()}",
            "rows": rows,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(args.out, lambda f: f.write(json.dumps(report, indent=1).encode()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
