"""Round records: the per-round counters, the metrics every method reports for a round and the row
written for it (the evaluation's aggregate: ``engine.evaluation``)."""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Mapping
from typing import Any

from flwr.app import MetricRecord

from common.payload import ClientReply
from common.run_folder import best_row
from engine.aggregation import sample_weighted_mean

log = logging.getLogger("flwr." + __name__)  # streamed with Flower's own log

#: distinct client errors kept per round (a row of a round that trained nothing quotes them)
MAX_ERRORS = 5


class RoundCounters:
    """What the transport and the roster count, for the run and for the current round.

    Attributes:
        traffic: ``"<category>_bytes_<up|down>"`` -> payload bytes of the run so far.
        dropped: message category -> dropped replies of the run so far.
        round_dropped: partition ids sampled or asked this round that gave no valid reply.
        round_clipped: uploaded rows scaled down to the round's outlier bound this round.
        round_work: architecture -> [training images, client train-seconds] of this round's valid
            train replies.
        round_gpu: partition id -> ``{"device": GPU name, "peak_mib": peak CUDA MiB}`` of this
            round's replies from GPUs.
        round_ray_nodes: Ray node id -> this round's valid replies from ClientApps on that node.
        seconds_per_image: architecture -> client training seconds per image in the last round
            that trained it (the transport's push order).
        round_errors: why this round's train replies were dropped or missing, distinct reasons in
            the order first seen, at most :data:`MAX_ERRORS` of them (rows of rounds that trained
            nothing, and the error of a run that fails for it, quote them).
        query_state: ``state-restores`` and ``state-rollbacks`` of the valid query replies not yet in a
            row: the handshake's land in the run's first row, a refresh's in its round's (:func:`round_row`
            takes them).
    """

    def __init__(self) -> None:
        self.traffic: Counter[str] = Counter()
        self.dropped: Counter[str] = Counter()
        self.seconds_per_image: dict[str, float] = {}
        self.round_dropped: set[int] = set()
        self.round_clipped = 0
        self.round_work: dict[str, list[float]] = {}
        self.round_gpu: dict[str, dict[str, object]] = {}
        self.round_ray_nodes: Counter[str] = Counter()
        self.round_errors: list[str] = []
        self.query_state: Counter[str] = Counter()

    def train_error(self, reason: str) -> None:
        """Note why a train reply of this round was dropped or missing (distinct reasons, at most
        :data:`MAX_ERRORS`)."""
        if reason not in self.round_errors and len(self.round_errors) < MAX_ERRORS:
            self.round_errors.append(reason)

    def begin_round(self) -> None:
        """Keep the last round's training speed per architecture, reset the per-round counters."""
        for arch, (images, seconds) in self.round_work.items():
            if images > 0:
                self.seconds_per_image[arch] = seconds / images
        self.round_dropped = set()
        self.round_clipped = 0
        self.round_work = {}
        self.round_gpu = {}
        self.round_ray_nodes = Counter()
        self.round_errors = []


def round_metrics(replies: list[ClientReply], server: Mapping[str, Any], server_seconds: float) -> dict[str, Any]:
    """The metrics of a training round every method reports.

    Args:
        replies: the round's valid train replies (of every train exchange).
        server: the method's own server metrics.
        server_seconds: wall time of the server's updates, seconds.

    Returns:
        ``num-clients`` (distinct clients with a valid reply), ``server-update-seconds``,
        the clients' summed and maximal ``train-seconds``, ``data-seconds`` (partition loads),
        ``app-start-seconds`` (process start to handler) and ``handler-seconds``, the
        sample-weighted mean ``train-loss``, and ``server``.
    """
    metrics = {"num-clients": len({r.node_id for r in replies}), **server, "server-update-seconds": server_seconds}
    metrics.update(_client_sums(replies, ("train-seconds", "data-seconds", "app-start-seconds", "handler-seconds")))
    # clients that found no state in memory and restored it from their node's state-dir
    metrics["client-state-restores"] = int(sum(r.metrics.get("state-restores", 0) for r in replies))
    # clients whose state was ahead of a resumed server (it crashed after they trained) and was rolled back
    metrics["client-state-rollbacks"] = int(sum(r.metrics.get("state-rollbacks", 0) for r in replies))
    private = [r for r in replies if "dp-epsilon" in r.metrics]
    if private:  # run config dp.epsilon > 0: what each client has spent, with which mechanisms
        metrics["dp-epsilon-per-client"] = {str(r.partition_id): r.metrics["dp-epsilon"] for r in private}
        metrics["dp-epsilon-max"] = max(r.metrics["dp-epsilon"] for r in private)
        metrics["dp-per-client"] = {
            str(r.partition_id): {
                key[len("dp-") :].replace("-", "_"): value for key, value in r.metrics.items() if key.startswith("dp-")
            }
            for r in private
        }
    losses = [r for r in replies if "train-loss" in r.metrics]
    if losses:
        metrics["train-loss"] = sample_weighted_mean(
            [r.metrics["train-loss"] for r in losses], [r.metrics.get("num-examples", 1) for r in losses]
        )
    return metrics


def round_row(
    server_round: int,
    train: Mapping[str, Any],
    evaluation: MetricRecord | None,
    traffic: Mapping[str, int],
    counters: RoundCounters,
    train_s: float,
    eval_s: float,
    elapsed: float,
) -> dict[str, Any]:
    """One round's results row (one line of ``metrics.jsonl``; see the README's Quickstart for its keys).

    Args:
        server_round: the round; train: the round's train metrics (:func:`round_metrics` and the
            method's own); evaluation: the aggregated evaluation, None when not evaluated;
        traffic: payload bytes by ``<category>_bytes_<up|down>`` this round;
        counters: the round's dropped partitions, clipped rows, training work per architecture,
            GPU peaks (row key ``gpu_per_client``, left out when no client ran on a GPU),
            replies per Ray node (``replies_per_ray_node``, left out outside a Ray simulation) and
            the query replies' state restores and rollbacks since the last row (added to the train
            replies' ``client_state_restores`` / ``client_state_rollbacks``; taken, so they count once);
        train_s, eval_s, elapsed: the train and evaluation phases and the run so far, seconds.
    """
    dropped, clipped, work = counters.round_dropped, counters.round_clipped, counters.round_work
    gpu, ray_nodes = counters.round_gpu, counters.round_ray_nodes
    ev = dict(evaluation) if evaluation is not None else {}
    row: dict[str, Any] = {
        "round": server_round,
        "evaluated": evaluation is not None,
        "accuracy_mean": ev.get("accuracy-mean"),
        "accuracy_weighted": ev.get("accuracy-weighted"),
        "bytes_up": traffic.get("train_bytes_up", 0),
        "bytes_down": traffic.get("train_bytes_down", 0),
        "eval_bytes_up": traffic.get("evaluate_bytes_up", 0),
        "eval_bytes_down": traffic.get("evaluate_bytes_down", 0),
        "num_clients": int(train.get("num-clients", 0)),
        "dropped_clients": sorted(dropped),
        "clipped_rows": clipped,
        # images per second of client training (with its payload computation), per architecture
        "train_images_per_second": {
            arch: images / seconds for arch, (images, seconds) in sorted(work.items()) if seconds > 0
        },
        "round_seconds": train_s + eval_s,
        "train_phase_seconds": train_s,
        "eval_phase_seconds": eval_s,
        "elapsed_seconds": elapsed,
    }
    if ray_nodes:
        row["replies_per_ray_node"] = dict(sorted(ray_nodes.items()))
    if gpu:
        row["gpu_per_client"] = {pid: dict(used) for pid, used in sorted(gpu.items(), key=lambda p: int(p[0]))}
    if ev:
        row["accuracy_per_client"] = dict(zip((str(p) for p in ev["partition-ids"]), ev["accuracy-per-client"]))
        # clients asked to evaluate that gave no valid evaluation: this accuracy covers only the others
        row["eval_missing"] = list(ev.get("partitions-not-evaluated", []))
        row.update(
            {k.replace("-", "_"): v for k, v in ev.items() if k.startswith(("accuracy-mean-", "accuracy-weighted-"))}
        )
    row.update({k.replace("-", "_"): v for k, v in train.items() if k != "num-clients"})
    for key in ("restores", "rollbacks"):  # a resumed run's handshake met the clients' state first
        row[f"client_state_{key}"] = row.get(f"client_state_{key}", 0) + counters.query_state.pop(f"state-{key}", 0)
    # a round in which no sampled client trained: said so, with why (run config max-untrained-rounds)
    row["untrained"] = row["num_clients"] == 0
    if row["untrained"]:
        row["client_errors"] = list(counters.round_errors)
    return finite_values(row)


def untrained_streak(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The last rows of ``rows`` in a row whose round had no valid training reply (``untrained``;
    rows written before that key by ``num_clients`` = 0), oldest first; [] when the last round trained."""
    streak: list[dict[str, Any]] = []
    for row in reversed(rows):
        if not row.get("untrained", row.get("num_clients") == 0):
            break
        streak.append(row)
    return streak[::-1]


def untrained_error(streak: list[dict[str, Any]], limit: int | None) -> str:
    """Why a run whose last rounds ``streak`` trained nothing failed: the rounds, the run config key
    ``max-untrained-rounds`` = ``limit`` when it ran out (None: the run ended on such rounds), and the
    clients' distinct errors of those rounds (at most :data:`MAX_ERRORS`)."""
    errors: list[str] = []
    for row in streak:
        errors += [e for e in row.get("client_errors", []) if e not in errors]
    first, last = streak[0]["round"], streak[-1]["round"]
    rounds = f"round {first}" if first == last else f"rounds {first}-{last}"
    why = f"run config key 'max-untrained-rounds' = {limit}" if limit is not None else "the run ended on it"
    said = "; ".join(errors[:MAX_ERRORS]) or "no reply and no error recorded"
    return f"no client trained in {rounds} ({why}); the clients' errors: {said}"


def finite_values(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` with every non-finite float (top level or in a nested dict or list) replaced by None
    and logged: rows are strict JSON, and a NaN from a server step (e.g. a diverged server loss
    that was rolled back) must not make ``metrics.jsonl`` unreadable to strict parsers."""

    def clean(key: str, value: Any) -> Any:
        if isinstance(value, dict):
            return {k: clean(f"{key}.{k}", v) for k, v in value.items()}
        if isinstance(value, list):
            return [clean(key, v) for v in value]
        if isinstance(value, float) and not math.isfinite(value):
            log.warning("Round row key '%s' = %s is not finite: written as null", key, value)
            return None
        return value

    return {k: clean(k, v) for k, v in row.items()}


def patience_exhausted(rows: list[dict[str, Any]], patience: int, metric: str = "accuracy_mean") -> str | None:
    """Why the run should stop after its last row (run config ``stop-patience``), or None.

    It stops once ``patience`` rounds have passed since the best ``metric`` (a row key, run config
    ``stop-metric``) so far (its first round, so a tie is no new best); rounds without evaluation
    count as rounds. With ``accuracy_weighted`` and patience 100 this is HtFLlib's auto-break
    (``check_done(top_cnt=100)`` on the pooled accuracy; FedTGP's scripts run with ``-ab 1``). The
    count comes from the rows alone, so a resumed run (which starts with the old rows) goes on counting.
    """
    best = best_row(rows, metric)
    if patience <= 0 or best is None:
        return None
    waited = rows[-1]["round"] - best["round"]
    if waited < patience:
        return None
    return (
        f"no new best {metric} for {waited} rounds (best {best[metric]:.4f} in round {best['round']}): "
        f"run config key 'stop-patience' = {patience}"
    )


def _client_sums(replies: list[ClientReply], keys: tuple[str, ...]) -> dict[str, float]:
    out = {}
    for key in keys:
        values = [float(r.metrics[key]) for r in replies if key in r.metrics]
        out["client-" + key] = float(sum(values))
        out["client-" + key.replace("seconds", "max-seconds")] = max(values, default=0.0)
    return out


def progress_line(row: Mapping[str, Any], rounds: int) -> str:
    acc = row["accuracy_mean"]
    acc_text = f"acc mean {acc:.4f} weighted {row['accuracy_weighted']:.4f}" if acc is not None else "acc -"
    line = (
        f"[round {row['round']}/{rounds}] {acc_text} | clients {row['num_clients']} | "
        f"up {row['bytes_up']} B down {row['bytes_down']} B | {row['round_seconds']:.1f} s"
    )
    curve = row.get("heldout_curve_mean")
    if curve and curve[0] is not None and curve[-1] is not None:  # a generalisation phase followed the round
        line += (
            f" | held-out {row['heldout_clients']}: acc mean {curve[0]:.4f} -> {curve[-1]:.4f} in "
            f"{len(curve) - 1} personalisation rounds, {row['heldout_seconds']:.1f} s"
        )
    return line
