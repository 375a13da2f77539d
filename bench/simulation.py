"""Benchmark a real ``flwr run`` simulation: accuracy, bytes, seconds per round, peak memory.

Usage (from the repository root):

    uv run --frozen python -m bench.simulation [-c "method='local'"] [--cpus-per-client 1]

Runs the job through ``tools.run`` while sampling the resident memory of the whole process
tree (launcher, SuperLink, ServerApp, Ray and its ClientApp actors) every 0.5 s, then prints
per round: mean accuracy, payload bytes, round seconds, and the split of the round into the
clients' training compute and everything else (data, serialisation, Ray, server step,
evaluation messages).

The split: with ``slots`` ClientApps running in parallel (cores / cpus-per-client), a
round's training share is ``sum(client train-seconds) / (slots * round seconds)``, where
train-seconds is each client's local training plus its payload computation, timed inside
the client. The rest of the round is overhead.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]


def tree_rss(proc: psutil.Process) -> int:
    """Resident bytes of ``proc`` and all its descendants."""
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-c", "--run-config", action="append", default=[])
    parser.add_argument("--cpus-per-client", type=int, default=1)
    parser.add_argument("--gpus-per-client", type=float, default=None)
    args = parser.parse_args()

    out = ROOT / "outputs" / f"bench-{int(time.time())}"
    cmd = [sys.executable, "-m", "tools.run", "-c", f"output-dir={json.dumps(str(out))}",
           "--cpus-per-client", str(args.cpus_per_client)]
    if args.gpus_per_client is not None:
        cmd += ["--gpus-per-client", str(args.gpus_per_client)]
    for item in args.run_config:
        cmd += ["-c", item]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    root = psutil.Process(proc.pid)
    peak = [0]

    def sample() -> None:
        while proc.poll() is None:
            peak[0] = max(peak[0], tree_rss(root))
            time.sleep(0.5)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    log = proc.stdout.read()
    proc.wait()
    sampler.join()
    wall = time.perf_counter() - start
    (run_dir,) = list(out.iterdir()) if out.exists() else [None]
    if proc.returncode != 0 or run_dir is None:
        print(log[-4000:])
        print(f"run failed with exit code {proc.returncode}")
        return 1
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    summary = json.loads((run_dir / "summary.json").read_text())
    slots = max(1, (os.cpu_count() or 1) // args.cpus_per_client)
    if args.gpus_per_client:
        slots = min(slots, int(1 / args.gpus_per_client))
    slots = min(slots, max(r["num_clients"] for r in rows))

    print(f"results: {run_dir}")
    print(f"{'round':>5} {'acc_mean':>8} {'acc_wtd':>8} {'bytes_up':>9} {'bytes_down':>10} {'round_s':>7} "
          f"{'train_s':>7} {'other_s':>7} {'other%':>6}")
    shares = []
    for r in rows:
        train = r["client_train_seconds"] / slots
        other = r["round_seconds"] - train
        shares.append(other / r["round_seconds"])
        acc = r["accuracy_mean"]
        print(f"{r['round']:>5} {acc if acc is not None else float('nan'):>8.4f} "
              f"{r['accuracy_weighted'] if acc is not None else float('nan'):>8.4f} {r['bytes_up']:>9} "
              f"{r['bytes_down']:>10} {r['round_seconds']:>7.2f} {train:>7.2f} {other:>7.2f} {100 * shares[-1]:>5.1f}%")
    steady = shares[1:] or shares
    print(f"parallel ClientApps: {slots}")
    print(f"final accuracy_mean {summary['final_accuracy_mean']:.4f}, best {summary['best_accuracy_mean']:.4f} "
          f"(round {summary['best_round']})")
    print(f"mean round {sum(r['round_seconds'] for r in rows) / len(rows):.2f} s; non-training share "
          f"{100 * sum(steady) / len(steady):.1f}% (rounds 2+), {100 * sum(shares) / len(shares):.1f}% (all)")
    print(f"bytes per round: up {rows[-1]['bytes_up']} down {rows[-1]['bytes_down']}; total up "
          f"{summary['total_bytes_up']} down {summary['total_bytes_down']}")
    print(f"wall time {wall:.1f} s (start-up, handshake, shut-down: {wall - rows[-1]['elapsed_seconds']:.1f} s)")
    print(f"peak resident memory of the process tree: {peak[0] / 2**30:.2f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
