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
- exits 0 only if the run's status is ``finished:completed`` (``flwr run`` exits 0 on failure).
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
import time
import tomllib
import urllib.request
from pathlib import Path

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
        return json.dumps(value)
    return repr(value)


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

    children = psutil.Process(proc.pid).children(recursive=True)
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
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
        help="overrides, e.g. \"method='local' num-server-rounds=5\" (repeatable)",
    )
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
        help="GPU share per ClientApp; default 0.25 when a GPU is visible, else 0",
    )
    args = parser.parse_args(argv)

    # the SuperLink takes seconds to start: it comes up while the config is validated
    home = ROOT / ".flwr"
    home.mkdir(exist_ok=True)
    bin_dir = str(Path(sys.executable).parent)  # flower-superexec etc. must be on PATH for the SuperLink
    env = {
        **os.environ,
        "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
        "FLWR_HOME": str(home),
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "PYTHONUNBUFFERED": "1",
    }
    superlink, address = start_superlink(env, home)
    try:
        return _validate_and_run(args, env, home, superlink, address)
    finally:
        stop(superlink)


def check_config(config: dict) -> tuple[str | None, int, bool]:
    """(error message or None, run config ``num-clients``, whether a GPU is visible) of ``config``:
    everything the ServerApp would reject, method options included. Runs in a child process
    (:func:`_validate_and_run`), so that torch and the methods are not kept in this launcher's
    memory for the whole run."""
    from common.config import RunConfig
    from server_app.results import tensorboard_class
    from strategies.registry import build_strategy

    try:
        cfg = RunConfig.from_dict(config)
        build_strategy(cfg)  # fail fast on any bad value, method options too
        tensorboard_class(cfg.logger)
    except ValueError as exc:
        return str(exc), 0, False
    import torch

    return None, cfg.num_clients, torch.cuda.is_available()


def _validate_and_run(args, env: dict, home: Path, superlink: subprocess.Popen, address: str) -> int:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from flwr.common.config import parse_config_args

    overrides = parse_config_args([args.preset]) if args.preset else {}
    overrides.update(parse_config_args(args.run_config) if args.run_config else {})
    config = {**app_defaults(), **overrides}
    unknown = sorted(set(overrides) - set(app_defaults()))
    if unknown:
        print(f"error: unknown run config key(s) {unknown}; see [tool.flwr.app.config] in pyproject.toml")
        return 2
    for key in ("data-dir", "output-dir", "resume-from", "state-dir"):
        if config[key]:
            config[key] = str(Path(config[key]).expanduser().resolve())
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        error, num_clients, gpu = pool.submit(check_config, config).result()
    if error:
        print(f"error: {error}")
        return 2
    if args.num_supernodes is not None and args.num_supernodes < 1:
        print(f"error: --num-supernodes {args.num_supernodes}: allowed values are integers >= 1")
        return 2
    supernodes = args.num_supernodes or num_clients or DEFAULT_SUPERNODES
    if num_clients and supernodes != num_clients:
        print(
            f"error: --num-supernodes {supernodes} disagrees with run config key 'num-clients' = "
            f"{num_clients}; drop one of them (num-clients=0 follows the federation)"
        )
        return 2
    gpus = args.gpus_per_client
    if gpus is None:
        gpus = 0.25 if gpu else 0.0
    wait_healthy(superlink, address, home)
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "sim"\n\n[superlink.sim]\naddress = "{address}"\ninsecure = true\n'
    )
    run_config = [f"{k}={toml_value(v)}" for k, v in config.items()]
    federation = (
        f"num-supernodes={supernodes} client-resources-num-cpus={args.cpus_per_client} client-resources-num-gpus={gpus}"
    )
    cmd = ["run", str(ROOT), "sim", "--format", "json", "--federation-config", federation]
    for item in run_config:
        cmd += ["--run-config", item]
    submitted = flwr_cli(*cmd, env=env)
    try:
        run_id = int(json.loads(submitted.stdout)["run-id"])
    except (ValueError, KeyError, TypeError):
        print(submitted.stdout, submitted.stderr, sep="\n")
        print("error: the run was not submitted")
        return 1
    print(f"Submitted run {run_id}; streaming its log (Ray needs tens of seconds before round 1)")
    try:
        status = wait_finished(env, run_id, "sim", None, echo=True)
    except KeyboardInterrupt:
        # the simulation runs outside the SuperLink's process group: stop the run itself
        flwr_cli("stop", str(run_id), "sim", env=env)
        raise
    print(f"Run {run_id}: {status}")
    return 0 if status == "finished:completed" else 1


if __name__ == "__main__":
    sys.exit(main())
