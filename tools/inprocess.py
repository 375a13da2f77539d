"""Run the app in this process over an in-process grid: no Ray, no Flower engine, no serialisation.

Usage: ``uv run --frozen python -m tools.inprocess [--preset presets/<name>.toml] [-c "method='fedgh' ..."]``

The run config (``num-clients`` > 0 required: the grid has exactly that many nodes, partitions
0..N-1) runs through the ServerApp's own :func:`server_app.app.run` over :class:`tools.fakegrid.FakeGrid`,
which hands each message straight to the real ClientApp: the same runner, client procedures, rows,
``summary.json``, checkpoints, ``resume-from`` and ``state-dir`` as under ``tools.run``, but the clients
train one after another on this process's torch threads and nothing is started besides. For many small
runs (``python -m tools.grid --in-process``) this saves the simulation's start-up (Ray and Flower's
processes: about 25 s a launch on a 2-core machine, more than ten rounds of a 10-client Fashion-MNIST run);
for one large run ``tools.run`` is faster, its ClientApps training side by side. Rows carry no
per-Ray-node counts. Exits 0 when the run completed, 1 when it failed or stopped, 2 on a configuration
error (one line naming the key).
"""

from __future__ import annotations

import argparse
import secrets
import sys

from common.errors import ConfigError
from common.files import read_summary
from tools.runconfig import add_config_arguments, read_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_config_arguments(parser)
    args = parser.parse_args(argv)
    try:
        config, _ = read_config(args.preset, args.run_config)
        from common.config import RunConfig

        cfg = RunConfig.from_dict(config)
        if cfg.num_clients <= 0:
            raise ConfigError("run config 'num-clients' is 0: tools.inprocess needs the federation's size, N > 0")
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from client_app.app import app as client_app
    from server_app.app import run
    from tools.fakegrid import FakeGrid

    try:
        # a random run id, as Flower's: two runs started within one second get folders of their own
        results = run(FakeGrid(client_app, config, cfg.num_clients), cfg, f"inprocess{secrets.randbits(63)}")
    except ConfigError as exc:  # found at the handshake (a client's data, a privacy target)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("inprocess: interrupted; the run resumes from its checkpoint with resume-from", flush=True)
        return 130
    summary = read_summary(results.path)
    print(f"run folder: {results.path} ({summary['status']}, {summary['rounds_completed']} rounds)", flush=True)
    return 0 if summary["status"] == "completed" else 1


if __name__ == "__main__":
    sys.exit(main())
