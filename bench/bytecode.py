"""One launch of ``tools.run`` with the installed packages' bytecode and one without, alternately.

Usage (from the repository root):

    uv run --frozen python -m bench.bytecode [--preset presets/<name>.toml] [-c "method='fedproto'"]
        [--pairs 3] [--out launches.json] [--table launches.json]

A simulation starts about ten Python processes (the launcher and its config check, the SuperLink, the
SuperExec, ``flwr-simulation``, Ray's agents, the ClientApps), each importing flwr, Ray or torch. With
``PYTHONDONTWRITEBYTECODE`` set (as on this project's machines) Python writes no bytecode, so where
the installer wrote none either, every process compiles every module it imports from source, every
launch. ``pyproject.toml`` has uv write it at install (``[tool.uv] compile-bytecode``). This bench
measures what that saves: the ``source`` side of a pair runs with ``PYTHONPYCACHEPREFIX`` set to a
folder that holds only the standard library's bytecode (compiled once, as the interpreter's own
install ships it), so the installed packages' is not found; the ``bytecode`` side runs as a plain
launch. Both with ``PYTHONDONTWRITEBYTECODE=1`` and one torch thread per ClientApp; the order
alternates from pair to pair, so a drift of the machine's speed falls on both sides.

The default run is the capped Fashion-MNIST cross-check's (``presets/fedtgp-fmnist-htcnn8.toml``, 20
clients of at most 120 examples, Local, 20 rounds, seed 0): ``-c`` overrides its keys, ``--preset`` replaces
it (with ``-c`` on top). Per launch (:func:`launch`): the wall time, the seconds in the rounds (the last row's
``elapsed_seconds``) and outside them, the CPU time and peak PSS of the whole process tree
(:func:`bench.measure.run_measured`) and the final accuracy (the two sides train alike). ``--out``
holds what is done (a rerun skips it) and is rewritten after every launch, the launches' run folders
and logs go beside it (``<out name>-runs/<side>-<pair>/``); ``--table`` prints the table of a file
(:func:`table`).
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import re
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from bench.measure import git_head
from bench.our_side import run_ours
from common.errors import ConfigError
from common.files import atomic_write, read_rows, read_summary
from tools.runconfig import ROOT, add_config_arguments, read_config

#: the run unless --preset / -c say otherwise: the capped Fashion-MNIST cross-check's Local, seed 0
DEFAULT_PRESET = "presets/fedtgp-fmnist-htcnn8.toml"
DEFAULT_CONFIG = [
    "max-examples-per-client=120",
    "method='local' num-server-rounds=20 stop-patience=0 seed=0 partition-seed=0",
]
SIDES = ("source", "bytecode")


def stdlib_bytecode(prefix: Path) -> None:
    """Compile the standard library into ``prefix`` as ``PYTHONPYCACHEPREFIX`` lays it out, so that a
    process given that prefix finds the interpreter's bytecode but no installed package's."""
    old = sys.pycache_prefix
    sys.pycache_prefix = str(prefix)
    try:
        # the interpreter's own modules; not its test suite, nor the packages installed beside it
        skip = re.compile(r"[/\\](test|tests|idlelib|site-packages)[/\\]")
        compileall.compile_dir(sysconfig.get_paths()["stdlib"], quiet=2, workers=0, rx=skip)
    finally:
        sys.pycache_prefix = old


def launch(items: list[str], preset: str, seed: int, out: Path, prefix: Path | None) -> dict:
    """One launch of run config ``preset`` + ``items`` (training seed ``seed``) into ``out``, as a
    cross-check runs ours (:func:`bench.our_side.run_ours`: one thread per ClientApp, a completed launch
    in ``out`` reused, a faulty one refused); ``prefix``: the ``PYTHONPYCACHEPREFIX`` of the ``source``
    side (None: the installed bytecode).

    Raises:
        RuntimeError: the launch did not complete, or completed with faults (see ``run_ours``).
    """
    # an empty PYTHONPYCACHEPREFIX counts as unset: the bytecode side ignores one this process inherited
    env = {"PYTHONDONTWRITEBYTECODE": "1", "PYTHONPYCACHEPREFIX": str(prefix) if prefix is not None else ""}
    ran = run_ours(items, preset, seed, out, threads=1, env=env)
    in_rounds = read_rows(ran["folder"])[-1]["elapsed_seconds"]
    return {
        "wall_seconds": round(ran["wall_seconds"], 2),
        "in_rounds_seconds": round(in_rounds, 2),
        "outside_rounds_seconds": round(ran["wall_seconds"] - in_rounds, 2),
        "cpu_seconds": round(ran["cpu_seconds"], 1),
        "peak_pss_gib": round(ran["peak_pss_gib"], 3),
        "final_accuracy_mean": read_summary(ran["folder"])["final_accuracy_mean"],
    }


def table(record: dict) -> str:
    """The markdown table of ``record`` (what ``--out`` writes): per side the launches, then the mean ±
    population std of the wall seconds, of those outside and inside the rounds, of the CPU seconds and
    the peak PSS (GiB)."""

    def cell(rows: list[dict], key: str, digits: int) -> str:
        values = [r[key] for r in rows]
        return f"{statistics.mean(values):.{digits}f} ± {statistics.pstdev(values):.{digits}f}"

    lines = [
        "| side | launches | wall s | outside the rounds s | in the rounds s | CPU s | peak PSS GiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for side in SIDES:
        rows = [r for r in record["launches"] if r["side"] == side]
        keys = (("wall_seconds", 1), ("outside_rounds_seconds", 1), ("in_rounds_seconds", 1), ("cpu_seconds", 0))
        cells = " | ".join(cell(rows, key, digits) for key, digits in keys)
        lines.append(f"| {side} | {len(rows)} | {cells} | {cell(rows, 'peak_pss_gib', 2)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_config_arguments(parser)
    parser.add_argument("--pairs", type=int, default=3, help="launches per side")
    parser.add_argument("--out", type=Path, help="JSON file of the launches, rewritten after each")
    parser.add_argument("--table", type=Path, help="print the table of this JSON file and exit")
    args = parser.parse_args(argv)
    if args.table:
        print(table(json.loads(args.table.read_text())))
        return 0
    preset = args.preset or DEFAULT_PRESET
    items = args.run_config if args.preset else [*DEFAULT_CONFIG, *args.run_config]
    try:
        config, _ = read_config(preset, items)  # a bad key or value type fails here, before any launch
    except ConfigError as exc:
        print(f"error: {exc}")
        return 2
    out = args.out or Path(tempfile.mkdtemp(prefix="bytecode-")) / "launches.json"
    record = json.loads(out.read_text()) if out.exists() else {"launches": []}
    record.update(
        {
            "what": "tools.run launches without the installed packages' bytecode (source) and with it, alternately",
            "command": "python -m bench.bytecode " + " ".join(sys.argv[1:] if argv is None else argv),
            "run": ["--preset", preset, *(a for item in items for a in ("-c", item))],
            "commit": git_head(ROOT),
            "cpus": os.cpu_count(),
            "units": "seconds (wall, in / outside the rounds, CPU of the process tree); GiB; accuracy a fraction",
        }
    )
    work = out.parent / f"{out.stem}-runs"  # the launches' run folders and logs, beside --out
    work.mkdir(parents=True, exist_ok=True)
    prefix = work / "stdlib-bytecode"
    stdlib_bytecode(prefix)
    for pair in range(1, args.pairs + 1):
        for side in SIDES if pair % 2 else SIDES[::-1]:
            if any(r["pair"] == pair and r["side"] == side for r in record["launches"]):
                continue
            started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            row = launch(items, preset, config["seed"], work / f"{side}-{pair}", prefix if side == "source" else None)
            record["launches"].append({"side": side, "pair": pair, "started": started, **row})
            atomic_write(out, lambda f: f.write(json.dumps(record, indent=1).encode()))
            print(f"pair {pair} {side}: {row}", flush=True)
    print(table(record))
    print(f"launches: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
