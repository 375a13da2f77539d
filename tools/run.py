"""Run the app with ``flwr run`` in Flower's Ray simulation, safely, and report the outcome.

Usage: ``uv run python -m tools.run [--preset presets/<name>.toml] [--run-config "method='local' num-server-rounds=5"]``

What plain ``flwr run . --stream`` (Flower 1.42, ``flwr.cli.run``) does not do and this does:

- validates the run config before anything starts (a bad key fails in a second);
- starts its *own* SuperLink (simulation mode, free ports, a Flower home of this launch's own
  under ``.flwr/launches/``, runtime dependency installation off) instead of the shared, detached
  local one, and stops it on exit, so no stray process captures the next run from another
  checkout and launches from one checkout run side by side (:func:`launch_home`);
- checks before anything starts: a preset that cannot be read or is not TOML, names of paths
  too long for a file system, an ``output-dir`` that is a file or not writable (:func:`tools.runconfig.read_config`,
  :func:`tools.runconfig.check_output_folders`), an ``--ray-address`` that is not a Ray cluster (within
  :data:`tools.ray_cluster.RAY_JOIN_TIMEOUT` seconds);
- takes a preset TOML file and ``key=value`` overrides together (``flwr run`` takes one or
  the other);
- resolves ``data-dir``, ``output-dir``, ``resume-from`` and ``state-dir`` to absolute paths
  from the current directory;
- sizes the simulation (``--num-supernodes``, default ``num-clients`` when that is set, else
  10; with ``num-clients`` = 0 the server takes every node) and grants each ClientApp a GPU
  share when one is present;
- checks what needs the federation's size before Ray starts (:func:`check_before_start`): prints the
  disk ``record-payloads`` takes at most and refuses it above ``record-payloads-max-gib``; splits every
  partition as the handshake would and refuses a run whose partitions cannot serve it (too small for a
  train and a test set, a data error); with the full handshake it decodes, on the way, the partitions
  the simulated clients' cache lacks, in the process that checked the config and its workers, which exit
  when done (:func:`tools.partition_cache.cache_before_ray`), so the ClientApp actors memory-map them
  instead of keeping what decoding imports;
- submits the run, streams its log and asks its status from this process (:class:`tools.control.LocalControl`),
  with the FAB built while the SuperLink starts (:func:`tools.control.build_fab`, byte for byte the one
  ``flwr run`` builds, without its walk through ``.venv``): no CLI process per step;
- runs the simulation on a Ray instance of its own, or with ``--ray-address`` (or ``RAY_ADDRESS``)
  on an existing Ray cluster, checked before anything starts (:func:`tools.ray_cluster.check_ray_cluster`);
- exits 0 only if the run's status is ``finished:completed`` and its ``summary.json`` says
  ``completed`` (``flwr run`` exits 0 on failure; a ServerApp may record a failure without raising);
- on every exit stops the SuperLink and every process the run started (the simulation and Ray
  included), and gives a run folder left ``running`` a final status (:func:`tools.outcome.mark_failed`);
- on Ctrl-C, SIGTERM or SIGHUP (:func:`tools.processes.stop_on_signals`) stops the run, its SuperLink, the
  simulation and Ray, marks the run folder's ``summary.json`` ``interrupted`` (:func:`tools.outcome.mark_stopped`)
  and exits 130.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import click

from tools.control import LocalControl, build_fab, wait_finished
from tools.outcome import mark_failed, mark_stopped, print_outcome, run_folder, summary_status, used_requested_config
from tools.partition_cache import cache_before_ray
from tools.processes import adopting_orphans, descendants, free_port, kill_all, stop, stop_on_signals
from tools.ray_cluster import LOCAL_RAY, check_ray_cluster
from tools.runconfig import (
    DEFAULT_SUPERNODES,
    ROOT,
    add_config_arguments,
    check_output_folders,
    federation_size,
    read_config,
    run_config_file,
    validate_configs,
)


def start_superlink(env: dict, home: Path) -> tuple[subprocess.Popen, str]:
    """Start a simulation SuperLink on free loopback ports and, beside it, the SuperExec that starts its
    runs' ``flwr-simulation``; returns (the SuperLink's process, its address) at once (it takes seconds
    to come up: :func:`wait_healthy`).

    Flower's default isolation (``subprocess``) has the SuperLink start the SuperExec only once its own
    imports are done; started together (``--isolation process``), their imports overlap on the cores
    (2.8 s of the SuperLink's start before it spawned the SuperExec here), and the SuperExec, which
    retries its connection, takes the run as soon as it is submitted. It exits with the SuperLink
    (``--parent-pid``); both log into ``<home>/superlink.log``.
    """
    port, control = free_port(), free_port()
    with open(home / "superlink.log", "ab") as log_file:
        bin_dir = Path(sys.executable).parent
        # both log into the launch's file, each in a process group of its own (stopped by stop_everything)
        where = {"env": env, "cwd": ROOT, "stdout": log_file, "stderr": subprocess.STDOUT, "start_new_session": True}
        proc = subprocess.Popen(
            [
                str(bin_dir / "flower-superlink"),
                "--insecure",
                "--simulation",
                "--isolation",
                "process",
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
            **where,
        )
        subprocess.Popen(
            [
                str(bin_dir / "flower-superexec"),
                "--insecure",
                "--runtime-api-address",
                f"127.0.0.1:{port}",
                "--parent-pid",
                str(proc.pid),
            ],
            **where,
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
            local = args.ray_address == LOCAL_RAY
            # the checks that need the federation's size (and the partition cache) run in the process
            # that checks the config, after the check passed: one process, one torch import, before Ray starts
            then = functools.partial(check_before_start, num_supernodes=args.num_supernodes, local=local)
            ((num_clients, gpu),) = validate_configs([config], then=then)  # before anything starts
            supernodes = federation_size(args.num_supernodes, num_clients)
            if not local:
                gpu = check_ray_cluster(args.ray_address, args.cpus_per_client, args.gpus_per_client)
        except ConfigError as exc:
            print(f"error: {exc}")
            return 2
        except KeyboardInterrupt:
            print("interrupted before the run started")
            return 130
        return _run(args, config, supernodes, gpu)


def check_before_start(config: dict, num_clients: int, *, num_supernodes: int | None, local: bool) -> None:
    """The checks of the checked ``config`` that need the federation's size (``num_clients``, or
    ``--num-supernodes`` ``num_supernodes``: :func:`tools.runconfig.federation_size`), in the process
    that checked it (:func:`tools.runconfig.validate_configs`' ``then``): prints what run config
    ``record-payloads`` writes at most (``engine.runner.Runner.check_recording``), then checks
    every partition as the handshake would, filling the partition cache on the way when the run has a Ray
    instance of its own (``local``; :func:`tools.partition_cache.cache_before_ray`).

    Raises:
        ConfigError: ``record-payloads`` above ``record-payloads-max-gib``, or a partition that cannot
            serve the run, naming the keys.
    """
    from common.config import RunConfig
    from common.errors import ConfigError
    from methods.registry import build_run

    try:
        size = federation_size(num_supernodes, num_clients)
    except ConfigError:
        return  # the launcher raises the same error when it sizes the federation
    if line := build_run(RunConfig.from_dict(config)).check_recording(size):
        print(line, flush=True)
    cache_before_ray(config, num_clients, num_supernodes=num_supernodes, cache=local)


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
    and report it; exit status 0 only when the Flower run finished
    ``completed`` and its summary says ``completed`` with the requested config. Whichever way it ends
    (Ctrl-C, SIGTERM or SIGHUP included), the run, the SuperLink and every process they started are
    stopped and a run folder left ``running`` gets a final status."""
    bin_dir = str(Path(sys.executable).parent)  # flower-superexec etc. must be on PATH for the SuperLink
    env = {
        # Ray starts its workers, here the ClientApp actors that do the run's work, at niceness 15 (its
        # system config `worker_niceness`) below Flower's engine in flwr-simulation, which at 10,000
        # nodes spends most of a core looking for each node's next message: at equal priority the
        # ClientApps get their share of the cores (results/scale/README.md). A value set by the user wins.
        "RAY_worker_niceness": "0",
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
    run_id = None
    control = None
    superlink, address = start_superlink(env, home)
    try:
        fab = build_fab()  # while the SuperLink starts: its imports take seconds
        wait_healthy(superlink, address, home)
        # the CLI's connection to this launch's SuperLink, for whoever asks it by hand meanwhile
        # (FLWR_HOME=<home> flwr list sim)
        (home / "config.toml").write_text(
            f'[superlink]\ndefault = "sim"\n\n[superlink.sim]\naddress = "{address}"\ninsecure = true\n'
        )
        control = LocalControl(address)
        try:
            with run_config_file(config) as path:
                run_id = control.submit(fab, path, supernodes, args.cpus_per_client, gpus)
        except click.ClickException as exc:
            print(f"error: the run was not submitted: {exc.format_message()}")
            return 1
        print(f"Submitted run {run_id}; streaming its log (Ray needs tens of seconds before round 1)")
        status = wait_finished(control, run_id, None, superlink=superlink)
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
    except (RuntimeError, ValueError) as exc:  # the SuperLink did not come up or died (its log says why), or no FAB
        print(f"error: {exc}")
        return 1
    except KeyboardInterrupt:
        started = descendants()  # before anything stops: Ray's processes leave the tree once orphaned
        before = summary_status(run_folder(config["output-dir"], run_id)) if run_id is not None else None
        if run_id is not None and control is not None:
            control.stop(run_id)  # a SuperLink that does not answer is killed next
        stop(superlink)
        kill_all(started)
        folder = run_folder(config["output-dir"], run_id) if run_id is not None else None
        if folder is not None:
            mark_stopped(folder, "stopped by a signal (Ctrl-C, SIGTERM or SIGHUP) to tools.run", before)
        print(f"interrupted: stopped the run, its SuperLink and {len(started)} processes; {folder or 'no run folder'}")
        return 130
    finally:
        if control is not None:
            control.close()
        stop_everything(superlink)
        if run_id is not None and (folder := run_folder(config["output-dir"], run_id)) is not None:
            mark_failed(folder, "tools.run ended before the run did (see the SuperLink's log)")


def stop_everything(superlink: subprocess.Popen) -> None:
    """Stop ``superlink`` and kill every other process this one started (the simulation and Ray run in
    process groups of their own); the processes are listed first, while they are still this process's
    descendants."""
    started = descendants()
    stop(superlink)
    kill_all(started)


if __name__ == "__main__":
    sys.exit(main())
