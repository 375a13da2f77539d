"""Transport, the part of every run that talks to clients: one message per client with only its
payload, the exchange (push, then pull at a short interval until every reply is in or the round
times out), payload bytes counted per message category, and every reply checked before use.

A :class:`Transport` is built by ``engine.federation.Federation`` from explicit inputs: the run
config, the method's :class:`ReplyRules` (its schemas, declared metrics and reply checks), the
roster's ``clients`` (read only) and the :class:`engine.round_rows.RoundCounters` it counts into.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid

from common.config import RunConfig
from common.heldout import architecture_for
from common.metrics import ANY_MESSAGE, MAX_DEVICE_NAME, REQUIRED_METRICS, MetricSpec, check_metrics, declared_metrics
from common.payload import ClientReply, PayloadError, Schemas, clip_outlier_rows, read_payload, tensor_bytes
from common.protocol import (
    CLIENT_STATE_DIR,
    CONFIG_RECORD,
    DEVICE_KEYS,
    DEVICE_RECORD,
    GPU_PEAK,
    PARTITION_ID,
    STATE_KEY,
    STATE_SCOPE,
)
from engine.payload_recorder import PayloadRecorder
from engine.round_rows import RoundCounters

log = logging.getLogger("flwr." + __name__)  # streamed with Flower's own log

#: seconds between two pulls for replies (Flower's HTTP grid waits 3 s)
PULL_SECONDS = 0.05
#: longest reason quoted in the log line of a dropped reply (a hostile reply's error may be long)
REASON_CHARS = 300


def quoted_reason(reason: str) -> str:
    """``reason`` cut to at most :data:`REASON_CHARS` characters (plus the marker of the cut): its
    start and its end, since a ClientApp's error is a traceback whose cause comes last."""
    if len(reason) <= REASON_CHARS:
        return reason
    head = REASON_CHARS // 3
    return f"{reason[:head]} ... {reason[head - REASON_CHARS :]} ({len(reason)} characters)"


class DuplicateReply(PayloadError):
    """A reply of a partition that already gave a valid reply in this exchange (replayed or spoofed)."""


@dataclass(frozen=True)
class ReplyRules:
    """What the transport needs of a method to build messages and check replies, settled from the
    method before the transport is built (``engine.runner.Runner``).

    Attributes:
        schemas: message type -> (server->client, client->server) payload schema.
        metrics: message category -> the method's declared reply metrics.
        eval_after_training: whether evaluation rides in train replies (the declared evaluate metrics
            are then expected in train replies too, ``common.metrics.declared_metrics``).
        check_reply: the method's own checks of a reply's metrics, ``(message_type, metrics)``;
            raises ``common.payload.PayloadError`` to drop the reply.
        reply_dims: node id -> the symbol values (``C``, ``d``, per-client sizes such as
            MH-pFedHN's ``K``) that node's reply is validated with; it may change as the server
            registers clients, so it is asked per reply.
    """

    schemas: Schemas
    metrics: Mapping[str, Mapping[str, MetricSpec]]
    eval_after_training: bool
    check_reply: Callable[[str, Mapping[str, Any]], None]
    reply_dims: Callable[[int], dict[str, int]]


class Transport:
    """Messages, the exchange, byte counting and reply validation.

    Args:
        cfg: the run config (``round-timeout``, ``model-group``, ``local-epochs``, the pool size).
        rules: the method's schemas, declared metrics and reply checks.
        clients: node id -> the handshake's metrics (the roster's, read only).
        counters: where bytes, dropped replies and the round's work are counted.
        recorder: keeps the payloads of the rounds ``record-payloads`` names (None: nothing is kept).
    """

    def __init__(
        self,
        cfg: RunConfig,
        rules: ReplyRules,
        clients: Mapping[int, Mapping[str, Any]],
        counters: RoundCounters,
        recorder: PayloadRecorder | None = None,
    ) -> None:
        self.cfg, self.rules, self.clients, self.counters = cfg, rules, clients, counters
        self.recorder = recorder
        self.grid: Grid | None = None
        #: names this run's client state on disk (node config ``state-dir``): the results folder of
        #: the run that started it, kept by a resumed run so clients find their state again
        self.state_key = "in-memory"
        #: sent as message config ``client-state-dir``: where clients without any ``state-dir`` keep
        #: their state (a simulation's run folder, see ``engine.runner.Runner.start``); empty: context.state
        self.client_state_dir = ""
        self.timeout = cfg.round_timeout
        #: in a simulation, the most messages of one exchange that wait for replies at once (asked
        #: at every push; see :meth:`push_and_pull`); None: every message at once (a deployment)
        self.window: Callable[[], int] | None = None

    def open(
        self,
        grid: Grid,
        state_key: str,
        client_state_dir: str = "",
        window: Callable[[], int] | None = None,
    ) -> None:
        """Start talking on ``grid``: the clients' state key and folder and the simulation's message
        window (the exchange timeout stays ``round-timeout``)."""
        self.grid, self.state_key, self.client_state_dir, self.window = grid, state_key, client_state_dir, window

    def message(
        self,
        message_type: str,
        node_id: int,
        arrays: Mapping[str, np.ndarray],
        config: ConfigRecord,
        server_round: int,
        scope: str = "",
    ) -> Message:
        """A message to one node: its payload (checked against the schema) plus ``config``; in a recorded
        round the payload is also written to the run folder (``engine.payload_recorder``). A ``scope``
        (message config ``state-scope``) gives the client a state of its own beside its run state
        (``common.runtime.ClientRuntime``: a held-out client's generalisation phase); such messages are
        never recorded."""
        content = self.rules.schemas[message_type][0].to_record(arrays)
        if self.recorder is not None and node_id in self.clients and not scope:
            self.recorder.download(server_round, self.clients[node_id][PARTITION_ID], message_type, arrays)
        extra: dict[str, str] = {CLIENT_STATE_DIR: self.client_state_dir} if self.client_state_dir else {}
        if scope:
            extra[STATE_SCOPE] = scope
        content[CONFIG_RECORD] = ConfigRecord({**dict(config), STATE_KEY: self.state_key, **extra})
        # a scoped message's group is not a round number: its reply is not recorded either
        group = f"{scope}-{server_round}" if scope else str(server_round)
        return Message(content, dst_node_id=node_id, message_type=message_type, group_id=group)

    def exchange(
        self, messages: Iterable[Message], timeout: float | None = None, key: str = "round-timeout"
    ) -> list[Message]:
        """Send ``messages``, wait for the replies (at most ``timeout`` s, default ``round-timeout``),
        count payload bytes both ways. ``key``: the run config key that set ``timeout``, named in the
        round's client error when replies are missing.

        Bytes are added to ``counters.traffic["<category>_bytes_down"]`` (per message sent) and
        ``["<category>_bytes_up"]`` (per reply received, valid or not).
        """
        messages = list(messages)
        if not messages:
            return []
        for m in messages:
            self.counters.traffic[_category(m.metadata.message_type) + "_bytes_down"] += tensor_bytes(m.content)
        timeout = timeout or self.timeout
        replies = self.push_and_pull(messages, timeout)
        self._count_replies(messages, replies, timeout, key)
        return replies

    def _count_replies(self, messages: list[Message], replies: list[Message], timeout: float, key: str) -> None:
        """Count the bytes up of ``replies`` and the messages of ``messages`` that got none."""
        for r in replies:
            if not r.has_error():
                self.counters.traffic[_category(r.metadata.message_type) + "_bytes_up"] += tensor_bytes(r.content)
        missing = {m.metadata.dst_node_id for m in messages} - {r.metadata.src_node_id for r in replies}
        if missing:
            partitions = sorted(self.clients[n][PARTITION_ID] for n in missing if n in self.clients)
            log.warning(
                "%d of %d %s replies did not arrive within %.0f s (partitions %s)",
                len(missing),
                len(messages),
                messages[0].metadata.message_type,
                timeout,
                partitions,
            )
            self.counters.dropped[_category(messages[0].metadata.message_type)] += len(missing)
            self.counters.round_dropped.update(partitions)
            if self._keeps_errors(_category(messages[0].metadata.message_type)):
                self.counters.train_error(f"no reply within {timeout:.0f} s (run config key '{key}')")

    def push_and_pull(self, messages: list[Message], timeout: float) -> list[Message]:
        """Push ``messages`` and pull their replies every :data:`PULL_SECONDS` until all are in or
        ``timeout`` seconds have passed (then the missing ones are late: :meth:`exchange` records
        them as dropped). Returns the replies in the order of ``messages``.

        Flower's ``send_and_receive`` does the same but sleeps 3 s between pulls on the
        deployment (HTTP) grid, which added up to 3 s to every exchange of a deployed round.

        The messages are pushed longest expected work first (:meth:`expected_seconds`): a
        simulation's ClientApps take messages in push order, and a large client pushed last would
        keep one ClientApp busy after the others are done (longest-processing-time-first
        scheduling). Only the push order changes: replies are returned in the order of ``messages``.

        With a :attr:`window` (a simulation's), at most ``window()`` messages wait for their replies
        at once, and the next ones are pushed as replies arrive: Flower's simulation engine looks
        for each node's next message by scanning every stored message, every 0.1 s for every node
        (``flwr.server.superlink.fleet.vce.vce_api.add_messages_to_queue``), a cost of nodes x
        waiting messages per scan. With 1,000 MNIST clients (FedProto, 100 trained and all 1,000
        evaluated per round, 2 ClientApps) a round took 26.2 s with every message pushed at once and
        18.1 s with a window of 16, same results. Messages not pushed by the ``timeout`` count as late.
        """
        index = {id(m): i for i, m in enumerate(messages)}
        queue = sorted(messages, key=self.expected_seconds, reverse=True)
        order: dict[str, int] = {}  # message id -> its place in ``messages``
        pending: set[str] = set()
        deadline = time.monotonic() + timeout
        replies: list[Message] = []
        while True:
            room = (self.window() if self.window else len(queue)) - len(pending)
            if queue and room > 0:
                batch, queue = queue[:room], queue[room:]
                ids = list(self.grid.push_messages(batch))
                order.update({mid: index[id(m)] for mid, m in zip(ids, batch)})
                pending.update(ids)
            arrived = list(self.grid.pull_messages(pending))
            replies += arrived
            pending -= {r.metadata.reply_to_message_id for r in arrived}
            if not (pending or queue) or time.monotonic() >= deadline:
                break
            if not arrived or not queue:
                time.sleep(min(PULL_SECONDS, max(deadline - time.monotonic(), 0.0)))
        # in the order the messages were sent, whatever order they arrived in: runs stay reproducible
        return sorted(replies, key=lambda r: order.get(r.metadata.reply_to_message_id, len(order)))

    def validate(self, message_type: str, replies: Iterable[Message]) -> list[ClientReply]:
        """Keep the replies that pass :meth:`check`; log and count the rest as dropped. Then count the
        round's work, Ray nodes and GPU peaks of the valid ones (:meth:`count_valid`) and scale down
        outlier rows (``common.payload.clip_outlier_rows``).

        In a train or evaluate exchange, a reply from a partition that already gave a valid reply in
        this exchange (a replayed or spoofed reply) is counted as dropped, while the partition's first
        reply stands. Query replies are claims: the roster decides between two claims of one
        partition. The log line of a dropped reply quotes at most :data:`REASON_CHARS` of its reason:
        its start and its end, where a traceback names its cause.
        """
        category = _category(message_type)
        up = self.rules.schemas[message_type][1]
        declared = declared_metrics(category, self.rules.metrics, self.rules.eval_after_training)
        valid: list[ClientReply] = []
        answered: set[int] = set()  # partitions with a valid reply in this exchange
        for reply in replies:
            node = reply.metadata.src_node_id
            try:
                checked = self.check(message_type, reply, declared, answered)
            except PayloadError as exc:
                self.drop(message_type, node, str(exc), duplicate=isinstance(exc, DuplicateReply))
                continue
            valid.append(checked)
            answered.add(checked.partition_id)
            if self.recorder is not None and reply.metadata.group_id.isdigit():
                self.recorder.upload(
                    int(reply.metadata.group_id), checked.partition_id, message_type, checked.arrays, checked.metrics
                )
        self.count_valid(category, valid)
        clipped = clip_outlier_rows(up, [r.arrays for r in valid])
        if clipped:
            self.counters.round_clipped += clipped
            log.warning(
                "Scaled down %d uploaded %s rows to the round's outlier bound (ArraySpec.row_norm_factor)",
                clipped,
                message_type,
            )
        return valid

    def handshakes(self, replies: Iterable[Message]) -> list[ClientReply]:
        """The handshake's answers inside train ``replies`` of nodes the server did not know (message config
        ``common.protocol.HANDSHAKE``; :meth:`read_handshake`); a reply that fails is logged and counted
        as a dropped query (:meth:`drop`)."""
        answers = []
        for reply in replies:
            try:
                answers.append(self.read_handshake(reply))
            except PayloadError as exc:
                self.drop("query", reply.metadata.src_node_id, str(exc), duplicate=False)
        return answers

    def read_handshake(self, reply: Message) -> ClientReply:
        """The handshake's answer inside the train ``reply`` of a node the server did not know: its query
        metrics (the keys a query reply declares beyond those of every message, e.g. ``num-train``,
        ``num-test``, ``num-partitions``) and ``partition-id``, checked as a query reply's
        (:meth:`_checked_metrics`), as a :class:`ClientReply` without arrays. The query metrics are then
        removed from ``reply``, which :meth:`validate` checks as a train reply against this answer.

        Raises:
            PayloadError: ``reply`` is not well formed (:meth:`_metric_record`) or its query metrics fail
                the query's checks.
        """
        record = self._metric_record(reply)
        declared = declared_metrics("query", self.rules.metrics, False)
        metrics = {k: record[k] for k in declared if k in record and k not in ANY_MESSAGE}
        if PARTITION_ID in record:
            metrics[PARTITION_ID] = record[PARTITION_ID]
        pid = self._checked_metrics("query", metrics, declared, None)
        for key in metrics.keys() - {PARTITION_ID}:
            del record[key]
        return ClientReply(reply.metadata.src_node_id, pid, {}, metrics)

    def check(
        self, message_type: str, reply: Message, declared: Mapping[str, MetricSpec], answered: set[int]
    ) -> ClientReply:
        """``reply`` as a :class:`ClientReply` when it is well formed and, in a train or evaluate
        exchange, its partition is not among those that ``answered`` already.

        Raises:
            PayloadError: it is an error, carries records other than the payload and one ``metrics``
                MetricRecord, its metrics fail their declarations ``declared``
                (``common.metrics.check_metrics``) or the method's ``check_reply``, it lacks
                ``partition-id`` (or claims another partition than its node did at the handshake),
                or its payload fails the schema (array names are checked before any array is decoded).
            DuplicateReply: its partition answered already (checked before its payload is decoded).
        """
        category, node = _category(message_type), reply.metadata.src_node_id
        metrics = dict(self._metric_record(reply))
        content = reply.content
        device = device_record(content)
        pid = self._checked_metrics(message_type, metrics, declared, self.clients.get(node))
        if node in self.clients and self.clients[node][PARTITION_ID] != pid:
            raise PayloadError(f"partition-id {pid} differs from the handshake's {self.clients[node][PARTITION_ID]}")
        if category != "query" and pid in answered:
            raise DuplicateReply(f"partition {pid} already replied in this exchange")
        up = self.rules.schemas[message_type][1]
        arrays = read_payload(content, up)
        up.validate(arrays, self.rules.reply_dims(node))
        return ClientReply(node, pid, arrays, metrics, device.get("name"), device.get("ray-node"))

    @staticmethod
    def _metric_record(reply: Message) -> MetricRecord:
        """The ``metrics`` record of ``reply``.

        Raises:
            PayloadError: ``reply`` is an error, carries records other than the payload, one ``metrics``
                MetricRecord and the ``device`` record, or lacks ``metrics``.
        """
        if reply.has_error():
            raise PayloadError(f"client error {reply.error.code}: {reply.error.reason}")
        content = reply.content
        extra = set(content.keys()) - {"payload", "metrics", DEVICE_RECORD}
        if extra or "metrics" not in content.metric_records:
            raise PayloadError(f"records {sorted(content.keys())[:5]}, expected payload + metrics")
        return content.metric_records["metrics"]

    def _checked_metrics(
        self, message_type: str, metrics: dict[str, Any], declared: Mapping[str, MetricSpec], known: Any
    ) -> int:
        """The partition id of a reply of ``message_type`` whose ``metrics`` hold an integer ``partition-id``
        and the category's required keys, pass their declarations ``declared`` against what the client
        reported at the handshake (``known``; None at the handshake: ``common.metrics.check_metrics``) and
        the method's ``check_reply``.

        Raises:
            PayloadError: naming what fails.
        """
        category = _category(message_type)
        pid = metrics.get(PARTITION_ID)
        if not isinstance(pid, int):
            raise PayloadError("metrics lack an integer 'partition-id'")
        absent = [k for k in REQUIRED_METRICS.get(category, ()) if k not in metrics]
        if absent:
            raise PayloadError(f"metrics lack {absent}")
        check_metrics(metrics, declared, known, category, self.cfg.pool_size)
        self.rules.check_reply(message_type, metrics)
        return pid

    def drop(self, message_type: str, node: int, reason: str, duplicate: bool) -> None:
        """Count and log a dropped reply of ``node``; a train reply's error (not a ``duplicate``'s) also
        goes to the round's client errors (``RoundCounters.train_error``), as does a query reply's when
        rounds ask their sampled nodes (run config ``handshake = "sampled"``)."""
        category = _category(message_type)
        self.counters.dropped[category] += 1
        if node in self.clients and not duplicate:
            self.counters.round_dropped.add(self.clients[node][PARTITION_ID])
        reason = quoted_reason(reason)
        log.warning("Dropped %s reply from node %s: %s", message_type, node, reason)
        if self._keeps_errors(category) and not duplicate:
            self.counters.train_error(reason)

    def _keeps_errors(self, category: str) -> bool:
        """Whether a dropped or missing reply of ``category`` is why a client of this round did not
        train: train replies, and query replies when each round asks its sampled nodes."""
        return category == "train" or (category == "query" and self.cfg.handshake == "sampled")

    def count_valid(self, category: str, valid: list[ClientReply]) -> None:
        """The round's work (train replies), the state restores and rollbacks of query replies, the Ray nodes
        that served ``valid`` and the peak GPU memory of each client's messages this round, on the device it
        names."""
        if category == "train":
            self._count_work(valid)
        elif category == "query":
            for key in ("state-restores", "state-rollbacks"):
                self.counters.query_state[key] += int(sum(r.metrics.get(key, 0) for r in valid))
        self.counters.round_ray_nodes.update(r.ray_node for r in valid if r.ray_node is not None)
        for r in valid:
            if GPU_PEAK in r.metrics:
                used = self.counters.round_gpu.setdefault(str(r.partition_id), {"device": r.device, "peak_mib": 0.0})
                used["peak_mib"] = max(float(used["peak_mib"]), float(r.metrics[GPU_PEAK]))

    def expected_seconds(self, message: Message) -> float:
        """Relative work a message asks of its client: its training (train messages) or test
        (evaluate messages) examples times its architecture's training seconds per image in the
        last round that trained it (1 before any); 0 for a node not known yet or a query."""
        known = self.clients.get(message.metadata.dst_node_id)
        category = _category(message.metadata.message_type)
        if known is None or category not in ("train", "evaluate"):
            return 0.0
        arch = architecture_for(self.cfg, known[PARTITION_ID], known["num-partitions"])
        examples = known.get("num-train" if category == "train" else "num-test", 0)
        return float(examples) * self.counters.seconds_per_image.get(arch, 1.0)

    def _count_work(self, replies: list[ClientReply]) -> None:
        """Add the replies' training images (``num-examples`` x ``local-epochs``) and ``train-seconds``
        to the round's work under each client's architecture (its model group's, by partition)."""
        for r in replies:
            if "train-seconds" in r.metrics and "num-examples" in r.metrics:
                known = self.clients[r.node_id]
                arch = architecture_for(self.cfg, r.partition_id, known["num-partitions"])
                work = self.counters.round_work.setdefault(arch, [0.0, 0.0])
                work[0] += float(r.metrics["num-examples"]) * self.cfg.local_epochs
                work[1] += float(r.metrics["train-seconds"])


def device_record(content) -> dict[str, str]:
    """Where a reply ran, from its ``device`` ConfigRecord: ``name`` (its GPU) and ``ray-node`` (the
    Ray node of its simulation actor), each only when the reply carries it; {} without the record.

    Raises:
        PayloadError: a ``device`` record with other keys, or with no key, or a value that is not a
            printable string of at most :data:`MAX_DEVICE_NAME` characters.
    """
    if DEVICE_RECORD not in content:
        return {}
    record = content.config_records.get(DEVICE_RECORD)
    values = dict(record) if record is not None else {}
    if (
        not values
        or set(values) - set(DEVICE_KEYS)
        or not all(isinstance(v, str) and v.isprintable() and len(v) <= MAX_DEVICE_NAME for v in values.values())
    ):
        raise PayloadError(
            f"record '{DEVICE_RECORD}' must hold {' and/or '.join(DEVICE_KEYS)}, each one printable string "
            f"of <= {MAX_DEVICE_NAME} chars"
        )
    return values


def _category(message_type: str) -> str:
    return message_type.split(".", 1)[0]
