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
   runs the threads each of our clients runs (:mod:`bench.crosscheck_pairing`; what a method cannot
   pair, e.g. a shared model or server state, is ``unpaired`` and in the report); it parses its
   per-round pooled test accuracy (:func:`~bench.htfllib.parse_reference_log`);
3. runs ours (``tools.run``) on the same partitions (``partition-seed`` fixed) and recipe, one run per
   training seed; a run with a round that trained or evaluated without every client (a crashed Ray
   node ends ``completed`` so) is refused, not compared (:func:`bench.our_side.run_faults`);
4. keeps the method's result (``<method>/result.json``) and writes ``report.md`` from every method's
   kept result in the output folder, earlier calls' included (:mod:`bench.crosscheck_report`: a
   verdict per method, final and best accuracy with the spread over seeds, the largest per-round
   gap, the settings as run, the test set's size, what is not paired and what the reference cannot
   express, commands, commits, wall and CPU time) and one figure per method (mean curve and min-max
   band over seeds for each implementation).

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
from pathlib import Path

from bench.crosscheck_pairing import CLIENT_THREADS
from bench.crosscheck_report import compare, plot, save_result, saved_results, verdict, write_report
from bench.htfllib import (
    FAMILIES,
    FAMILY_DEVIATIONS,
    PAIRED,
    REFERENCE_METHODS,
    check_expressible,
    compared_metric,
    evaluates_as_reference,
    run_reference,
)
from bench.measure import git_head
from bench.our_side import method_options, run_ours
from bench.pfllib import write_partitions
from common.errors import ConfigError
from tools.grid import git_commit
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_config_arguments(parser)
    parser.add_argument(
        "--reference", type=Path, required=True, help="a checkout of TsingZ0/HtFLlib (outside this repo)"
    )
    parser.add_argument("--methods", required=True, help=f"comma-separated, of: {', '.join(REFERENCE_METHODS)}")
    parser.add_argument("--seeds", default="0,1,2", help="training seeds (default 0,1,2)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default: the config's num-server-rounds)")
    parser.add_argument("--out", type=Path, default=None, help="default outputs/crosscheck/<preset or 'config'>")
    args = parser.parse_args(argv)
    reference = args.reference.resolve()
    with stop_on_signals():
        try:
            if not (reference / "system" / "main.py").is_file():
                raise ConfigError(
                    f"--reference {reference}: no system/main.py (expected a checkout of TsingZ0/HtFLlib)"
                )
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
                raise ConfigError(f"--methods: {', '.join(unknown)} have no HtFLlib counterpart; allowed: {allowed}")
            configs = {
                m: {**base, **fixed, **REFERENCE_METHODS[m].recipe, "method": m, "seed": seeds[0]} for m in methods
            }
            for m, config in configs.items():
                check_expressible(config, m)
            validate_configs(list(configs.values()))
        except (ConfigError, ValueError) as exc:
            print(f"error: {exc}")
            return 2
        out = (
            args.out or ROOT / "outputs" / "crosscheck" / (Path(args.preset).stem if args.preset else "config")
        ).resolve()
        out.mkdir(parents=True, exist_ok=True)
        partitions = out / "partitions"
        first = next(iter(configs.values()))
        print(f"writing partitions to {partitions}", flush=True)
        written = write_partitions(first, partitions)
        info = {
            "preset": args.preset,
            "command": "python -m bench.crosscheck " + " ".join(argv if argv is not None else sys.argv[1:]),
            "commit": git_commit(),
            "reference": str(reference),
            "reference_commit": git_head(reference),
            "seeds": seeds,
            "settings": {k: first[k] for k in SETTINGS},
            # the -c items as given (read_config's overrides hold the preset's keys too, e.g. its 1000 rounds)
            "overrides": " ".join(args.run_config),
            "threads": CLIENT_THREADS,
            "family": f"ours `{first['model-group']}` as HtFLlib's `{FAMILIES[first['model-group']]}`"
            + (f"; {FAMILY_DEVIATIONS[first['model-group']]}" if first["model-group"] in FAMILY_DEVIATIONS else ""),
            "test_examples": sum(written["test_examples"]),
        }
        (out / "crosscheck.json").write_text(json.dumps(info, indent=1))
        failed: list[str] = []
        try:
            for method, config in configs.items():
                write_partitions(config, partitions)  # the same partitions for every method: kept
                pinned = {**fixed, **REFERENCE_METHODS[method].recipe, "method": method}
                items = [*args.run_config, " ".join(f"{k}={json.dumps(v)}" for k, v in pinned.items())]
                refs, ours = [], []
                try:
                    for seed in seeds:
                        print(f"{method}, seed {seed}: HtFLlib", flush=True)
                        refs.append(run_reference(reference, config, method, seed, partitions, out / method))
                        print(f"{method}, seed {seed}: ours", flush=True)
                        metric = compared_metric(config, method)
                        ours.append(run_ours(items, args.preset, seed, out / method / f"seed-{seed}", metric))
                except RuntimeError as exc:  # this method's comparison is incomplete; the others go on
                    print(f"error: {method}: {exc}", flush=True)
                    failed.append(method)
                    continue
                curves, ref_curves = [o["curve"] for o in ours], [r["curve"] for r in refs]
                ref = REFERENCE_METHODS[method]
                result = {
                    "comparison": compare(curves, ref_curves),
                    "verdict": verdict(curves, ref_curves),
                    "reference": refs,
                    "ours": ours,
                    "same_model": evaluates_as_reference(config, method),
                    "reported_option": list(ref.reported[:2]) if ref.reported else None,
                    "unexpressed": {k: method_options(config, method)[k] for k in ref.unexpressed},
                    "recipe": ref.recipe,
                    "paired": PAIRED,
                    "unpaired": ref.unpaired,
                    "info": info,
                }
                save_result(out, method, result)
                plot(method, curves, ref_curves, out / f"{method}.png")
                write_report(out, info, saved_results(out, list(REFERENCE_METHODS)))
                print(f"{method}: {result['verdict']['verdict']}; {json.dumps(result['comparison'])}", flush=True)
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
