"""Benchmark a real deployment round: where the time goes between the clients' compute and the round.

Usage (from the repository root):

    uv run --frozen python -m bench.deployment [--nodes 3] [--rounds 4] [--late 0] [--preset FILE] [-c "..."]

``-c`` and ``--preset`` work as in ``tools.run``; the whole config is checked before anything starts.

Starts a SuperLink and ``--nodes`` SuperNodes on loopback with TLS and node authentication
(:mod:`tools.loopback`, i.e. :mod:`tools.deploy`'s commands), runs one job (default FedGH,
CIFAR-10, 200 examples per client, batch 32), stops everything it started, and prints per round:

- ``round_s``: the round's wall time at the server (train and evaluate exchanges);
- ``compute_s``: the slowest client's training (``train-seconds``: local training and payload);
- ``overhead_s``: round_s - compute_s;
- per message, the slowest client's ``app_start_s`` (its process start to the handler: the
  fork from :mod:`tools.superexec`'s warm fork server and the app's load from the FAB; a fresh
  ``flwr-clientapp`` process would add the interpreter and every import), ``data_s`` (loading
  and decoding the partition) and ``handler_s``;
- the server's steps of the round (``engine.runner.Runner.run_round``): ``refresh_s`` (nodes that
  left or joined), ``configure_s`` (sampling and building the payloads), ``exchange_s`` (sending them
  and waiting for every reply: the clients' compute, their process start and Flower's transport),
  ``aggregate_s`` (the method's server update) and ``evaluate_s`` (the evaluation exchange); their sum
  is ``round_s`` but for the replies' checks and the rows' bookkeeping.

``--late N`` starts the last N partitions' SuperNodes only once round 1's row is written (give the run
``min-clients`` = nodes - N, or hold those partitions out with ``generalization.held-out-clients``): the
late-join path of docs/generalization.md. For each it prints the round it was first served in (trained,
evaluated or, held out, personalised) and the seconds from its SuperNode's start to the end of that
round, and what a held-out one downloaded in its phase (``heldout_bytes_down``).

It also times the import floor, ``python -c "import torch, flwr"`` (best of 3, before and after
the job), on the same machine in the same run: what a fresh ClientApp process per message cannot
go below, against which the overhead can be read when the machine is noisy; and the same with
``torchvision``, which model groups with torchvision models import (and it ``torch._dynamo``;
the optimisers of :mod:`common.optim` do not). The last line is
``overhead_s=<median overhead of rounds 2..> import_floor_s=<floor>``.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common.errors import ConfigError
from tools.loopback import LoopbackDeployment, rows_of
from tools.outcome import print_outcome, run_folder
from tools.processes import stop_on_signals, wait_for
from tools.runconfig import add_config_arguments, read_config, validate_configs

ROOT = Path(__file__).resolve().parents[1]
DATA_DIR = ROOT.parent / "shared" / "data"


def import_floor(modules: str = "torch, flwr", repeats: int = 3) -> float:
    """Best wall time of ``python -c "import <modules>"`` over ``repeats`` runs, seconds."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", f"import {modules}"], check=True)
        times.append(time.perf_counter() - start)
    return min(times)


def start_late(deployment: LoopbackDeployment, partitions: list[int], out: Path) -> dict[int, float]:
    """Start ``partitions``' SuperNodes once the run's round 1 row is written; returns partition -> its start,
    seconds into the run (round 1's ``elapsed_seconds`` plus the wait since that row was seen)."""
    wait_for(lambda: rows_of(out), 60 * 60, "round 1's row")
    seen, first = time.perf_counter(), rows_of(out)[0]
    started = {}
    for p in partitions:
        deployment.supernode(p)
        started[p] = first["elapsed_seconds"] + time.perf_counter() - seen
    return started


def late_lines(rows: list[dict], started: dict[int, float]) -> list[str]:
    """One line per late partition: the round whose row first shows it (in ``accuracy_per_client`` or
    ``heldout_partitions``), the seconds from its SuperNode's start to that round's end, and a held-out
    one's phase downloads (``heldout_bytes_down``: every held-out client's, bytes)."""
    lines = []
    for p, at in started.items():
        served = next(
            (r for r in rows if str(p) in r.get("accuracy_per_client", {}) or p in r.get("heldout_partitions", [])),
            None,
        )
        if served is None:
            lines.append(f"late partition {p}: started {at:.1f} s into the run, never served")
            continue
        held_out = p in served.get("heldout_partitions", [])
        what = f"held out, phase downloads {served['heldout_bytes_down']} B" if held_out else "training"
        lines.append(
            f"late partition {p}: started {at:.1f} s into the run, first served in round {served['round']} "
            f"({what}), {served['elapsed_seconds'] - at:.1f} s after its start"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--late", type=int, default=0, help="start the last N SuperNodes once round 1 is written")
    parser.add_argument("--data-dir", type=Path, default=DATA_DIR)
    add_config_arguments(parser)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-deployment-") as tmp, stop_on_signals():
        folder = Path(tmp)
        out = folder / "outputs"
        base = {
            "method": "fedgh",
            "num-clients": args.nodes,
            "num-server-rounds": args.rounds,
            "max-examples-per-client": 200,
            "batch-size": 32,
            "data-dir": str(args.data_dir),
            "output-dir": str(out),
            "round-timeout": 300.0,
        }
        try:
            if not 0 <= args.late < args.nodes:
                raise ConfigError(f"--late {args.late}: allowed 0 to --nodes - 1 = {args.nodes - 1}")
            config, run_config = read_config(args.preset, args.run_config, base)
            validate_configs([config])  # before any SuperLink or SuperNode starts
        except ConfigError as exc:
            print(f"error: {exc}")
            return 2
        try:
            floor = [import_floor()]
            start = time.perf_counter()
            late = list(range(args.nodes - args.late, args.nodes))
            with LoopbackDeployment(folder, args.nodes, args.data_dir) as deployment:
                deployment.start(started=args.nodes - args.late)
                started = time.perf_counter() - start
                run_id = deployment.submit(run_config)
                late_started = start_late(deployment, late, out) if late else {}
                status = deployment.finished(run_id, 60 * 60)
        except KeyboardInterrupt:  # the deployment's processes were stopped on the way out
            print("interrupted: stopped the SuperLink and the SuperNodes")
            return 130
        except (RuntimeError, TimeoutError) as exc:  # no SuperLink, a refused key or run, no end within the hour
            print(f"deployment failed: {exc}; stopped the SuperLink and the SuperNodes")
            return 1
        rows = rows_of(out)
        if status != "finished:completed" or not rows:
            print(f"deployment: run {status} after {len(rows)} rounds; no timing to report")
            print_outcome(run_folder(out, run_id), status)
            return 1
    floor.append(import_floor())
    # a message of a client with a torchvision model cannot start below this
    torchvision_floor = import_floor("torch, flwr, torchvision")
    print(
        f"deployment: {args.nodes} SuperNodes on loopback, TLS + node auth; start {started:.1f} s; "
        f"run {status}; {run_config['method']}"
    )
    header = ("round", "round_s", "compute_s", "overhead_s", "app_start_s", "data_s", "handler_s", "clients")
    steps = ("refresh_s", "configure_s", "exchange_s", "aggregate_s", "evaluate_s")
    print(" ".join(f"{h:>11}" for h in header + steps))
    overheads = []
    for r in rows:
        compute = r.get("client_train_max_seconds", 0.0)
        overhead = r["round_seconds"] - compute
        overheads.append(overhead)
        values = (
            r["round"],
            r["round_seconds"],
            compute,
            overhead,
            r.get("client_app_start_max_seconds", 0.0),
            r.get("client_data_max_seconds", 0.0),
            r.get("client_handler_max_seconds", 0.0),
            r["num_clients"],
            # the server's steps of the round (engine.runner.Runner.run_round); a method's own round has no
            # configure or exchange step of the runner's (MH-pFedHN, FedRE): "-"
            *(r.get(key, "-") for key in ("refresh_seconds", "configure_seconds", "exchange_seconds")),
            r.get("server_update_seconds", "-"),
            r["eval_phase_seconds"],
        )
        print(" ".join(f"{v:>11.2f}" if isinstance(v, float) else f"{v:>11}" for v in values))
    for line in late_lines(rows, late_started):
        print(line)
    later = overheads[1:] or overheads
    print(
        f"import floor (python -c 'import torch, flwr', best of 3): before {floor[0]:.2f} s, after {floor[1]:.2f} s; "
        f"with torchvision (model groups with torchvision models): {torchvision_floor:.2f} s"
    )
    print(f"overhead_s={statistics.median(later):.2f} import_floor_s={min(floor):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
