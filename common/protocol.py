"""The wire protocol between the ServerApp and the ClientApps, defined once for both halves: every
message type, record name, config key and structural metric key (``tests/test_protocol.py`` checks that
no other module defines one).

A message to a client carries the method's payload (ArrayRecord :data:`PAYLOAD`) and a
ConfigRecord :data:`CONFIG_RECORD` of scalar settings: the keys below, and for a train instruction the
training settings of :func:`train_config` (plus a method's own, e.g. FedKD's ``kd-temperature``). A
reply carries the payload and a MetricRecord of the keys ``common.metrics`` declares, built with
:func:`metric_values`. A client keeps its state under record names such as :func:`snapshot_name`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from common.config import RunConfig

#: message types, ``<category>[.<action>]``: evaluate the personal model, answer the handshake's query,
#: train; MH-pFedHNGD's training of the public global model; FedRE's ``head-source = "client-0"`` head upload
EVALUATE_MESSAGE, QUERY, TRAIN, TRAIN_GLOBAL, TRAIN_HEAD = "evaluate", "query", "train", "train.global", "train.head"
#: every message type a method may send: the ClientApp registers a handler for each (``client_app.app``,
#: which must not import the methods to know them); the registry refuses a method that sends another
#: (``methods.registry``)
MESSAGE_TYPES = (EVALUATE_MESSAGE, QUERY, TRAIN, TRAIN_GLOBAL, TRAIN_HEAD)
#: the ArrayRecord that carries a method's payload, in both directions (``common.payload``)
PAYLOAD = "payload"
#: a payload: array name -> array (the message's arrays after schema validation)
Arrays = dict[str, np.ndarray]
#: what a client handler returns: (reply payload, scalar metrics)
Reply = tuple[Arrays, dict[str, Any]]
#: metric key every reply carries (the client runtime adds it)
PARTITION_ID = "partition-id"
#: prefix of evaluation metrics carried in a train reply (a method that evaluates in its train replies)
EVAL_PREFIX = "eval-"
#: metric of a reply from a client on a GPU: its peak CUDA memory in the message (``common.gpu``)
GPU_PEAK = "gpu-peak-mib"
#: the ConfigRecord in which a reply says where it ran: its GPU (key ``name``, from a GPU only) and its
#: Ray node (key ``ray-node``, from a simulation's actor only)
DEVICE_RECORD = "device"
DEVICE_KEYS = ("name", "ray-node")
#: the ConfigRecord in which a query reply says instead of its sizes that the client cannot serve the
#: run: its configuration or data error (key ``error``, a string; ``engine.roster``), and its
#: ``partition-id`` when the node config has one
CONFIG_ERROR_RECORD, CONFIG_ERROR_KEY = "config-error", "error"
#: the ConfigRecord of a message to a client
CONFIG_RECORD = "config"
#: config key: the round a message belongs to (a generalisation phase's step for its messages)
SERVER_ROUND = "server-round"
#: config key: the key of the run's client state (a resumed run sends its first run's; ``common.runtime``)
STATE_KEY = "state-key"
#: config key: the run folder's client-state folder, for clients without a node config ``state-dir``
CLIENT_STATE_DIR = "client-state-dir"
#: config key: a state of the client's own beside its run state (``common.runtime.ClientRuntime``:
#: a held-out client's generalisation phase)
STATE_SCOPE = "state-scope"
#: config key (train): evaluate the just-trained personal model in the same reply
EVALUATE = "evaluate"
#: config key (train): keep the just-trained personal model for the privacy evaluation (:func:`snapshot_name`)
RECORD = "record"
#: config key (train): the server does not know this node yet (run config ``handshake = "sampled"``): the reply
#: also answers the handshake's query (its metrics beside the train metrics; ``engine.roster.Roster.answered``)
HANDSHAKE = "handshake"


def train_config(cfg: RunConfig, server_round: int, evaluate: bool = False) -> dict[str, Any]:
    """The training settings every train instruction carries (not counted as payload): the round,
    ``local-epochs``, ``batch-size``, ``batch-order``, ``lr``, ``momentum``, ``weight-decay``,
    ``clip-norm``, ``precision`` of ``cfg``, :data:`EVALUATE` (evaluate right after training) and
    :data:`RECORD` (keep a copy of the trained personal model for the privacy evaluation:
    ``record-payloads``)."""
    return {
        SERVER_ROUND: server_round,
        "local-epochs": cfg.local_epochs,
        "batch-size": cfg.batch_size,
        "batch-order": cfg.batch_order,
        "lr": cfg.lr,
        "momentum": cfg.momentum,
        "weight-decay": cfg.weight_decay,
        "clip-norm": cfg.clip_norm,
        "precision": cfg.precision,
        EVALUATE: evaluate,
        RECORD: cfg.records_round(server_round),
    }


def metric_values(values: Mapping[str, Any]) -> dict[str, Any]:
    """MetricRecord accepts only Python int/float (and lists): cast numpy scalars, drop the rest."""
    out = {}
    for k, v in values.items():
        if isinstance(v, (bool, np.bool_, int, np.integer)):
            out[k] = int(v)
        elif isinstance(v, (float, np.floating)):
            out[k] = float(v)
        elif isinstance(v, list):
            out[k] = v
    return out


def snapshot_name(server_round: int) -> str:
    """The client state record holding the personal model as it was after training round ``server_round``."""
    return f"model-round-{server_round}"


def start_snapshot_name(server_round: int) -> str:
    """The client state record holding the whole module local training optimises in round ``server_round``
    (the personal model with its companions: FML's meme model, FedKD's mentee and alignment map, FedMRL's
    fused model), as it was before that training."""
    return f"training-module-round-{server_round}-start"
