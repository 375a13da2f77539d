"""Byzantine clients: honest-client accuracy with and without one attacker, per aggregation rule.

Usage (from the repository root):

    uv run --frozen python -m bench.byzantine --out outputs/bench-byzantine [--rounds 5]
        [--max-examples 200] [--seeds 0,1,2] [--aggregations mean,norm-bound] [--attacks fml-10,...]

Every run is in-process over :class:`tools.fakegrid.FakeGrid` (the real ClientApp, no Ray):
MNIST, model group ``cnn1`` (the shared models at their defaults, CNN-5), 4 clients, all sampled
every round; the attacker is partition 1,
whose train replies of every round pass through the attack's tamper. For each attack of
:data:`ATTACKS`, aggregation and seed it runs the federation with and without the attacker and
records the mean over the 3 honest clients' (partitions 0, 2, 3) final accuracy; then, on clean
runs of FML and LG-FedAvg, the accuracy cost of ``norm-bound`` against ``mean``. One JSON row per
run is appended to ``<out>/rows.jsonl`` as it finishes, and a run already there is skipped, so an
interrupted bench continues where it stopped. The table printed at the end averages over seeds.

:data:`ATTACKS` maps a name to ``(method, run config overrides, tamper factory)``; a factory
``(seed) -> attack`` returns the function that rewrites the attacker's payload arrays
(name -> ndarray, as it would upload them) into the hostile ones. Other engineers add attacks
on other methods there.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from flwr.app import Array, ArrayRecord, Message, RecordDict

from common.config import RunConfig
from common.errors import RunFailed
from common.protocol import PAYLOAD
from tools.fakegrid import FakeGrid
from tools.runconfig import app_defaults

ROOT = Path(__file__).resolve().parents[1]
DATA_DIR = ROOT.parent / "shared" / "data"
ATTACKER = 1  # partition of the Byzantine client
HONEST = (0, 2, 3)
NUM_CLIENTS = 4

#: an attack: the attacker's payload arrays (name -> ndarray) -> the arrays it uploads instead
Attack = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]


def constant(value: float) -> Callable[[int], Attack]:
    """Every entry of every array set to ``value`` (FML's 10, FedMRL's 100, all-zero)."""
    return lambda seed: lambda arrays: {k: np.full_like(v, value) for k, v in arrays.items()}


def signs(scale: float) -> Callable[[int], Attack]:
    """Every entry ``±scale``, signs drawn from ``seed`` (new draws every round)."""

    def factory(seed: int) -> Attack:
        rng = np.random.default_rng(seed)
        return lambda arrays: {k: (scale * rng.choice([-1.0, 1.0], v.shape)).astype(v.dtype) for k, v in arrays.items()}

    return factory


def svd_rebuilding_to(value: float) -> Callable[[int], Attack]:
    """FedKD: every SVD factor triple (``.u``, ``.s``, ``.v``) replaced so that (U·diag(s))·V has
    every entry ``value``: U = V = 1, s_k = value / r. It passes the schema's rebuild bound
    (Σ_k |u s_k| · max|v| = value, up to rounding: take ``value`` a little below 1e6)."""

    def attack(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = dict(arrays)
        for key in [k[:-2] for k in arrays if k.endswith(".s")]:
            r = len(arrays[key + ".s"])
            out[key + ".u"] = np.ones_like(arrays[key + ".u"])
            out[key + ".s"] = np.full_like(arrays[key + ".s"], value / r)
            out[key + ".v"] = np.ones_like(arrays[key + ".v"])
        return out

    return lambda seed: attack


def setting(key: str, value: float) -> Callable[[int], Attack]:
    """Payload array ``key`` filled with ``value``, the others as uploaded (FedRE: z = 100, its
    soft label kept, so the reply passes the soft-label check)."""
    return lambda seed: lambda arrays: {**arrays, key: np.full_like(arrays[key], value)}


def every_class(
    values: str, labels: str, value: float, next_class: bool = False, classes: tuple[int, ...] = tuple(range(10))
) -> Callable[[int], Attack]:
    """Per-class uploads (prototypes, LARs, logits): a row for each class of ``classes`` (all 10 by
    default, held or not), every entry ``value``; with ``next_class`` row c is ``value`` · e_{c+1 mod 10}
    instead (FD: logits that name the next class, since a constant logit vector changes no softmax)."""
    chosen = np.array(classes, np.int64)

    def attack(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        width = arrays[values].shape[1]
        rows = np.roll(np.eye(10, width), 1, axis=1) if next_class else np.ones((10, width))
        return {
            values: (value * rows[chosen]).astype(arrays[values].dtype),
            labels: chosen.astype(arrays[labels].dtype),
        }

    return lambda seed: attack


#: the class the "-one" attacks claim: at ``--partition-seed 0`` the class most clients hold (MNIST,
#: pathological, 2 classes a client: partitions 0, 3, 4 of 5; 0, 3, 4, 5, 7 of 10), so its honest
#: holders outnumber 1 or 2 colluders (partitions 1, 2) and are outnumbered by 4 (1-4) of 10
ONE_CLASS = 6
#: name -> (method, run config overrides, tamper factory (seed) -> attack on the payload arrays)
ATTACKS: dict[str, tuple[str, dict, Callable[[int], Attack]]] = {
    "fml-10": ("fml", {}, constant(10.0)),
    "fml-zero": ("fml", {}, constant(0.0)),
    "fedmrl-100": ("fedmrl", {}, constant(100.0)),
    "fedkd-1e6": ("fedkd", {}, svd_rebuilding_to(0.99e6)),
    "lg-fedavg-1e6": ("lg-fedavg", {}, signs(1e6)),
    "fedre-z-100": ("fedre", {}, setting("z", 100.0)),
    "fedproto-1e5": ("fedproto", {}, every_class("protos", "proto_labels", 1e5)),
    "fedtgp-1e5": ("fedtgp", {}, every_class("protos", "proto_labels", 1e5)),
    "fedgh-1e5": ("fedgh", {}, every_class("lar", "lar_labels", 1e5)),
    "fd-next-1e5": ("fd", {}, every_class("logits", "logit_labels", 1e5, next_class=True)),
    "fedproto-1e5-one": ("fedproto", {}, every_class("protos", "proto_labels", 1e5, classes=(ONE_CLASS,))),
    "fedtgp-1e5-one": ("fedtgp", {}, every_class("protos", "proto_labels", 1e5, classes=(ONE_CLASS,))),
    "fedgh-1e5-one": ("fedgh", {}, every_class("lar", "lar_labels", 1e5, classes=(ONE_CLASS,))),
    "fd-next-1e5-one": ("fd", {}, every_class("logits", "logit_labels", 1e5, next_class=True, classes=(ONE_CLASS,))),
}
#: the methods whose clean runs measure the accuracy cost of norm-bound against mean
CLEAN = {"fml": {}, "lg-fedavg": {}, "fedproto": {}, "fedre": {}}


def tamper_of(attack: Attack, attackers: tuple[int, ...] = (ATTACKER,)) -> Callable[[int, Message], Message]:
    """A FakeGrid ``tamper``: the valid train replies of the ``attackers`` (partition ids) with their
    payload through ``attack`` (colluding: the same hostile payload from each)."""
    nodes = {1000 + p for p in attackers}

    def tamper(node: int, reply: Message) -> Message:
        if node not in nodes or reply.metadata.message_type != "train" or reply.has_error():
            return reply
        arrays = {k: v.numpy() for k, v in reply.content.array_records[PAYLOAD].items()}
        hostile = ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in attack(arrays).items()})
        reply.content = RecordDict({PAYLOAD: hostile, "metrics": reply.content.metric_records["metrics"]})
        return reply

    return tamper


def attackers_of(count: int) -> tuple[int, ...]:
    """The attackers' partition ids for ``count`` = f colluders: 1, ..., f (partition 0 always honest)."""
    return tuple(range(1, count + 1))


def run_once(
    method: str,
    options: dict,
    attack: Attack | None,
    aggregation: str,
    seed: int,
    rounds: int,
    examples: int,
    clients: int = NUM_CLIENTS,
    attackers: int = 1,
    partition_seed: int = -1,
) -> dict:
    """One in-process federation of ``clients`` clients, the first ``attackers`` after partition 0
    colluding when ``attack`` is given; its row: the honest clients' (the other partitions') mean
    final accuracy, every client's final accuracy (0 for one without an evaluation), the fewest
    clients of a round, bounded rows, rollbacks, seconds. ``partition_seed``: run config
    ``partition-seed`` (-1: the partition follows ``seed``; fixed: every seed trains on one partition)."""
    from client_app.app import app as client_app
    from methods.registry import build_run

    rc = {
        **app_defaults(),
        "device": "cpu",
        "data-dir": str(DATA_DIR),
        "dataset": "mnist",
        "model-group": "cnn1",
        "num-clients": clients,
        "num-server-rounds": rounds,
        "max-examples-per-client": examples,
        "round-timeout": 5.0,
        "seed": seed,
        "partition-seed": partition_seed,
        "method": method,
        "aggregation": aggregation,
        **options,
    }
    cfg = RunConfig.from_dict(rc)
    run = build_run(cfg)
    hostile = attackers_of(attackers)
    grid = FakeGrid(client_app, rc, cfg.num_clients, tamper_of(attack, hostile) if attack else None)
    start = time.perf_counter()
    failed = ""
    try:
        run.start(grid)
    except RunFailed as exc:  # no client trained for max-untrained-rounds rounds: the honest ones too
        failed = str(exc)
    rows = run.rows
    # a failed run's honest clients count as its last evaluation (rounds without one, e.g. all dropped, add none)
    final = next((r["accuracy_per_client"] for r in reversed(rows) if "accuracy_per_client" in r), {})
    honest = [p for p in range(clients) if p not in hostile]
    return {
        "honest_accuracy": float(np.mean([final.get(str(p), 0.0) for p in honest])),
        "accuracy_per_client": {str(p): float(final.get(str(p), 0.0)) for p in range(clients)},
        "failed": failed,
        "min_num_clients": min((r["num_clients"] for r in rows), default=0),
        "bounded": int(sum(r.get("server_bounded", 0) for r in rows)),
        "rolled_back": int(sum(r.get("server_rolled_back", 0) for r in rows)),
        "seconds": time.perf_counter() - start,
    }


#: a federation's size and its colluders: (clients N, attackers f); rows without these keys are (4, 1)
Setting = tuple[int, int]
DEFAULT_SETTING: Setting = (NUM_CLIENTS, 1)


def setting_of(row: dict) -> Setting:
    """(clients, attackers) of a bench row or case; an older row without them ran the default."""
    return int(row.get("clients", DEFAULT_SETTING[0])), int(row.get("attackers", DEFAULT_SETTING[1]))


def plan(attacks: list[str], aggregations: list[str], seeds: list[int], settings: list[Setting] = None) -> list[dict]:
    """Every run of the bench, seed by seed (an interrupted bench has every cell at its first seeds):
    per attack, aggregation and setting (N, f) with and without the attackers, then, when the
    default setting is among ``settings``, the clean runs of :data:`CLEAN` per aggregation (shared
    keys dedupe them). Cases of the default setting carry no ``clients``/``attackers`` keys, so rows
    written before those keys existed are found again."""
    settings = settings or [DEFAULT_SETTING]
    cases = []
    for seed in seeds:
        for n, f in settings:
            size = {} if (n, f) == DEFAULT_SETTING else {"clients": n, "attackers": f}
            for name in attacks:
                method, options, _ = ATTACKS[name]
                for agg in aggregations:
                    case = {"method": method, "options": options, "aggregation": agg, "seed": seed, **size}
                    cases.append({**case, "attack": name})
                    cases.append({**case, "attack": None})
        if DEFAULT_SETTING in settings:
            for method, options in CLEAN.items():
                for agg in ("mean", "norm-bound"):
                    cases.append(
                        {"method": method, "options": options, "attack": None, "aggregation": agg, "seed": seed}
                    )
    unique = {}
    for c in cases:
        unique.setdefault(case_key(c), c)
    return list(unique.values())


def case_key(case: dict) -> str:
    """One run's identity; a clean run of N clients is the same whatever f its attacked twin has."""
    n, f = setting_of(case)
    size = [] if (n, f) == DEFAULT_SETTING else [n, f if case["attack"] else 0]
    return json.dumps([case["method"], case["options"], case["attack"], case["aggregation"], case["seed"], *size])


def table(rows: list[dict], attacks: list[str], aggregations: list[str]) -> str:
    """Means over seeds: per attack, aggregation and setting (N clients, f attackers), the honest
    clients' accuracy without / with the attackers and the runs that failed; then the clean cost of
    norm-bound (default setting)."""

    def found(**where) -> list[dict]:
        return [
            r
            for r in rows
            if all(r.get(k) == v for k, v in where.items() if k not in ("n", "f"))
            and setting_of(r)[0] == where["n"]
            and (not r["attack"] or setting_of(r)[1] == where["f"])
        ]

    def mean(selected: list[dict], f: int | None = None) -> float:
        """Mean over runs of the honest clients' mean accuracy; with ``f``, honest = the partitions
        other than :func:`attackers_of` (f), so a clean run is compared on the attacked run's clients."""
        if not selected:
            return float("nan")
        if f is None:
            return float(np.mean([r["honest_accuracy"] for r in selected]))
        hostile = {str(p) for p in attackers_of(f)}
        return float(
            np.mean([np.mean([a for p, a in r["accuracy_per_client"].items() if p not in hostile]) for r in selected])
        )

    settings = sorted({setting_of(r) for r in rows if r["attack"]}) or [DEFAULT_SETTING]
    lines = [
        f"{'attack':<18}{'aggregation':<13}{'N':>4}{'f':>3}{'clean':>8}{'attacked':>10}{'drop':>8}{'seeds':>7}{'failed':>8}"
    ]
    for name in attacks:
        method, options, _ = ATTACKS[name]
        for n, f in settings:
            for agg in aggregations:
                clean_runs = found(method=method, options=options, attack=None, aggregation=agg, n=n, f=f)
                per_client = clean_runs and all("accuracy_per_client" in r for r in clean_runs)
                clean = mean(clean_runs, f if per_client else None)
                hit = found(method=method, options=options, attack=name, aggregation=agg, n=n, f=f)
                if not hit:
                    continue
                failed = sum(bool(r["failed"]) for r in hit)
                lines.append(
                    f"{name:<18}{agg:<13}{n:>4}{f:>3}{clean:>8.3f}{mean(hit):>10.3f}{clean - mean(hit):>8.3f}"
                    f"{len(hit):>7}{failed:>8}"
                )
    lines.append("")
    lines.append(f"{'clean method':<16}{'mean':>8}{'norm-bound':>12}{'cost':>8}")
    n, f = DEFAULT_SETTING
    for method, options in CLEAN.items():
        plain = mean(found(method=method, options=options, attack=None, aggregation="mean", n=n, f=f))
        bounded = mean(found(method=method, options=options, attack=None, aggregation="norm-bound", n=n, f=f))
        lines.append(f"{method:<16}{plain:>8.3f}{bounded:>12.3f}{plain - bounded:>8.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder of rows.jsonl (resumable)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-examples", type=int, default=200, help="max-examples-per-client")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--aggregations", default="mean,norm-bound")
    parser.add_argument("--attacks", default=",".join(ATTACKS))
    parser.add_argument(
        "--partition-seed", type=int, default=-1, help="run config partition-seed (-1: each seed its own partition)"
    )
    parser.add_argument(
        "--settings",
        default=f"{DEFAULT_SETTING[0]}:{DEFAULT_SETTING[1]}",
        help="N:f pairs, comma-separated: N clients of which partitions 1..f collude (e.g. 5:1,5:2,10:2,10:4)",
    )
    args = parser.parse_args(argv)
    try:
        sizes = [tuple(int(x) for x in pair.split(":")) for pair in args.settings.split(",")]
    except ValueError:
        parser.error(f"--settings {args.settings!r}: expected N:f pairs such as 5:2,10:4")
    if any(len(s) != 2 or not 0 < s[1] < s[0] for s in sizes):
        parser.error(f"--settings {args.settings!r}: each N:f needs 0 < f < N")
    seeds = [int(s) for s in args.seeds.split(",")]
    aggregations, attacks = args.aggregations.split(","), args.attacks.split(",")
    unknown = sorted(set(attacks) - set(ATTACKS))
    if unknown:
        parser.error(f"unknown attacks {unknown}; known: {sorted(ATTACKS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "rows.jsonl"
    settings = {"rounds": args.rounds, "max_examples": args.max_examples}
    if args.partition_seed != -1:  # rows of the default carry no key, as before the option existed
        settings["partition_seed"] = args.partition_seed
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    rows = [r for r in rows if all(r.get(k) == v for k, v in settings.items())]
    done = {case_key(r) for r in rows}
    for case in plan(attacks, aggregations, seeds, sizes):
        if case_key(case) in done:
            continue
        attack = ATTACKS[case["attack"]][2](case["seed"]) if case["attack"] else None
        n, f = setting_of(case)
        result = run_once(
            case["method"],
            case["options"],
            attack,
            case["aggregation"],
            case["seed"],
            args.rounds,
            args.max_examples,
            n,
            f,
            args.partition_seed,
        )
        row = {**case, **settings, **result}
        rows.append(row)
        with open(path, "a") as out:
            out.write(json.dumps(row) + "\n")
        print(
            f"{case['method']:<10} {case['attack'] or 'clean':<16} {case['aggregation']:<11} "
            f"N={n} f={f if case['attack'] else 0} "
            f"seed {case['seed']}: "
            f"honest {result['honest_accuracy']:.3f} (min clients {result['min_num_clients']}, "
            f"{result['seconds']:.0f} s){' FAILED' if result['failed'] else ''}",
            flush=True,
        )
    print(table(rows, attacks, aggregations))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
