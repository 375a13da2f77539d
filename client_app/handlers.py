"""The ClientApp's handlers: thin functions that route each message to the method's client procedure.

:mod:`client_app.app` registers :func:`handle` for every message type any registered method uses
(``train``, ``evaluate``, ``query``, ``train.<action>`` ...) and imports this module at a process's first
message. The handler validates the incoming payload against the method's schema, calls the procedure,
stores nothing itself (procedures persist their state through the runtime) and replies with the payload
plus metrics (with ``partition-id``); a query it cannot answer for a configuration or data error is
answered with that error.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import time

import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict

from common import gpu
from common.data import load_client_data
from common.datasets import DATASETS
from common.errors import ConfigError
from common.metrics import MAX_ERROR_CHARS
from common.payload import read_payload, short
from common.protocol import (
    CLIENT_STATE_DIR,
    CONFIG_ERROR_KEY,
    CONFIG_ERROR_RECORD,
    CONFIG_RECORD,
    DEVICE_RECORD,
    EVAL_PREFIX,
    EVALUATE,
    HANDSHAKE,
    PARTITION_ID,
    RECORD,
    SERVER_ROUND,
    STATE_KEY,
    STATE_SCOPE,
    metric_values,
    snapshot_name,
)
from common.runtime import ClientRuntime
from methods.registry import client_procedure

log = logging.getLogger("flwr." + __name__)  # streamed with Flower's own log
#: the C library when it is glibc (the one with ``malloc_trim``), else None
_libc: ctypes.CDLL | None = ctypes.CDLL(None)
if not hasattr(_libc, "malloc_trim"):
    _libc = None
_first_message = [True]


def process_age() -> float:
    """Seconds since this process started (Linux ``/proc``; 0.0 where that is not available)."""
    try:
        with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
            started = int(stat.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
            return max(0.0, float(uptime.read().split()[0]) - started)
    except (OSError, ValueError, IndexError):
        return 0.0


def startup_metrics() -> dict[str, float]:
    """``app-start-seconds``: process start to this handler for the process's first message
    (interpreter, imports, app load: what every deployed message pays, since Flower starts a
    fresh ClientApp process per message), 0 for later messages of a long-lived process."""
    first, _first_message[0] = _first_message[0], False
    return {"app-start-seconds": process_age() if first else 0.0}


def ray_node() -> str | None:
    """The id of the Ray node this ClientApp runs on (hex), or None outside Ray. Ray is only asked
    when this process already imported it (a simulation's actor): a deployed ClientApp never does."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    return ray.get_runtime_context().get_node_id()


def handle(msg: Message, context: Context) -> Message:
    """Run the method's handler for ``msg`` and build the reply; a message that answers the handshake's
    query (:func:`answers_query`) and meets a configuration or data error (a ConfigError: the run or
    node config, the data files, the partitioner) is answered with that error instead
    (:func:`config_error_reply`), so the server learns it at the handshake.

    Raises:
        ConfigError, PayloadError, GPUShareExceeded: from any other message: turned into an error
            reply by Flower; the server logs and drops it, the round goes on.
    """
    try:
        return handle_message(msg, context)
    except ConfigError as exc:
        if not answers_query(msg):
            raise
        return config_error_reply(msg, context, exc)
    finally:
        return_freed_memory()


def answers_query(msg: Message) -> bool:
    """Whether ``msg`` asks for the handshake's answer: a query, or a train message to a node the server
    does not know yet (message config :data:`common.protocol.HANDSHAKE`)."""
    if msg.metadata.message_type == "query":
        return True
    records = msg.content.config_records
    return msg.metadata.message_type.startswith("train") and bool(
        CONFIG_RECORD in records and records[CONFIG_RECORD].get(HANDSHAKE, False)
    )


def return_freed_memory() -> None:
    """Hand the memory this message freed back to the operating system (glibc's ``malloc_trim``; a
    no-op without glibc). A simulated ClientApp serves many clients in turn: glibc keeps what one
    client's model, gradients and batches freed in its heap, fragmented, so without this each actor
    grows by hundreds of MiB over a few messages (FedTGP ``htfe2``, CIFAR-10: 527 -> 677 MiB USS
    after the first 7 train messages of one process, 433 -> 498 MiB with it). It costs about 0.1 ms
    when nothing was freed and some tens of ms per GiB it returns."""
    if _libc is not None:
        _libc.malloc_trim(0)


def config_error_reply(msg: Message, context: Context, error: ConfigError) -> Message:
    """The reply to ``msg`` (a query, or a train message that answers it: :func:`answers_query`) of a
    client that cannot serve the run: one ConfigRecord ``config-error`` whose key ``error`` holds the
    error's text, cut to ``MAX_ERROR_CHARS`` (``common.metrics``), and key ``partition-id`` the node
    config's, when it has an integer one. ``engine.roster.Roster`` decides whether it ends the run."""
    record = {CONFIG_ERROR_KEY: short(str(error), MAX_ERROR_CHARS)}
    pid = context.node_config.get(PARTITION_ID)
    if isinstance(pid, int) and not isinstance(pid, bool):
        record[PARTITION_ID] = pid
    return Message(RecordDict({CONFIG_ERROR_RECORD: ConfigRecord(record)}), reply_to=msg)


def handle_message(msg: Message, context: Context) -> Message:
    """Run the method's handler for ``msg`` and build the reply.

    On a GPU the reply also carries the message's peak CUDA memory (metric ``gpu-peak-mib``) and
    the device's name (ConfigRecord ``device``, key ``name``), see ``common.gpu``; in a Ray
    simulation the ``device`` record names the Ray node too (key ``ray-node``, :func:`ray_node`).

    Raises:
        ConfigError, PayloadError, GPUShareExceeded: see :func:`handle`.
    """
    started = startup_metrics()
    records = msg.content.config_records
    config = dict(records[CONFIG_RECORD]) if CONFIG_RECORD in records else {}
    message_type = msg.metadata.message_type
    client = ClientRuntime(
        context,
        str(config.get(STATE_KEY, "in-memory")),
        int(config[SERVER_ROUND]) if SERVER_ROUND in config else None,
        str(config.get(CLIENT_STATE_DIR, "")),
        trains=message_type.startswith("train"),
        scope=str(config.get(STATE_SCOPE, "")),
    )
    procedure = client_procedure(client.cfg)
    trains = message_type.startswith("train")
    if trains or message_type == "query":
        client.dp = procedure.dp_plan(client)  # None with DP off; calibrated per client (common.dp)
    down, up = procedure.schemas[message_type]
    payload = read_payload(msg.content, down)
    down.validate(payload, {"C": DATASETS[client.cfg.dataset].num_classes, "d": client.cfg.representation_dim})
    cached = load_client_data.cache_info().currsize
    gpu.begin_message(client.device)
    start = time.perf_counter()
    try:
        handshake = {}
        if trains and config.get(HANDSHAKE):
            # a node the server does not know yet answers the handshake first (a data error fails here, before
            # training), from the partition training reads: loaded once, not read for its sizes and again
            _ = client.data
            handshake = procedure.query(client, {}, config)[1]
        if trains:
            # with DP on: a message whose training and release the budget cannot take ends here, before any
            client.check_budget(1, procedure.dp_releases)
        arrays, metrics = getattr(procedure, message_type.replace(".", "_"))(client, payload, config)
        metrics = {**handshake, **metrics}
        metrics.update(started, **{"handler-seconds": time.perf_counter() - start})
        if trains and client.dp is not None:
            # the loss and accuracy of the training examples are not noised: they stay on the client
            metrics = {k: v for k, v in metrics.items() if k not in ("train-loss", "train-acc")}
            metrics.update(client.privacy_metrics())
        if config.get(RECORD) and trains:
            client.keep_snapshot(snapshot_name(client.server_round or 0), client.model)
        if config.get(EVALUATE):  # evaluate the just-trained personal model in the same reply
            metrics.update({EVAL_PREFIX + k: v for k, v in procedure.evaluate(client, {}, config)[1].items()})
    except torch.cuda.OutOfMemoryError as exc:
        raise gpu.share_exceeded(exc, client.partition_id, client.device, client.gpu_share) from exc
    if load_client_data.cache_info().currsize > cached:  # this message loaded the partition
        metrics["data-seconds"] = client.data.load_seconds
    usage, device_name = gpu.report(client.device)
    metrics.update(usage)
    content = up.to_record(arrays)
    where = {"name": device_name, "ray-node": ray_node()}
    if any(where.values()):
        content[DEVICE_RECORD] = ConfigRecord({k: v for k, v in where.items() if v})
    content["metrics"] = MetricRecord(
        metric_values(
            {
                **metrics,
                PARTITION_ID: client.partition_id,
                "state-restores": client.state_restores,
                "state-rollbacks": client.state_rollbacks,
            }
        )
    )
    return Message(content, reply_to=msg)
