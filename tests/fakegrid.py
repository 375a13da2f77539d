"""An in-process Grid: delivers messages straight to the real ClientApp, one Context per node.

No Ray, no serialisation, so whole rounds run in seconds. Messages built outside a Flower
runtime need a task identity, set here once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from flwr.app import Context, Error, Message, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity

TaskIdentity.run_id = TaskIdentity.node_id = TaskIdentity.task_id = 1


class FakeGrid(Grid):
    """Nodes ``1000 + partition_id``; ``tamper(node_id, reply) -> reply`` can corrupt replies."""

    def __init__(self, client_app, run_config: dict, num_nodes: int,
                 tamper: Callable[[int, Message], Message] | None = None) -> None:
        self.client_app = client_app
        self.tamper = tamper
        self.contexts = {
            1000 + p: Context(run_id=1, node_id=1000 + p,
                              node_config={"partition-id": p, "num-partitions": num_nodes},
                              state=RecordDict(), run_config=dict(run_config))
            for p in range(num_nodes)
        }
        self.sent: list[Message] = []

    def set_run(self, run) -> None:  # pragma: no cover - unused by the strategies
        raise NotImplementedError

    @property
    def run(self):  # pragma: no cover
        raise NotImplementedError

    def create_message(self, *args, **kwargs):  # pragma: no cover
        raise NotImplementedError

    def push_messages(self, messages):  # pragma: no cover
        raise NotImplementedError

    def pull_messages(self, message_ids):  # pragma: no cover
        raise NotImplementedError

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        replies = []
        for msg in messages:
            self.sent.append(msg)
            node = msg.metadata.dst_node_id
            try:
                reply = self.client_app(msg, self.contexts[node])
            except Exception as exc:  # the real runtime turns this into an error reply, code 2
                reply = Message(Error(code=2, reason=f"{type(exc).__name__}: {exc}"), reply_to=msg)
            replies.append(self.tamper(node, reply) if self.tamper else reply)
        return replies
