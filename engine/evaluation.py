"""The evaluation of the clients' personal models, in one place.

A round's evaluation reaches a client one of two ways. A method whose evaluated model is the
client's post-training personal model (``MethodServer.evaluates_after_training``) asks its sampled clients
to evaluate right after training: the train message's config carries ``evaluate``
(``common.protocol.train_config``), the client runs its evaluation in the same message
(``client_app.handlers``) and replies with its evaluate metrics under ``eval-`` names, which the transport
then expects in train replies (``common.metrics.declared_metrics``). Every other client to evaluate
gets an evaluate message. ``engine.federation.Federation.evaluate`` takes the evaluations carried by
train replies (:func:`evaluations_in`) and asks the rest; the method's ``aggregate_evaluate`` (by
default :func:`aggregate_evaluation`) aggregates both, naming the clients asked that gave no valid
evaluation. The round's evaluation (``engine.runner.Runner.evaluate_round``) and a generalisation
phase (``engine.heldout_phase``) both go this way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from flwr.app import MetricRecord

from common.metrics import REQUIRED_METRICS
from common.payload import ClientReply
from common.protocol import EVAL_PREFIX


def evaluations_in(replies: list[ClientReply]) -> list[ClientReply]:
    """The evaluations carried by train replies (``eval-`` metrics, see
    ``MethodServer.evaluates_after_training``), as evaluate replies without payload."""
    return [
        ClientReply(
            r.node_id,
            r.partition_id,
            {},
            {k[len(EVAL_PREFIX) :]: v for k, v in r.metrics.items() if k.startswith(EVAL_PREFIX)},
        )
        for r in replies
        if all(EVAL_PREFIX + k in r.metrics for k in REQUIRED_METRICS["evaluate"])
    ]


def aggregate_evaluation(replies: list[ClientReply], asked: Sequence[int] = ()) -> MetricRecord | None:
    """Accuracy of the clients' personal models on their local test splits (None without replies).

    ``accuracy-mean`` is the unweighted mean over clients (the papers' "average test
    accuracy"), ``accuracy-weighted`` the sample-weighted mean; both fractions in [0, 1].
    Per-client values come as parallel lists ``partition-ids`` / ``accuracy-per-client``, in
    partition-id order. Any other ``test-acc-<name>`` metric is averaged unweighted into
    ``accuracy-mean-<name>`` and weighted by ``num-examples`` into ``accuracy-weighted-<name>``
    (over the replies that have it). ``partitions-not-evaluated`` lists the partitions of
    ``asked`` (the partitions asked to evaluate) without a valid reply, when there are any: that
    round's accuracy covers only part of the clients (``common.run_folder.counted_rows``).
    """
    valid = sorted(replies, key=lambda r: r.partition_id)
    if not valid:
        return None
    correct = np.array([r.metrics["test-correct"] for r in valid], dtype=np.float64)
    total = np.array([r.metrics["num-examples"] for r in valid], dtype=np.float64)
    acc = correct / np.maximum(total, 1)
    out: dict[str, Any] = {
        "accuracy-mean": float(acc.mean()),
        "accuracy-weighted": float(correct.sum() / max(total.sum(), 1)),
        "num-evaluated": len(valid),
        "partition-ids": [r.partition_id for r in valid],
        "accuracy-per-client": [float(a) for a in acc],
    }
    extra = sorted({k for r in valid for k in r.metrics if k.startswith("test-acc-")})
    for key in extra:
        having = [r for r in valid if key in r.metrics]
        values = np.array([r.metrics[key] for r in having], dtype=np.float64)
        weights = np.array([r.metrics["num-examples"] for r in having], dtype=np.float64)
        name = key[len("test-acc-") :]
        out["accuracy-mean-" + name] = float(values.mean())
        out["accuracy-weighted-" + name] = float((values * weights).sum() / max(weights.sum(), 1))
    missing = sorted(set(asked) - set(out["partition-ids"]))
    if missing:
        out["partitions-not-evaluated"] = missing
    return MetricRecord(out)
