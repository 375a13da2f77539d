"""The ServerApp: read the run config, build the method's run, run it, record results."""

from __future__ import annotations

import logging
import sys
import time

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp
from flwr.superlink.grid import InMemoryGrid  # the grid flwr-simulation gives the ServerApp

from common.config import RunConfig
from common.errors import ConfigError
from common.run_folder import ResultsWriter
from methods.registry import build_run

app = ServerApp()
log = logging.getLogger("flwr." + __name__)  # streamed with Flower's own log

#: the fewest messages of one exchange a simulation keeps waiting at once (:func:`simulation_window`)
MIN_WINDOW = 16


def simulation_window() -> int:
    """How many messages of one exchange wait for their replies at once in a simulation
    (``engine.transport.Transport.window``): four per CPU of the Ray cluster, which runs at most
    one ClientApp per CPU at a time, and at least :data:`MIN_WINDOW` (also before Ray is up: the
    ServerApp starts before the simulation's Ray, in the same process). The cluster's CPUs are asked
    once Ray is up, then kept."""
    if not _cluster_cpus:
        ray = sys.modules.get("ray")
        try:
            if ray is not None and ray.is_initialized():
                _cluster_cpus.append(int(ray.cluster_resources().get("CPU", 0)))
        except AttributeError:  # the simulation's other thread is importing Ray right now
            pass
    return max(MIN_WINDOW, 4 * (_cluster_cpus[0] if _cluster_cpus else 0))


_cluster_cpus: list[int] = []  # the simulation's Ray cluster's CPUs, once known


def run(grid: Grid, cfg: RunConfig, run_id: int | str) -> ResultsWriter:
    """Run method ``cfg.method`` on ``grid``; returns the writer (its ``path`` holds the results).

    The config is fully validated (including the method's options) before any message is
    sent. A failure (an invalid method option included, a run in which no client trained for run
    config ``max-untrained-rounds`` rounds: ``common.errors.RunFailed``, with the clients' errors)
    marks ``summary.json`` as ``failed`` and re-raises, so Flower records the run as failed. In a simulation
    (an ``InMemoryGrid``) clients without a ``state-dir`` keep their state in
    ``<run folder>/client-state`` (``engine.runner.Runner.start``'s ``state_in_run_folder``), and at most
    :func:`simulation_window` messages of an exchange wait at once (``Transport.window``).
    """
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    results = ResultsWriter(cfg.output_dir, f"{stamp}-{cfg.method}-{cfg.dataset}-{run_id}", cfg.as_dict(), cfg.logger)
    simulation = isinstance(grid, InMemoryGrid)
    try:
        run = build_run(cfg, results)
        # a simulation's clients share this file system: without state-dir their state goes to the run
        # folder, not into context.state, which the simulation keeps in this one process for every
        # client; its engine scans every waiting message for every node, so few wait at once
        result = run.start(grid, window=simulation_window if simulation else None, state_in_run_folder=simulation)
        results.write_global_arrays(result.arrays.to_torch_state_dict())
    except BaseException as exc:
        results.finish("failed", f"{type(exc).__name__}: {exc}", getattr(exc, "client_errors", None))
        raise
    return results


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Flower entry point: :func:`run` on the run config.

    A configuration error (``common.errors.ConfigError``: a value the run cannot take, found in the
    config or at the handshake, e.g. a client's data or privacy target) is logged as one line and the
    ServerApp returns: raised, Flower would print the ServerApp's traceback and its exit code for a
    message that already names the key and what is allowed. Flower's status of such a run is
    ``completed``; its ``summary.json`` (once :func:`run` has made the run folder) says ``failed`` with
    the message, so ``tools.run`` exits 1. Any other failure is raised, as :func:`run` documents.
    """
    try:
        run(grid, RunConfig.from_dict(context.run_config), context.run_id)
    except ConfigError as exc:
        log.error("The run failed: %s", exc)
