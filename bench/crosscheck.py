"""Cross-check methods against a reference implementation (TsingZ0/HtFLlib) on identical partitions.

Usage (from the repository root; the reference is a checkout of https://github.com/TsingZ0/HtFLlib
*outside* this repository, never copied into it):

    uv run --frozen --extra crosscheck python -m bench.crosscheck --reference ../HtFLlib \\
        --preset presets/fedtgp-cifar10-htfe2.toml --methods fedgh,fedproto --seeds 0,1,2 --rounds 20 \\
        [-c "num-clients=4 max-examples-per-client=400"] [--out outputs/crosscheck/<preset>]

For each method it

1. writes our partitions once (the exact per-client train and test images after our partitioner,
   normalised as the run config says) in PFLlib's ``save_file`` layout: ``train/<i>.npz``,
   ``test/<i>.npz`` (``data = {"x": float32 [n, C, H, W], "y": int64 [n]}``) and ``config.json``
   (:func:`bench.pfllib.write_partitions`); HtFLlib reads them from ``<reference>/dataset/<name>``,
   a symlink to that folder;
2. runs the reference (``system/main.py``) with the flags that map our run config
   (:mod:`bench.htfllib`: :data:`~bench.htfllib.FAMILIES`, :data:`~bench.htfllib.REFERENCE_METHODS`,
   :func:`~bench.htfllib.reference_command`), paired with ours: every client's model starts from
   our client's initial model for the run config and seed, and PyTorch
   runs the threads each of our clients runs, a server that starts from a module (a head, a shared
   model, FedTGP's trainable prototypes) starts from our server's where the architectures agree, and
   FedTGP's and FedGH's servers take our mini-batch order over the uploads (:mod:`bench.crosscheck_pairing`;
   what a method cannot pair, e.g. a shared model of another architecture, is ``unpaired`` and in the
   report); it parses its
   per-round pooled test accuracy (:func:`~bench.htfllib.parse_reference_log`);
3. runs ours (``tools.run``; with ``--in-process`` ``tools.inprocess``, one process as HtFLlib's) on
   the same partitions (``partition-seed`` fixed) and recipe, one run per training seed; a run with a
   round that trained or evaluated without every client (a crashed Ray node ends ``completed`` so) is
   refused, not compared (:func:`bench.our_side.run_faults`);
4. keeps the method's result (``<method>/result.json``) and writes ``report.md`` from every method's
   kept result in the output folder, earlier calls' included (:mod:`bench.crosscheck_report`: a
   verdict per method, final and best accuracy with the spread over seeds, the largest per-round
   gap, the settings as run, the test set's size, what is not paired and what the reference cannot
   express, commands, commits, wall and CPU time) and one figure per method (mean curve and min-max
   band over seeds for each implementation). ``--reference-only`` runs step 2 alone (kept for a
   later call with both sides), e.g. HtFLlib's long runs beside our committed grid's.

Where each evaluates: HtFLlib evaluates every client's model at the start of iteration ``i``, after
``i`` rounds of training and after the server's broadcast of round ``i``'s result (iteration 0 is
the initial models); our row ``i`` is the evaluation after round ``i``. Both report the accuracy
pooled over all clients' test examples (our ``accuracy_weighted``), which is what is compared.

Seeds: HtFLlib has no seed flag (``torch.manual_seed(0)`` once); its ``-t S`` repetitions run in one
process and differ by the continuing random state. Ours vary run config ``seed``; paired, every client
on both sides starts from our initial model of that seed, and the bootstrap seeds HtFLlib's other
draws with it (:data:`bench.htfllib.BOOTSTRAP`). The partition is the same for all
(``partition-seed``, default the first seed).

Every run is resumable: the partitions, a reference run whose every repetition finished, and our
completed seeds are kept and skipped when the command is given again; a failed run (any early end
but the reference's NaN divergence, or a run of ours with faults) is never kept.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.crosscheck_pairing import CLIENT_THREADS
from bench.crosscheck_report import compare, plot, save_result, saved_results, verdict, write_report
from bench.htfllib import (
    AUTHORS_REFERENCES,
    FAMILIES,
    FAMILY_DEVIATIONS,
    REFERENCE_METHODS,
    check_expressible,
    compared_metric,
    evaluates_as_reference,
    pairing,
    run_reference,
)
from bench.measure import git_head
from bench.our_side import method_options, run_ours
from bench.pfllib import write_partitions
from common.errors import ConfigError
from tools.grid import git_commit
from tools.partition_cache import cache_before_ray
from tools.processes import stop_on_signals
from tools.runconfig import ROOT, add_config_arguments, read_config, validate_configs

#: the run config keys of a cross-check's settings line (as run: the rounds and stop-patience it
#: pins, not the preset's)
SETTINGS = (
    "dataset",
    "model-group",
    "feature-dim",
    "num-clients",
    "max-examples-per-client",
    "partitioner",
    "dirichlet-alpha",
    "test-fraction",
    "partition-seed",
    "normalize",
    "init",
    "num-server-rounds",
    "stop-patience",
    "aggregation",
    "fraction-train",
    "local-epochs",
    "batch-size",
    "lr",
    "batch-order",
    "eval-every",
)


@dataclass(frozen=True)
class Plan:
    """One call's cross-check as checked (:func:`checked_plan`): the reference checkout, our preset and
    ``-c`` items as given (``run_config``), the training seeds, the run config values pinned for every
    method (``fixed``), each method's whole run config (``configs``, in ``--methods`` order; seed: the
    first), the output folder and the launcher of our runs (``runner``, :data:`bench.our_side.RUNNERS`)."""

    reference: Path
    preset: str | None
    run_config: list[str]
    seeds: list[int]
    fixed: dict
    configs: dict[str, dict]
    out: Path
    runner: str = "tools.run"


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    """The command line: the run config's ``--preset`` and ``-c``, and the cross-check's own flags."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_config_arguments(parser)
    parser.add_argument(
        "--reference", type=Path, required=True, help="a checkout of TsingZ0/HtFLlib (outside this repo)"
    )
    parser.add_argument("--methods", required=True, help=f"comma-separated, of: {', '.join(REFERENCE_METHODS)}")
    parser.add_argument("--seeds", default="0,1,2", help="training seeds (default 0,1,2)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default: the config's num-server-rounds)")
    parser.add_argument("--out", type=Path, default=None, help="default outputs/crosscheck/<preset or 'config'>")
    parser.add_argument(
        "--reference-only",
        action="store_true",
        help="run HtFLlib's side alone (kept for a later call with both sides; no comparison), e.g. its long"
        " runs beside our committed ones",
    )
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="run ours through tools.inprocess (one process, the clients one after another, no Ray or Flower"
        " engine: HtFLlib's shape) instead of Flower's simulation (tools.run)",
    )
    return parser.parse_args(argv)


def checked_plan(args: argparse.Namespace) -> Plan:
    """The cross-check ``args`` ask for, every method's run config checked before anything runs.

    Raises:
        ConfigError: ``--reference`` is no HtFLlib checkout or is this repository, ``--methods``,
            ``--seeds`` or ``--rounds`` is empty or out of range, a method has no HtFLlib counterpart, or
            a run config is one the reference cannot follow (:func:`bench.htfllib.check_expressible`) or
            one of ours refuses (:func:`tools.runconfig.validate_configs`).
        ValueError: a seed is no integer.
    """
    reference = args.reference.resolve()
    if not (reference / "system" / "main.py").is_file():
        raise ConfigError(f"--reference {reference}: no system/main.py (expected a checkout of TsingZ0/HtFLlib)")
    if reference == ROOT:
        raise ConfigError("--reference points at this repository")
    methods = [m for m in args.methods.split(",") if m]
    seeds = [int(s) for s in args.seeds.split(",") if s]
    if not methods or not seeds or (args.rounds is not None and args.rounds < 1):
        raise ConfigError("--methods and --seeds need at least one value, --rounds at least 1")
    base, _ = read_config(args.preset, args.run_config)
    # every round on both sides, compared round by round: HtFLlib runs without its auto-break (-ab);
    # its servers average plainly, so ours does too (run config aggregation = mean)
    fixed = {
        "partition-seed": base["partition-seed"] if base["partition-seed"] >= 0 else seeds[0],
        "stop-patience": 0,
        "aggregation": "mean",
    }
    if args.rounds is not None:
        fixed["num-server-rounds"] = args.rounds
    if unknown := [m for m in methods if m not in REFERENCE_METHODS]:
        allowed = ", ".join(REFERENCE_METHODS)
        elsewhere = sorted({AUTHORS_REFERENCES[m] for m in unknown if m in AUTHORS_REFERENCES})
        hint = f" (against their authors' code: python -m {', '.join(elsewhere)})" if elsewhere else ""
        raise ConfigError(f"--methods: {', '.join(unknown)} have no HtFLlib counterpart{hint}; allowed: {allowed}")
    configs = {m: {**base, **fixed, **REFERENCE_METHODS[m].recipe, "method": m, "seed": seeds[0]} for m in methods}
    for m, config in configs.items():
        check_expressible(config, m)
    validate_configs(list(configs.values()))
    out = args.out or ROOT / "outputs" / "crosscheck" / (Path(args.preset).stem if args.preset else "config")
    runner = "tools.inprocess" if args.in_process else "tools.run"
    return Plan(reference, args.preset, args.run_config, seeds, fixed, configs, out.resolve(), runner)


#: what both sides' timed runs leave out (``info["untimed"]``, quoted by the report)
CACHED_BEFORE_TIMING = (
    "each side's data prepared before its timed runs: HtFLlib's partition files and our clients' partition"
    " cache (`tools.partition_cache`)"
)


def call_info(plan: Plan, command: str, written: dict) -> dict:
    """This call's ``info`` for the report and every result (``crosscheck.json``; the keys
    :func:`bench.crosscheck_report.write_report` reads): ``command`` as given, the settings as run (the
    first method's run config), both commits, the threads, the model family and the pooled test set's
    size (``written``: the partitions' ``config.json``, :func:`bench.pfllib.write_partitions`), what
    the timed runs leave out (``untimed``) and our runs' launcher (``runner``)."""
    first = next(iter(plan.configs.values()))
    group = first["model-group"]
    return {
        "preset": plan.preset,
        "command": command,
        "commit": git_commit(),
        "reference": str(plan.reference),
        "reference_commit": git_head(plan.reference),
        "seeds": plan.seeds,
        "settings": {k: first[k] for k in SETTINGS},
        # the -c items as given (read_config's overrides hold the preset's keys too, e.g. its 1000 rounds)
        "overrides": " ".join(plan.run_config),
        "threads": CLIENT_THREADS,
        "runner": plan.runner,
        "family": f"ours `{group}` as HtFLlib's `{FAMILIES[group]}`"
        + (f"; {FAMILY_DEVIATIONS[group]}" if group in FAMILY_DEVIATIONS else ""),
        "test_examples": sum(written["test_examples"]),
        "untimed": CACHED_BEFORE_TIMING,
    }


def run_both_sides(plan: Plan, method: str) -> tuple[list[dict], list[dict]]:
    """HtFLlib's run and ours of ``method`` for every seed, in seed order, each side's seed ``s`` under
    ``<out>/<method>`` (:func:`bench.htfllib.run_reference`, :func:`bench.our_side.run_ours`, which
    reuse what an earlier call finished); ours is run with the plan's pinned values and the method's
    recipe as ``-c`` items after the given ones.

    Raises:
        RuntimeError: a run of either side failed (this method's comparison is incomplete).
    """
    config = plan.configs[method]
    partitions = plan.out / "partitions"
    pinned = {**plan.fixed, **REFERENCE_METHODS[method].recipe, "method": method}
    items = [*plan.run_config, " ".join(f"{k}={json.dumps(v)}" for k, v in pinned.items())]
    refs, ours = [], []
    for seed in plan.seeds:
        print(f"{method}, seed {seed}: HtFLlib", flush=True)
        refs.append(run_reference(plan.reference, config, method, seed, partitions, plan.out / method))
        print(f"{method}, seed {seed}: ours", flush=True)
        metric = compared_metric(config, method)
        ours.append(run_ours(items, plan.preset, seed, plan.out / method / f"seed-{seed}", metric, runner=plan.runner))
    return refs, ours


def method_result(config: dict, method: str, refs: list[dict], ours: list[dict], info: dict) -> dict:
    """One method's result as kept and reported (:func:`bench.crosscheck_report.write_report`): the
    comparison and verdict of both sides' curves, their runs, what ours evaluates, what is paired and
    not, HtFLlib's recipe and our options it cannot express, and this call's ``info``."""
    curves, ref_curves = [o["curve"] for o in ours], [r["curve"] for r in refs]
    ref = REFERENCE_METHODS[method]
    paired, unpaired = pairing(method, refs)
    return {
        "comparison": compare(curves, ref_curves),
        "verdict": verdict(curves, ref_curves),
        "reference": refs,
        "ours": ours,
        "same_model": evaluates_as_reference(config, method),
        "reported_option": list(ref.reported[:2]) if ref.reported else None,
        "unexpressed": {k: method_options(config, method)[k] for k in ref.unexpressed},
        "recipe": ref.recipe,
        "paired": paired,
        "unpaired": unpaired,
        "info": info,
    }


def cross_check(plan: Plan, method: str, info: dict) -> bool:
    """Compare ``method``: both sides run (:func:`run_both_sides`), its result kept
    (``<out>/<method>/result.json``), its figure and the report of every kept result written; False,
    with the error printed, when a run failed (nothing is kept for the method, the others go on)."""
    write_partitions(plan.configs[method], plan.out / "partitions")  # the same partitions for every method: kept
    # our clients' partition cache is filled before the timed runs, as HtFLlib's partition files are just
    # above: otherwise the first run of ours paid the decoding in its wall time (20 capped Fashion-MNIST
    # partitions: 18.3 s on 2 processes, once) and HtFLlib's side nothing (CACHED_BEFORE_TIMING)
    cache_before_ray(plan.configs[method], plan.configs[method]["num-clients"])
    try:
        refs, ours = run_both_sides(plan, method)
    except RuntimeError as exc:  # this method's comparison is incomplete; the others go on
        print(f"error: {method}: {exc}", flush=True)
        return False
    result = method_result(plan.configs[method], method, refs, ours, info)
    save_result(plan.out, method, result)
    plot(
        method,
        [o["curve"] for o in ours],
        [r["curve"] for r in refs],
        plan.out / f"{method}.png",
        REFERENCE_METHODS[method].repository,
    )
    write_report(plan.out, info, saved_results(plan.out, list(REFERENCE_METHODS)))
    print(f"{method}: {result['verdict']['verdict']}; {json.dumps(result['comparison'])}", flush=True)
    return True


def reference_side(plan: Plan, method: str) -> bool:
    """HtFLlib's runs of ``method`` alone (``--reference-only``), kept under ``<out>/<method>`` as a
    call with both sides keeps them (:func:`bench.htfllib.run_reference`), each summarised in one line:
    best pooled accuracy and its round, the final round's, the round it diverged. False, with the
    error printed, when a run failed."""
    config = plan.configs[method]
    write_partitions(config, plan.out / "partitions")
    for seed in plan.seeds:
        print(f"{method}, seed {seed}: HtFLlib", flush=True)
        try:
            ref = run_reference(plan.reference, config, method, seed, plan.out / "partitions", plan.out / method)
        except RuntimeError as exc:
            print(f"error: {method}: {exc}", flush=True)
            return False
        valued = [(a, r) for r, a in enumerate(ref["curve"], 1) if a is not None]
        best = max(valued, default=None)
        print(
            f"{method}, seed {seed}: HtFLlib best {100 * best[0]:.2f} % (round {best[1]}), "
            f"round {valued[-1][1]} {100 * valued[-1][0]:.2f} %, diverged from round {ref['diverged_round']}"
            if best
            else f"{method}, seed {seed}: HtFLlib diverged from round {ref['diverged_round']}",
            flush=True,
        )
    return True


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring). Exit code 0 when every method was compared, 1 when
    one has no comparison (a run failed; the others are compared), 2 for a command refused before
    anything runs, 130 when interrupted (finished parts are kept)."""
    args = parse_arguments(argv)
    with stop_on_signals():
        try:
            plan = checked_plan(args)
        except (ConfigError, ValueError) as exc:
            print(f"error: {exc}")
            return 2
        out = plan.out
        out.mkdir(parents=True, exist_ok=True)
        print(f"writing partitions to {out / 'partitions'}", flush=True)
        written = write_partitions(next(iter(plan.configs.values())), out / "partitions")
        command = "python -m bench.crosscheck " + " ".join(argv if argv is not None else sys.argv[1:])
        info = call_info(plan, command, written)
        (out / "crosscheck.json").write_text(json.dumps(info, indent=1))
        failed: list[str] = []
        try:
            for method in plan.configs:
                if not (reference_side(plan, method) if args.reference_only else cross_check(plan, method, info)):
                    failed.append(method)
        except KeyboardInterrupt:
            print(f"interrupted; finished parts are kept in {out} and reused when the command is given again")
            return 130
    if (out / "report.md").is_file():
        print(f"report: {out / 'report.md'}")
    if failed:
        print(f"error: no comparison for {', '.join(failed)} (see above); any others are in the report")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
