"""Per-message client runtime: config, data, the personal model and its persistence, device.

Only ``context.state`` survives between rounds for a client, in simulation and deployment
alike; module globals are shared between virtual clients (simulation) or reset every message
(deployment), so they hold read-only caches only (the decoded data, the parsed config).
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from functools import cached_property, lru_cache
from pathlib import Path

import torch
from flwr.app import Context
from torch import nn

from common import gpu
from common.config import ConfigError, RunConfig
from common.data import ClientData, DataSpec, load_client_data, partition_sizes, torch_seed
from common.datasets import DATASETS, DatasetInfo, with_recipe
from common.dp import EPSILON_KEY, LEDGER_FOLDER, DPOptions, DPPlan, PrivacyLedger, epsilon_of
from common.heldout import architecture_for
from common.state_store import StateStore, safe_name
from models.base import SplitModel
from models.groups import MODEL_GROUPS

MODEL_STATE = "model"
#: node config key: the most ε this node's examples may spend, whatever the run config's ``dp.epsilon``
NODE_EPSILON = "dp-epsilon-max"
#: with ``dp.adaptive-clip``: the state record of the clip a model's DP-SGD left off at, after the model's record
CLIP_SUFFIX = "-dp-clip"

log = logging.getLogger("flwr." + __name__)


class ClipState(nn.Module):
    """The clip a model's adaptive DP-SGD left off at (``dp.adaptive-clip``), kept between rounds as a state
    record, so that a resumed server's repeated round rolls it back with the model (``common.state_store``).

    Args:
        clip: C, the per-example gradient L2 bound; held as the float64 scalar buffer ``clip_norm``.
    """

    def __init__(self, clip: float) -> None:
        super().__init__()
        self.register_buffer("clip_norm", torch.tensor(float(clip), dtype=torch.float64))


@lru_cache(maxsize=8)
def _parse(items: tuple) -> RunConfig:
    return RunConfig.from_dict(dict(items))


def parse_run_config(run_config) -> RunConfig:
    """The validated :class:`RunConfig` of a Flower ``run_config`` (parsed once per process)."""
    return _parse(tuple(sorted(run_config.items())))


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/mheterofl/partitions`` (``~/.cache/...`` without it): decoded partitions of
    nodes without a ``cache-dir`` or ``state-dir``, e.g. every simulated client."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mheterofl" / "partitions"


def pick_device(name: str) -> torch.device:
    """``auto``: the GPU when one is visible (granted to this ClientApp), else the CPU.

    Raises:
        ConfigError: for ``cuda`` when no GPU is visible.
    """
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "run config key 'device' = 'cuda' but no GPU is visible to this ClientApp; "
            "allowed values are 'auto', 'cpu', 'cuda' (in simulation grant GPUs with "
            "client-resources-num-gpus > 0)"
        )
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda")


class ClientRuntime:
    """What a client procedure needs for one message.

    Node config keys: ``partition-id`` (required), ``num-partitions`` (default: run config
    ``num-clients``; required when that is 0), ``data-dir`` (optional, overrides the run config's ``data-dir``),
    ``state-dir`` (optional: a folder that holds this node's client state instead of
    ``context.state``, so it survives a SuperNode restart, which empties ``context.state``, and
    no process keeps every client's models in memory; default: run config ``state-dir``, which
    gives simulated clients the same, so a resumed simulation continues every client exactly),
    ``cache-dir`` (optional: a folder for the decoded partition, written once and memory-mapped
    by later messages' processes and runs; default ``<node state-dir>/partition-cache`` when the
    node has a ``state-dir``, else :func:`default_cache_dir`), ``gpu-memory-fraction`` (optional:
    the share of the GPU's memory this node's ClientApps may allocate, see ``common.gpu``),
    ``dp-epsilon-max`` (optional: the most ε this node's examples may spend, whatever the run config's
    ``dp.epsilon``; :meth:`privacy_budget`).

    Args:
        context: the message's Flower context.
        state_key: names the run whose state this is (sent by the server in every message
            config as ``state-key``); state lives in ``<state-dir>/<state_key>/partition-<id>/``.
        server_round: the message's ``server-round`` (None when its config has none): stamps the
            records it stores and tells which records on disk are ahead of the server (see
            :meth:`store` and :meth:`restore`).
        run_state_dir: where a client without any ``state-dir`` keeps its state
            (``<run_state_dir>/partition-<id>/``): the simulation's server sends its run folder's
            ``client-state`` (message config ``client-state-dir``); empty: ``context.state``.
        trains: True for a train message (it trains the round's model), False for the others
            (evaluate), which come after the round's training (see :meth:`restore`).
        scope: a state of its own beside the run's (message config ``state-scope``; empty: the run's):
            its records live in ``<state folder>/<scope>/`` and under ``<scope>/<name>`` in
            ``context.state``, so a held-out client's generalisation phase starts from nothing and
            leaves the run's state alone (``engine.heldout_phase``).
    """

    def __init__(
        self,
        context: Context,
        state_key: str = "in-memory",
        server_round: int | None = None,
        run_state_dir: str = "",
        trains: bool = True,
        scope: str = "",
    ) -> None:
        self.context = context
        self.scope = scope
        #: the message's server round (None: none given): stamps the state on disk
        self.server_round = server_round
        self.cfg = parse_run_config(context.run_config)
        node = context.node_config
        if "partition-id" not in node:
            raise ConfigError(
                "node config lacks 'partition-id' (flower-supernode --node-config \"partition-id=0 num-partitions=N\")"
            )
        self.partition_id = int(node["partition-id"])
        if "num-partitions" not in node and not self.cfg.num_clients:
            raise ConfigError(
                "node config lacks 'num-partitions' and run config key 'num-clients' = 0 (follow "
                'the federation): start the SuperNode with --node-config "partition-id=0 '
                'num-partitions=N" or set num-clients=N'
            )
        self.spec = DataSpec.from_config(
            self.cfg, int(node.get("num-partitions", self.cfg.num_clients)), node.get("data-dir")
        )
        self.device = pick_device(self.cfg.device)
        #: the share of the GPU's memory this ClientApp may allocate (None: no cap; see common.gpu)
        self.gpu_share = gpu.gpu_share(node) if self.device.type == "cuda" else None
        if self.gpu_share is not None:
            gpu.limit_memory(self.device, self.gpu_share)
        state_dir = node.get("state-dir") or self.cfg.state_dir
        partition = f"partition-{self.partition_id}"
        if state_dir:
            self.state_dir: Path | None = Path(str(state_dir)) / safe_name(state_key) / partition
        else:  # the run folder's client-state (a simulation without state-dir), or context.state
            self.state_dir = Path(run_state_dir) / partition if run_state_dir else None
        if scope and self.state_dir is not None:
            self.state_dir = self.state_dir / safe_name(scope)
        # the privacy ledger belongs to the client's examples, not to a run: in its own state folder, outside
        # the state key and scope the server sends (common.dp.PrivacyLedger)
        ledger_root = Path(str(state_dir)) if state_dir else Path(run_state_dir) if run_state_dir else None
        #: the file of this client's privacy ledger (None: kept in ``context.state``)
        self.ledger_path = (
            ledger_root / LEDGER_FOLDER / f"{safe_name(self.spec.dataset)}-{partition}.json" if ledger_root else None
        )
        #: where the decoded partition is cached on disk
        self.cache_dir = str(
            node.get("cache-dir")
            or (Path(str(node["state-dir"])) / "partition-cache" if node.get("state-dir") else default_cache_dir())
        )
        #: the client's state records (``common.state_store``)
        self.state = StateStore(context, self.state_dir, scope, server_round, trains, self.partition_id)
        #: objects the handlers of this one message share (e.g. FedMRL's just-trained small model
        #: for the evaluation in the same train reply); gone with the message
        self.scratch: dict[str, object] = {}
        #: this client's DP mechanisms (run config ``dp.epsilon`` > 0), set by the ClientApp for its
        #: query and train messages (``common.dp.make_plan``); None: DP off
        self.dp: DPPlan | None = None
        #: local trainings and payload releases this message has charged to the privacy ledger
        self.spent_now = [0, 0]
        #: with ``dp.adaptive-clip``: the clip this message's DP-SGD ended at (None: no adaptive training yet)
        self.clip_now: float | None = None

    @cached_property
    def info(self) -> DatasetInfo:
        """The dataset's facts with the run's augmentation and normalisation (run config keys
        ``augment``, ``normalize``); loads no data."""
        return with_recipe(DATASETS[self.spec.dataset], self.cfg.augment, self.cfg.normalize)

    @cached_property
    def data(self) -> ClientData:
        """This client's decoded partition (cached per process and on disk), with :attr:`info`."""
        return replace(load_client_data(self.spec, self.partition_id, self.cache_dir), info=self.info)

    def data_sizes(self) -> tuple[int, int]:
        """(local train, local test) example counts: from the cache file, else by loading (decoding and
        checking) the partition once (:func:`partition_sizes`), so faulty data fail at the handshake."""
        if "data" in self.__dict__:
            return len(self.data.train_y), len(self.data.test_y)
        return partition_sizes(self.spec, self.partition_id, self.cache_dir)

    def initial_model(self) -> SplitModel:
        """The personal model as initialised from the model group and seed (run config ``init``), on
        the current default device (the meta device inside ``with torch.device("meta")``): what a new
        client starts from, built anew on each call."""
        info = self.info
        return MODEL_GROUPS[self.cfg.model_group].build(
            self.partition_id,
            info.num_classes,
            info.channels,
            info.image_size,
            self.cfg.seed,
            self.cfg.feature_dim,
            identical=self.cfg.init == "identical",
            architecture=architecture_for(self.cfg, self.partition_id, self.spec.num_partitions),
        )

    @cached_property
    def model(self) -> SplitModel:
        """The personal model: restored from state, else built from the model group and seed (run
        config ``init``); on device.

        A model with a stored state needs no initialisation, which costs more than loading the
        state (HtCNN7 28 ms, ResNet-18 90 ms, ResNet-152 0.6 s on one CPU thread): its modules are
        built on the meta device and take the loaded tensors as their own in :meth:`restore`, which
        sets every parameter and buffer (a model with a buffer outside its state dict is built in full).
        Without a usable state it is built and initialised as the seed says; a client that has none
        (:meth:`common.state_store.StateStore.holds`: its first message) skips the skeleton.
        """
        build = self.initial_model
        if not self.state.holds(MODEL_STATE):  # a new client: nothing to restore, so no skeleton to build
            return build().to(self.device)
        with torch.device("meta"):
            skeleton = build()
        if set(dict(skeleton.named_buffers())) <= set(skeleton.state_dict()):
            if self.restore(MODEL_STATE, skeleton):
                return skeleton.to(self.device)
            return build().to(self.device)
        model = build()
        self.restore(MODEL_STATE, model)
        return model.to(self.device)

    def restore(self, name: str, module: nn.Module) -> bool:
        """Load ``module`` from this client's state record ``name``; True when found
        (:meth:`common.state_store.StateStore.restore`: rolled back when ahead of the server)."""
        return self.state.restore(name, module)

    def store(self, name: str, module: nn.Module) -> None:
        """Save ``module`` as state record ``name`` (:meth:`common.state_store.StateStore.store`).

        Raises:
            RuntimeError: ``module`` has a non-finite float entry; nothing is stored.
        """
        self.state.store(name, module)

    def keep_snapshot(self, name: str, module: nn.Module) -> None:
        """Keep ``module`` as state record ``name`` for the privacy evaluation's white-box attacker (run
        config ``record-payloads``; :func:`common.protocol.snapshot_name`). Only a client with a state folder
        keeps it (a simulation's run folder, a node's ``state-dir``): in ``context.state`` every copy would
        ride along with every later message; without one a warning says what is not kept.

        Raises:
            RuntimeError: as :meth:`store`.
        """
        if self.state_dir is None:
            log.warning(
                "partition %d: no state folder (node config 'state-dir'), so '%s' is not kept for run config key "
                "'record-payloads'",
                self.partition_id,
                name,
            )
            return
        self.store(name, module)

    @property
    def state_restores(self) -> int:
        """State records read back from ``state-dir`` in this message."""
        return self.state.restores

    @property
    def state_rollbacks(self) -> int:
        """State records rolled back in this message because they were ahead of the server."""
        return self.state.rollbacks

    @property
    def ledger(self) -> PrivacyLedger:
        """The budget this client has spent on its examples so far, over every run (``common.dp.PrivacyLedger``)."""
        return PrivacyLedger(self.ledger_path, self.context.state)

    def privacy_budget(self) -> tuple[DPOptions, str]:
        """The run's ``dp.*`` options with ε lowered to the node config's :data:`NODE_EPSILON` where that is
        smaller (the node's own cap, which no run config raises), and the key that sets the ε in force.

        Raises:
            ConfigError: the node config's cap is not a number > 0.
        """
        options, cap = self.dp.options, self.context.node_config.get(NODE_EPSILON)
        if cap is None:
            return options, EPSILON_KEY
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0:
            raise ConfigError(f"node config key '{NODE_EPSILON}' = {cap!r}: give a number > 0 (an ε)")
        if cap < options.epsilon:
            return replace(options, epsilon=float(cap)), f"node config key '{NODE_EPSILON}'"
        return options, EPSILON_KEY

    def check_budget(self, trainings: int, releases: int) -> None:
        """Before a train message, with DP on: refuse when its ``trainings`` local trainings and ``releases``
        payload releases would take the ledger past ``dp.epsilon``, so no training starts that could not be sent.

        Raises:
            BudgetSpent: naming the ledger's file; the reply becomes an error the server logs and drops
                (and the server samples the client no more).
            ConfigError: the ledger is unreadable (``common.dp.PrivacyLedger.read``).
        """
        if self.dp is not None:
            self.ledger.check(self.dp.spend(trainings, releases), *self._budget_args())

    def spend_privacy(self, trainings: int = 0, releases: int = 0) -> None:
        """With DP on, charge ``trainings`` DP-SGD trainings and ``releases`` payload releases to the ledger,
        durably, before they run (nothing with DP off).

        Raises:
            BudgetSpent: they would take the ledger past ``dp.epsilon`` (another message spent it meanwhile).
        """
        if self.dp is None:
            return
        self.ledger.charge(self.dp.spend(trainings, releases), trainings, releases, *self._budget_args())
        self.spent_now[0] += trainings
        self.spent_now[1] += releases

    def dp_clip_norm(self, record: str = MODEL_STATE) -> float | None:
        """With ``dp.adaptive-clip``: the clip the DP-SGD of the model kept as state record ``record`` starts
        from, where its last training left it (record ``<record>-dp-clip``), else ``dp.clip-norm``. None
        without it (DP-SGD clips at ``dp.clip-norm``) or with DP off."""
        if self.dp is None or not self.dp.options.adaptive_clip:
            return None
        state = ClipState(self.dp.options.clip_norm)
        self.restore(record + CLIP_SUFFIX, state)
        return float(state.clip_norm)

    def keep_dp_clip_norm(self, clip: float, record: str = MODEL_STATE) -> None:
        """Store ``clip``, where the adaptive DP-SGD of ``record``'s model ended, for its next training, and
        report it as this message's ``dp-clip-norm``.

        Raises:
            RuntimeError: ``clip`` is not finite (``common.state_store.StateStore.store``); nothing is stored.
        """
        self.store(record + CLIP_SUFFIX, ClipState(clip))
        self.clip_now = clip

    def _budget_args(self) -> tuple[DPOptions, int, str]:
        options, key = self.privacy_budget()
        return options, self.partition_id, key

    def privacy_metrics(self) -> dict[str, float]:
        """What a train reply says of its privacy (empty with DP off): ``dp-epsilon`` and ``dp-epsilon-rdp`` spent
        so far by the ledger at ``dp.delta`` (PLD, RDP), ``dp-noise-multiplier`` and
        ``dp-release-noise-multiplier`` (σ of DP-SGD and of a release), ``dp-sample-rate`` (q),
        ``dp-steps`` and ``dp-releases`` of this message and ``dp-trainings-total`` and ``dp-releases-total``
        of the ledger, ``dp-clip-norm`` (with ``dp.adaptive-clip``: where this message's training left it) and
        ``dp-payload-clip``, and ``dp-rounds-left`` (whole rounds the budget still allows). With
        ``dp.adaptive-clip`` also ``dp-count-noise`` (σ_b) and ``dp-gradient-noise-multiplier`` (σ_Δ: the
        gradients' noise, above σ, which the accountant charges for gradients and count together)."""
        if self.dp is None:
            return {}
        dp = self.dp
        events, trainings, releases = self.ledger.read()
        adaptive = {}
        if dp.options.adaptive_clip:
            adaptive = {"dp-count-noise": dp.count_noise, "dp-gradient-noise-multiplier": dp.gradient_noise_multiplier}
        return {
            "dp-epsilon": epsilon_of(events, dp.options.delta),
            "dp-epsilon-rdp": epsilon_of(events, dp.options.delta, "rdp"),
            "dp-noise-multiplier": dp.noise_multiplier,
            "dp-release-noise-multiplier": dp.release_noise_multiplier,
            "dp-sample-rate": dp.sample_rate,
            "dp-steps": self.spent_now[0] * dp.steps_per_training,
            "dp-releases": self.spent_now[1],
            "dp-trainings-total": trainings,
            "dp-releases-total": releases,
            "dp-clip-norm": dp.options.clip_norm if self.clip_now is None else self.clip_now,
            "dp-payload-clip": dp.options.payload_clip,
            "dp-rounds-left": dp.rounds_left(events, self.privacy_budget()[0].epsilon),
            **adaptive,
        }

    def save_model(self) -> None:
        """Persist the personal model."""
        self.store(MODEL_STATE, self.model)

    def generator(self, server_round: int, purpose: int = 0) -> torch.Generator:
        """A CPU RNG seeded by (seed, partition, round, purpose): same draws in every process."""
        seed = ((self.cfg.seed * 1_000_003 + self.partition_id) * 10_007 + server_round) * 31 + purpose
        return torch.Generator().manual_seed(torch_seed(seed))
