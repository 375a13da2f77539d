"""Run the app with ``flwr run`` in Flower's Ray simulation, safely, and report the outcome.

Usage: ``uv run python -m tools.run [--preset presets/<name>.toml] [--run-config "method='local' num-server-rounds=5"]``

What plain ``flwr run . --stream`` does not do and this does (shared/notes/flower.md §0):

- validates the run config before anything starts (a bad key fails in a second);
- starts its *own* SuperLink (simulation mode, free ports, this checkout's ``.flwr`` home,
  runtime dependency installation off) instead of the shared, detached local one, and stops
  it on exit, so no stray process captures the next run from another checkout;
- takes a preset TOML file and ``key=value`` overrides together (``flwr run`` takes one or
  the other);
- resolves ``data-dir``, ``output-dir``, ``resume-from`` and ``state-dir`` to absolute paths
  from the current directory;
- sizes the simulation (``--num-supernodes``, default ``num-clients`` when that is set, else
  10; with ``num-clients`` = 0 the server takes every node) and grants each ClientApp a GPU
  share when one is present;
- runs the simulation on a Ray instance of its own, or with ``--ray-address`` (or ``RAY_ADDRESS``)
  on an existing Ray cluster, checked before anything starts (:func:`check_ray_cluster`);
- exits 0 only if the run's status is ``finished:completed`` (``flwr run`` exits 0 on failure);
- on Ctrl-C, SIGTERM or SIGHUP (:func:`stop_on_signals`) stops the run, its SuperLink, the
  simulation and Ray, marks the run folder's ``summary.json`` ``interrupted`` (:func:`mark_stopped`)
  and exits 130.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
#: virtual SuperNodes when neither --num-supernodes nor num-clients sets them (the README's default job)
DEFAULT_SUPERNODES = 10


def app_defaults(root: Path = ROOT) -> dict:
    """``[tool.flwr.app.config]`` of ``pyproject.toml``, flattened to Flower's dotted keys."""
    with open(root / "pyproject.toml", "rb") as f:
        table = tomllib.load(f)["tool"]["flwr"]["app"]["config"]

    def flat(d: dict, prefix: str = "") -> dict:
        out = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
        return out

    return flat(table)


def toml_value(value) -> str:
    """A run-config value written as TOML (strings quoted, bools lower-case)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    return repr(value)


@contextlib.contextmanager
def run_config_file(config: dict[str, Any]):
    """``config`` (flat keys) as a TOML file for ``flwr run --run-config FILE``, removed on exit.

    Why a file: Flower 1.41's ``parse_config_args`` parses each ``--run-config KEY=VALUE`` item to a
    nested dict and merges the items with a shallow ``dict.update``, so of several items of one table
    (``--run-config fedgh.server-mode=... --run-config fedgh.server-lr=...``) only the last survives
    and the others silently take their defaults. A TOML file is read in one piece; its quoted dotted
    keys (``"fedgh.server-mode" = "minibatch"``) stay flat, as Flower's own flattened keys are.
    """
    with tempfile.NamedTemporaryFile("w", suffix=".toml", prefix="run-config-", delete=False, encoding="utf-8") as f:
        f.writelines(f"{json.dumps(key, ensure_ascii=False)} = {toml_value(value)}\n" for key, value in config.items())
    try:
        yield Path(f.name)
    finally:
        Path(f.name).unlink(missing_ok=True)


def config_mismatch(requested: dict[str, Any], used: dict[str, Any]) -> list[str]:
    """``key: requested -> used`` for every key of ``requested`` whose value the run did not use
    (``used``: the ``config`` of its ``summary.json``); empty when the run used what was asked."""
    return [f"{k}: {v!r} -> {used.get(k)!r}" for k, v in requested.items() if used.get(k) != v]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def flwr_cli(*args: str, env: dict, capture: bool = True, timeout: float | None = None) -> subprocess.CompletedProcess:
    """The ``flwr`` CLI of this environment with ``args``, run from the repository root; output
    captured unless ``capture`` is False (e.g. ``flwr log --stream``)."""
    exe = str(Path(sys.executable).with_name("flwr"))
    return subprocess.run(
        [exe, *args], env=env, cwd=ROOT, text=True, capture_output=capture, check=False, timeout=timeout
    )


#: ``--ray-address`` (and ``RAY_ADDRESS``) value for a Ray instance of this run's own (Ray's own word)
LOCAL_RAY = "local"


def check_ray_cluster(address: str, cpus: float, gpus: float | None) -> bool:
    """Check that the Ray cluster at ``address`` (``HOST:PORT`` of its head's GCS, or ``auto``: the
    latest ``ray start`` on this host) answers and can host a ClientApp of ``cpus`` CPUs and ``gpus``
    GPUs (None: any); returns whether it has a GPU. Flower sizes its actor pool the same way, node by
    node (``flwr.simulation.ray_transport.ray_actor.pool_size_from_resources``), so a cluster this
    passes runs the ClientApps.

    Ray is asked from a spawned child, as a short-lived driver of the cluster (``ray.init`` then
    ``ray.nodes()``), after a TCP connection to ``HOST:PORT`` has shown something listens there (Ray
    itself retries an absent head for about a minute).

    Raises:
        ConfigError: naming ``--ray-address``: nothing answers there, Ray cannot join it, or no alive
            node has the CPUs (and GPUs) of one ClientApp.
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


def cluster_nodes(address: str) -> tuple[str | None, list[dict]]:
    """(error or None, ``[{"id": Ray node id (hex), "resources": {"CPU": ..., ...}}]`` of each alive
    node) of the Ray cluster at ``address``, asked by a spawned child that joins the cluster as a
    driver and leaves (Ray and its driver state stay out of this process)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_ray_nodes, address).result()


def _ray_nodes(address: str) -> tuple[str | None, list[dict]]:
    import ray

    try:
        ray.init(address=address, logging_level="ERROR", log_to_driver=False)
        nodes = [
            {"id": n["NodeID"], "resources": dict(n["Resources"])} for n in ray.nodes() if n["Alive"] and n["Resources"]
        ]
        return None, nodes
    except (ConnectionError, ValueError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}", []
    finally:
        ray.shutdown()


def start_superlink(env: dict, home: Path) -> tuple[subprocess.Popen, str]:
    """Start a simulation SuperLink on free loopback ports; returns (process, address) at once
    (it takes seconds to come up: :func:`wait_healthy`)."""
    port, control = free_port(), free_port()
    with open(home / "superlink.log", "ab") as log_file:
        exe = str(Path(sys.executable).with_name("flower-superlink"))
        proc = subprocess.Popen(
            [
                exe,
                "--insecure",
                "--simulation",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--control-api-address",
                f"127.0.0.1:{control}",
                "--database",
                str(home / "state.db"),
                "--disable-runtime-dependency-installation",
            ],
            env=env,
            cwd=ROOT,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return proc, f"127.0.0.1:{port}"


def wait_healthy(proc: subprocess.Popen, address: str, home: Path, timeout: float = 60.0) -> None:
    """Wait until the SuperLink at ``address`` answers ``/health``.

    Raises:
        RuntimeError: it exited (see ``<home>/superlink.log``) or did not answer within ``timeout`` s.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"flower-superlink exited with {proc.returncode}; see {home / 'superlink.log'}")
        try:
            with urllib.request.urlopen(f"http://{address}/health", timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"flower-superlink did not become healthy within {timeout:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    """Stop the SuperLink and everything it started (its process group)."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def interrupt(proc: subprocess.Popen, grace: float = 120.0) -> None:
    """Stop a running ``tools.run`` job as Ctrl-C would, then whatever it leaves behind.

    SIGINT makes the launcher stop its run (``flwr stop``) and its SuperLink; the simulation and
    Ray run in other process groups, so every descendant seen before the signal is killed after
    the launcher exits (or after ``grace`` seconds, when the launcher is killed too).
    """
    import psutil

    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:  # it has just exited (and been reaped): nothing of it is left to stop
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    for child in children:
        with contextlib.suppress(psutil.Error):
            child.kill()


def run_status(env: dict, run_id: int, connection: str = "sim") -> str:
    """The status of run ``run_id`` on CLI ``connection`` (``finished:completed``, ...; ``unknown``
    when the SuperLink does not answer or lists no such run)."""
    out = flwr_cli("list", connection, "--run-id", str(run_id), "--format", "json", env=env).stdout
    try:
        runs = json.loads(out).get("runs", [])
    except json.JSONDecodeError:
        return "unknown"
    return runs[0].get("status", "unknown") if runs else "unknown"


def wait_finished(env: dict, run_id: int, connection: str, timeout: float | None, echo: bool = False) -> str:
    """Wait up to ``timeout`` seconds (None: no limit) for run ``run_id`` on CLI ``connection`` to
    finish; returns its status (``finished:completed``, ...).

    A ``flwr log --stream`` process waits for the end of the run (the SuperLink closes the
    stream then), printing the run's log when ``echo``; the status is asked only afterwards,
    and the stream opened again should it have ended early. Asking ``flwr list`` every second
    instead costs about 2 s of CPU per call (the CLI's imports), which a 2-core machine takes
    from the run itself.

    Raises:
        TimeoutError: the run did not finish within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout if timeout is not None else None
    while True:
        left = deadline - time.monotonic() if deadline is not None else None
        try:
            flwr_cli("log", str(run_id), connection, "--stream", env=env, capture=not echo, timeout=left)
        except subprocess.TimeoutExpired:
            break
        status = run_status(env, run_id, connection)
        if status.startswith("finished"):
            return status
        if deadline is not None and time.monotonic() >= deadline:
            break
        time.sleep(2.0)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for run {run_id} to finish")


def wait_for(predicate, timeout: float, what: str, poll: float = 0.5):
    """``predicate()``'s first truthy value, asked every ``poll`` seconds.

    Raises:
        TimeoutError: naming ``what`` when ``timeout`` seconds pass first.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


#: the signals every entry point (tools.run, tools.grid, tools.compose_demo, bench.*) stops on: Ctrl-C,
#: a batch system's or container engine's SIGTERM, a closed terminal's SIGHUP
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def stop_on_signals():
    """Within this block the first of :data:`STOP_SIGNALS` raises ``KeyboardInterrupt`` in the main
    thread, so an entry point stops what it started through one clean-up path whichever signal came.
    Later ones are ignored (noted on stderr) until the block ends, so that clean-up runs to its end:
    a terminal's Ctrl-C reaches a launcher and the ``tools.run`` it started at once, and the
    launcher's :func:`interrupt` then sends that ``tools.run`` one more SIGINT, which would otherwise
    break off its clean-up halfway (Ray left running, the summary left ``running``). The clean-up is
    bounded (:func:`_run`: about 90 s at most); SIGKILL still ends it. The previous handlers come
    back after the block.

    Raises:
        ValueError: entered outside the main thread (Python runs signal handlers there only).
    """
    first: list[signal.Signals] = []

    def handler(signum: int, frame) -> None:
        if first:
            # a Python handler, not SIG_IGN: processes started during the clean-up must not inherit it
            os.write(2, f"{signal.Signals(signum).name} ignored: still stopping after {first[0].name}\n".encode())
            return
        first.append(signal.Signals(signum))
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def add_config_arguments(parser: argparse.ArgumentParser, preset: bool = True) -> None:
    """``--preset FILE`` (unless the entry point takes it otherwise) and ``-c/--run-config``: the one
    way every entry point takes run config keys (:func:`read_config`)."""
    if preset:
        parser.add_argument(
            "--preset",
            default=None,
            help="a TOML file of run config keys (e.g. presets/fedgh-table3-cifar10.toml); "
            "--run-config overrides its values",
        )
    parser.add_argument(
        "--run-config",
        "-c",
        action="append",
        default=[],
        help="overrides, several key=value pairs each, e.g. \"method='local' num-server-rounds=5\" (repeatable)",
    )


def read_config(preset: str | os.PathLike | None, items: list[str], base: dict | None = None) -> tuple[dict, dict]:
    """``(config, overrides)``: the run config defaults (pyproject), then ``base`` (an entry point's
    own settings), then the preset, then each ``-c`` item, parsed by Flower's ``parse_config_args``
    as ``flwr run --run-config`` does (several ``key=value`` pairs per item); ``data-dir``,
    ``output-dir``, ``resume-from`` and ``state-dir`` of ``config`` resolved to absolute paths.
    ``overrides`` is everything but the defaults, as given.

    Raises:
        ConfigError: a key the app does not have (naming it), or an item Flower cannot parse.
    """
    from flwr.common.config import parse_config_args

    from common.errors import ConfigError

    overrides = dict(base or {})
    try:
        overrides.update(parse_config_args([str(preset)]) if preset else {})
        # one item at a time: Flower merges the items' nested tables shallowly (run_config_file)
        for item in items:
            overrides.update(parse_config_args([item]))
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"run config overrides {items} cannot be parsed: {exc}") from None
    defaults = app_defaults()
    unknown = sorted(set(overrides) - set(defaults))
    if unknown:
        raise ConfigError(f"unknown run config key(s) {unknown}; see [tool.flwr.app.config] in pyproject.toml")
    config = {**defaults, **overrides}
    for key in ("data-dir", "output-dir", "resume-from", "state-dir"):
        if config[key]:
            config[key] = str(Path(config[key]).expanduser().resolve())
    return config, overrides


def validate_configs(configs: list[dict]) -> list[tuple[int, bool]]:
    """Check every run config of ``configs`` as the ServerApp would (:func:`check_config`), in one
    spawned child (torch and the methods stay out of the caller's memory), before anything starts.

    Returns:
        ``(num-clients, whether a GPU is visible)`` per config.

    Raises:
        ConfigError: the first invalid config's error, naming the key.
    """
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from common.errors import ConfigError

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        checked = list(pool.map(check_config, configs))
    for error, _, _ in checked:
        if error:
            raise ConfigError(error)
    return [(num_clients, gpu) for _, num_clients, gpu in checked]


def run_folder(output_dir: str | os.PathLike, run_id: int) -> Path | None:
    """The run folder the ServerApp of Flower run ``run_id`` wrote under ``output_dir`` (its name ends
    in the run id), or None when it wrote none."""
    found = sorted(Path(output_dir).glob(f"*-{run_id}/summary.json"))
    return found[-1].parent if found else None


def summary_status(folder: Path | None) -> str | None:
    """The ``status`` of ``<folder>/summary.json`` (``running``, ``completed``, ``failed``, ...); None when
    there is no folder or no readable summary in it."""
    from common.errors import ConfigError
    from common.files import read_summary

    try:
        return read_summary(folder)["status"] if folder is not None else None
    except ConfigError:
        return None


def mark_stopped(folder: Path, reason: str, status_before: str | None) -> None:
    """Give the run folder of a run the launcher stopped a final status: ``summary.json`` status
    ``interrupted`` with ``reason`` under ``error``, when the ServerApp left it ``running`` (killed
    before it could write) or recorded ``failed`` after the stop (``status_before``, its status when
    the signal came, was ``running`` or None: the failure is the stop's doing; its error is kept after
    ``reason``). A run that had ended before the signal keeps its summary, as does a folder without
    a readable one."""
    from common.errors import ConfigError
    from common.files import SUMMARY_FILE, atomic_write, read_summary

    try:
        summary = read_summary(folder)
    except ConfigError:
        return
    if summary["status"] != "running" and not (summary["status"] == "failed" and status_before in (None, "running")):
        return
    error = reason + (f"; the ServerApp then recorded: {summary['error']}" if summary.get("error") else "")
    summary.update(status="interrupted", error=error)
    text = json.dumps(summary, indent=2, allow_nan=False).encode("utf-8")
    atomic_write(folder / SUMMARY_FILE, lambda f: f.write(text))


def print_outcome(folder: Path | None, status: str) -> None:
    """The run's last lines: its status (and the reason when it failed), final and best accuracy (mean over
    clients and pooled, each best with its round), total payload bytes and its folder, from ``summary.json``."""
    from common.errors import ConfigError
    from common.files import read_summary

    try:
        summary = read_summary(folder) if folder is not None else None
    except ConfigError as exc:
        print(f"status {status}; {exc}")
        return
    if summary is None:
        print(f"status {status}; the run wrote no results folder")
        return
    if summary.get("error") or summary["status"] != "completed":
        print(f"status {status} ({summary['status']}): {summary.get('error') or 'no reason recorded'}")

    def pct(key: str) -> str:
        return f"{100 * summary[key]:.2f} %" if summary.get(key) is not None else "-"

    total = sum(summary.get(f"total_{k}", 0) for k in ("bytes_up", "bytes_down", "eval_bytes_up", "eval_bytes_down"))
    best_mean = f"{pct('best_accuracy_mean')} (mean over clients) in round {summary.get('best_round')}"
    best_pooled = f"{pct('best_accuracy_weighted')} (pooled) in round {summary.get('best_round_weighted')}"
    print(
        f"{summary['rounds_completed']} rounds: final accuracy {pct('final_accuracy_mean')} (mean over clients), "
        f"{pct('final_accuracy_weighted')} (pooled); best {best_mean}, {best_pooled}; "
        f"payload {total / 2**20:.2f} MiB in all (training and evaluation, both ways)"
    )
    print(f"results: {folder} (python -m tools.report {folder} draws its curves)")


def used_requested_config(folder: Path | None, config: dict[str, Any]) -> bool:
    """Whether the run in ``folder`` used ``config`` (its ``summary.json``); prints what differs if not.
    A run without a readable summary has nothing to compare (:func:`print_outcome` said why)."""
    from common.errors import ConfigError
    from common.files import read_summary

    try:
        used = read_summary(folder).get("config") if folder is not None else None
    except ConfigError:
        used = None
    differs = config_mismatch(config, used) if used is not None else []
    if differs:
        print(f"error: the run did not use the requested run config: {'; '.join(differs)}")
    return not differs


def descendants() -> list:
    """Every process this one started, directly or not (psutil processes)."""
    import psutil

    return psutil.Process().children(recursive=True)


def kill_all(processes: list) -> None:
    """Kill ``processes`` that are still alive (a simulation's Ray daemons run in process groups of
    their own, so stopping the SuperLink's group does not reach them)."""
    import psutil

    for p in processes:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(processes, timeout=10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_config_arguments(parser)
    parser.add_argument(
        "--num-supernodes",
        type=int,
        default=None,
        help=f"virtual SuperNodes (= clients); default: run config num-clients, or "
        f"{DEFAULT_SUPERNODES} when that is 0 (follow the federation)",
    )
    parser.add_argument(
        "--cpus-per-client",
        type=int,
        default=1,
        help="CPU cores reserved per ClientApp (Ray); parallel clients = cores / this",
    )
    parser.add_argument(
        "--gpus-per-client",
        type=float,
        default=None,
        help="GPU share per ClientApp; default 0.25 when a GPU is visible (on the Ray cluster with "
        "--ray-address), else 0",
    )
    parser.add_argument(
        "--ray-address",
        default=os.environ.get("RAY_ADDRESS") or LOCAL_RAY,
        help="HOST:PORT of an existing Ray cluster's head (as 'ray start --head' prints it; 'auto': the "
        "latest 'ray start' on this host) to run the ClientApps on; default: $RAY_ADDRESS, else "
        f"'{LOCAL_RAY}', a Ray instance of this run's own",
    )
    args = parser.parse_args(argv)
    from common.errors import ConfigError

    with stop_on_signals():
        try:
            config, _ = read_config(args.preset, args.run_config)
            ((num_clients, gpu),) = validate_configs([config])  # before anything starts
            supernodes = federation_size(args.num_supernodes, num_clients)
            if args.ray_address != LOCAL_RAY:
                gpu = check_ray_cluster(args.ray_address, args.cpus_per_client, args.gpus_per_client)
        except ConfigError as exc:
            print(f"error: {exc}")
            return 2
        except KeyboardInterrupt:
            print("interrupted before the run started")
            return 130
        return _run(args, config, supernodes, gpu)


def federation_size(num_supernodes: int | None, num_clients: int) -> int:
    """The simulated SuperNodes: ``--num-supernodes``, else run config ``num-clients``, else
    :data:`DEFAULT_SUPERNODES`.

    Raises:
        ConfigError: ``--num-supernodes`` below 1 or disagreeing with a non-zero ``num-clients``.
    """
    from common.errors import ConfigError

    if num_supernodes is not None and num_supernodes < 1:
        raise ConfigError(f"--num-supernodes {num_supernodes}: allowed values are integers >= 1")
    supernodes = num_supernodes or num_clients or DEFAULT_SUPERNODES
    if num_clients and supernodes != num_clients:
        raise ConfigError(
            f"--num-supernodes {supernodes} disagrees with run config key 'num-clients' = "
            f"{num_clients}; drop one of them (num-clients=0 follows the federation)"
        )
    return supernodes


def check_config(config: dict) -> tuple[str | None, int, bool]:
    """(error message or None, run config ``num-clients``, whether a GPU is visible) of ``config``:
    everything the ServerApp would reject, method options included. Runs in a child process
    (:func:`_validate_and_run`), so that torch and the methods are not kept in this launcher's
    memory for the whole run."""
    from common.config import RunConfig
    from common.results import tensorboard_class
    from strategies.registry import build_strategy

    try:
        cfg = RunConfig.from_dict(config)
        build_strategy(cfg)  # fail fast on any bad value, method options too
        tensorboard_class(cfg.logger)
    except ValueError as exc:
        return str(exc), 0, False
    import torch

    return None, cfg.num_clients, torch.cuda.is_available()


def _run(args, config: dict, supernodes: int, gpu: bool) -> int:
    """Start a SuperLink, submit the validated ``config`` to it, stream the run and report it; on
    Ctrl-C, SIGTERM or SIGHUP stop the run, the SuperLink and every process they started, and give the
    run folder a final status."""
    home = ROOT / ".flwr"
    home.mkdir(exist_ok=True)
    bin_dir = str(Path(sys.executable).parent)  # flower-superexec etc. must be on PATH for the SuperLink
    env = {
        **os.environ,
        "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
        "FLWR_HOME": str(home),
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "PYTHONUNBUFFERED": "1",
        # flwr-simulation (started with the SuperLink's environment) joins the cluster named here;
        # "local" keeps a plain run off any cluster a 'ray start' left on this host
        "RAY_ADDRESS": args.ray_address,
    }
    gpus = args.gpus_per_client if args.gpus_per_client is not None else (0.25 if gpu else 0.0)
    federation = (
        f"num-supernodes={supernodes} client-resources-num-cpus={args.cpus_per_client} client-resources-num-gpus={gpus}"
    )
    cmd = ["run", str(ROOT), "sim", "--format", "json", "--federation-config", federation]
    run_id = None
    superlink, address = start_superlink(env, home)
    try:
        wait_healthy(superlink, address, home)
        (home / "config.toml").write_text(
            f'[superlink]\ndefault = "sim"\n\n[superlink.sim]\naddress = "{address}"\ninsecure = true\n'
        )
        with run_config_file(config) as path:
            submitted = flwr_cli(*cmd, "--run-config", str(path), env=env)
        try:
            run_id = int(json.loads(submitted.stdout)["run-id"])
        except (ValueError, KeyError, TypeError):
            print(submitted.stdout, submitted.stderr, sep="\n")
            print("error: the run was not submitted")
            return 1
        print(f"Submitted run {run_id}; streaming its log (Ray needs tens of seconds before round 1)")
        status = wait_finished(env, run_id, "sim", None, echo=True)
        print(f"Run {run_id}: {status}")
        folder = run_folder(config["output-dir"], run_id)
        print_outcome(folder, status)
        return 0 if status == "finished:completed" and used_requested_config(folder, config) else 1
    except RuntimeError as exc:  # the SuperLink did not come up: its log says why
        print(f"error: {exc}")
        return 1
    except KeyboardInterrupt:
        started = descendants()  # before anything stops: Ray's processes leave the tree once orphaned
        before = summary_status(run_folder(config["output-dir"], run_id)) if run_id is not None else None
        if run_id is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):  # a SuperLink that does not answer is killed next
                flwr_cli("stop", str(run_id), "sim", env=env, timeout=60)
        stop(superlink)
        kill_all(started)
        folder = run_folder(config["output-dir"], run_id) if run_id is not None else None
        if folder is not None:
            mark_stopped(folder, "stopped by a signal (Ctrl-C, SIGTERM or SIGHUP) to tools.run", before)
        print(f"interrupted: stopped the run, its SuperLink and {len(started)} processes; {folder or 'no run folder'}")
        return 130
    finally:
        stop(superlink)


if __name__ == "__main__":
    sys.exit(main())
