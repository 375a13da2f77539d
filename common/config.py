"""Run configuration: one typed, validated view of Flower's flat ``run_config``.

Every key lives in ``[tool.flwr.app.config]`` of ``pyproject.toml`` and can be overridden
with ``flwr run . --run-config "key=value ..."``. Method-specific keys sit in a nested
table named after the method (``[tool.flwr.app.config.fedgh]``), which Flower flattens
to dotted keys (``fedgh.server-lr``); :meth:`RunConfig.method_options` returns them.

Both the ServerApp and the ClientApp parse the same config, so a bad value fails on the
server before any message is sent.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from common.datasets import AUGMENTATIONS, DATASETS, NORMALIZATIONS, with_recipe
from common.errors import ConfigError

PARTITIONERS = ("iid", "dirichlet", "pathological")
#: run config ``data-pool``: ``train`` partitions the official train split; ``train+test`` merges the
#: official train and test splits first, as the PFLlib/HtFLlib generators (FedTGP, FedRE) do
DATA_POOLS = ("train", "train+test")
DEVICES = ("auto", "cpu", "cuda")
#: run config ``precision``: ``fp32`` (default, the papers' recipe) or ``bf16`` autocast of local training
PRECISIONS = ("fp32", "bf16")
#: run config ``batch-order`` of local training: ``shuffle`` (default: reshuffled every epoch, the last
#: partial batch kept) or ``fixed`` (the partition's own order every epoch, the last partial batch
#: dropped: HtFLlib's training loader, ``DataLoader(drop_last=True, shuffle=False)``, FedTGP's code)
BATCH_ORDERS = ("shuffle", "fixed")
EVAL_CLIENTS = ("all", "trained")
LOGGERS = ("none", "tensorboard")
#: ``independent``: client k's model is initialised from seed + k (FedGH, FedMRL code); ``identical``:
#: every client of one architecture starts from the same weights (HtFLlib/PFLlib: FedTGP, FedRE)
INITS = ("independent", "identical")


def _fail(key: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError(f"run config key '{key}' = {value!r} is invalid: allowed values are {allowed}")


def choice(key: str, value: Any, allowed: tuple[str, ...] | list[str]) -> str:
    """Return ``value`` if it is one of ``allowed``.

    Raises:
        ConfigError: naming ``key`` and listing the allowed values.
    """
    if not isinstance(value, str) or value not in allowed:
        raise _fail(key, value, ", ".join(repr(a) for a in allowed))
    return value


#: the range of every integer key unless it declares a narrower one: Flower carries run config
#: integers as signed 64-bit (``sint64``), so a larger one passes nowhere
INT64 = (-(2**63), 2**63 - 1)


def number(
    key: str,
    value: Any,
    *,
    kind: type = float,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
) -> Any:
    """Return ``value`` as ``kind`` (int or float) if it is finite and lies in the given range.

    Every numeric run config key and method option is read here, so this is the one place that
    refuses NaN and infinity (a ``<``/``>`` range check lets NaN through, and Flower compares a
    run's config before and after each message, where NaN != NaN) and integers outside
    :data:`INT64` (or the key's narrower ``low``/``high``). ``low_open=True`` excludes ``low``
    itself (e.g. a learning rate must be > 0).

    Raises:
        ConfigError: naming ``key`` and the allowed range.
    """
    if kind is int:
        low = INT64[0] if low is None else max(low, INT64[0])
        high = INT64[1] if high is None else min(high, INT64[1])
    allowed = f"finite {'integers' if kind is int else 'numbers'}{_range_text(low, high, low_open)}"
    ok_types = (int,) if kind is int else (int, float)
    if isinstance(value, bool) or not isinstance(value, ok_types):
        raise _fail(key, value, f"{'an integer' if kind is int else 'a number'}{_range_text(low, high, low_open)}")
    try:
        v = kind(value)
    except OverflowError:  # an integer beyond float range given for a float key
        raise _fail(key, value, allowed) from None
    if (
        (kind is float and not math.isfinite(v))
        or (low is not None and (v < low or (low_open and v == low)))
        or (high is not None and v > high)
    ):
        raise _fail(key, value, allowed)
    return v


def flag(key: str, value: Any) -> bool:
    """Return ``value`` if it is a bool.

    Raises:
        ConfigError: naming ``key``.
    """
    if not isinstance(value, bool):
        raise _fail(key, value, "true, false")
    return value


def _range_text(low: float | None, high: float | None, low_open: bool) -> str:
    parts = []
    if low is not None:
        parts.append(f"{'>' if low_open else '>='} {low}")
    if high is not None:
        parts.append(f"<= {high}")
    return (" " + " and ".join(parts)) if parts else ""


@dataclass(frozen=True)
class RunConfig:
    """Validated run configuration shared by server and clients.

    Units: ``round_timeout`` and ``connect_timeout`` in seconds; ``fraction_train`` and ``test_fraction`` are
    fractions in [0, 1], never percent. ``augment``, ``normalize`` and ``init`` set the training recipe
    (see ``common.datasets.with_recipe`` and ``INITS``). ``num_clients`` = 0 means "every node of the federation": the
    server learns N from the nodes' ``num-partitions`` at the handshake.
    """

    method: str
    dataset: str
    data_dir: str
    data_pool: str
    partitioner: str
    dirichlet_alpha: float
    dirichlet_min_size: int
    dirichlet_self_balancing: bool
    classes_per_client: int
    test_fraction: float
    max_examples_per_client: int
    model_group: str
    feature_dim: int
    num_clients: int
    num_server_rounds: int
    stop_patience: int
    local_epochs: int
    batch_size: int
    lr: float
    momentum: float
    weight_decay: float
    clip_norm: float
    fraction_train: float
    eval_every: int
    eval_clients: str
    seed: int
    partition_seed: int
    output_dir: str
    resume_from: str
    state_dir: str
    device: str
    precision: str
    batch_order: str
    round_timeout: float
    connect_timeout: float
    logger: str
    augment: str
    normalize: str
    init: str
    extra: tuple[tuple[str, Any], ...] = ()  # other keys (method tables), sorted; a tuple keeps cfg hashable

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> RunConfig:
        """Parse and validate a flat Flower run config.

        Dataset and model-group names are checked against their registries; the method
        name and its options are checked by ``strategies.registry``.

        Raises:
            ConfigError: on the first missing or invalid key.
        """
        from models.groups import MODEL_GROUPS  # imports torch: only when a config is parsed

        names = {f.name.replace("_", "-") for f in fields(cls)} - {"extra"}
        missing = sorted(names - set(raw))
        if missing:
            raise ConfigError(f"run config is missing key(s): {', '.join(missing)}")
        g = raw.__getitem__
        cfg = cls(
            method=_string("method", g("method")),
            dataset=choice("dataset", g("dataset"), tuple(DATASETS)),
            data_dir=_string("data-dir", g("data-dir")),
            data_pool=choice("data-pool", g("data-pool"), DATA_POOLS),
            partitioner=choice("partitioner", g("partitioner"), PARTITIONERS),
            dirichlet_alpha=number("dirichlet-alpha", g("dirichlet-alpha"), low=0, low_open=True),
            dirichlet_min_size=number("dirichlet-min-size", g("dirichlet-min-size"), kind=int, low=1),
            dirichlet_self_balancing=flag("dirichlet-self-balancing", g("dirichlet-self-balancing")),
            classes_per_client=number("classes-per-client", g("classes-per-client"), kind=int, low=1),
            test_fraction=number("test-fraction", g("test-fraction"), low=0, high=0.9, low_open=True),
            max_examples_per_client=number("max-examples-per-client", g("max-examples-per-client"), kind=int, low=0),
            model_group=choice("model-group", g("model-group"), tuple(MODEL_GROUPS)),
            feature_dim=number("feature-dim", g("feature-dim"), kind=int, low=1),
            num_clients=number("num-clients", g("num-clients"), kind=int, low=0),
            num_server_rounds=number("num-server-rounds", g("num-server-rounds"), kind=int, low=1),
            stop_patience=number("stop-patience", g("stop-patience"), kind=int, low=0),
            local_epochs=number("local-epochs", g("local-epochs"), kind=int, low=0),
            batch_size=number("batch-size", g("batch-size"), kind=int, low=1),
            lr=number("lr", g("lr"), low=0),
            momentum=number("momentum", g("momentum"), low=0, high=1),
            weight_decay=number("weight-decay", g("weight-decay"), low=0),
            clip_norm=number("clip-norm", g("clip-norm"), low=0),
            fraction_train=number("fraction-train", g("fraction-train"), low=0, high=1, low_open=True),
            eval_every=number("eval-every", g("eval-every"), kind=int, low=1),
            eval_clients=choice("eval-clients", g("eval-clients"), EVAL_CLIENTS),
            seed=number("seed", g("seed"), kind=int, low=0),
            partition_seed=number("partition-seed", g("partition-seed"), kind=int, low=-1),
            output_dir=_string("output-dir", g("output-dir")),
            resume_from=_optional_string("resume-from", g("resume-from")),
            state_dir=_optional_string("state-dir", g("state-dir")),
            device=choice("device", g("device"), DEVICES),
            precision=choice("precision", g("precision"), PRECISIONS),
            batch_order=choice("batch-order", g("batch-order"), BATCH_ORDERS),
            round_timeout=number("round-timeout", g("round-timeout"), low=0, low_open=True),
            connect_timeout=number("connect-timeout", g("connect-timeout"), low=0, low_open=True),
            logger=choice("logger", g("logger"), LOGGERS),
            augment=choice("augment", g("augment"), AUGMENTATIONS),
            normalize=choice("normalize", g("normalize"), NORMALIZATIONS),
            init=choice("init", g("init"), INITS),
            extra=tuple(sorted((k, v) for k, v in raw.items() if k not in names)),
        )
        info = with_recipe(DATASETS[cfg.dataset], cfg.augment, cfg.normalize)
        if cfg.classes_per_client > info.num_classes:
            raise _fail(
                "classes-per-client",
                cfg.classes_per_client,
                f"integers from 1 to {info.num_classes} for dataset '{cfg.dataset}'",
            )
        return cfg

    @property
    def data_seed(self) -> int:
        """The seed of the partition (the shuffle, the partitioner and each client's train/test split):
        ``partition-seed``, or ``seed`` when that is -1 (the default), so a grid can hold the
        partition fixed while ``seed`` varies the training (model initialisation, client RNG)."""
        return self.seed if self.partition_seed < 0 else self.partition_seed

    @property
    def pool_size(self) -> int:
        """Examples in the pool that is partitioned (``data-pool``): the train split, or train + test."""
        info = DATASETS[self.dataset]
        return info.train_size + (info.test_size if self.data_pool == "train+test" else 0)

    @property
    def representation_dim(self) -> int:
        """d: the representation size of every client model (500 for CNN-1..5, else ``feature-dim``)."""
        from models.groups import MODEL_GROUPS

        return MODEL_GROUPS[self.model_group].feature_dim(self.feature_dim)

    def method_options(self, table: str | None = None) -> dict[str, Any]:
        """Keys of table ``table`` (default: the run's method's own table), without the ``<table>.`` prefix."""
        prefix = f"{table or self.method}."
        return {k[len(prefix) :]: v for k, v in self.extra if k.startswith(prefix)}

    def as_dict(self) -> dict[str, Any]:
        """The full config as a flat JSON-serialisable dict with Flower's key names."""
        out = {k.replace("_", "-"): v for k, v in asdict(self).items() if k != "extra"}
        out.update(dict(self.extra))
        return out


def _optional_string(key: str, value: Any) -> str:
    if not isinstance(value, str):
        raise _fail(key, value, "a string (empty: off)")
    return value


def _string(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise _fail(key, value, "a non-empty string")
    return value
