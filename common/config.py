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
from dataclasses import asdict, dataclass, replace
from typing import Any, TypeVar

from common.datasets import AUGMENTATIONS, DATASETS, NORMALIZATIONS, with_recipe
from common.errors import ConfigError
from common.options import declared_fields, invalid, option, option_key, read_values

T = TypeVar("T")

PARTITIONERS = ("iid", "dirichlet", "pathological")
#: run config ``data-pool``: ``train`` partitions the official train split; ``train+test`` merges the
#: official train and test splits first, as the PFLlib/HtFLlib generators (FedTGP, FedRE) do
DATA_POOLS = ("train", "train+test")
DEVICES = ("auto", "cpu", "cuda")
#: run config ``precision``: ``fp32`` (default, the papers' recipe) or ``bf16`` autocast of local training
PRECISIONS = ("fp32", "bf16")
#: run config ``batch-order`` of local training: ``shuffle`` (default: reshuffled every epoch, the last
#: partial batch kept), ``fixed`` (the partition's own order every epoch, the last partial batch
#: dropped: HtFLlib's training loader, ``DataLoader(drop_last=True, shuffle=False)``, FedTGP's code) or
#: ``shuffle-drop`` (reshuffled every epoch, the last partial batch dropped: PFLlib's training loader,
#: ``DataLoader(drop_last=True, shuffle=True)``, FedRE's Table-12 code)
BATCH_ORDERS = ("shuffle", "fixed", "shuffle-drop")
EVAL_CLIENTS = ("auto", "all", "trained")
#: run config ``handshake``: ``all`` asks every node for its partition before round 1 (rounds sample by
#: partition id, so a seed samples the same partitions in every run); ``sampled`` asks no node up front
#: and each round only the nodes it samples that were not asked before, in their train message unless the
#: method needs the answer first (cross-device scale: Flower's simulation engine looks at every waiting
#: message for every node, so asking all N nodes costs O(N^2))
HANDSHAKES = ("auto", "all", "sampled")
#: ``handshake`` / ``eval-clients`` = ``auto`` (the defaults) choose ``sampled`` / ``trained`` above this many
#: clients (``num-clients``) and ``all`` / ``all`` up to it (:func:`resolve_auto`). Why 1,000: the handshake
#: of ``all`` costs Flower's engine about N^2 looks at stored messages (``results/scale/README.md``: over
#: 200 s before round 1 at N = 10,000, so about 2 s at 1,000), and ``sampled`` changes which partitions a
#: seed samples, so runs of the papers' sizes (20-100 clients) keep ``all``
AUTO_SAMPLED_CLIENTS = 1000
#: the keys whose ``auto`` :func:`resolve_auto` replaces, and the values it chooses from
AUTO_KEYS = {"handshake": HANDSHAKES[1:], "eval-clients": EVAL_CLIENTS[1:]}
#: what ``stop-patience`` watches: the unweighted mean over clients, or the pooled accuracy (HtFLlib's
#: auto-break, ``check_done`` on ``rs_test_acc``)
STOP_METRICS = ("accuracy_mean", "accuracy_weighted")
LOGGERS = ("none", "tensorboard")
#: run config ``aggregation``: how the server combines the uploads of one round (see
#: ``engine.robust``): ``norm-bound`` (default) bounds each upload's change from what the server sent
#: by the round's median (FLAME's clipping, Nguyen et al. 2022); ``mean`` is the papers' plain average;
#: the others are Flower's robust aggregators, for the methods whose server step is an average
AGGREGATIONS = ("norm-bound", "mean", "median", "trimmed-mean", "krum", "multi-krum", "bulyan")
#: ``independent``: client k's model is initialised from seed + k (FedGH, FedMRL code); ``identical``:
#: every client of one architecture starts from the same weights (HtFLlib/PFLlib: FedTGP, FedRE)
INITS = ("independent", "identical")


def _model_groups() -> tuple[str, ...]:
    from models.groups import MODEL_GROUPS  # imports torch: only when a config is read

    return tuple(MODEL_GROUPS)


@dataclass(frozen=True)
class RunConfig:
    """Validated run configuration shared by server and clients: every key of
    ``[tool.flwr.app.config]``, declared once with :func:`common.options.option` (type, default,
    bounds or allowed values, meaning) and read by the same reader as the method options.

    Units: ``round_timeout`` and ``connect_timeout`` in seconds; ``fraction_train`` and ``test_fraction`` are
    fractions in [0, 1], never percent. ``augment``, ``normalize`` and ``init`` set the training recipe
    (see ``common.datasets.with_recipe`` and ``INITS``). ``num_clients`` = 0 means "every node of the federation": the
    server learns N from the nodes' ``num-partitions`` at the handshake.
    """

    method: str = option("fedgh", "the method (see the method table); checked by `methods.registry`", nonempty=True)
    dataset: str = option(
        "cifar10",
        "`cifar10`, `mnist`, `fashion-mnist` offline from `data-dir`; `cifar100` from the Hugging Face Hub "
        "(needs internet)",
        choices=tuple(DATASETS),
    )
    data_dir: str = option(
        "../shared/data",
        "folder with `<dataset>/{train,test}.parquet` (Hugging Face schema), relative to the working directory; "
        "a SuperNode's `--node-config data-dir=...` overrides it",
        nonempty=True,
    )
    data_pool: str = option(
        "train",
        "`train`: the official train split is partitioned; `train+test`: the official train and test splits are "
        "merged first, as the PFLlib/HtFLlib generators behind FedTGP and FedRE do (each client's test split then "
        "comes from the pool)",
        choices=DATA_POOLS,
    )
    partitioner: str = option(
        "pathological",
        "flwr-datasets partitioner over the pool: `iid`, `dirichlet` (`dirichlet-*` keys), `pathological` "
        "(`classes-per-client`)",
        choices=PARTITIONERS,
    )
    dirichlet_alpha: float = option(0.5, "concentration of the Dirichlet partitioner", low=0, low_open=True)
    dirichlet_min_size: int = option(
        2, "the Dirichlet draw is repeated until every partition has at least this many samples", low=1
    )
    dirichlet_self_balancing: bool = option(
        False, "a partition above the average size gets no more samples (PFLlib/HtFLlib's rule: FedRE, FedTGP)"
    )
    classes_per_client: int = option(2, "classes per client of the pathological partitioner", low=1)
    test_fraction: float = option(
        0.2,
        "share of each client's partition kept as its local test split (same class proportions, seeded)",
        low=0,
        high=0.9,
        low_open=True,
    )
    max_examples_per_client: int = option(
        0, "cap per partition before the split, class proportions kept (+-1 per class; 0: all): quick runs", low=0
    )
    model_group: str = option(
        "hetero-cnn5",
        "the clients' architectures: client k gets member k mod size (CNN-1..5, FedTGP's HtFE/HtCNN zoo, FedRE's, "
        "MH-pFedHN's; see the model table)",
        choices=_model_groups,
    )
    feature_dim: int = option(
        512, "K, the representation size of the zoo groups (fixed pooling to K); CNN-1..5 give 500", low=1
    )
    num_clients: int = option(
        0,
        "0: every node of the federation (N from the nodes' `num-partitions`); N > 0: exactly N, a node whose "
        "`num-partitions` differs fails the run at the handshake",
        low=0,
    )
    min_clients: int = option(
        0,
        "0: the run starts once every training partition has answered the handshake; m > 0 (at most `num-clients` "
        "when that is set): once m have, the others joining at a round boundary when their SuperNode connects (a "
        "federation that grows while it runs)",
        low=0,
    )
    handshake: str = option(
        "auto",
        "`auto`: `sampled` above 1,000 clients (`num-clients`) when nothing needs every client (`eval-clients` "
        "`auto` or `trained`, `min-clients` = 0, no held-out clients, no client-level DP), else `all`; the choice is "
        "logged at start. "
        "`all`: every node answers a partition query before round 1 and rounds sample by partition id (a seed "
        "samples the same partitions in every run); `sampled`: no node is asked up front, each round samples K of "
        "the connected nodes (seeded, in node-id order) and asks only those not asked before (in their train "
        "message, unless the method, DP or `record-payloads` needs the answer first), so start-up and "
        "rounds do not grow with N (which partitions a seed samples then follows the nodes' ids; needs "
        "`num-clients` > 0, `eval-clients` = `trained`, `min-clients` = 0 and no held-out clients)",
        choices=HANDSHAKES,
    )
    num_server_rounds: int = option(20, "rounds", low=1)
    stop_patience: int = option(
        0,
        "stop once this many rounds have passed since the round of the best `stop-metric` (0: off); the last "
        "row's and the summary's `stop_reason` say why, and a resumed run counts from its rows",
        low=0,
    )
    max_untrained_rounds: int = option(
        3,
        "a run fails (status `failed`, the clients' errors in the summary) after this many rounds in a row without "
        "one valid training reply",
        low=1,
    )
    stop_metric: str = option(
        "accuracy_mean",
        "the row key `stop-patience` watches: `accuracy_mean` (unweighted over clients) or `accuracy_weighted` "
        "(pooled over all test samples, as HtFLlib's auto-break)",
        choices=STOP_METRICS,
    )
    local_epochs: int = option(1, "local epochs per round", low=0)
    batch_size: int = option(64, "local mini-batch size", low=1)
    lr: float = option(0.01, "local SGD learning rate", low=0)
    momentum: float = option(0.9, "local SGD momentum", low=0, high=1)
    weight_decay: float = option(0.001, "local SGD weight decay", low=0)
    clip_norm: float = option(50.0, "global gradient-norm clip of local training (0: off)", low=0)
    fraction_train: float = option(
        1.0, "share of clients sampled per round: K = max(1, floor(fraction x N)), seeded", low=0, high=1, low_open=True
    )
    aggregation: str = option(
        "norm-bound",
        "how the server combines a round's uploads: `norm-bound` (each upload's change bounded by the round's "
        "median), `mean` (the papers' plain average), or Flower's robust aggregators `median`, `trimmed-mean`, "
        "`krum`, `multi-krum`, `bulyan` (methods that average models or heads; FedProto and FD take `median` and "
        "`trimmed-mean` per class; each method page says which it takes)",
        choices=AGGREGATIONS,
    )
    byzantine_clients: int = option(
        1, "f, the Byzantine clients `krum`, `multi-krum` and `bulyan` tolerate (n > 2f + 2, Bulyan n > 4f + 2)", low=0
    )
    trim_fraction: float = option(
        0.2, "share cut from each end per coordinate by `trimmed-mean` (Flower's `trim_mean`)", low=0, high=0.49
    )
    eval_every: int = option(1, "evaluate the clients' personal models every n rounds (and the last)", low=1)
    eval_clients: str = option(
        "auto",
        "`auto`: `trained` when `handshake` is (or `auto` chooses) `sampled`, else `all`; "
        "`all`: every client every `eval-every` rounds; `trained`: only this round's sampled clients, right after "
        "training (FedMRL's official protocol A)",
        choices=EVAL_CLIENTS,
    )
    seed: int = option(42, "seed of the training (model initialisation, sampling, batch order, augmentation)", low=0)
    partition_seed: int = option(
        -1,
        "seed of the partition and each client's train/test split; -1: `seed` (a fixed one holds the partition "
        "while `seed` varies the training, as the papers' repetitions do)",
        low=-1,
    )
    output_dir: str = option("outputs", "folder of the run folders", nonempty=True)
    resume_from: str = option(
        "",
        "a previous run folder: continue after its last completed round from its `checkpoint.pt` (every method; "
        "clients find their state through `state-dir` or the run folder)",
    )
    state_dir: str = option(
        "",
        "folder for every client's state on disk (personal model, projector, ...); a SuperNode's node config "
        "`state-dir` overrides it. Without it a simulation keeps client state in `<run folder>/client-state/`, a "
        "deployed SuperNode in `context.state` (lost when it restarts)",
    )
    device: str = option(
        "auto", "where clients train: `auto` (a GPU when there is one), `cpu`, `cuda`", choices=DEVICES
    )
    precision: str = option(
        "fp32",
        "`fp32` (the papers' recipe) or `bf16`: local training's forward pass and loss under bfloat16 autocast "
        "(weights, gradients and optimiser in float32), for CPUs with AVX512-BF16 and GPUs",
        choices=PRECISIONS,
    )
    batch_order: str = option(
        "shuffle",
        "`shuffle`: reshuffled every epoch, the last partial batch kept; `fixed`: the partition's own order every "
        "epoch, the last partial batch dropped (HtFLlib's loader, FedTGP's code); `shuffle-drop`: reshuffled every "
        "epoch, the last partial batch dropped (PFLlib's loader, FedRE's Table-12 code)",
        choices=BATCH_ORDERS,
    )
    round_timeout: float = option(
        3600.0,
        "seconds to wait for a round's replies; later ones are recorded in `dropped_clients`",
        low=0,
        low_open=True,
    )
    connect_timeout: float = option(
        600.0, "seconds to wait for all clients to connect and answer the handshake", low=0, low_open=True
    )
    logger: str = option(
        "none", "`tensorboard`: also write every round row as TensorBoard scalars into the run folder", choices=LOGGERS
    )
    record_payloads: str = option(
        "",
        "rounds whose payloads the server records for the privacy evaluation (`tools.privacy`): comma-separated "
        "round numbers from 1 to `num-server-rounds` (`1,10`) or `all`; each client also keeps its personal model "
        "of those rounds in its state folder (see docs/privacy.md); at most `record-payloads-max-gib` on disk",
    )
    record_payloads_max_gib: float = option(
        1.0,
        "the most disk (GiB, 2^30 bytes) `record-payloads` may take: a run whose estimate (payload and personal "
        "model bytes per client and recorded round, times the recorded rounds and the clients) is above it is "
        "refused before it starts",
        low=0,
        low_open=True,
    )
    augment: str = option(
        "auto",
        "training augmentation: `auto` (FedGH's code: flip + random erasing + crop for CIFAR, crop for MNIST and "
        "Fashion-MNIST), `none` (FedTGP, FedRE, MH-pFedHN code) or one of the named pipelines",
        choices=AUGMENTATIONS,
    )
    normalize: str = option(
        "auto",
        "`auto` (ImageNet statistics for CIFAR-10 as FedGH's code, the dataset's own otherwise), `imagenet`, "
        "`dataset` (MH-pFedHN code), `half` (mean = std = 0.5: HtFLlib/PFLlib, FedTGP, FedRE)",
        choices=NORMALIZATIONS,
    )
    init: str = option(
        "independent",
        "`independent`: client k's model from seed + k (FedGH's code); `identical`: every client of one "
        "architecture starts from the same weights (HtFLlib/PFLlib)",
        choices=INITS,
    )
    extra: tuple[tuple[str, Any], ...] = ()  # other keys (method tables), sorted; a tuple keeps cfg hashable
    auto_chosen: tuple[str, ...] = ()  # the keys whose value `auto` chose (resolve_auto), for the start-up log

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> RunConfig:
        """Parse and validate a flat Flower run config.

        Every key is checked against its declaration; the method name and its options are
        checked by ``methods.registry``.

        Raises:
            ConfigError: on the first missing or invalid key.
        """
        names = {option_key(f) for f, _ in declared_fields(cls)}
        missing = sorted(names - set(raw))
        if missing:
            raise ConfigError(f"run config is missing key(s): {', '.join(missing)}")
        extra = tuple(sorted((k, v) for k, v in raw.items() if k not in names))
        cfg = resolve_auto(cls(**read_values(cls, raw), extra=extra))
        info = with_recipe(DATASETS[cfg.dataset], cfg.augment, cfg.normalize)
        if cfg.classes_per_client > info.num_classes:
            raise invalid(
                "classes-per-client",
                cfg.classes_per_client,
                f"integers from 1 to {info.num_classes} for dataset '{cfg.dataset}'",
            )
        if cfg.handshake == "sampled":
            # N must be known before any node is asked, and nothing may need every client
            for key, ok, allowed in (
                ("num-clients", cfg.num_clients > 0, "N > 0 with handshake = 'sampled' (K is drawn from N)"),
                ("eval-clients", cfg.eval_clients == "trained", "'trained' with handshake = 'sampled'"),
                ("min-clients", cfg.min_clients == 0, "0 with handshake = 'sampled'"),
            ):
                if not ok:
                    raise invalid(key, getattr(cfg, key.replace("-", "_")), allowed)
        if cfg.num_clients and cfg.min_clients > cfg.num_clients:  # the roster would wait for num-clients instead
            raise invalid("min-clients", cfg.min_clients, f"0 to 'num-clients' = {cfg.num_clients}")
        cfg.recorded_rounds  # noqa: B018 (parses record-payloads: a bad value fails here)
        # each client needs one local train and one local test example (test-fraction > 0): a larger N
        # would fail on every client at the handshake, so it fails here, before anything starts
        if cfg.num_clients > cfg.pool_size // 2:
            raise invalid(
                "num-clients",
                cfg.num_clients,
                f"0 to {cfg.pool_size // 2} for dataset '{cfg.dataset}' with data-pool '{cfg.data_pool}' "
                f"({cfg.pool_size} examples, at least 2 per client: one to train, one to test)",
            )
        return cfg

    @property
    def data_seed(self) -> int:
        """The seed of the partition (the shuffle, the partitioner and each client's train/test split):
        ``partition-seed``, or ``seed`` when that is -1 (the default), so a grid can hold the
        partition fixed while ``seed`` varies the training (model initialisation, client RNG)."""
        return self.seed if self.partition_seed < 0 else self.partition_seed

    @property
    def recorded_rounds(self) -> frozenset[int] | None:
        """The rounds ``record-payloads`` names: a set of rounds (empty: off), or None for ``all``.

        Raises:
            ConfigError: a value that is neither ``all`` nor comma-separated rounds from 1 to
                ``num-server-rounds`` (a later round never comes: nothing would be recorded).
        """
        text = self.record_payloads.strip()
        if text == "all":
            return None
        parts = [p.strip() for p in text.split(",")] if text else []
        last = self.num_server_rounds
        # isascii: str.isdigit takes other scripts' digits (and superscripts, which int() refuses)
        if not all(p.isascii() and p.isdigit() and 1 <= int(p) <= last for p in parts):
            raise invalid(
                "record-payloads",
                self.record_payloads,
                f"'' (off), 'all' or comma-separated rounds from 1 to 'num-server-rounds' = {last} ('1,{last}')",
            )
        return frozenset(int(p) for p in parts)

    def is_eval_round(self, server_round: int) -> bool:
        """True every ``eval-every`` rounds and in the last round (``num-server-rounds``)."""
        return server_round % self.eval_every == 0 or server_round == self.num_server_rounds

    def records_round(self, server_round: int) -> bool:
        """True when ``record-payloads`` names round ``server_round`` (or is ``all``)."""
        rounds = self.recorded_rounds
        return server_round >= 1 and (rounds is None or server_round in rounds)

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
        out = {k.replace("_", "-"): v for k, v in asdict(self).items() if k not in ("extra", "auto_chosen")}
        out.update(dict(self.extra))
        return out


def sample_size(fraction: float, num_nodes: int) -> int:
    """Clients per round K = max(1, floor(fraction * N)) (docs/methods/fedgh.md §4), run config
    ``fraction-train``: the roster's draw and client-level DP's expected sample.

    The product is rounded to 9 decimals first so that 0.29 * 100 gives 29, not 28.
    """
    return max(1, math.floor(round(fraction * num_nodes, 9)))


def resolve_auto(cfg: RunConfig) -> RunConfig:
    """``cfg`` with ``handshake`` and ``eval-clients`` = ``auto`` replaced by what they choose, and
    :attr:`RunConfig.auto_chosen` naming the keys so chosen; a value the user set stands.

    ``handshake``: ``sampled`` when ``num-clients`` > :data:`AUTO_SAMPLED_CLIENTS` and nothing needs every
    client answered up front (``eval-clients`` not ``all``, ``min-clients`` = 0, no
    ``generalization.held-out-clients``, no ``client-dp.epsilon``), else ``all``. ``eval-clients``:
    ``trained`` with a ``sampled`` handshake (which needs it), else ``all``. Up to 1,000 clients both
    choose what the defaults were (``all``), so such runs are unchanged.
    """
    chosen = []
    handshake, eval_clients = cfg.handshake, cfg.eval_clients
    if handshake == "auto":
        tables = dict(cfg.extra)
        # the table keys are validated later, by their tables: any value but 0 counts as set here
        held_out = tables.get("generalization.held-out-clients", 0) != 0
        client_dp = tables.get("client-dp.epsilon", 0) != 0  # samples the clients itself
        large = cfg.num_clients > AUTO_SAMPLED_CLIENTS
        free = eval_clients != "all" and cfg.min_clients == 0 and not held_out and not client_dp
        handshake = "sampled" if large and free else "all"
        chosen.append("handshake")
    if eval_clients == "auto":
        eval_clients = "trained" if handshake == "sampled" else "all"
        chosen.append("eval-clients")
    if not chosen:
        return cfg
    return replace(cfg, handshake=handshake, eval_clients=eval_clients, auto_chosen=tuple(chosen))


def read_options(cls: type[T], cfg: RunConfig, table: str | None = None) -> T:
    """The options of table ``table`` (default: the run's method) of ``cfg``, validated.

    Keys the table does not set take their declared default. If ``cls`` has a ``check(cfg)``
    method (cross-key or cross-config rules), it runs last.

    Raises:
        ConfigError: an unknown key in the table (naming it and the table's keys), or a value
            outside its declaration (naming the key and its allowed values).
    """
    table = table or cfg.method
    given = cfg.method_options(table)
    known = [option_key(f) for f, _ in declared_fields(cls)]
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise ConfigError(
            f"run config key(s) {', '.join(repr(f'{table}.{k}') for k in unknown)} unknown: "
            f"the keys of [{table}] are {', '.join(repr(k) for k in known) or 'none'}"
        )
    options = cls(**read_values(cls, given, f"{table}."))
    if hasattr(options, "check"):
        options.check(cfg)
    return options
