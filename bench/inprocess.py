"""Our part of a round alone: a run config's rounds on an in-process grid, at several federation sizes N.

Usage (from the repository root):

    uv run --frozen python -m bench.inprocess [--preset presets/<name>.toml] [-c "method='local'"]
        [--clients 100,1000,10000] [--per-round 100] [--out runs.json]

Each N runs the run config with ``num-clients`` N and ``fraction-train`` ``per-round / N`` (at most 1) over
:class:`tools.fakegrid.FakeGrid`: the real ServerApp run and ClientApp handlers, client state in the
run folder as in a simulation (``engine.runner.Runner.start``'s ``state_in_run_folder``), but no Ray, no
Flower engine and no serialisation, in one process on one torch thread. What grows with N here is ours
(the roster, a new client's partition and model, its state); what ``bench.simulation`` adds at the same
N is Flower's and Ray's. It prints per N the seconds of each round and the clients' handler, training
and data seconds summed over the round (row keys ``round_seconds``, ``client_handler_seconds``,
``client_train_seconds``, ``client_data_seconds``); ``--out`` adds one JSON object per N (those lists,
N, the clients per round, the command, the commit and the CPU count) to a JSON list as each N ends. With handshake
``sampled`` and K of N clients per round, nearly every client of a later round at N = 10,000 is new (its
first message), and every one at N = K is known.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from bench.simulation import add_row, later_rounds
from common.config import RunConfig
from tools.runconfig import add_config_arguments, read_config

#: the row keys reported per round, each a list over the rounds
KEYS = ("round_seconds", "client_handler_seconds", "client_train_seconds", "client_data_seconds")


def run_size(config: dict, num_clients: int, per_round: int) -> dict:
    """One run of ``config`` (flat run config keys) with ``num_clients`` clients, ``per_round`` sampled a
    round; returns N, the clients per round and the :data:`KEYS` of its rows."""
    import torch

    from client_app.app import app as client_app
    from common.run_folder import ResultsWriter
    from methods.registry import build_run
    from tools.fakegrid import FakeGrid

    torch.set_num_threads(1)
    rc = {**config, "num-clients": num_clients, "fraction-train": min(1.0, per_round / num_clients)}
    cfg = RunConfig.from_dict(rc)
    name = f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-inprocess-{num_clients}"
    results = ResultsWriter(cfg.output_dir, name, cfg.as_dict(), cfg.logger)
    run = build_run(cfg, results)
    run.start(FakeGrid(client_app, rc, num_clients), state_in_run_folder=True)
    return {
        "num_clients": num_clients,
        "per_round": round(num_clients * cfg.fraction_train),
        **{key: [row[key] for row in run.rows] for key in KEYS},
    }


def table(runs: list[dict]) -> str:
    """The markdown table of ``runs`` (:func:`run_size`'s): per N the mean and range of the later rounds'
    seconds, their ratio to the first run's, and the clients' handler, training and data seconds a
    later round (means)."""
    lines = [
        "| N | clients per round | rounds 2+ (range) | vs first row | handler s a round | training s | data s |",
        "|---|---|---|---|---|---|---|",
    ]
    first = None
    for run in runs:
        cells, mean = later_rounds(run["round_seconds"], first)
        first = first or mean
        clients = " | ".join(f"{sum(run[key][1:]) / len(run[key][1:]):.2f}" for key in KEYS[1:])
        lines.append(f"| {run['num_clients']:,} | {run['per_round']} | {cells} | {clients} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_config_arguments(parser)
    parser.add_argument("--clients", default="100,1000,10000", help="comma-separated federation sizes N")
    parser.add_argument("--per-round", type=int, default=100, help="clients sampled a round (at most N)")
    parser.add_argument("--out", type=Path, default=None, help="JSON list that each N's run is added to")
    parser.add_argument("--table", type=Path, default=None, help="print the markdown table of an --out file and exit")
    args = parser.parse_args(argv)
    if args.table:
        print(table(json.loads(args.table.read_text())))
        return 0
    config, _ = read_config(args.preset, args.run_config)
    runs = []
    for n in (int(item) for item in args.clients.split(",")):
        runs.append(run_size(config, n, args.per_round))
        if args.out:
            add_row(args.out, argv, runs[-1], "bench.inprocess")
    print(table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
