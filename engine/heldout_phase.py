"""The generalisation phase: clients that never trained are served what a new client gets.

Run config table ``[generalization]`` (``common.heldout``) holds partitions out of training.
Every ``generalization.every`` rounds and after the last round (or the round ``stop-patience`` ends
the run on), :func:`run_phase` serves each connected held-out client for ``generalization.rounds``
personalisation rounds through the method's ``personalize`` (``engine.contract.MethodServer``; a
method with per-client state also sets the phase up and drops it: ``engine.contract.PerClientServer``),
and evaluates it on its own test split before the first and after each. Each phase runs under a state
scope of its own (message config ``state-scope``), so a held-out client starts every phase from nothing
and the run's state is never touched; the server's state is left as it was (the method's hooks must
not change it). The phase's bytes are reported
apart from the training's (row keys ``heldout_bytes_*``), so a run's training traffic is the same
with and without held-out clients.

Source: MH-pFedHN (NeurIPS 2025) §4.4 and Figures 3-5 (held-out clients solid, training clients
dashed); docs/generalization.md.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from flwr.app import MetricRecord

from common.payload import ClientReply
from engine.contract import MethodServer, PerClientServer
from engine.evaluation import evaluations_in
from engine.federation import Federation
from engine.round_rows import RoundCounters


class HeldOutHost(Protocol):
    """What a phase needs of its run (``engine.runner.Runner`` is one)."""

    method: MethodServer
    federation: Federation
    counters: RoundCounters
    phases: int

    def evaluate_nodes(
        self, nodes: list[int], evaluated: list[ClientReply], step: int, server_round: int, scope: str = ""
    ) -> MetricRecord | None: ...


def phase_due(run: HeldOutHost, server_round: int, last: bool) -> bool:
    """True when a generalisation phase follows round ``server_round``: held-out clients are set and it
    is a multiple of ``generalization.every`` (> 0) or the run's ``last`` round."""
    opts = run.federation.roster.generalization
    return opts.enabled and (last or (opts.every > 0 and server_round % opts.every == 0))


def run_phase(run: HeldOutHost, server_round: int) -> dict[str, Any]:
    """One generalisation phase after round ``server_round``: the row keys it adds.

    Returns:
        ``heldout_partitions`` (the run's held-out partition ids), ``heldout_clients`` (held-out
        clients connected and served), ``heldout_accuracy_mean`` / ``_weighted`` (fractions after the
        last personalisation round; None when no held-out client answered), ``heldout_curve_mean`` /
        ``_weighted`` (before any personalisation, then after each round: ``rounds`` + 1 values),
        ``heldout_accuracy_per_client``
        (partition id -> fraction, last round), ``heldout_bytes_up`` / ``_down`` (payload bytes of
        the phase, every message category), ``heldout_seconds``.
    """
    method, federation, counters = run.method, run.federation, run.counters
    roster = federation.roster
    held = roster.held_out
    nodes = [n for n in roster.nodes if n in held and n in roster.connected]
    per_client = isinstance(method, PerClientServer)
    run.phases += 1  # a phase repeated for the same round (a test, a resumed run) starts afresh too
    scope = f"heldout-{run.phases}-round-{server_round}"
    before = counters.traffic.copy()
    start = time.perf_counter()
    curve_mean: list[float | None] = []
    curve_weighted: list[float | None] = []
    evaluation: dict[str, Any] = {}
    if per_client:
        method.begin_generalization(nodes, server_round)
    try:
        for step in range(roster.generalization.rounds + 1):  # step 0: what a new client gets, untouched
            replies = method.personalize(nodes, step, scope, server_round) if nodes and step else []
            record = run.evaluate_nodes(nodes, evaluations_in(replies), step, server_round, scope)
            evaluation = dict(record) if record is not None else {}
            curve_mean.append(evaluation.get("accuracy-mean"))
            curve_weighted.append(evaluation.get("accuracy-weighted"))
    finally:
        if per_client:
            method.end_generalization()
    traffic = counters.traffic - before
    counters.traffic = before  # the run's training traffic stays what it is without held-out clients
    return {
        "heldout_partitions": roster.held_out_partitions,
        "heldout_clients": len(nodes),
        "heldout_accuracy_mean": curve_mean[-1],
        "heldout_accuracy_weighted": curve_weighted[-1],
        "heldout_curve_mean": curve_mean,
        "heldout_curve_weighted": curve_weighted,
        "heldout_accuracy_per_client": dict(
            zip((str(p) for p in evaluation.get("partition-ids", [])), evaluation.get("accuracy-per-client", []))
        ),
        "heldout_bytes_up": sum(v for k, v in traffic.items() if k.endswith("_bytes_up")),
        "heldout_bytes_down": sum(v for k, v in traffic.items() if k.endswith("_bytes_down")),
        "heldout_seconds": time.perf_counter() - start,
    }
