"""Run the app with ``flwr run`` in Flower's Ray simulation, safely, and report the outcome.

Usage: ``uv run python -m tools.run [--preset presets/<name>.toml] [--run-config "method='local' num-server-rounds=5"]``

What plain ``flwr run . --stream`` (Flower 1.41, ``flwr.cli.run``) does not do and this does:

- validates the run config before anything starts (a bad key fails in a second);
- starts its *own* SuperLink (simulation mode, free ports, a Flower home of this launch's own
  under ``.flwr/launches/``, runtime dependency installation off) instead of the shared, detached
  local one, and stops it on exit, so no stray process captures the next run from another
  checkout and launches from one checkout run side by side (:func:`launch_home`);
- checks before anything starts: a preset that cannot be read or is not TOML, names of paths
  too long for a file system, an ``output-dir`` that is a file or not writable (:func:`read_config`,
  :func:`check_output_folders`), an ``--ray-address`` that is not a Ray cluster (within
  :data:`RAY_JOIN_TIMEOUT` seconds);
- takes a preset TOML file and ``key=value`` overrides together (``flwr run`` takes one or
  the other);
- resolves ``data-dir``, ``output-dir``, ``resume-from`` and ``state-dir`` to absolute paths
  from the current directory;
- sizes the simulation (``--num-supernodes``, default ``num-clients`` when that is set, else
  10; with ``num-clients`` = 0 the server takes every node) and grants each ClientApp a GPU
  share when one is present;
- runs the simulation on a Ray instance of its own, or with ``--ray-address`` (or ``RAY_ADDRESS``)
  on an existing Ray cluster, checked before anything starts (:func:`check_ray_cluster`);
- exits 0 only if the run's status is ``finished:completed`` and its ``summary.json`` says
  ``completed`` (``flwr run`` exits 0 on failure; a ServerApp may record a failure without raising);
- on every exit stops the SuperLink and every process the run started (the simulation and Ray
  included), and gives a run folder left ``running`` a final status (:func:`mark_failed`);
- on Ctrl-C, SIGTERM or SIGHUP (:func:`stop_on_signals`) stops the run, its SuperLink, the
  simulation and Ray, marks the run folder's ``summary.json`` ``interrupted`` (:func:`mark_stopped`)
  and exits 130.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.request
from collections.abc import Callable
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


def wait_finished(
    env: dict,
    run_id: int,
    connection: str,
    timeout: float | None,
    echo: bool = False,
    superlink: subprocess.Popen | None = None,
) -> str:
    """Wait up to ``timeout`` seconds (None: no limit) for run ``run_id`` on CLI ``connection`` to
    finish; returns its status (``finished:completed``, ...). ``superlink``: the SuperLink process
    serving ``connection``, when this process started it (a run whose SuperLink has exited never
    finishes).

    A ``flwr log --stream`` process waits for the end of the run (the SuperLink closes the
    stream then), printing the run's log when ``echo``; the status is asked only afterwards,
    and the stream opened again should it have ended early. Asking ``flwr list`` every second
    instead costs about 2 s of CPU per call (the CLI's imports), which a 2-core machine takes
    from the run itself.

    Raises:
        TimeoutError: the run did not finish within ``timeout`` seconds.
        RuntimeError: ``superlink`` exited before the run finished.
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
        if superlink is not None and superlink.poll() is not None:
            raise RuntimeError(f"flower-superlink exited with {superlink.returncode} before run {run_id} finished")
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


def read_preset(path: str | os.PathLike) -> dict[str, Any]:
    """The run config keys of preset ``path``, a TOML file (whatever its name ends in), flattened to
    Flower's dotted keys as ``flwr run --run-config FILE`` flattens them.

    Raises:
        ConfigError: naming the file: it cannot be read (missing, a folder, no permission) or is not
            UTF-8 TOML of run config values (strings, numbers, booleans, tables of them).
    """
    from flwr.common.config import flatten_dict

    from common.errors import ConfigError
    from common.options import excerpt

    try:
        with open(Path(path).expanduser(), "rb") as f:
            return flatten_dict(tomllib.load(f))
    except OSError as exc:
        raise ConfigError(f"preset {excerpt(str(path))} cannot be read: {exc.strerror or exc}") from None
    except ValueError as exc:  # TOMLDecodeError, UnicodeDecodeError, or a value Flower does not take (a list)
        raise ConfigError(f"preset {excerpt(str(path))} is not a TOML file of run config keys: {exc}") from None


#: the run config keys that hold paths (:func:`read_config` resolves them)
PATH_KEYS = ("data-dir", "output-dir", "resume-from", "state-dir")
#: the longest name of one file or folder (bytes): ext4, XFS, Btrfs, tmpfs and APFS all stop there
NAME_MAX = 255


def check_path_names(key: str, value: str) -> None:
    """Refuse path ``value`` of run config key ``key`` that no file system takes: longer than
    ``common.options.MAX_STRING`` characters, or with a name (between two ``/``) over :data:`NAME_MAX`
    bytes in UTF-8. Only the text is checked, nothing on disk.

    Raises:
        ConfigError: naming ``key``, quoting the start of the value (and of the long name).
    """
    from common.options import MAX_STRING, excerpt, invalid

    if len(value) > MAX_STRING:
        raise invalid(key, value, f"a path of at most {MAX_STRING} characters")
    for name in Path(value).parts:
        if len(os.fsencode(name)) > NAME_MAX:
            raise invalid(
                key,
                value,
                f"a path whose every name is at most {NAME_MAX} bytes (this one has a name of "
                f"{len(os.fsencode(name))} bytes: {excerpt(name, 40)})",
            )


def read_config(preset: str | os.PathLike | None, items: list[str], base: dict | None = None) -> tuple[dict, dict]:
    """``(config, overrides)``: the run config defaults (pyproject), then ``base`` (an entry point's
    own settings), then the preset (:func:`read_preset`), then each ``-c`` item, parsed by Flower's
    ``parse_config_args`` as ``flwr run --run-config`` does (several ``key=value`` pairs per item);
    ``data-dir``, ``output-dir``, ``resume-from`` and ``state-dir`` of ``config`` checked
    (:func:`check_path_names`) and resolved to absolute paths. ``overrides`` is everything but the
    defaults, as given.

    Raises:
        ConfigError: a preset that cannot be read or is not TOML (naming it), a key the app does not
            have (naming it), an item Flower cannot parse, or a path no file system takes.
    """
    import click
    from flwr.common.config import parse_config_args

    from common.errors import ConfigError
    from common.options import excerpt

    overrides = dict(base or {})
    overrides.update(read_preset(preset) if preset else {})
    try:
        # one item at a time: Flower merges the items' nested tables shallowly (run_config_file)
        for item in items:
            overrides.update(parse_config_args([item]))
    except (ValueError, tomllib.TOMLDecodeError, click.ClickException) as exc:
        message = exc.format_message() if isinstance(exc, click.ClickException) else str(exc)
        raise ConfigError(f"run config overrides {excerpt(items)} cannot be parsed: {message}") from None
    defaults = app_defaults()
    unknown = sorted(set(overrides) - set(defaults))
    if unknown:
        raise ConfigError(f"unknown run config key(s) {excerpt(unknown)}; see [tool.flwr.app.config] in pyproject.toml")
    config = {**defaults, **overrides}
    for key in PATH_KEYS:
        if config[key] and isinstance(config[key], str):  # another type is refused by check_config, named
            check_path_names(key, config[key])
            config[key] = str(Path(config[key]).expanduser().resolve())
    return config, overrides


def check_output_folders(config: dict[str, Any]) -> None:
    """Check that run config ``output-dir`` and (when set) ``state-dir`` of ``config`` (absolute paths,
    :func:`read_config`) are folders this user can write, or can be created as such (the nearest
    existing folder above is writable), before anything starts; nothing is created.

    Raises:
        ConfigError: naming the key: the path is a file, lies below a file, or cannot be written.
    """
    from common.errors import ConfigError
    from common.options import excerpt

    for key in ("output-dir", "state-dir"):
        if not config.get(key):
            continue
        path = Path(config[key])
        where = f"run config key '{key}' = {excerpt(config[key])}"
        try:
            existing = next(p for p in (path, *path.parents) if p.exists())
        except OSError as exc:
            raise ConfigError(f"{where} cannot be checked: {exc.strerror or exc}") from None
        if not existing.is_dir():
            what = "is a file" if existing == path else f"lies below {excerpt(str(existing))}, which is a file"
            raise ConfigError(f"{where} {what}: allowed values are folders (existing or to be created)")
        if not os.access(existing, os.W_OK | os.X_OK):
            raise ConfigError(f"{where}: {excerpt(str(existing))} is not writable by this user")


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

    def final(summary: dict) -> tuple[str, str] | None:
        if summary["status"] != "running" and not (
            summary["status"] == "failed" and status_before in (None, "running")
        ):
            return None
        return "interrupted", reason + (
            f"; the ServerApp then recorded: {summary['error']}" if summary.get("error") else ""
        )

    _finish_summary(folder, final)


def mark_failed(folder: Path, reason: str) -> None:
    """Give the run folder of a run that ended while its ``summary.json`` still said ``running`` (its
    ServerApp was killed or died before it could write) the status ``failed`` with ``reason`` under
    ``error``; any other summary, or a folder without a readable one, is left as it is."""
    _finish_summary(folder, lambda summary: ("failed", reason) if summary["status"] == "running" else None)


def _finish_summary(folder: Path, final: Callable[[dict], tuple[str, str] | None]) -> None:
    """Rewrite ``<folder>/summary.json`` (atomically) with the ``(status, error)`` that ``final`` gives
    for it; unchanged when ``final`` gives None or there is no readable summary."""
    from common.errors import ConfigError
    from common.files import SUMMARY_FILE, atomic_write, read_summary

    try:
        summary = read_summary(folder)
    except ConfigError:
        return
    if (outcome := final(summary)) is None:
        return
    summary.update(status=outcome[0], error=outcome[1])
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
            check_output_folders(config)
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


#: the folder of each launch's Flower home (:func:`launch_home`)
LAUNCHES = ROOT / ".flwr" / "launches"


def launch_home(parent: Path | None = None) -> Path:
    """A new, empty Flower home (``FLWR_HOME``) for one launch: ``<parent>/<UTC time>-<pid>-<random>``.

    Its SuperLink's log (``superlink.log``), state database (``state.db``) and the CLI's connection
    (``config.toml``) are this launch's alone: launches from one checkout at the same time never ask
    each other's SuperLink (with one shared home the second launch's connection replaced the first's,
    which then asked a stopped SuperLink for ever). ``parent`` defaults to :data:`LAUNCHES`."""
    parent = parent or LAUNCHES
    parent.mkdir(parents=True, exist_ok=True)
    prefix = time.strftime("%Y%m%d-%H%M%S-", time.gmtime()) + f"{os.getpid()}-"
    return Path(tempfile.mkdtemp(prefix=prefix, dir=parent))


def _run(args, config: dict, supernodes: int, gpu: bool) -> int:
    """Run the validated ``config`` (:func:`_launch`) in a Flower home of its own (:func:`launch_home`),
    removed when the run completed; otherwise only its SuperLink's log is kept there (the state database
    and the installed app, megabytes, go), and its path is printed."""
    home = launch_home()
    code = 1
    try:
        with adopting_orphans():
            code = _launch(home, args, config, supernodes, gpu)
    finally:
        if code == 0:
            shutil.rmtree(home, ignore_errors=True)
        else:
            for entry in home.iterdir():
                if entry.is_dir():
                    shutil.rmtree(entry, ignore_errors=True)
                elif entry.name != "superlink.log":
                    entry.unlink(missing_ok=True)
            print(f"the SuperLink's log: {home / 'superlink.log'}")
    return code


def _launch(home: Path, args, config: dict, supernodes: int, gpu: bool) -> int:
    """Start a SuperLink with Flower home ``home``, submit the validated ``config`` to it, stream the run
    and report it; exit status 0 only when the Flower run finished ``completed`` and its summary says
    ``completed`` with the requested config. Whichever way it ends (Ctrl-C, SIGTERM or SIGHUP included),
    the run, the SuperLink and every process they started are stopped and a run folder left ``running``
    gets a final status."""
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
        status = wait_finished(env, run_id, "sim", None, echo=True, superlink=superlink)
        print(f"Run {run_id}: {status}")
        stop_everything(superlink)  # the run has ended: its simulation and Ray must not outlive it
        folder = run_folder(config["output-dir"], run_id)
        if folder is not None:
            mark_failed(
                folder,
                f"the Flower run ended {status} before its ServerApp recorded an outcome (with no error in the "
                "log, the process was killed: out of memory? see dmesg)",
            )
        print_outcome(folder, status)
        used = used_requested_config(folder, config)
        return 0 if status == "finished:completed" and summary_status(folder) == "completed" and used else 1
    except RuntimeError as exc:  # the SuperLink did not come up or died: its log says why
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
        stop_everything(superlink)
        if run_id is not None and (folder := run_folder(config["output-dir"], run_id)) is not None:
            mark_failed(folder, "tools.run ended before the run did (see the SuperLink's log)")


#: ``prctl`` option of Linux (``<linux/prctl.h>``): orphaned descendants are re-parented to this process
PR_SET_CHILD_SUBREAPER = 36


@contextlib.contextmanager
def adopting_orphans():
    """Within the block, a process orphaned below this one (a simulation whose SuperLink died, Ray's
    daemons once their driver exited) is re-parented to this process instead of init, so that
    :func:`descendants` still lists it and the clean-up kills it (Linux's ``PR_SET_CHILD_SUBREAPER``,
    prctl(2)); elsewhere nothing changes."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
    if libc is not None:
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    try:
        yield
    finally:
        if libc is not None:
            libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


def stop_everything(superlink: subprocess.Popen) -> None:
    """Stop ``superlink`` and kill every other process this one started (the simulation and Ray run in
    process groups of their own); the processes are listed first, while they are still this process's
    descendants."""
    started = descendants()
    stop(superlink)
    kill_all(started)


if __name__ == "__main__":
    sys.exit(main())
