"""Client data: load a dataset, partition it with flwr-datasets, split, decode once, augment.

Loading: ``<data-dir>/<name>/{train,test}.parquet`` through Hugging Face ``datasets`` when
the files exist (the offline copies in shared/data), the dataset's Hub id otherwise.
Partitioning: flwr-datasets partitioners over the pool (run config ``data-pool``: the train
split, or the train and test splits merged, as the PFLlib/HtFLlib generators do) with
``iid``, ``dirichlet`` or ``pathological``, after one seeded shuffle, as ``FederatedDataset``
does. Each partition is then split into a local train and test part with the same class
proportions. The partition's seed is ``RunConfig.data_seed`` (run config ``partition-seed``, or
``seed``).

A partition is decoded once per process into uint8 tensors and cached: in simulation a Ray
actor serves many virtual clients over many rounds, so decoding per round would dominate.
The decoded tensors are also written to disk once (a cache folder, see
``common.runtime.ClientRuntime``) and memory-mapped by later processes: a deployed ClientApp
is a fresh process per message, and every run would otherwise load Hugging Face ``datasets``,
partition and decode again.

The data are checked as they are read, each check once: a split's file must be whole parquet with
the dataset's columns (:func:`check_parquet`, from its footer) and every label a class id
(:func:`check_labels`, one vectorised pass over the label column); each image must decode to the
dataset's shape as its partition is decoded (:func:`decode_images`). A failure is a ``ConfigError``
naming the file and the first bad row. The handshake's query loads the partition
(:func:`partition_sizes`), so faulty data fail there, before any round.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import os
import time
import warnings
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, lru_cache
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from common.config import ConfigError, RunConfig
from common.datasets import DATASETS, DatasetInfo
from common.files import atomic_write

log = logging.getLogger("flwr." + __name__)  # streamed with Flower's own log

# torchvision 0.29 marks its decoders deprecated in favour of TorchCodec, which is not needed
# for still images; the pathological partitioner warns whenever N * classes-per-client < C,
# which is a legitimate configuration here.
warnings.filterwarnings("ignore", message="The image decoding and encoding capabilities of TorchVision")
warnings.filterwarnings("ignore", message=r"Classes: \[.*\] will NOT be used")


@dataclass(frozen=True)
class DataSpec:
    """Everything that determines one client's data; hashable, so it keys the cache."""

    dataset: str
    data_dir: str
    data_pool: str
    partitioner: str
    num_partitions: int
    dirichlet_alpha: float
    dirichlet_min_size: int
    dirichlet_self_balancing: bool
    classes_per_client: int
    test_fraction: float
    max_examples_per_client: int
    seed: int  # the partition's seed (RunConfig.data_seed), not the training's

    @classmethod
    def from_config(cls, cfg: RunConfig, num_partitions: int, data_dir: str | None = None) -> DataSpec:
        """Build from the run config; ``data_dir`` (a node-config value) overrides ``data-dir``."""
        return cls(
            cfg.dataset,
            os.path.realpath(data_dir or cfg.data_dir),
            cfg.data_pool,
            cfg.partitioner,
            num_partitions,
            cfg.dirichlet_alpha,
            cfg.dirichlet_min_size,
            cfg.dirichlet_self_balancing,
            cfg.classes_per_client,
            cfg.test_fraction,
            cfg.max_examples_per_client,
            cfg.data_seed,
        )


@dataclass
class ClientData:
    """One client's decoded local data.

    ``train_x``/``test_x``: uint8 ``[n, channels, H, W]``; ``train_y``/``test_y``: int64 ``[n]``.
    ``load_seconds``: wall time spent loading and decoding it (0 when it came from the cache).
    """

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    info: DatasetInfo
    load_seconds: float = 0.0


def torch_seed(value: int) -> int:
    """``value`` modulo 2^64: a seed derived from run config ``seed`` (any int64 >= 0) that
    ``torch.Generator.manual_seed`` accepts; the identity below 2^64, so small seeds draw as before."""
    return value % 2**64


#: parquet's magic bytes: a parquet file begins and ends with them
PARQUET_MAGIC = b"PAR1"
#: columns :func:`load_split` adds to every example: its row in its split's file (or Hub split) and
#: the split's index in :func:`pool_splits`, so an error names the file and row of a bad example
ROW_COLUMN, SPLIT_COLUMN = "source-row", "source-split"


def split_path(data_dir: str, name: str, split: str) -> str:
    """The parquet file of split ``split`` of dataset ``name``: ``<data_dir>/<name>/<split>.parquet``."""
    return os.path.join(data_dir, name, f"{split}.parquet")


def check_parquet(path: str, info: DatasetInfo) -> None:
    """Check that ``path`` is a whole parquet file with ``info``'s image and label columns, from its
    first and last bytes and its footer (no data page is read).

    Raises:
        ConfigError: naming ``path`` and what is wrong: empty, not parquet (no leading magic bytes),
            truncated (no trailing magic bytes), a footer that cannot be parsed, or a missing column.
    """
    import pyarrow.parquet as pq

    size = os.path.getsize(path)
    if size == 0:
        raise ConfigError(f"dataset file {path} is empty (0 bytes), not a parquet file")
    with open(path, "rb") as f:
        head = f.read(len(PARQUET_MAGIC))
        f.seek(max(size - len(PARQUET_MAGIC), 0))
        tail = f.read(len(PARQUET_MAGIC))
    if head != PARQUET_MAGIC:
        raise ConfigError(f"dataset file {path} is not a parquet file: it does not begin with parquet's magic bytes")
    if tail != PARQUET_MAGIC or size < 3 * len(PARQUET_MAGIC):
        raise ConfigError(
            f"dataset file {path} is truncated: {size} bytes that do not end with parquet's footer (magic bytes)"
        )
    try:
        columns = pq.read_schema(path).names
    except Exception as exc:  # pyarrow raises ArrowInvalid, OSError, ... for a footer it cannot parse
        raise ConfigError(
            f"dataset file {path} is corrupt: its parquet footer cannot be read ({type(exc).__name__}: {exc})"
        ) from exc
    check_columns(columns, info, f"dataset file {path}")


def check_columns(columns: list[str], info: DatasetInfo, where: str) -> None:
    """Raises ConfigError naming ``where`` unless ``columns`` hold ``info``'s image and label columns."""
    for column, holds in ((info.image_column, "the encoded images"), (info.label_column, "the class ids")):
        if column not in columns:
            raise ConfigError(
                f"{where} has no column '{column}' ({holds}); its columns: {', '.join(map(repr, columns)) or 'none'}"
            )


def check_labels(labels, info: DatasetInfo, where: str) -> None:
    """Check every label of a split at once: integers in ``[0, num_classes)``, none missing.

    Args:
        labels: the split's label column, a ``pyarrow.ChunkedArray`` (row order of the file).
        info: the dataset (its ``num_classes``).
        where: names the file (or Hub split) in the error.

    Raises:
        ConfigError: naming ``where``, the first bad row and how many rows are bad.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    column = f"column '{info.label_column}' of {where}"
    if not pa.types.is_integer(labels.type):
        raise ConfigError(f"{column} holds {labels.type}, not integer class ids")
    if labels.null_count:
        first = pc.index(pc.is_null(labels), True).as_py()
        raise ConfigError(f"{column} has no label in {labels.null_count} row(s), the first row {first}")
    y = labels.to_numpy()
    bad = np.flatnonzero((y < 0) | (y >= info.num_classes))
    if bad.size:
        raise ConfigError(
            f"{column}: row {bad[0]} has label {y[bad[0]]}, outside [0, {info.num_classes}) "
            f"({bad.size} row(s) out of range)"
        )


def source_name(name: str, data_dir: str, split: str) -> str:
    """Where split ``split`` of dataset ``name`` is read from, for errors: its file, or its Hub id."""
    path = split_path(data_dir, name, split)
    return f"dataset file {path}" if os.path.exists(path) else f"Hub dataset '{DATASETS[name].hub_id}' split '{split}'"


def load_split(name: str, data_dir: str, split: str, split_index: int = 0):
    """Return split ``split`` of dataset ``name`` as a ``datasets.Dataset`` (images not decoded),
    checked: the file is whole parquet with the dataset's columns (:func:`check_parquet`) and every
    label is a class id (:func:`check_labels`, one pass over the label column). Each example also
    carries its row (:data:`ROW_COLUMN`) and ``split_index`` (:data:`SPLIT_COLUMN`).

    Uses ``<data_dir>/<name>/<split>.parquet`` when present, the Hub id otherwise.

    Raises:
        ConfigError: when the dataset is neither on disk nor reachable on the Hub; when the file
            is not a readable parquet file, lacks a column or holds a label that is no class id
            (naming the file, and the first bad row).
    """
    from datasets import Image, load_dataset

    info = DATASETS[name]
    path = split_path(data_dir, name, split)
    where = source_name(name, data_dir, split)
    if os.path.exists(path):
        check_parquet(path, info)
        try:
            ds = load_dataset("parquet", data_files={split: path}, split=split)
        except Exception as exc:  # a damaged data page raises whatever pyarrow or datasets make of it
            cause = exc
            while cause.__cause__ is not None:  # datasets wraps pyarrow's error, which says what is wrong
                cause = cause.__cause__
            raise ConfigError(f"{where} is corrupt: reading it failed ({type(cause).__name__}: {cause})") from exc
    else:
        try:
            ds = load_dataset(info.hub_id, split=split)
        except Exception as exc:  # offline Hub access raises several unrelated types
            raise ConfigError(
                f"dataset '{name}': no file {path} and the Hub dataset '{info.hub_id}' could not be loaded "
                f"({type(exc).__name__}: {exc}); set run config key 'data-dir' (or node config 'data-dir') "
                "to a folder holding <dataset>/train.parquet"
            ) from exc
        check_columns(ds.column_names, info, where)
    check_labels(ds.data.column(info.label_column), info, where)
    ds = ds.select_columns([info.image_column, info.label_column])
    ds = ds.add_column(ROW_COLUMN, np.arange(len(ds), dtype=np.int64))
    ds = ds.add_column(SPLIT_COLUMN, np.full(len(ds), split_index, dtype=np.int8))
    return ds.cast_column(info.image_column, Image(decode=False))


#: the run config keys each partitioner's outcome depends on, named when it cannot split the pool
PARTITIONER_KEYS = {
    "iid": ("num-clients",),
    "dirichlet": ("num-clients", "dirichlet-alpha", "dirichlet-min-size", "dirichlet-self-balancing"),
    "pathological": ("num-clients", "classes-per-client"),
}


@lru_cache(maxsize=4)
def partitioner_for(spec: DataSpec, *, labels_only: bool = False):
    """The flwr-datasets partitioner for ``spec``, with its (shuffled) pool attached.

    ``labels_only`` (keyword only, so that the cache holds one entry per spec and mode): the pool keeps
    only the label column, its shuffle written out in memory (``flatten_indices``), so the partitions are
    the same rows (the three partitioners read only the labels and the row order) and each
    ``load_partition`` costs about a third (the ``Dataset.select`` behind it rebuilds its table's metadata
    over every column and chunk; measured in results/scale/README.md, "The launcher's check at 10,000
    clients, cut"), for the callers that need a partition's labels and split, not its images.

    Raises:
        ConfigError: the data set is not readable (:func:`load_pool`).
    """
    import datasets
    from flwr_datasets.partitioner import DirichletPartitioner, IidPartitioner, PathologicalPartitioner

    info = DATASETS[spec.dataset]
    n, label = spec.num_partitions, info.label_column
    if spec.partitioner == "iid":
        partitioner = IidPartitioner(num_partitions=n)
    elif spec.partitioner == "dirichlet":
        partitioner = DirichletPartitioner(
            num_partitions=n,
            partition_by=label,
            alpha=spec.dirichlet_alpha,
            min_partition_size=spec.dirichlet_min_size,
            self_balancing=spec.dirichlet_self_balancing,
            seed=spec.seed,
        )
    else:
        partitioner = PathologicalPartitioner(
            num_partitions=n,
            partition_by=label,
            num_classes_per_partition=spec.classes_per_client,
            class_assignment_mode="random",
            seed=spec.seed,
        )
    pool = load_pool(spec).shuffle(seed=spec.seed)
    if labels_only:
        bars = datasets.is_progress_bar_enabled()
        datasets.disable_progress_bars()  # flatten_indices draws one; a run's log is no place for it
        try:
            pool = pool.select_columns([label]).flatten_indices(keep_in_memory=True)
        finally:
            if bars:
                datasets.enable_progress_bars()
    partitioner.dataset = pool
    return partitioner


def pool_splits(data_pool: str) -> tuple[str, ...]:
    """The official splits run config ``data-pool`` partitions, in the order they are concatenated."""
    return ("train", "test") if data_pool == "train+test" else ("train",)


def load_pool(spec: DataSpec):
    """The examples that are partitioned: the train split, or the train and test splits concatenated
    in that order (``data-pool = "train+test"``), as a ``datasets.Dataset`` (images not decoded).

    Raises:
        ConfigError: see :func:`load_split` (every split is checked).
    """
    from datasets import concatenate_datasets

    splits = [load_split(spec.dataset, spec.data_dir, split, i) for i, split in enumerate(pool_splits(spec.data_pool))]
    return splits[0] if len(splits) == 1 else concatenate_datasets(splits)


def stratified_split(
    labels: torch.Tensor, fraction: float, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split indices class by class: ``round(fraction * n_c)`` of each class go to the second part.

    Args:
        labels: int64 ``[n]``.
        fraction: share of each class put in the second part, in [0, 1].
        generator: seeded RNG, so every process derives the same split.

    Returns:
        ``(first, second)``: int64 index tensors, each sorted ascending.

    A class with one sample stays in the first part (``round(fraction) == 0`` for
    fraction < 0.5). Hugging Face's ``train_test_split(stratify_by_column=...)`` rejects
    such classes, which Dirichlet partitions often have, hence this function.
    """
    first, second = [torch.zeros(0, dtype=torch.int64)], [torch.zeros(0, dtype=torch.int64)]  # for no labels
    for c in torch.unique(labels):
        idx = torch.nonzero(labels == c).flatten()
        idx = idx[torch.randperm(len(idx), generator=generator)]
        k = int(round(fraction * len(idx)))
        second.append(idx[:k])
        first.append(idx[k:])
    return torch.sort(torch.cat(first)).values, torch.sort(torch.cat(second)).values


#: the first 8 bytes of every PNG file (PNG specification, 3rd edition, section 5.2)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_intact(data: bytes) -> bool:
    """Whether every chunk of PNG ``data`` up to ``IEND`` is whole and matches its CRC-32 (PNG
    specification, 3rd edition, section 5.3: length, type, data, CRC of type and data).

    torchvision 0.29's ``decode_png`` ends the process (a segmentation fault) instead of raising
    when libpng meets damaged image data (``IDAT: incorrect data check``), so one flipped bit in
    a PNG would kill every client that decodes it; the CRCs catch such damage first (a PNG built
    with valid CRCs around bad data can still crash it). Walking the chunks costs about 1.5 us per
    MNIST image, decoding it about 22 us.
    """
    pos, end = len(PNG_SIGNATURE), len(data)
    while pos + 12 <= end:
        length = int.from_bytes(data[pos : pos + 4], "big")
        stop = pos + 12 + length
        if stop > end or zlib.crc32(data[pos + 4 : stop - 4]) != int.from_bytes(data[stop - 4 : stop], "big"):
            return False
        if data[pos + 4 : pos + 8] == b"IEND":
            return True
        pos = stop
    return False


def decode_images(examples, spec: DataSpec) -> torch.Tensor:
    """Decode and check the images of ``examples`` (rows of :func:`load_pool`'s dataset).

    Returns:
        uint8 ``[n, channels, size, size]``: the decoder converts each image to the dataset's
        channels (``ImageReadMode``), so an image is bad when it does not decode or has another size.

    Raises:
        ConfigError: naming the file (or Hub split) and the row of its first bad image, and how many
            of ``examples`` are bad (every image is checked: a PNG's CRCs, then decoded, its shape).
    """
    from torchvision.io import ImageReadMode, decode_image  # torchvision costs seconds to import

    info = DATASETS[spec.dataset]
    mode = ImageReadMode.RGB if info.channels == 3 else ImageReadMode.GRAY
    shape = (info.channels, info.image_size, info.image_size)
    images, decoded, bad = examples[info.image_column], [], []
    for i, im in enumerate(images):
        data = im["bytes"]
        if isinstance(data, bytes) and data.startswith(PNG_SIGNATURE) and not png_intact(data):
            bad.append((i, "cannot be decoded (a damaged PNG: a chunk's CRC-32 does not match its bytes)"))
            continue
        try:
            x = decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=mode)
        except Exception as exc:  # torchvision raises RuntimeError; missing or empty bytes TypeError/ValueError
            bad.append((i, f"cannot be decoded ({type(exc).__name__}: {exc})"))
            continue
        if tuple(x.shape) != shape:
            size = f"{x.shape[-2]}x{x.shape[-1]}"
            bad.append((i, f"is {size} pixels, dataset '{spec.dataset}' has {shape[1]}x{shape[2]}"))
            continue
        decoded.append(x)
    if bad:
        (i, what), split = bad[0], pool_splits(spec.data_pool)[examples[SPLIT_COLUMN][bad[0][0]]]
        raise ConfigError(
            f"{source_name(spec.dataset, spec.data_dir, split)}: the image in row {examples[ROW_COLUMN][i]} {what} "
            f"({len(bad)} of {len(images)} images of this partition are bad)"
        )
    return torch.stack(decoded) if decoded else torch.empty((0, *shape), dtype=torch.uint8)


def partition_split(spec: DataSpec, partition_id: int, labels_only: bool = False):
    """Partition ``partition_id`` (images not decoded), its labels and its local train/test indices.

    Returns:
        ``(partition, labels, train_idx, test_idx)``: a ``datasets.Dataset`` (with ``labels_only``, its
        label column alone: :func:`partitioner_for`), int64 ``[n]``, and two int64 index tensors into it
        (the ``max-examples-per-client`` cap applied, then the stratified ``test-fraction`` split, both
        seeded by (seed, partition)); the same labels and indices either way.

    Raises:
        ConfigError: if ``partition_id`` is outside ``[0, num_partitions)``, the data fail their
            checks (:func:`load_split`), the partitioner cannot split the pool (its ValueError,
            naming the run config keys it depends on) or the partition is too small to split.
    """
    if not 0 <= partition_id < spec.num_partitions:
        raise ConfigError(f"partition-id {partition_id} is outside [0, {spec.num_partitions})")
    info = DATASETS[spec.dataset]
    partitioner = partitioner_for(spec, labels_only=labels_only)
    pool = len(partitioner.dataset)
    if 2 * spec.num_partitions > pool:  # flwr-datasets' iid partitioner would fail with an IndexError
        raise ConfigError(
            f"dataset '{spec.dataset}' has {pool} examples in data-pool '{spec.data_pool}' (under {spec.data_dir}), "
            f"too few for {spec.num_partitions} partitions of at least 2 (one to train, one to test): run config "
            f"key 'num-clients' (or node config 'num-partitions') must be at most {pool // 2}"
        )
    try:
        part = partitioner.load_partition(partition_id)
    except ConfigError:
        raise
    except ValueError as exc:  # flwr-datasets' partitioners reject their settings with ValueError
        keys = PARTITIONER_KEYS[spec.partitioner]
        raise ConfigError(
            f"the '{spec.partitioner}' partitioner cannot split dataset '{spec.dataset}' (data-pool "
            f"'{spec.data_pool}') into {spec.num_partitions} partitions ({exc}); check run config key(s) "
            f"{', '.join(repr(k) for k in keys)} (num-clients, or node config 'num-partitions', is the partition count)"
        ) from exc
    # one query for the column: iterating a lazy Column (datasets 4.8.5) queries the table once per row
    labels = torch.tensor(part[:][info.label_column], dtype=torch.int64)
    g = torch.Generator().manual_seed(torch_seed(spec.seed * 100_003 + partition_id))
    keep = torch.arange(len(labels))
    if 0 < spec.max_examples_per_client < len(labels):
        _, keep = stratified_split(labels, spec.max_examples_per_client / len(labels), g)
    train_idx, test_idx = stratified_split(labels[keep], spec.test_fraction, g)
    train_idx, test_idx = keep[train_idx], keep[test_idx]
    if len(train_idx) == 0 or len(test_idx) == 0:
        capped = len(keep) < len(labels)
        raise ConfigError(
            f"partition {partition_id} has {len(labels)} examples"
            + (f", {len(keep)} kept by run config key 'max-examples-per-client'" if capped else "")
            + f": too few for a train and a test set at test-fraction {spec.test_fraction} (split per class); "
            + ("raise max-examples-per-client" if capped else "use fewer clients or another partitioner")
        )
    return part, labels, train_idx, test_idx


#: bump when the cached tensors' meaning changes, so older cache files miss
CACHE_FORMAT = 1


def partition_key(spec: DataSpec, partition_id: int) -> str:
    """A hex digest of everything that determines partition ``partition_id``'s tensors: the
    :class:`DataSpec`, the partition id, :data:`CACHE_FORMAT` and the size and modification time
    of each on-disk split of the pool (so a replaced data file misses)."""
    paths = [split_path(spec.data_dir, spec.dataset, split) for split in pool_splits(spec.data_pool)]
    stamp = [(os.stat(p).st_size, os.stat(p).st_mtime_ns) if os.path.exists(p) else None for p in paths]
    text = repr((CACHE_FORMAT, dataclasses.astuple(spec), partition_id, stamp))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


TENSORS = ("train_x", "train_y", "test_x", "test_y")


def _read_cache(path: Path, key: str, info: DatasetInfo) -> dict[str, torch.Tensor] | None:
    """The cached tensors of ``path`` when it holds ``key``'s partition whole, else None.

    Whole means what :func:`load_client_data` writes: a dict with this ``key``, uint8 image tensors
    ``[n, channels, size, size]`` of dataset ``info`` and int64 label tensors ``[n]`` of class ids
    in ``[0, num_classes)``, of matching lengths. Anything else (torn, foreign, another partition's,
    written before the data were checked) is logged and ignored, and the caller decodes (and so
    checks) the data again and rewrites it.
    """
    shape = (info.channels, info.image_size, info.image_size)
    try:
        saved = torch.load(path, mmap=True, weights_only=True)
        if (
            isinstance(saved, dict)
            and saved.get("key") == key
            and all(isinstance(saved.get(t), torch.Tensor) for t in TENSORS)
            and all(saved[x].dtype == torch.uint8 and saved[x].shape[1:] == shape for x in ("train_x", "test_x"))
            and all(saved[y].dtype == torch.int64 and saved[y].ndim == 1 for y in ("train_y", "test_y"))
            and len(saved["train_x"]) == len(saved["train_y"])
            and len(saved["test_x"]) == len(saved["test_y"])
            and all(((saved[y] >= 0) & (saved[y] < info.num_classes)).all() for y in ("train_y", "test_y"))
        ):
            return saved
    except FileNotFoundError:
        return None
    except Exception as exc:  # a torn or foreign file raises whatever its bytes make torch raise
        log.warning("ignoring unreadable partition cache %s (%s: %s)", path, type(exc).__name__, exc)
        return None
    log.warning("ignoring partition cache %s: it holds other data", path)
    return None


def _cache_file(spec: DataSpec, partition_id: int, cache_dir: str) -> tuple[Path, str]:
    key = partition_key(spec, partition_id)
    return Path(cache_dir) / f"partition-{partition_id}-{key}.pt", key


@cache
def load_client_data(spec: DataSpec, partition_id: int, cache_dir: str | None = None) -> ClientData:
    """Load, split, decode and check partition ``partition_id`` (cached per process).

    The data are checked as they are read: every label of the pool's files and every image of the
    partition as it is decoded (:func:`load_split`, :func:`decode_images`; decoding dominates: the
    checks of all 60,000 MNIST training images, their PNG CRCs and shapes, took 0.13 s, their labels
    0.1 ms). With ``cache_dir``, the decoded tensors are read from
    ``<cache_dir>/partition-<id>-<key>.pt`` (:func:`partition_key`, memory-mapped) when that file
    is whole and holds this partition; otherwise they are decoded and the file written
    atomically. A torn, foreign or unreadable file is ignored and rewritten.

    Raises:
        ConfigError: see :func:`partition_split` and :func:`decode_images`.
    """
    start = time.perf_counter()
    info = DATASETS[spec.dataset]
    if cache_dir:
        path, key = _cache_file(spec, partition_id, cache_dir)
        saved = _read_cache(path, key, info)
        if saved is not None:
            data = ClientData(*(saved[t] for t in TENSORS), info)
            data.load_seconds = time.perf_counter() - start
            return data
    part, labels, train_idx, test_idx = partition_split(spec, partition_id)
    order = torch.cat([train_idx, test_idx])
    # rows by index in one query: Dataset.select builds (and fingerprints) a new dataset first
    x = decode_images(part[order.tolist()], spec)
    n_train = len(train_idx)
    data = ClientData(x[:n_train], labels[train_idx], x[n_train:], labels[test_idx], info)
    if cache_dir:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda f: torch.save({"key": key, **{t: getattr(data, t) for t in TENSORS}}, f))
    data.load_seconds = time.perf_counter() - start
    log.debug("partition %d: %d train / %d test in %.2f s", partition_id, n_train, len(test_idx), data.load_seconds)
    return data


def partition_sizes(spec: DataSpec, partition_id: int, cache_dir: str | None = None) -> tuple[int, int]:
    """(local train, local test) sizes of partition ``partition_id``: from the memory-mapped cache
    file when it is whole, else by loading the partition (:func:`load_client_data`: decoded,
    checked and cached once, so later messages find it decoded). The handshake asks for these
    sizes, so faulty data fail there, before any round, rather than in every client's every round.

    Raises:
        ConfigError: see :func:`load_client_data`.
    """
    if cache_dir:
        saved = _read_cache(*_cache_file(spec, partition_id, cache_dir), DATASETS[spec.dataset])
        if saved is not None:
            return len(saved["train_y"]), len(saved["test_y"])
    data = load_client_data(spec, partition_id, cache_dir)
    return len(data.train_y), len(data.test_y)


def _cache_partition(spec: DataSpec, partition_id: int, cache_dir: str) -> str | None:
    """Decode partition ``partition_id`` into ``cache_dir`` (:func:`partition_sizes`); None when done,
    else the data error's message (a worker of :func:`cache_partitions`)."""
    try:
        partition_sizes(spec, partition_id, cache_dir)
    except ConfigError as exc:
        return str(exc)
    return None


def cache_partitions(spec: DataSpec, cache_dir: str, workers: int) -> tuple[int, int, list[str]]:
    """Decode every partition of ``spec`` that ``cache_dir`` lacks into it, in ``workers`` processes
    of their own that exit when done, so that no long-lived process (a simulation's ClientApp actors,
    which serve many clients for the whole run) pays for what decoding imports and keeps: Hugging Face
    ``datasets`` with pandas, pyarrow and flwr-datasets with matplotlib, seaborn and scipy, and
    torchvision with torch._dynamo (measured: 299 -> 617 MiB USS in a process with torch, to decode
    CIFAR-10's first partition). The clients then memory-map the files (:func:`load_client_data`), as
    they would after a first run.

    Returns:
        ``(decoded, already cached, errors)``: partition counts and the data errors met (each a
        ``ConfigError`` message naming the file and row). A partition that fails is left uncached,
        so its client meets the same error at the handshake, where a run reports data errors.
    """
    missing = [i for i in range(spec.num_partitions) if not _cache_file(spec, i, cache_dir)[0].is_file()]
    errors = _in_workers(_cache_partition, spec, missing, cache_dir, workers)
    return len(missing) - len(errors), spec.num_partitions - len(missing), errors


def _split_partition(spec: DataSpec, partition_id: int, cache_dir: None) -> str | None:
    """None when partition ``partition_id`` splits into a train and a test set (:func:`partition_split`,
    nothing decoded), else the error's message (a worker of :func:`partition_errors`)."""
    try:
        partition_split(spec, partition_id, labels_only=True)
    except ConfigError as exc:
        return str(exc)
    return None


def partition_errors(spec: DataSpec, workers: int) -> list[str]:
    """The configuration or data errors of every partition of ``spec`` that the handshake would meet
    (:func:`partition_split`: the data checks, the partitioner, the train/test split), found from the
    labels alone (no image is decoded), in ``workers`` processes of their own that exit when done."""
    return _in_workers(_split_partition, spec, list(range(spec.num_partitions)), None, workers)


def _in_workers(
    worker: Callable[[DataSpec, int, str | None], str | None],
    spec: DataSpec,
    partitions: list[int],
    cache_dir: str | None,
    workers: int,
) -> list[str]:
    """The errors ``worker(spec, partition, cache_dir)`` returns for ``partitions``, called in up to
    ``workers`` spawned processes that exit when done."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    if not partitions:
        return []
    # spawn, not fork: a forked child would share this process's state (threads, open files) for nothing
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=max(1, min(workers, len(partitions))), mp_context=context) as pool:
        chunk = max(1, len(partitions) // (4 * workers))  # a worker keeps its partitioner between partitions
        n = len(partitions)
        results = list(pool.map(worker, [spec] * n, partitions, [cache_dir] * n, chunksize=chunk))
    return [r for r in results if r is not None]


def normalize(x: torch.Tensor, info: DatasetInfo) -> torch.Tensor:
    """uint8 ``[B, C, H, W]`` -> float32 normalised with the dataset's mean/std (ToTensor + Normalize)."""
    mean = torch.tensor(info.mean, device=x.device).view(1, -1, 1, 1)
    std = torch.tensor(info.std, device=x.device).view(1, -1, 1, 1)
    return (x.float() / 255.0 - mean) / std


def augment(x: torch.Tensor, info: DatasetInfo, generator: torch.Generator) -> torch.Tensor:
    """Training augmentation on a normalised batch ``[B, C, H, W]`` float32, drawn per image.

    Order and parameters as the FedGH authors' code (docs/methods/fedgh.md §8): horizontal
    flip (p=0.5), random erasing (p=0.5, scale (0.04, 0.2), ratio (0.5, 2), value 0), random
    crop with zero padding; each only where ``info`` enables it (:func:`with_recipe`), so
    ``augment = "none"`` returns ``x`` itself. torchvision's v2 transforms draw one set of
    parameters per call, so a batched call would flip or crop every image alike, and per-image
    calls cost about a third of a CNN-1 training step on this CPU; hence these few tensor ops.
    """
    n, c, h, w = x.shape
    dev = x.device
    if info.flip:
        flip = (torch.rand(n, generator=generator) < 0.5).to(dev)
        x = torch.where(flip.view(n, 1, 1, 1), x.flip(-1), x)
    if info.erase:
        apply = torch.rand(n, generator=generator) < 0.5
        area = h * w * (0.04 + 0.16 * torch.rand(n, generator=generator))
        ratio = torch.exp(math.log(0.5) + math.log(4.0) * torch.rand(n, generator=generator))
        eh = (area * ratio).sqrt().round().clamp(1, h).long()
        ew = (area / ratio).sqrt().round().clamp(1, w).long()
        top = (torch.rand(n, generator=generator) * (h - eh + 1)).long()
        left = (torch.rand(n, generator=generator) * (w - ew + 1)).long()
        rows, cols = torch.arange(h), torch.arange(w)
        in_rows = (rows >= top[:, None]) & (rows < (top + eh)[:, None])
        in_cols = (cols >= left[:, None]) & (cols < (left + ew)[:, None])
        mask = in_rows[:, :, None] & in_cols[:, None, :] & apply[:, None, None]
        x = x.masked_fill(mask[:, None].to(dev), 0.0)
    if info.crop_padding:
        p = info.crop_padding
        padded = F.pad(x, (p, p, p, p))
        dy = torch.randint(0, 2 * p + 1, (n, 1), generator=generator)
        dx = torch.randint(0, 2 * p + 1, (n, 1), generator=generator)
        rows = (dy + torch.arange(h)).to(dev)
        cols = (dx + torch.arange(w)).to(dev)
        batch = torch.arange(n, device=dev).view(n, 1, 1, 1)
        chan = torch.arange(c, device=dev).view(1, c, 1, 1)
        x = padded[batch, chan, rows.view(n, 1, h, 1), cols.view(n, 1, 1, w)]
    return x


def batches(n: int, batch_size: int, generator: torch.Generator | None) -> list[torch.Tensor]:
    """Index batches over ``n`` samples: shuffled with ``generator``, in order when it is None.

    The last partial batch is kept (docs/methods/fedgh.md §3).
    """
    order = torch.randperm(n, generator=generator) if generator is not None else torch.arange(n)
    return list(torch.split(order, batch_size))


def class_counts(labels: torch.Tensor, num_classes: int) -> np.ndarray:
    """Per-class sample counts int64 ``[num_classes]`` of an int64 label tensor."""
    return torch.bincount(labels, minlength=num_classes).numpy()
