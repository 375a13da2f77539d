"""What a finished run recorded, read for the privacy evaluation (``tools.privacy``).

:class:`RunView` opens a run folder that recorded its payloads (run config ``record-payloads``,
``engine.payload_recorder``): the recorded rounds and partitions, each message's arrays, each client's
personal model as kept after a recorded round, the clients' data and the public auxiliary images. The
payload readers name what an attack inverts in a message's arrays: an upload's per-class (or
per-sample) vectors (:func:`class_rows`), the class ids of an upload whose rows nothing here inverts
(:func:`class_ids`), a download's per-class vectors (:func:`global_rows`), and a shared module's weights
with FedKD's SVD factors multiplied out (:func:`expanded`).
"""

from __future__ import annotations

import io
import pickle
from functools import cached_property
from pathlib import Path

import numpy as np
import torch

from common.config import RunConfig
from common.data import DataSpec, decode_images, load_client_data, load_split
from common.datasets import DATASETS, with_recipe
from common.errors import ConfigError
from common.files import read_bounded, read_summary, resume_chain
from common.protocol import snapshot_name
from engine.payload_recorder import PAYLOADS, read_arrays
from methods.fedkd import svd_decompress
from methods.registry import METHODS
from models.groups import MODEL_GROUPS
from tools.runconfig import app_defaults

#: upload array pairs (vectors, their class ids) of the per-class payloads, and the space they live in
CLASS_VECTORS = {"lar": ("lar_labels", "representation"), "protos": ("proto_labels", "representation")}
CLASS_LOGITS = {"logits": ("logit_labels", "logits")}
#: uploads of per-class rows in no space the attacks invert or test (FedL2G's quiz gradients with respect to the
#: guiding vectors): only their class ids are read, for label leakage
CLASS_IDS_ONLY = {"grads": "grad_labels"}
#: uploads of the client's per-class training counts (FedGen): the label distribution itself, read for label
#: leakage; the weights uploaded beside them are read without them
CLASS_COUNTS = frozenset({"class_counts"})
#: downloads of per-class vectors: (vectors, mask of the classes they stand for)
GLOBAL_VECTORS = {"protos": "representation", "logits": "logits", "global_protos": "representation"}


class RunView:
    """What one run recorded, and the run's data and models for scoring.

    Raises:
        ConfigError: ``run_dir`` is no run folder, its ``resume-from`` chain is a loop
            (:func:`common.files.resume_chain`), or it recorded no payloads (naming ``record-payloads``).
    """

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        #: this run and the runs it resumed (``resume-from``, newest first): a resumed run's earlier rounds
        #: were recorded by the launch that ran them
        self.chain = resume_chain(self.run_dir)
        summary = read_summary(self.run_dir)
        # a run recorded before a key existed ran as that key's default does (e.g. min-clients)
        self.cfg = RunConfig.from_dict({**app_defaults(), **summary["config"]})
        self.method = METHODS[self.cfg.method]
        if not self.rounds():
            raise ConfigError(
                f"{self.run_dir} holds no recorded payloads: run it with run config key 'record-payloads' "
                '(e.g. record-payloads="1,10") to attack what its clients shared'
            )
        self.info = with_recipe(DATASETS[self.cfg.dataset], self.cfg.augment, self.cfg.normalize)
        self.num_clients = int(summary.get("num_clients") or self.cfg.num_clients)
        self.spec = DataSpec.from_config(self.cfg, self.num_clients)

    def round_dir(self, server_round: int) -> Path | None:
        """The folder of a recorded round (in the newest run of :attr:`chain` that recorded it), or None."""
        return next((d for run in self.chain if (d := run / PAYLOADS / f"round-{server_round}").is_dir()), None)

    def rounds(self) -> list[int]:
        """The recorded rounds."""
        found = {p.name.removeprefix("round-") for run in self.chain for p in (run / PAYLOADS).glob("round-*")}
        return sorted(int(r) for r in found if r.isdigit())

    def partitions(self, server_round: int) -> list[int]:
        """The partitions with a recorded payload in ``server_round``."""
        folder = self.round_dir(server_round)
        found = [p.name.removeprefix("partition-") for p in folder.glob("partition-*")] if folder else []
        return sorted(int(p) for p in found if p.isdigit())

    def payload(self, server_round: int, partition_id: int, direction: str, message_type: str = "train") -> dict:
        """The recorded arrays of one message (``direction``: ``up`` or ``down``); {} when none was recorded."""
        folder = self.round_dir(server_round)
        path = None if folder is None else folder / f"partition-{partition_id}" / f"{message_type}.{direction}.npz"
        return read_arrays(path) if path is not None and path.is_file() else {}

    @cached_property
    def state_dir(self) -> Path:
        """The clients' state folder of the run (named after the first run of a resumed chain)."""
        key = self.chain[-1].name
        if self.cfg.state_dir:
            return Path(self.cfg.state_dir) / key
        return self.run_dir.parent / key / "client-state"

    def model(self, partition_id: int, server_round: int | None = None, seed: int | None = None) -> torch.nn.Module:
        """Client ``partition_id``'s personal model as built at the start, or, with ``server_round``, as kept
        after that round (state record ``model-round-<r>``); ``seed``: the initial weights' seed (default
        the run's: the client's own initial weights).

        Raises:
            ConfigError: naming the file when it is absent, cannot be read (``common.files.read_bounded``)
                or is not this client's model as the client kept it.
        """
        cfg, info = self.cfg, self.info
        model = MODEL_GROUPS[cfg.model_group].build(
            partition_id,
            info.num_classes,
            info.channels,
            info.image_size,
            cfg.seed if seed is None else seed,
            cfg.feature_dim,
            identical=cfg.init == "identical",
        )
        if server_round is not None:
            load_kept(model, self.kept_state(partition_id, snapshot_name(server_round)), partition_id)
        return model.eval()

    def kept_state(self, partition_id: int, name: str) -> tuple[Path, dict[str, torch.Tensor]]:
        """(file, state dict) of client ``partition_id``'s state record ``name`` (run config
        ``record-payloads`` keeps :func:`common.protocol.snapshot_name` and
        :func:`common.protocol.start_snapshot_name` of the recorded rounds).

        Raises:
            ConfigError: naming the file when it is absent or cannot be read (``common.files.read_bounded``,
                ``torch.load`` with ``weights_only``: a file placed there cannot run code).
        """
        path = self.state_dir / f"partition-{partition_id}" / f"{name}.pt"
        if not path.is_file():
            raise ConfigError(
                f"{path} is missing: the clients keep their models of a recorded round (run config key "
                "'record-payloads') only with a state folder (a simulation's run folder or 'state-dir'), and the "
                "start of a training module with companions only from this version on"
            )
        data = read_bounded(path)
        try:
            return path, torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)["state"]
        except (RuntimeError, pickle.UnpicklingError, EOFError, KeyError, TypeError, ValueError) as exc:
            said = " ".join(str(exc).split())[:300]  # torch's errors span lines: one line, cut short
            raise ConfigError(f"{path} is not client {partition_id}'s model as it kept it: {said}") from None

    def data(self, partition_id: int):
        """Client ``partition_id``'s decoded partition (``common.data.ClientData``)."""
        return load_client_data(self.spec, partition_id)

    @cached_property
    def auxiliary(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The black-box attacker's public labelled images: the official test split (uint8, int64).

        Raises:
            ConfigError: with ``data-pool = "train+test"`` the clients own those images too.
        """
        if self.cfg.data_pool != "train":
            raise ConfigError(
                f"run config key 'data-pool' = {self.cfg.data_pool!r}: the clients own the official test split, so "
                "no public auxiliary images are left for the black-box attacks (use a run with data-pool='train')"
            )
        split = load_split(self.cfg.dataset, self.cfg.data_dir, "test")
        ys = torch.tensor(split[self.info.label_column], dtype=torch.int64)
        return decode_images(split, self.spec), ys


def class_rows(arrays: dict) -> tuple[str, torch.Tensor, list[int | None], str] | None:
    """(payload name, vectors [k, w], the class of each row (None: all classes), space) of an upload's
    vectors, or None for an upload without any."""
    for name, (ids, space) in {**CLASS_VECTORS, **CLASS_LOGITS}.items():
        if name in arrays:
            return name, torch.from_numpy(arrays[name]), [int(c) for c in arrays[ids]], space
    if "z" in arrays:
        return "z", torch.from_numpy(arrays["z"]), [None], "representation"
    return None


def class_ids(arrays: dict) -> tuple[str, list[int]] | None:
    """(payload name, the class of each row) of an upload of :data:`CLASS_IDS_ONLY`, or None."""
    for name, ids in CLASS_IDS_ONLY.items():
        if name in arrays:
            return name, [int(c) for c in arrays[ids]]
    return None


def global_rows(arrays: dict) -> tuple[str, torch.Tensor, list[int], str] | None:
    """(payload name, vectors, classes, space) of a download of per-class vectors (a mask of classes), or None."""
    for name, space in GLOBAL_VECTORS.items():
        if name in arrays and "mask" in arrays:
            classes = [int(c) for c in np.flatnonzero(arrays["mask"])]
            return global_name(name), torch.from_numpy(arrays[name]), classes, space
        if name in arrays and arrays[name].ndim == 2:  # FedTGP's global prototypes: one row per class
            vectors = torch.from_numpy(arrays[name])
            return global_name(name), vectors, list(range(len(vectors))), space
    return None


def expanded(arrays: dict, shapes: dict[str, tuple[int, ...]]) -> dict:
    """A shared module's arrays with FedKD's SVD factors (``<key>.u/.s/.v``) multiplied out; others as they are."""
    return svd_decompress(arrays, shapes) if any(k.endswith(".u") for k in arrays) else arrays


def global_name(name: str) -> str:
    """A downloaded per-class payload's table name: ``global_protos`` as it is, ``protos`` -> ``global protos``."""
    return name if name.startswith("global") else f"global {name}"


def load_kept(module: torch.nn.Module, kept: tuple[Path, dict[str, torch.Tensor]], partition_id: int) -> None:
    """Load a :meth:`RunView.kept_state` into ``module`` (strict).

    Raises:
        ConfigError: naming the file when its state is not ``module``'s (other keys or shapes).
    """
    path, state = kept
    try:
        module.load_state_dict(state)
    except RuntimeError as exc:
        said = " ".join(str(exc).split())[:300]
        raise ConfigError(f"{path} is not client {partition_id}'s model as it kept it: {said}") from None
