"""The run's clients as the runner and a method's own round see them, behind one facade.

:class:`Federation` owns the :class:`engine.roster.Roster` (who is there: the handshake, nodes leaving
and joining, each round's sample) and the :class:`engine.transport.Transport` (messages, bytes, reply
checks), and wires them without either importing the other: the roster asks nodes through the
:class:`engine.roster.Handshakes` port this class implements, and the transport reads the roster's
``clients`` read-only. Everything that talks to clients goes through :meth:`Federation.send` (one
message type to a set of nodes, the valid replies back), :meth:`Federation.train` (the standard round's
exchange, which also admits the nodes that answer the handshake in their train reply) or
:meth:`Federation.evaluate`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Message
from flwr.serverapp import Grid

from common.config import RunConfig
from common.payload import ClientReply
from common.protocol import HANDSHAKE, PARTITION_ID, SERVER_ROUND, Arrays
from engine.payload_recorder import PayloadRecorder
from engine.roster import Roster
from engine.round_rows import RoundCounters
from engine.transport import ReplyRules, Transport


class Federation:
    """Handshake, sampling and every exchange of one run.

    Built in two steps because the method's reply rules need the method, and the method reads the
    federation's clients: ``Federation(...)``, then :meth:`bind` once the method exists (the runner does
    both, ``engine.runner.Runner``).

    Args:
        cfg: the run config.
        counters: where bytes, dropped replies and the round's work are counted (the rows read them).
        rng: the run's seeded generator: it samples the clients (and a method's own round may draw from
            it; the checkpoint saves it, so a resumed run continues the same stream).
        recorder: keeps the payloads of the rounds ``record-payloads`` names.
        query_in_train: handshake ``sampled``: a drawn node not known yet answers the handshake's query in
            its train reply (``engine.contract.needs_query_first`` is False for the method).
    """

    def __init__(
        self,
        cfg: RunConfig,
        counters: RoundCounters,
        rng: np.random.Generator,
        recorder: PayloadRecorder | None,
        query_in_train: bool,
    ) -> None:
        self.cfg, self.counters, self.recorder = cfg, counters, recorder
        self.roster = Roster(cfg, counters, rng, self, query_in_train)
        self.transport: Transport | None = None
        #: the rounds the run has completed (the resumed checkpoint's, then each finished round; the runner
        #: sets it): a query carries it, so a client whose state on disk is ahead of it rolls back
        #: (``common.state_store.StateStore.restore``) before it answers
        self.completed_round = 0

    def bind(self, rules: ReplyRules) -> None:
        """Build the transport with the method's reply rules (schemas, metrics, checks)."""
        self.transport = Transport(self.cfg, rules, self.roster.clients, self.counters, self.recorder)

    def open(
        self, grid: Grid, state_key: str, client_state_dir: str = "", window: Callable[[], int] | None = None
    ) -> None:
        """Start talking on ``grid`` (``engine.transport.Transport.open``)."""
        self.transport.open(grid, state_key, client_state_dir, window=window)

    # ------------------------------------------------------------ the roster's port (engine.roster.Handshakes)
    @property
    def simulated(self) -> bool:
        """True in a simulation: a message window is set (``server_app.app``)."""
        return self.transport.window is not None

    def listed(self) -> set[int]:
        """The node ids the grid lists now."""
        return set(self.transport.grid.get_node_ids())

    def ask(self, nodes: list[int], timeout: float, key: str = "round-timeout") -> list[Message]:
        """One ``query`` message to each of ``nodes``, with :attr:`completed_round` as its server round;
        their raw replies (``Transport.exchange``)."""
        config = ConfigRecord({SERVER_ROUND: self.completed_round})
        return self.transport.exchange([self.transport.message("query", n, {}, config, 0) for n in nodes], timeout, key)

    def answers(self, replies: list[Message], in_train: bool = False) -> list[ClientReply]:
        """The valid query replies, or with ``in_train`` the handshake's answers inside train replies."""
        return self.transport.handshakes(replies) if in_train else self.transport.validate("query", replies)

    # ------------------------------------------------------------ who is there
    def handshake(self) -> None:
        """Learn the run's clients (``engine.roster.Roster.handshake``)."""
        self.roster.handshake()

    def refresh(self) -> list[int]:
        """Round boundary: nodes that left or joined; returns the nodes admitted since
        (``engine.roster.Roster.refresh``)."""
        return self.roster.refresh()

    def sample(self) -> list[int]:
        """This round's training clients, seeded, in partition order (``engine.roster.Roster.sample``)."""
        return self.roster.sample()

    @property
    def clients(self) -> Mapping[int, Mapping[str, Any]]:
        """Node id -> its handshake metrics (``partition-id``, sizes, what the method's client reports)."""
        return self.roster.clients

    @property
    def nodes(self) -> list[int]:
        """Every known node, in partition order (held-out ones included)."""
        return self.roster.nodes

    @property
    def training_nodes(self) -> list[int]:
        """The known nodes that train (not held out), in partition order."""
        return self.roster.training_nodes

    @property
    def held_out(self) -> set[int]:
        """The known nodes held out of training (run config ``[generalization]``)."""
        return self.roster.held_out

    def partition_of(self, node: int) -> int:
        """The partition id node ``node`` answered the handshake with."""
        return self.roster.clients[node][PARTITION_ID]

    def exhaust(self, replies: list[ClientReply]) -> list[int]:
        """Note the clients whose privacy budget is spent (``engine.roster.Roster.exhaust``)."""
        return self.roster.exhaust(replies)

    def use_poisson_sampling(self, rate: float) -> None:
        """Client-level DP: draw every training client on its own at rate ``rate`` each round."""
        self.roster.poisson_rate = rate

    # ------------------------------------------------------------ exchanges
    def send(
        self,
        message_type: str,
        payloads: Mapping[int, Arrays],
        config: ConfigRecord,
        server_round: int,
        scope: str = "",
    ) -> list[ClientReply]:
        """One ``message_type`` message to each node of ``payloads`` (its arrays and ``config``), and the
        replies that pass the checks (schema, metrics, partition); the others are dropped, counted and
        logged. ``scope``: a client state of its own (a generalisation phase's)."""
        messages = [
            self.transport.message(message_type, n, arrays, config, server_round, scope)
            for n, arrays in payloads.items()
        ]
        return self.transport.validate(message_type, self.transport.exchange(messages))

    def send_each(
        self, kinds: Mapping[int, str], payloads: Mapping[int, Arrays], config: ConfigRecord, server_round: int
    ) -> list[ClientReply]:
        """As :meth:`send` with a message type per node (``kinds``) in one exchange, each reply checked
        against the type its node was sent, the valid ones in partition order. The types are ``train``
        and its actions (``train.<action>``): a reply from a node not sent to is checked as ``train``."""
        messages = [self.transport.message(kinds[n], n, arrays, config, server_round) for n, arrays in payloads.items()]
        replies = self.transport.exchange(messages)
        kind_of = {id(r): kinds.get(r.metadata.src_node_id, "train") for r in replies}
        valid = [
            reply
            for kind in dict.fromkeys(["train", *sorted(set(kinds.values()))])
            for reply in self.transport.validate(kind, [r for r in replies if kind_of[id(r)] == kind])
        ]
        return sorted(valid, key=lambda r: r.partition_id)

    def train(self, payloads: Mapping[int, Arrays], config: ConfigRecord, server_round: int) -> list[ClientReply]:
        """The standard round's exchange: :meth:`send` of ``train``, where a drawn node not known yet
        (handshake ``sampled``) is also asked the handshake's question and admitted on a valid answer
        (``engine.roster.Roster.answered``); it waits as a first answer may take
        (``engine.roster.Roster.exchange_timeout``)."""
        pending = set(self.roster.pending)
        handshake = ConfigRecord({**dict(config), HANDSHAKE: True})
        messages = [
            self.transport.message("train", n, arrays, handshake if n in pending else config, server_round)
            for n, arrays in payloads.items()
        ]
        wait = self.roster.exchange_timeout() if pending else ()  # (seconds, run config key) for new nodes
        replies = self.roster.answered(self.transport.exchange(messages, *wait))
        return self.transport.validate("train", replies)

    def evaluate(
        self,
        nodes: Sequence[int],
        evaluated: list[ClientReply],
        payload: Callable[[int], Arrays],
        config: ConfigRecord,
        server_round: int,
        scope: str = "",
    ) -> list[ClientReply]:
        """The evaluations of ``nodes``: those carried by their train replies (``evaluated``) and one
        ``evaluate`` message (arrays ``payload(node)``, ``config``) to each of the others, the valid
        replies of both."""
        done = {r.node_id for r in evaluated}
        asked = {node: payload(node) for node in nodes if node not in done}
        return self.send("evaluate", asked, config, server_round, scope) + evaluated
