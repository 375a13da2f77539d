"""The ServerApp: read the run config, build the method's strategy, run it, record results."""

from __future__ import annotations

import time

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp
from flwr.superlink.grid import InMemoryGrid  # the grid flwr-simulation gives the ServerApp

from common.config import RunConfig
from server_app.results import ResultsWriter
from strategies.registry import build_strategy

app = ServerApp()


def run(grid: Grid, cfg: RunConfig, run_id: int | str) -> ResultsWriter:
    """Run method ``cfg.method`` on ``grid``; returns the writer (its ``path`` holds the results).

    The config is fully validated (including the method's options) before any message is
    sent. A failure mid-run marks ``summary.json`` as ``failed`` and re-raises. In a simulation
    (an ``InMemoryGrid``) clients without a ``state-dir`` keep their state in
    ``<run folder>/client-state`` (``HeteroStrategy.client_state_in_run_folder``).
    """
    strategy = build_strategy(cfg)
    # a simulation's clients share this file system: without state-dir their state goes to the run
    # folder, not into context.state, which the simulation keeps in this one process for every client
    strategy.client_state_in_run_folder = isinstance(grid, InMemoryGrid)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    results = ResultsWriter(cfg.output_dir, f"{stamp}-{cfg.method}-{cfg.dataset}-{run_id}", cfg.as_dict(), cfg.logger)
    strategy.results = results
    try:
        strategy.start(grid)
    except BaseException as exc:
        results.finish("failed", f"{type(exc).__name__}: {exc}")
        raise
    return results


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Flower entry point."""
    cfg = RunConfig.from_dict(context.run_config)
    run(grid, cfg, context.run_id)
