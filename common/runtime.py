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
from flwr.app import ArrayRecord, ConfigRecord, Context
from torch import nn

from common import gpu
from common.config import ConfigError, RunConfig
from common.data import ClientData, DataSpec, load_client_data, partition_sizes, torch_seed
from common.datasets import DATASETS, DatasetInfo, with_recipe
from common.dp import BudgetSpent, DPPlan, PrivacyLedger
from common.files import atomic_write
from common.generalization import architecture_for
from models.base import SplitModel
from models.groups import MODEL_GROUPS

MODEL_STATE = "model"
#: the state record of the client's privacy ledger (run config ``dp.epsilon`` > 0; ``common.dp``)
LEDGER_STATE = "dp-ledger"
#: context.state ConfigRecord: record name -> the round stamped on its file in state-dir
STAMPS = "state-rounds"
#: suffix of the file a record replaced on disk (kept for a resumed server that repeats a round)
PREVIOUS = ".prev"

log = logging.getLogger("flwr." + __name__)


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
    the share of the GPU's memory this node's ClientApps may allocate, see ``common.gpu``).

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
            leaves the run's state alone (``strategies.generalization``).
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
        #: a record on disk stamped this round or later is ahead of the server (see restore)
        self.ahead_from = None if server_round is None else server_round + (0 if trains else 1)
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
            self.state_dir: Path | None = Path(str(state_dir)) / _safe(state_key) / partition
        else:  # the run folder's client-state (a simulation without state-dir), or context.state
            self.state_dir = Path(run_state_dir) / partition if run_state_dir else None
        if scope and self.state_dir is not None:
            self.state_dir = self.state_dir / _safe(scope)
        #: where the decoded partition is cached on disk
        self.cache_dir = str(
            node.get("cache-dir")
            or (Path(str(node["state-dir"])) / "partition-cache" if node.get("state-dir") else default_cache_dir())
        )
        self.state_restores = 0  # state records read back from state-dir in this message
        self.state_rollbacks = 0  # state records rolled back because they were ahead of the server
        #: objects the handlers of this one message share (e.g. FedMRL's just-trained small model
        #: for the evaluation in the same train reply); gone with the message
        self.scratch: dict[str, object] = {}
        #: this client's DP mechanisms (run config ``dp.epsilon`` > 0), set by the ClientApp for its
        #: query and train messages (``common.dp.make_plan``); None: DP off
        self.dp: DPPlan | None = None

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

    @cached_property
    def model(self) -> SplitModel:
        """The personal model: built from the model group and seed (run config ``init``), restored
        from state, on device."""
        info = self.info
        model = MODEL_GROUPS[self.cfg.model_group].build(
            self.partition_id,
            info.num_classes,
            info.channels,
            info.image_size,
            self.cfg.seed,
            self.cfg.feature_dim,
            identical=self.cfg.init == "identical",
            architecture=architecture_for(self.cfg, self.partition_id, self.spec.num_partitions),
        )
        self.restore(MODEL_STATE, model)
        return model.to(self.device)

    def restore(self, name: str, module: nn.Module) -> bool:
        """Load ``module`` from this client's state record ``name``; True when found.

        Without a ``state-dir`` the state lives in ``context.state``. With one it lives only in
        ``state-dir``, and ``context.state`` keeps the round of each record's file (its stamp),
        so neither a simulation's process nor a SuperNode holds (and ships with every message)
        a copy of every client's models.

        A record that ``context.state`` does not know (a restarted SuperNode, a new Flower run)
        is read from disk and counted in ``state_restores``. Records on disk carry the round of
        the message that stored them. In a train message of round t, a record on disk stamped t
        or later is ahead of the server: the server crashed after this client trained (or also
        evaluated) round t and a new run resumed from the checkpoint of round t-1 (a new Flower
        run starts with an empty ``context.state``, so only the disk can be ahead). In another
        message of round t (evaluate: it follows round t's training), a record stamped later
        than t is ahead. The version it replaced (``<name>.prev.pt``, from before
        round t: see :meth:`store`) is used instead, or none when that is not older, so the
        client repeats round t from where the server's checkpoint left it (``state_rollbacks``
        counts this). The ahead file is dropped (``.prev`` takes its place), so a second crash
        in the repeated round rolls back to the same state again.
        """
        key = self._record(name)
        if key in self.context.state.array_records:
            module.load_state_dict(self.context.state.array_records[key].to_torch_state_dict())
            return True
        known = self._stamps().get(key)
        if known is not None:
            saved = self._stamped(name, known, module)
            if saved is None:
                log.warning(
                    "partition %d: '%s' of round %d is gone from %s; starting afresh",
                    self.partition_id,
                    name,
                    known,
                    self.state_dir,
                )
                return False
        else:
            saved = self._read(name, module)
            if saved is not None and self.ahead_from is not None and saved[0] >= self.ahead_from:
                previous = self._read(name + PREVIOUS, module)
                usable = previous is not None and previous[0] < self.ahead_from
                log.warning(
                    "partition %d: '%s' on disk is from round %d, later than the server's state (round %d); %s",
                    self.partition_id,
                    name,
                    saved[0],
                    self.ahead_from - 1,
                    f"rolled back to round {previous[0]}" if usable else "starting afresh",
                )
                self.state_rollbacks += 1
                saved = previous if usable else None
                # the ahead file goes: kept, the next store would rotate it into .prev, where a
                # second crash in this round would find it instead of the state from before it
                if usable:
                    os.replace(self._state_file(name + PREVIOUS), self._state_file(name))
                else:
                    self._state_file(name).unlink()
            if saved is None:
                return False
            log.info("partition %d: restored '%s' of round %d from disk", self.partition_id, name, saved[0])
            self._stamp(key, saved[0])
            self.state_restores += 1
        module.load_state_dict(saved[1])
        return True

    def store(self, name: str, module: nn.Module) -> None:
        """Save ``module``'s state dict as record ``name``: into ``context.state`` without a
        ``state-dir``; with one, atomically and durably to ``<name>.pt`` there (survives a
        SuperNode restart) and only its round into ``context.state`` (see :meth:`restore`).

        On disk a record is stamped with the server round of the message that stored it (0 when
        it names none). The first store of a round keeps the file it replaces as
        ``<name>.prev.pt``: what :meth:`restore` rolls back to when a resumed server repeats a
        round. Later stores in the same round (FedRE's client stores its model in train and in
        evaluate) overwrite only ``<name>.pt``, so ``.prev`` stays the state from before the
        round.

        Raises:
            RuntimeError: ``module`` has a non-finite float entry (training diverged, e.g. from a
                poisoned server payload): nothing is stored, the record keeps its previous state in
                memory and on disk, and the message's reply becomes an error the server drops.
        """
        diverged = [k for k, v in module.state_dict().items() if v.is_floating_point() and not torch.isfinite(v).all()]
        if diverged:
            reason = (
                f"partition {self.partition_id}: refused to store '{name}' with non-finite values in "
                f"{diverged[:3]}{' ...' if len(diverged) > 3 else ''}; its previous state is kept"
            )
            log.warning("%s", reason)
            raise RuntimeError(reason)
        path, key = self._state_file(name), self._record(name)
        if path is None:
            self.context.state[key] = ArrayRecord(module.state_dict())
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        round_ = self.server_round or 0
        if path.is_file() and self._stamps().get(key) != round_:
            os.replace(path, self._state_file(name + PREVIOUS))
        saved = {"round": round_, "state": {k: v.detach().cpu() for k, v in module.state_dict().items()}}
        atomic_write(path, lambda f: torch.save(saved, f))
        self._stamp(key, round_)

    def _record(self, name: str) -> str:
        """The ``context.state`` key of record ``name`` in this message's scope."""
        return f"{self.scope}/{name}" if self.scope else name

    def _stamps(self) -> dict[str, int]:
        """Record name -> the round stamped on its file in ``state-dir`` (as read or written)."""
        record = self.context.state.config_records.get(STAMPS)
        return {k: int(v) for k, v in record.items()} if record is not None else {}

    def _stamp(self, name: str, round_: int) -> None:
        self.context.state[STAMPS] = ConfigRecord({**self._stamps(), name: round_})

    def _read(self, name: str, module: nn.Module) -> tuple[int, dict] | None:
        """``(round, state dict)`` of record ``name`` in ``state-dir`` (round 0 for files written
        before stamping), or None when there is none.

        The file must be what :meth:`store` wrote for ``module``: ``{"round": int >= 0, "state":
        ...}`` (or a bare state dict of the unstamped format) whose state has exactly
        ``module``'s keys, shapes and dtypes. A torn file, or one that loads but is not that
        (another architecture's weights, other keys, a round that is no integer), is logged and
        ignored: the client starts afresh and its next :meth:`store` replaces the file, instead
        of failing on every later message."""
        path = self._state_file(name)
        if path is None or not path.is_file():
            return None
        try:
            saved = torch.load(path, map_location="cpu", weights_only=True)
            round_, state = (saved["round"], saved["state"]) if _stamped_format(saved) else (0, saved)
            if isinstance(round_, bool) or not isinstance(round_, int) or round_ < 0:
                raise ValueError(f"its round stamp {round_!r} is not an integer >= 0")
            mismatch = _state_mismatch(state, module)
            if mismatch:
                raise ValueError(f"it does not fit the model: {mismatch}")
        except Exception as exc:  # torch raises whatever a torn or foreign file's bytes make it raise
            log.warning(
                "partition %d: ignoring state file %s (%s: %s); starting afresh",
                self.partition_id,
                path,
                type(exc).__name__,
                exc,
            )
            return None
        return round_, state

    def _stamped(self, name: str, round_: int, module: nn.Module) -> tuple[int, dict] | None:
        """Record ``name`` as stamped ``round_``: its file, or the one it replaced after a
        rollback (:meth:`restore`); None when neither is of that round."""
        for candidate in (name, name + PREVIOUS):
            saved = self._read(candidate, module)
            if saved is not None and saved[0] == round_:
                return saved
        return None

    def _state_file(self, name: str) -> Path | None:
        return self.state_dir / f"{_safe(name)}.pt" if self.state_dir is not None else None

    @cached_property
    def ledger(self) -> PrivacyLedger:
        """The budget this client has spent so far (``common.dp.PrivacyLedger``), restored from state."""
        ledger = PrivacyLedger()
        self.restore(LEDGER_STATE, ledger)
        return ledger

    def check_budget(self) -> None:
        """Before a train message: with DP on, refuse when the budget allows no further round.

        A message of a round this client already trained in (MH-pFedHNGD's second train message)
        finishes a round already counted; any other starts a new one.

        Raises:
            BudgetSpent: one more round would exceed ``DPPlan.rounds_within_budget``; the reply
                becomes an error the server drops (and the server samples the client no more).
            ConfigError: the ledger was spent at another σ (a resumed run with other settings).
        """
        if self.dp is None:
            return
        ledger = self.ledger
        spent_at = float(ledger.noise_multiplier)
        if spent_at and abs(spent_at - self.dp.noise_multiplier) > 1e-9 * spent_at:
            raise ConfigError(
                f"partition {self.partition_id} spent its 'dp.epsilon' budget at noise multiplier {spent_at:.6g}, this "
                f"run's settings give {self.dp.noise_multiplier:.6g}: a resumed DP run must keep 'num-server-rounds', "
                "'fraction-train', 'batch-size', 'local-epochs' and the 'dp.*' keys"
            )
        new_round = int(ledger.last_round) != (self.server_round or 0)
        if int(ledger.rounds) + new_round > self.dp.rounds_within_budget():
            epsilon = self.dp.epsilon(int(ledger.trainings), int(ledger.releases))
            raise BudgetSpent(
                f"partition {self.partition_id}: its privacy budget 'dp.epsilon' = {self.dp.options.epsilon:g} is "
                f"spent ({int(ledger.rounds)} rounds trained, ε = {epsilon:.4g}); it sends nothing more"
            )

    def spend_privacy(self, trainings: int = 0, releases: int = 0) -> None:
        """Charge ``trainings`` DP-SGD trainings and ``releases`` payload releases to the ledger (with DP
        on; nothing otherwise) and store it."""
        if self.dp is None:
            return
        ledger = self.ledger
        if int(ledger.last_round) != (self.server_round or 0):
            ledger.rounds += 1
            ledger.last_round.fill_(self.server_round or 0)
        ledger.trainings += trainings
        ledger.releases += releases
        ledger.noise_multiplier.fill_(self.dp.noise_multiplier)
        self.store(LEDGER_STATE, ledger)

    def privacy_metrics(self) -> dict[str, float]:
        """``dp-epsilon`` (ε spent so far at ``dp.delta``) and ``dp-rounds-left`` (whole rounds the budget
        still allows); empty with DP off."""
        if self.dp is None:
            return {}
        ledger = self.ledger
        return {
            "dp-epsilon": self.dp.epsilon(int(ledger.trainings), int(ledger.releases)),
            "dp-rounds-left": max(0, self.dp.rounds_within_budget() - int(ledger.rounds)),
        }

    def save_model(self) -> None:
        """Persist the personal model."""
        self.store(MODEL_STATE, self.model)

    def generator(self, server_round: int, purpose: int = 0) -> torch.Generator:
        """A CPU RNG seeded by (seed, partition, round, purpose): same draws in every process."""
        seed = ((self.cfg.seed * 1_000_003 + self.partition_id) * 10_007 + server_round) * 31 + purpose
        return torch.Generator().manual_seed(torch_seed(seed))


def _stamped_format(saved: object) -> bool:
    return isinstance(saved, dict) and saved.keys() == {"round", "state"}


def _state_mismatch(state: object, module: nn.Module) -> str:
    """Why ``state`` cannot be loaded into ``module`` as it is (keys, shapes, dtypes), or ``""``."""
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        return f"a {type(state).__name__}, not a state dict of tensors"
    want = module.state_dict()
    if state.keys() != want.keys():
        missing, extra = sorted(want.keys() - state.keys()), sorted(state.keys() - want.keys())
        return f"keys differ (missing {missing[:3]}, unexpected {extra[:3]})"
    for key, tensor in want.items():
        got = state[key]
        if got.shape != tensor.shape or got.dtype != tensor.dtype:
            return f"'{key}' is {got.dtype} {tuple(got.shape)}, expected {tensor.dtype} {tuple(tensor.shape)}"
    return ""


def _safe(name: str) -> str:
    """A file-name-safe version of ``name`` (no separators, no leading dots)."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name).lstrip(".") or "_"
