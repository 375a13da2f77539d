"""An in-process Grid: delivers messages straight to the real ClientApp, one Context per node.

No Ray, no serialisation, so whole rounds run in seconds: the tests' federation
(``tests/fakegrid.py`` re-exports it) and in-process benchmarks (``bench.byzantine``).
Messages built outside a Flower runtime need a task identity, set here once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from uuid import uuid4

from flwr.app import Context, Error, Message, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity

TaskIdentity.run_id = TaskIdentity.node_id = TaskIdentity.task_id = 1


class FakeGrid(Grid):
    """Nodes ``1000 + partition_id``; ``tamper(node_id, reply) -> reply`` can corrupt replies.

    Failures: messages to a node in ``silent`` get no reply (a SuperNode killed a moment ago,
    still listed); a node in ``gone`` is not listed either; a node in ``delay`` answers late.
    :meth:`add_node` starts a node.
    """

    def __init__(
        self,
        client_app,
        run_config: dict,
        num_nodes: int,
        tamper: Callable[[int, Message], Message] | None = None,
        node_config: dict | None = None,
    ) -> None:
        self.client_app = client_app
        self.tamper = tamper
        self.run_config, self.num_nodes, self.node_config = dict(run_config), num_nodes, dict(node_config or {})
        self.contexts: dict[int, Context] = {}
        for p in range(num_nodes):
            self.add_node(1000 + p, p)
        self.sent: list[Message] = []
        self.silent: set[int] = set()
        self.gone: set[int] = set()
        self.delay: dict[int, float] = {}  # node id -> seconds before its replies can be pulled
        self.outbox: dict[str, tuple[float, Message]] = {}  # message id -> (available from, reply)
        self.pulls = 0

    def add_node(self, node_id: int, partition_id: int) -> Context:
        """A node with an empty state holding ``partition_id`` (a fresh or restarted SuperNode)."""
        self.contexts[node_id] = Context(
            run_id=1,
            node_id=node_id,
            node_config={"partition-id": partition_id, "num-partitions": self.num_nodes, **self.node_config},
            state=RecordDict(),
            run_config=self.run_config,
        )
        return self.contexts[node_id]

    def set_run(self, run) -> None:  # pragma: no cover - unused by the runner
        raise NotImplementedError

    @property
    def run(self):  # pragma: no cover
        raise NotImplementedError

    def create_message(self, *args, **kwargs):  # pragma: no cover
        raise NotImplementedError

    def get_node_ids(self) -> Iterable[int]:
        return [n for n in self.contexts if n not in self.gone]

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        """Deliver each message to its node's ClientApp now; its reply becomes pullable after
        ``delay[node]`` seconds (0 by default). Returns the message ids."""
        ids = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = str(uuid4())
            ids.append(msg.metadata.message_id)
            self.sent.append(msg)
            node = msg.metadata.dst_node_id
            if node in self.silent or node in self.gone:
                continue
            try:
                reply = self.client_app(msg, self.contexts[node])
            except Exception as exc:  # the real runtime turns this into an error reply, code 2
                reply = Message(Error(code=2, reason=f"{type(exc).__name__}: {exc}"), reply_to=msg)
            reply = self.tamper(node, reply) if self.tamper else reply
            self.outbox[msg.metadata.message_id] = (time.monotonic() + self.delay.get(node, 0.0), reply)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        """The replies to ``message_ids`` that are available now (each returned once)."""
        self.pulls += 1
        now, ready = time.monotonic(), []
        for mid in message_ids:
            if mid in self.outbox and self.outbox[mid][0] <= now:
                ready.append(self.outbox.pop(mid)[1])
        return ready

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        raise AssertionError("the runner exchanges through push_messages/pull_messages")
