"""Benchmark a real ``flwr run`` simulation: accuracy, bytes, seconds per round, peak memory.

Usage (from the repository root):

    uv run --frozen python -m bench.simulation [--preset presets/<name>.toml] [-c "method='local'"]
        [--cpus-per-client 1] [--methods local,fedmrl,...] [--minutes 20] [--out runs.json]

Runs the job through ``tools.run`` while sampling the resident memory of the whole process
tree (launcher, SuperLink, ServerApp, Ray and its ClientApp actors) every 0.5 s, then prints
per round: mean accuracy, payload bytes, round seconds, and the split of the round into the
clients' training compute and everything else (data, serialisation, Ray, server step,
evaluation messages). It also splits the start-up (launch to round 1) at the launcher's log
lines: the launcher (SuperLink, config check, ``flwr run``), Flower's simulation start, the
ServerApp's start, and Ray's start with the handshake (every client's first message).

``--methods`` runs each listed method in turn on the same config (same partitions, seed and
models), ``--minutes`` stops each run after that wall time (the rounds completed so far are
reported: results are written every round), and a comparison table ends the output. ``--out``
adds each finished run's totals (start-up phases and seconds per round in seconds, peak memory in
GiB and, per process kind at the peak, [count, PSS MiB]) to a JSON list, with command and commit.

The split: with ``slots`` ClientApps running in parallel (cores / cpus-per-client), a
round's training share is ``sum(client train-seconds) / (slots * round seconds)``, where
train-seconds is each client's local training plus its payload computation, timed inside
the client. The rest of the round is overhead.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from bench.measure import tree_memory
from common.errors import ConfigError
from common.files import atomic_write, read_rows
from tools.grid import git_commit
from tools.outcome import print_outcome
from tools.processes import interrupt, stop_on_signals
from tools.runconfig import add_config_arguments, read_config, validate_configs

ROOT = Path(__file__).resolve().parents[1]


#: log lines that end each start-up phase: the launcher has submitted the run, Flower's simulation
#: process is up, the ServerApp has started (its handshake begins), every client has answered (run
#: config ``handshake = "all"``) or the nodes a round samples are listed (``"sampled"``: the
#: ClientApps then start in round 1)
STARTUP_MARKS = (
    ("launcher", ("Submitted run",)),
    ("simulation start", ("Starting Flower Simulation",)),
    ("ServerApp start", ("Writing results to",)),
    ("Ray start + handshake", ("Handshake: ", "Handshake sampled: ")),
)


def startup_phases(lines: list[tuple[float, str]]) -> tuple[dict[str, float], str] | None:
    """Seconds of each start-up phase from launch to round 1, split at :data:`STARTUP_MARKS` (the first
    line holding one of each phase's marks) of ``lines`` = ``[(seconds since launch, log line)]``, and
    the handshake line's own summary; None when a phase's line is missing."""
    phases, last, detail = {}, 0.0, ""
    for phase, marks in STARTUP_MARKS:
        hit = next(((t, line, m) for t, line in lines for m in marks if m in line), None)
        if hit is None:
            return None
        phases[phase] = hit[0] - last
        last, detail = hit[0], hit[1].split(hit[2], 1)[1].strip()
    return phases, detail


def startup_split(lines: list[tuple[float, str]]) -> str:
    """:func:`startup_phases` as one line: the total, each phase and the handshake's own summary (its
    seconds and the slowest client's process start-up, or the nodes listed)."""
    found = startup_phases(lines)
    if found is None:
        return "start-up split: not found"
    phases, detail = found
    parts = " + ".join(f"{phase} {seconds:.1f} s" for phase, seconds in phases.items())
    return f"start-up, launch to round 1: {sum(phases.values()):.1f} s = {parts} ({detail})"


@dataclass
class Launch:
    """A finished ``tools.run`` job as :func:`launch` measured it."""

    lines: list[tuple[float, str]]  # (seconds since launch, line) of its output
    returncode: int
    wall: float  # seconds
    peak_rss: int  # bytes, summed over the process tree
    peak_pss: int  # bytes, shared pages split among their processes
    at_peak: dict[str, tuple[int, int]]  # process kind -> (count, PSS bytes) when the PSS sum peaked
    budget_hit: bool  # stopped by the wall-time budget, not by a failure


def launch(cmd: list[str], minutes: float) -> Launch:
    """Run ``cmd`` (a ``tools.run`` command) sampling its process tree's memory every 0.5 s; with
    ``minutes`` > 0 interrupt it (SIGINT, so the launcher stops its SuperLink) after that wall time."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    root = psutil.Process(proc.pid)
    peak = [0, 0]  # RSS sum, PSS sum
    budget_hit = threading.Event()
    at_peak: dict[str, tuple[int, int]] = {}

    def sample() -> None:
        while proc.poll() is None:
            rss, pss, kinds = tree_memory(root)
            if pss > peak[1]:
                at_peak.clear()
                at_peak.update(kinds)
            peak[:] = [max(peak[0], rss), max(peak[1], pss)]
            if minutes > 0 and time.perf_counter() - start > 60 * minutes:
                budget_hit.set()
                interrupt(proc)
                break
            time.sleep(0.5)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        lines = [(time.perf_counter() - start, line) for line in proc.stdout]
    except KeyboardInterrupt:  # Ctrl-C, SIGTERM or SIGHUP: stop the launcher as Ctrl-C would, and what it started
        interrupt(proc)
        raise
    proc.wait()
    sampler.join()
    wall = time.perf_counter() - start
    return Launch(lines, proc.returncode, wall, peak[0], peak[1], at_peak, budget_hit.is_set())


def print_rounds(rows: list[dict], slots: int) -> list[float]:
    """The per-round table; returns each round's non-training share (fraction of its seconds)."""
    print(
        f"{'round':>5} {'acc_mean':>8} {'acc_wtd':>8} {'bytes_up':>9} {'bytes_down':>10} {'round_s':>7} "
        f"{'train_s':>7} {'other_s':>7} {'other%':>6}"
    )
    shares = []
    for r in rows:
        train = r["client_train_seconds"] / slots
        other = r["round_seconds"] - train
        shares.append(other / r["round_seconds"])
        acc = r["accuracy_mean"]
        print(
            f"{r['round']:>5} {acc if acc is not None else float('nan'):>8.4f} "
            f"{r['accuracy_weighted'] if acc is not None else float('nan'):>8.4f} {r['bytes_up']:>9} "
            f"{r['bytes_down']:>10} {r['round_seconds']:>7.2f} {train:>7.2f} {other:>7.2f} {100 * shares[-1]:>5.1f}%"
        )
    return shares


def print_totals(run: Launch, rows: list[dict], slots: int, shares: list[float], totals: dict) -> None:
    """The run's totals: rounds, accuracy, seconds and non-training share, bytes, images per second
    per architecture, the start-up split and the peak memory by process kind."""
    steady = shares[1:] or shares
    print(
        f"parallel ClientApps: {slots}; rounds completed: {len(rows)}"
        + (" (stopped by the time budget)" if run.budget_hit else "")
    )
    print(
        f"final accuracy_mean {totals['final']:.4f}, best {totals['best']:.4f}, "
        f"mean of the last 10 {totals['last10']:.4f}"
    )
    print(
        f"mean round {totals['round_s']:.2f} s; non-training share "
        f"{100 * sum(steady) / len(steady):.1f}% (rounds 2+), {100 * sum(shares) / len(shares):.1f}% (all)"
    )
    print(
        f"bytes per round: up {rows[-1]['bytes_up']} down {rows[-1]['bytes_down']}; per client-round up "
        f"{totals['up_per_client']:.0f} down {totals['down_per_client']:.0f}"
    )
    work = {}
    for r in rows:
        for arch, rate in r.get("train_images_per_second", {}).items():
            work.setdefault(arch, []).append(rate)
    if work:
        print(
            "client training, images/s per ClientApp (mean over rounds): "
            + ", ".join(f"{arch} {sum(v) / len(v):.1f}" for arch, v in sorted(work.items()))
        )
    print(
        f"wall time {run.wall:.1f} s (start-up, handshake, shut-down: {run.wall - rows[-1]['elapsed_seconds']:.1f} s)"
    )
    print(startup_split(run.lines))
    print(
        f"peak memory of the process tree: {run.peak_pss / 2**30:.2f} GiB PSS (shared pages split among their "
        f"processes), {run.peak_rss / 2**30:.2f} GiB summed RSS (shared pages counted once per process)"
    )
    print(
        "PSS at its peak by process: "
        + ", ".join(
            f"{kind} x{count} {total / 2**20:.0f} MiB"
            for kind, (count, total) in sorted(run.at_peak.items(), key=lambda item: -item[1][1])
        ),
        flush=True,
    )


def run_one(config: list[str], cpus: int, gpus: float | None, minutes: float, preset: str | None = None) -> dict | None:
    """One ``tools.run`` job with ``config`` overrides; prints its per-round table, returns its totals.

    With ``minutes`` > 0 the job is interrupted (SIGINT, so the launcher stops its SuperLink)
    after that wall time and the rounds completed so far are reported. A run that failed (or wrote
    no rows) prints the tail of its log, its status and the reason from its summary, and returns None.
    """
    out = ROOT / "outputs" / f"bench-{time.time_ns()}"  # one per run, also for runs that fail within a second
    cmd = [sys.executable, "-m", "tools.run", "-c", f"output-dir={json.dumps(str(out))}"]
    cmd += ["--cpus-per-client", str(cpus)]
    cmd += ["--preset", preset] if preset else []
    if gpus is not None:
        cmd += ["--gpus-per-client", str(gpus)]
    for item in config:
        cmd += ["-c", item]
    run = launch(cmd, minutes)
    run_dirs = list(out.iterdir()) if out.exists() else []
    rows = read_rows(run_dirs[0]) if run_dirs else []
    if not rows or (run.returncode != 0 and not run.budget_hit):
        print("".join(line for _, line in run.lines)[-4000:])
        print_outcome(run_dirs[0] if run_dirs else None, f"tools.run exit {run.returncode}")
        return None
    slots = max(1, (os.cpu_count() or 1) // cpus)
    if gpus:
        slots = min(slots, int(1 / gpus))
    slots = min(slots, max(r["num_clients"] for r in rows))
    print(f"results: {run_dirs[0]}")
    shares = print_rounds(rows, slots)
    accs = [r["accuracy_mean"] for r in rows if r["accuracy_mean"] is not None]
    clients = sum(r["num_clients"] for r in rows)
    phases = startup_phases(run.lines)
    totals = {
        "run_dir": str(run_dirs[0]),
        "wall_seconds": run.wall,
        "startup_seconds": phases[0] if phases else None,
        "round_seconds": [r["round_seconds"] for r in rows],
        # the ClientApps' time per round, summed over its train messages: all of the handler, and training
        "client_handler_seconds": [r.get("client_handler_seconds") for r in rows],
        "client_train_seconds": [r["client_train_seconds"] for r in rows],
        "peak_pss_gib": run.peak_pss / 2**30,
        "peak_rss_gib": run.peak_rss / 2**30,
        "pss_mib_at_peak": {kind: [count, total / 2**20] for kind, (count, total) in run.at_peak.items()},
        "rounds": len(rows),
        "final": accs[-1] if accs else float("nan"),
        "best": max(accs, default=float("nan")),
        "last10": sum(accs[-10:]) / max(len(accs[-10:]), 1),
        "round_s": sum(r["round_seconds"] for r in rows) / len(rows),
        "up_per_client": sum(r["bytes_up"] for r in rows) / max(clients, 1),
        "down_per_client": sum(r["bytes_down"] for r in rows) / max(clients, 1),
    }
    print_totals(run, rows, slots, shares, totals)
    return totals


def add_row(out: Path, argv: list[str] | None, totals: dict, module: str = "bench.simulation") -> None:
    """Add one finished run's ``totals`` (:func:`run_one`'s, or another bench ``module``'s) to the JSON
    list in ``out`` (created when missing), with the command line, the commit and the machine's CPU
    count; written atomically."""
    rows = json.loads(out.read_text()) if out.exists() else []
    args = sys.argv[1:] if argv is None else argv
    rows.append(
        {
            "command": f"python -m {module} " + " ".join(shlex.quote(a) for a in args),
            "commit": git_commit(),
            "cpus": os.cpu_count(),
            **totals,
        }
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, lambda f: f.write(json.dumps(rows, indent=1).encode()))


def later_rounds(seconds: list[float], first: float | None) -> tuple[str, float]:
    """The rounds after round 1 of ``seconds`` as two table cells, ``<mean> s (<min>-<max>) | <ratio>x`` (the
    mean over ``first``, the first run's mean; None: this is the first run), and their mean."""
    later = seconds[1:]
    mean = sum(later) / len(later)
    return f"{mean:.2f} s ({min(later):.2f}-{max(later):.2f}) | {mean / (first or mean):.2f}x", mean


def scale_table(runs: list[dict]) -> str:
    """The markdown table of ``runs`` (the JSON list ``--out`` writes, one run per N), as
    ``results/scale/README.md`` quotes it: N, clients trained per round, start-up (launch to round 1)
    with the launcher's part, round 1, the mean and range of the later rounds and their ratio to the
    first run's, the peak PSS of the process tree and of the ServerApp's (``flwr-simulation``) and the
    ClientApps' processes. Seconds, GiB and MiB."""
    lines = [
        "| N | clients per round | launch to round 1 (launcher) | round 1 | rounds 2+ (range) | vs first row "
        "| peak PSS | `flwr-simulation` | ClientApps |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    first = None
    for run in runs:
        # key=value words, also those of one quoted -c "k=v k=v" argument
        words = [w for item in shlex.split(run["command"]) for w in (shlex.split(item) if " " in item else [item])]
        config = dict(w.split("=", 1) for w in words if "=" in w)
        n, fraction = int(config["num-clients"]), float(config["fraction-train"])
        cells, mean = later_rounds(run["round_seconds"], first)
        first = first or mean
        actors = run["pss_mib_at_peak"].get("ray::ClientAppActor.run", [0, 0.0])
        lines.append(
            f"| {n:,} | {round(n * fraction)} | {sum(run['startup_seconds'].values()):.1f} s "
            f"({run['startup_seconds']['launcher']:.1f} s) | {run['round_seconds'][0]:.1f} s | {cells} "
            f"| {run['peak_pss_gib']:.2f} GiB "
            f"| {run['pss_mib_at_peak']['flwr-simulation'][1]:.0f} MiB "
            f"| {actors[0]} x {actors[1] / actors[0]:.0f} MiB |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_config_arguments(parser)
    parser.add_argument("--cpus-per-client", type=int, default=1)
    parser.add_argument("--gpus-per-client", type=float, default=None)
    parser.add_argument("--methods", default="", help="comma-separated methods to run in turn on the same config")
    parser.add_argument("--minutes", type=float, default=0.0, help="wall-time budget per run (0: none)")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON file that each finished run is added to as it ends (its command, commit and totals)",
    )
    parser.add_argument("--table", type=Path, default=None, help="print the markdown table of an --out file and exit")
    args = parser.parse_args(argv)
    if args.table is not None:
        print(scale_table(json.loads(args.table.read_text())))
        return 0

    methods = [m for m in args.methods.split(",") if m] or [None]
    with stop_on_signals():
        try:  # every run's whole config, before the first starts
            config, _ = read_config(args.preset, args.run_config)
            validate_configs([{**config, **({"method": m} if m else {})} for m in methods])
        except ConfigError as exc:
            print(f"error: {exc}")
            return 2
        table = {}
        try:
            for method in methods:
                items = args.run_config + ([f"method={json.dumps(method)}"] if method else [])
                if method:
                    print(f"=== {method}", flush=True)
                table[method] = run_one(items, args.cpus_per_client, args.gpus_per_client, args.minutes, args.preset)
                if args.out is not None and table[method] is not None:
                    add_row(args.out, argv, table[method])
        except KeyboardInterrupt:
            print("interrupted: stopped the run and everything it started", flush=True)
            return 130
    if len(methods) > 1:
        print(
            f"{'method':>12} {'rounds':>6} {'final':>7} {'best':>7} {'last10':>7} {'s/round':>8} "
            f"{'B up/client-round':>18} {'B down/client-round':>20}"
        )
        for method, t in table.items():
            if t is None:
                print(f"{method:>12} failed")
                continue
            print(
                f"{method:>12} {t['rounds']:>6} {t['final']:>7.4f} {t['best']:>7.4f} {t['last10']:>7.4f} "
                f"{t['round_s']:>8.2f} {t['up_per_client']:>18.0f} {t['down_per_client']:>20.0f}"
            )
    return 0 if all(t is not None for t in table.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
