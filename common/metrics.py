"""The scalar metrics a client may report, declared once, and the check every reply's metrics pass.

A reply's ``metrics`` MetricRecord may hold only keys its message category declares: those every
client reports (:data:`ANY_MESSAGE`, added by the client runtime), those of the category
(:data:`CATEGORY_METRICS`), the evaluate keys with the ``eval-`` prefix in a train reply of a
method that evaluates in its train replies, and the method's own (``Method.metrics``, e.g.
FedGH's ``test-acc-global-head``). Each key has a :class:`MetricSpec`: integer or number, and the
range it must lie in. An undeclared key or a value outside its spec makes the reply malformed: the
server drops it like a payload that fails its schema, so no client can put an unbounded number
into a results row (a ``train-loss`` of 1e308 summed into ``inf``) or grow a row by inventing keys.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from common.payload import PayloadError, names, short
from common.protocol import EVAL_PREFIX, GPU_PEAK, PARTITION_ID

#: further metric keys a reply of a message category must carry
REQUIRED_METRICS = {
    "train": ("num-examples",),
    "evaluate": ("test-correct", "num-examples"),
    "query": ("num-train", "num-test", "num-partitions"),
}
#: the longest value of a reply's ``common.protocol.DEVICE_RECORD`` entries
MAX_DEVICE_NAME = 100
#: the longest error text of a query reply's ``common.protocol.CONFIG_ERROR_RECORD``
MAX_ERROR_CHARS = 1000
#: largest seconds a client may report for one message step (~116 days: far beyond any round timeout)
MAX_SECONDS = 1e7
#: largest loss magnitude a client may report; a diverged honest client reports a non-finite loss
#: (dropped either way), while this bound keeps sums and weighted means of the round finite
MAX_LOSS = 1e9


@dataclass(frozen=True)
class MetricSpec:
    """One metric a client may report.

    Args:
        kind: ``int`` (a Python int is required) or ``float`` (an int or a float).
        low, high: the closed range the value must lie in.
        meaning: one line: what it is, with its unit.
    """

    kind: type
    low: float
    high: float
    meaning: str = ""

    def check(self, key: str, value: Any) -> None:
        """Raises PayloadError naming ``key`` unless ``value`` is of :attr:`kind`, finite and in range."""
        types = (int,) if self.kind is int else (int, float)
        if isinstance(value, bool) or not isinstance(value, types) or not math.isfinite(value):
            raise PayloadError(f"metric '{key}' = {short(value)} is not a finite {self.kind.__name__}")
        if not self.low <= value <= self.high:
            raise PayloadError(f"metric '{key}' = {short(value)} is outside [{self.low:g}, {self.high:g}]")


def count(meaning: str) -> MetricSpec:
    """A count of examples, classes or parameters: an int >= 0 (further bounded by :func:`check_metrics`)."""
    return MetricSpec(int, 0, 2**63 - 1, meaning)


def fraction(meaning: str) -> MetricSpec:
    """An accuracy or share: a number in [0, 1], never percent."""
    return MetricSpec(float, 0.0, 1.0, meaning)


def seconds(meaning: str) -> MetricSpec:
    """A duration in seconds, in [0, :data:`MAX_SECONDS`]."""
    return MetricSpec(float, 0.0, MAX_SECONDS, meaning)


def loss(meaning: str) -> MetricSpec:
    """A loss value, in [-:data:`MAX_LOSS`, :data:`MAX_LOSS`]."""
    return MetricSpec(float, -MAX_LOSS, MAX_LOSS, meaning)


#: keys every reply may carry: the client runtime adds them to every message's metrics
ANY_MESSAGE: dict[str, MetricSpec] = {
    PARTITION_ID: MetricSpec(int, 0, 2**31 - 1, "the client's partition (node config partition-id)"),
    # records restored or rolled back in one message: a handful at most (model, projector, ...)
    "state-restores": MetricSpec(int, 0, 1000, "state records read back from state-dir in this message"),
    "state-rollbacks": MetricSpec(int, 0, 1000, "state records rolled back to an earlier round in this message"),
    "app-start-seconds": seconds("process start to the handler (first message of a process), seconds"),
    "handler-seconds": seconds("the method's handler, seconds"),
    "data-seconds": seconds("loading the partition, seconds"),
    GPU_PEAK: MetricSpec(float, 0.0, 1e7, "peak CUDA memory allocated while handling the message, MiB"),
}

#: keys of the replies of one message category, beside :data:`ANY_MESSAGE`
CATEGORY_METRICS: dict[str, dict[str, MetricSpec]] = {
    "query": {
        "num-train": count("local training examples"),
        "num-test": count("local test examples"),
        "num-partitions": MetricSpec(int, 1, 2**31 - 1, "partitions of the federation (node config)"),
        "dp-noise-multiplier": MetricSpec(float, 0.0, 1e3, "DP-SGD's σ calibrated for this client (run config dp.*)"),
        "dp-release-noise-multiplier": MetricSpec(
            float, 0.0, 1e3, "a payload release's σ calibrated for this client (0: none; run config dp.*)"
        ),
    },
    "train": {
        "num-examples": count("training examples of this round"),
        "train-loss": loss("mean training loss of the last local epoch"),
        "train-acc": fraction("training accuracy of the last local epoch"),
        "train-seconds": seconds("local training (and the payload's computation), seconds"),
        "dp-epsilon": MetricSpec(float, 0.0, 1e9, "ε the client's privacy ledger has spent at dp.delta, PLD"),
        "dp-epsilon-rdp": MetricSpec(float, 0.0, 1e12, "the same ε by the RDP accountant (looser)"),
        "dp-noise-multiplier": MetricSpec(float, 0.0, 1e3, "DP-SGD's σ (noise std σ·dp.clip-norm a step)"),
        "dp-release-noise-multiplier": MetricSpec(float, 0.0, 1e3, "a release's σ (std σ·√2·dp.payload-clip); 0: none"),
        "dp-sample-rate": fraction("DP-SGD's Poisson sampling rate q = batch-size / n"),
        "dp-steps": count("DP-SGD steps of this message"),
        "dp-releases": count("payload releases of this message"),
        "dp-trainings-total": count("local trainings in the client's privacy ledger, over every run"),
        "dp-releases-total": count("payload releases in the client's privacy ledger, over every run"),
        "dp-clip-norm": MetricSpec(
            float, 0.0, 1e9, "DP-SGD's per-example gradient L2 bound (dp.clip-norm; adaptive: where it ended)"
        ),
        "dp-count-noise": MetricSpec(float, 0.0, 1e9, "dp.adaptive-clip: σ_b, noise std of each step's clip count"),
        "dp-gradient-noise-multiplier": MetricSpec(
            float, 0.0, 1e3, "dp.adaptive-clip: σ_Δ of the gradients (σ pays for them and the count together)"
        ),
        "dp-payload-clip": MetricSpec(float, 0.0, 1e9, "a release's per-example row L2 bound (dp.payload-clip)"),
        "dp-rounds-left": count("whole rounds the client's dp.epsilon budget still allows"),
    },
    "evaluate": {
        "num-examples": count("local test examples evaluated"),
        "test-correct": count("correctly classified test examples"),
        "test-acc": fraction("test accuracy of the personal model"),
        "test-loss": loss("mean test cross-entropy of the personal model"),
    },
}


def declared_metrics(
    category: str, method_metrics: Mapping[str, Mapping[str, MetricSpec]], eval_after_training: bool
) -> dict[str, MetricSpec]:
    """Every key a reply of ``category`` may carry, with its spec.

    Args:
        category: ``query``, ``train`` or ``evaluate`` (a message type's part before the dot).
        method_metrics: the method's own keys by category (``Method.metrics``).
        eval_after_training: the method asks sampled clients to evaluate in their train reply,
            so train replies may also carry the evaluate keys prefixed with :data:`EVAL_PREFIX`.
    """
    declared = {**ANY_MESSAGE, **CATEGORY_METRICS.get(category, {}), **method_metrics.get(category, {})}
    if category == "train" and eval_after_training:
        evaluate = {**CATEGORY_METRICS["evaluate"], **method_metrics.get("evaluate", {})}
        declared.update({EVAL_PREFIX + k: spec for k, spec in evaluate.items()})
    return declared


def check_metrics(
    metrics: Mapping[str, Any],
    declared: Mapping[str, MetricSpec],
    known: Mapping[str, Any] | None,
    category: str,
    dataset_size: int,
) -> None:
    """Reject a reply's metrics that the server could not safely use.

    First the keys: no more than ``declared`` has (checked before anything else, so a reply with
    thousands of keys costs nothing), none undeclared. Then each value against its
    :class:`MetricSpec` (integer or number, finite, in range). Then the example counts against
    what is known: at the handshake (``known`` None) ``num-train`` + ``num-test`` at most
    ``dataset_size`` (the partitioned pool's size, ``RunConfig.pool_size``), and ``num-partitions``
    at most that too; later within what the client reported at the handshake (``known``): a train reply's
    ``num-examples`` at most its ``num-train``, an evaluation's ``num-examples`` at most its
    ``num-test`` and ``test-correct`` at most ``num-examples`` (also for the ``eval-`` metrics
    inside a train reply), so one client cannot claim to outweigh the others in a
    sample-weighted mean.

    Raises:
        PayloadError: naming the metric (a few names of a long list: ``common.payload.names``).
    """
    undeclared = [k for k in metrics if k not in declared] if len(metrics) <= len(declared) else list(metrics)
    if len(metrics) > len(declared) or undeclared:
        raise PayloadError(
            f"{len(metrics)} metrics with {len(undeclared)} undeclared key(s) ({names(undeclared)}); "
            f"a {category} reply may carry only {names(declared)}"
        )
    for key, value in metrics.items():
        declared[key].check(key, value)
    if known is None:
        claimed = metrics.get("num-train", 0) + metrics.get("num-test", 0)
        if claimed > dataset_size:
            raise PayloadError(
                f"metrics 'num-train' + 'num-test' = {claimed} exceed the dataset's {dataset_size} examples"
            )
        if metrics.get("num-partitions", 1) > dataset_size:
            raise PayloadError(
                f"metric 'num-partitions' = {metrics['num-partitions']} exceeds the dataset's {dataset_size} examples"
            )
        return
    limits = {
        "num-examples": known.get("num-train" if category == "train" else "num-test"),
        EVAL_PREFIX + "num-examples": known.get("num-test"),
    }
    for key, limit in limits.items():
        if key in metrics and limit is not None and metrics[key] > limit:
            raise PayloadError(
                f"metric '{key}' = {metrics[key]} exceeds the {limit} examples the client reported at the handshake"
            )
    for prefix in ("", EVAL_PREFIX):
        correct, total = metrics.get(prefix + "test-correct"), metrics.get(prefix + "num-examples")
        if correct is not None and total is not None and correct > total:
            raise PayloadError(f"metric '{prefix}test-correct' = {correct} exceeds '{prefix}num-examples' = {total}")
