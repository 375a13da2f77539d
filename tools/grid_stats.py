"""The statistics of a grid's cells: mean ± sample std over seeds, per-method summary numbers
(:func:`method_stats`), rounds above a baseline, differences in standard errors, training FLOPs per
client-round, and the class-prior baseline's accuracy (:func:`prior_accuracy`)."""

from __future__ import annotations

import functools

import numpy as np

from common.errors import ConfigError
from tools.grid_rows import Cell
from tools.runconfig import app_defaults


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (ddof 1; 0 for a single value)."""
    a = np.asarray(values, dtype=np.float64)
    return float(a.mean()), float(a.std(ddof=1)) if len(a) > 1 else 0.0


def mean_ci(values: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """(mean, lower, upper): the mean and its Student-t confidence interval at ``level`` (a fraction) over
    independent ``values``; a single value gives an interval of that value alone.

    Raises:
        ValueError: no values.
    """
    from scipy import stats  # imported here: a second of start-up the other reports do not need

    a = np.asarray(values, dtype=np.float64)
    if not len(a):
        raise ValueError("mean_ci needs at least one value")
    mean = float(a.mean())
    if len(a) == 1:
        return mean, mean, mean
    half = float(stats.t.ppf(0.5 + level / 2, len(a) - 1) * a.std(ddof=1) / np.sqrt(len(a)))
    return mean, mean - half, mean + half


def seed_curves(cells: list[Cell], key: str) -> tuple[np.ndarray, np.ndarray]:
    """``(rounds [n], values [seeds, n])`` of ``key`` (fractions, float64) over the n rounds that
    every cell evaluated (:meth:`Cell.curve`): a round one seed left out (an incomplete
    evaluation) or has not reached is left out for all, so each column is one round."""
    curves = [c.curve(key) for c in cells]
    rounds = functools.reduce(np.intersect1d, [r for r, _ in curves])
    return rounds, np.stack([values[np.isin(r, rounds)] for r, values in curves])


def above_baseline(cells: list[Cell], baseline: list[Cell], key: str) -> dict:
    """Where the mean over seeds of ``key`` is above ``baseline``'s (also a mean over its seeds),
    over the rounds both have: ``first`` (the first round above, None if never), ``stays_from``
    (the first round of the final stretch above, None when it ends at or below), ``above`` (how
    many rounds are above) and ``of`` (how many rounds were compared)."""
    ours_rounds, ours = seed_curves(cells, key)
    theirs_rounds, theirs = seed_curves(baseline, key)
    rounds = np.intersect1d(ours_rounds, theirs_rounds)
    n = len(rounds)
    is_above = ours[:, np.isin(ours_rounds, rounds)].mean(0) > theirs[:, np.isin(theirs_rounds, rounds)].mean(0)
    behind = np.nonzero(~is_above)[0]
    stays_from = None
    if n and is_above[-1]:  # the final stretch starts right after the last round not above
        stays_from = int(rounds[behind[-1] + 1]) if len(behind) else int(rounds[0])
    first = int(rounds[np.argmax(is_above)]) if is_above.any() else None
    return {"first": first, "stays_from": stays_from, "above": int(is_above.sum()), "of": n}


def rounds_to_target(cell: Cell, key: str, target: float) -> int | None:
    """First round whose ``key`` reaches ``target`` (a fraction), None if never."""
    rounds, values = cell.curve(key)
    hit = np.nonzero(values >= target)[0]
    return int(rounds[hit[0]]) if len(hit) else None


def method_stats(cells: list[Cell], key: str, target: float | None) -> dict:
    """The table's numbers for one method's cells (its seeds)."""
    out = {"seeds": sorted(c.seed for c in cells), "rounds": sorted({len(c.rows) for c in cells})}
    # a run that stop-patience ended is finished; any other with fewer rounds than the paper's is not
    out["stopped"] = sum(bool(c.rows[-1].get("stop_reason")) for c in cells)
    out["open_rounds"] = sorted({len(c.rows) for c in cells if not c.rows[-1].get("stop_reason")})
    for metric in ("accuracy_mean", "accuracy_weighted"):
        curves = [values for values in (c.curve(metric)[1] for c in cells) if len(values)]
        finals = [values[-1] for values in curves]
        bests = [values.max() for values in curves]
        out[f"final_{metric}"] = mean_std(finals) if finals else None
        out[f"best_{metric}"] = mean_std(bests) if bests else None
    clients = sum(r["num_clients"] for c in cells for r in c.rows)
    out["up_per_client_round"] = sum(r["bytes_up"] for c in cells for r in c.rows) / max(clients, 1)
    out["down_per_client_round"] = sum(r["bytes_down"] for c in cells for r in c.rows) / max(clients, 1)
    # the median: a grid's launches may run beside other jobs, which inflates some rounds many times
    out["seconds_per_round"] = float(np.median([r["round_seconds"] for c in cells for r in c.rows]))
    if target is not None:
        hits = [(rounds_to_target(c, key, target), c) for c in cells]
        reached = [(r, c) for r, c in hits if r is not None]
        out["reached"] = f"{len(reached)}/{len(cells)}"
        out["rounds_to_target"] = mean_std([r for r, _ in reached]) if reached else None
        out["bytes_to_target"] = float(np.mean([c.cumulative_bytes()[r - 1] for r, c in reached])) if reached else None
    return out


def difference(a: tuple[float, float], n_a: int, b: tuple[float, float], n_b: int) -> tuple[float, float | None]:
    """``a - b`` in points and in standard errors, sqrt(std_a**2 / n_a + std_b**2 / n_b) (None when
    either has one seed or there is no spread); ``a``, ``b``: (mean, sample std) as fractions."""
    diff = 100 * (a[0] - b[0])
    se = 100 * float(np.sqrt(a[1] ** 2 / n_a + b[1] ** 2 / n_b))
    return diff, diff / se if min(n_a, n_b) > 1 and se > 0 else None


def with_federation_size(config: dict, cells: list[Cell]) -> dict:
    """``config`` (a run's or a grid's run config) with ``num-clients`` the size of the federation its
    ``cells`` ran in, for the partition figure and the FLOPs, which partition the data as the clients did.

    A config with ``num-clients`` > 0 is returned as it is. With 0 (the default: the server takes every
    node, as a plain ``flwr run`` does) the size is the ``num_clients`` the runs' summaries recorded,
    else the most clients one round of theirs saw (its ``num_clients``, or its highest partition id of
    ``accuracy_per_client`` + 1).

    Raises:
        ConfigError: ``num-clients`` is 0 and neither the summaries nor the rows say how many clients
            there were.
    """
    if {**app_defaults(), **config}["num-clients"]:
        return config
    recorded = [n for c in cells if isinstance(n := c.summary.get("num_clients"), int) and n > 0]
    seen = [
        max([int(r.get("num_clients") or 0), *(int(p) + 1 for p in r.get("accuracy_per_client") or {})])
        for c in cells
        for r in c.rows
    ]
    size = max(recorded) if recorded else max(seen, default=0)
    if size < 1:
        raise ConfigError("run config num-clients = 0 and no summary or round row says how many clients took part")
    return {**config, "num-clients": size}


def training_flops(config: dict, data_dir: str | None = None) -> float:
    """Training FLOPs per client-round: forward + backward of each client's personal model on one
    sample (``FlopCounterMode``), times its training samples and ``local-epochs``, averaged over clients.

    ``config`` is the run config of one cell (its seed fixes the partition, hence the sample counts).
    """
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from common.config import RunConfig
    from common.data import DataSpec, partition_split
    from common.datasets import DATASETS
    from models.groups import MODEL_GROUPS

    cfg = RunConfig.from_dict({**app_defaults(), **config, **({"data-dir": data_dir} if data_dir else {})})
    info, group = DATASETS[cfg.dataset], MODEL_GROUPS[cfg.model_group]
    spec = DataSpec.from_config(cfg, cfg.num_clients)
    per_sample: dict[tuple[str, str], float] = {}
    total = 0.0
    for pid in range(cfg.num_clients):
        key = (group.architecture_for(pid), group.head_for(pid))
        if key not in per_sample:
            model = group.build(pid, info.num_classes, info.channels, info.image_size, cfg.seed, cfg.feature_dim)
            x = torch.zeros(2, info.channels, info.image_size, info.image_size)  # 2: BatchNorm in train mode
            with FlopCounterMode(display=False) as counter:
                model(x).sum().backward()
            per_sample[key] = counter.get_total_flops() / 2
        total += per_sample[key] * len(partition_split(spec, pid, labels_only=True)[2]) * cfg.local_epochs
    return total / cfg.num_clients


def prior_accuracy(config: dict, partitions: list[int], data_dir: str | None = None) -> tuple[float, float]:
    """(mean over clients, pooled) test accuracy, fractions, of the class prior alone: each client of
    ``partitions`` predicts its most frequent training class (the lowest id on a tie) for every test
    example. A model that learnt only its client's label skew scores this; the rows' accuracies are
    read against it.

    ``config`` is the run config of one cell (its seed and ``num-clients`` fix the partitions);
    ``data_dir`` overrides its ``data-dir``.

    Raises:
        ConfigError: the dataset is not readable there (``common.data.partition_split``), or
            ``partitions`` is empty.
    """
    from common.config import RunConfig
    from common.data import DataSpec, class_counts, partition_split
    from common.datasets import DATASETS

    if not partitions:
        raise ConfigError("no partitions to score the class prior on")
    cfg = RunConfig.from_dict({**app_defaults(), **config, **({"data-dir": data_dir} if data_dir else {})})
    spec = DataSpec.from_config(cfg, cfg.num_clients)
    hits, totals = [], []
    for pid in partitions:  # the labels alone: the same split as the client's data, no image decoded
        _, labels, train_idx, test_idx = partition_split(spec, pid, labels_only=True)
        majority = int(class_counts(labels[train_idx], DATASETS[cfg.dataset].num_classes).argmax())
        hits.append(int((labels[test_idx] == majority).sum()))
        totals.append(len(test_idx))
    per_client = [h / t for h, t in zip(hits, totals, strict=True) if t]
    return float(np.mean(per_client)), sum(hits) / max(1, sum(totals))


def prior_by_seed(
    preset_config: dict, cells: list[Cell], data_dir: str | None = None
) -> dict[str, dict[int, tuple[float, float]]]:
    """:func:`prior_accuracy` (mean over clients, pooled) of a grid's clients for each of its cells' seeds:
    ``training`` (every partition but the held-out ones) and, when the summaries name held-out partitions
    (run config ``generalization.held-out-clients``), ``held-out``; each seed -> (mean, pooled).

    Raises:
        ConfigError: see :func:`prior_accuracy` and :func:`with_federation_size`.
    """
    config = with_federation_size(preset_config, cells)
    size = {**app_defaults(), **config}["num-clients"]
    held = sorted({p for c in cells for p in c.summary.get("held_out_partitions") or []})
    groups = {"training": [p for p in range(size) if p not in held], **({"held-out": held} if held else {})}
    seeds = sorted({c.seed for c in cells})
    return {
        label: {seed: prior_accuracy({**config, "seed": seed}, partitions, data_dir) for seed in seeds}
        for label, partitions in groups.items()
    }


def prior_stats(by_seed: dict[int, tuple[float, float]]) -> dict[str, tuple[float, float]]:
    """One group of :func:`prior_by_seed`, mean ± sample std over the seeds: ``{"mean": ..., "weighted": ...}``."""
    return {"mean": mean_std([m for m, _ in by_seed.values()]), "weighted": mean_std([w for _, w in by_seed.values()])}
