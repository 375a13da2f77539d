"""The Ray cluster a simulation runs on with ``--ray-address``: checked before anything starts
(:func:`check_ray_cluster`), from a spawned child that joins it as a short-lived driver.
"""

from __future__ import annotations

import contextlib
import socket

from tools.processes import kill_all

#: ``--ray-address`` (and ``RAY_ADDRESS``) value for a Ray instance of this run's own (Ray's own word)
LOCAL_RAY = "local"


#: seconds a child may take to import Ray, join the cluster at ``--ray-address`` and list its nodes: Ray
#: retries a GCS that does not answer (a TCP service that is not Ray) without end
RAY_JOIN_TIMEOUT = 45.0


def check_ray_cluster(address: str, cpus: float, gpus: float | None) -> bool:
    """Check that the Ray cluster at ``address`` (``HOST:PORT`` of its head's GCS, or ``auto``: the
    latest ``ray start`` on this host) answers and can host a ClientApp of ``cpus`` CPUs and ``gpus``
    GPUs (None: any); returns whether it has a GPU. Flower sizes its actor pool the same way, node by
    node (``flwr.simulation.ray_transport.ray_actor.pool_size_from_resources``), so a cluster this
    passes runs the ClientApps.

    Ray is asked from a spawned child, as a short-lived driver of the cluster (``ray.init`` then
    ``ray.nodes()``), after a TCP connection to ``HOST:PORT`` has shown something listens there (Ray
    itself retries an absent head for about a minute); the child is killed after
    :data:`RAY_JOIN_TIMEOUT` seconds (:func:`cluster_nodes`).

    Raises:
        ConfigError: naming ``--ray-address``: nothing answers there, Ray cannot join it (within
            :data:`RAY_JOIN_TIMEOUT` s), or no alive node has the CPUs (and GPUs) of one ClientApp.
    """
    from common.errors import ConfigError

    if address != "auto":
        host, sep, port = address.rpartition(":")
        if not sep or not port.isdigit():
            raise ConfigError(f"--ray-address {address!r}: expected HOST:PORT of the Ray head (or 'auto')")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
        except OSError as exc:
            raise ConfigError(
                f"--ray-address {address}: no Ray cluster answers there ({exc}); start its head with "
                f"'ray start --head --port {port}' (docs/running.md: Simulation on a Ray cluster)"
            ) from None
    error, nodes = cluster_nodes(address)
    if error:
        raise ConfigError(f"--ray-address {address}: Ray cannot join the cluster: {error}")
    resources = [node["resources"] for node in nodes]
    fits = sum(client_slots(r, cpus, gpus or 0.0) for r in resources)
    if not fits:
        raise ConfigError(
            f"--ray-address {address}: no alive node of the cluster can host a ClientApp of {cpus} CPUs"
            + (f" and {gpus} GPUs" if gpus else "")
            + f" (node resources: {[{k: v for k, v in r.items() if k in ('CPU', 'GPU')} for r in resources]}); "
            "start a worker with 'ray start --address ...' or lower --cpus-per-client/--gpus-per-client"
        )
    return any(r.get("GPU", 0) > 0 for r in resources)


def client_slots(resources: dict[str, float], cpus: float, gpus: float) -> int:
    """ClientApps of ``cpus`` CPUs and ``gpus`` GPUs that fit on one Ray node of ``resources``
    (Flower's per-node count: a node without the GPUs asked for fits none)."""
    fits = int(resources.get("CPU", 0) // cpus)
    return min(fits, int(resources.get("GPU", 0) // gpus)) if gpus > 0 else fits


def cluster_nodes(address: str, timeout: float | None = None) -> tuple[str | None, list[dict]]:
    """(error or None, ``[{"id": Ray node id (hex), "resources": {"CPU": ..., ...}}]`` of each alive
    node) of the Ray cluster at ``address``, asked by a spawned child that joins the cluster as a
    driver and leaves (Ray and its driver state stay out of this process). A child without an answer
    after ``timeout`` seconds (default :data:`RAY_JOIN_TIMEOUT`) is killed, with whatever it started,
    and the error says so."""
    import multiprocessing

    import psutil

    timeout = RAY_JOIN_TIMEOUT if timeout is None else timeout
    context = multiprocessing.get_context("spawn")
    answer, sender = context.Pipe(duplex=False)
    child = context.Process(target=_ray_nodes, args=(address, sender), daemon=True)
    child.start()
    sender.close()  # this end is the child's: EOF here once the child is gone
    try:
        if answer.poll(timeout):
            return answer.recv()
        return f"no Ray cluster answered within {timeout:.0f} s (is a Ray head's GCS listening there?)", []
    except EOFError:  # it died without an answer
        return f"the child that joins the cluster exited with {child.exitcode} without an answer", []
    finally:
        with contextlib.suppress(psutil.Error):
            kill_all(psutil.Process(child.pid).children(recursive=True))
        child.kill()
        child.join()
        answer.close()


def _ray_nodes(address: str, sender) -> None:
    """Send :func:`cluster_nodes`'s answer for ``address`` through the pipe end ``sender``."""
    import ray

    try:
        ray.init(address=address, logging_level="ERROR", log_to_driver=False)
        nodes = [
            {"id": n["NodeID"], "resources": dict(n["Resources"])} for n in ray.nodes() if n["Alive"] and n["Resources"]
        ]
        sender.send((None, nodes))
    except (ConnectionError, ValueError, RuntimeError) as exc:
        sender.send((f"{type(exc).__name__}: {exc}", []))
    finally:
        ray.shutdown()
