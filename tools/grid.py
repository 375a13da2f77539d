"""Run a preset for several methods and seeds, one after another, into one grid folder; resumable.

Usage (from the repository root):

    uv run --frozen python -m tools.grid presets/<name>.toml --methods fedre,local,fedgh --seeds 0,1
        [--rounds N] [--minutes M] [-c "local-epochs=1"] [--out outputs/grids/<name>] [--in-process]

Every (method, seed) cell runs the preset through ``tools.run`` with ``method`` and ``seed``
overridden, so all methods of one seed train on identical partitions (the partition depends on
the dataset, partitioner, client count and seed only). Layout::

    <grid>/grid.json                       preset, methods, seeds, rounds, commit, machine, invocations
    <grid>/<method>-seed<seed>/<run>/      metrics.jsonl, summary.json, checkpoint.pt (one per launch)
    <grid>/<method>-seed<seed>/client-state/   the clients' state (run config ``state-dir``)

A cell whose newest run completed ``--rounds`` rounds (default: the preset's
``num-server-rounds``) is skipped; one that stopped earlier (interrupted, crashed, stopped by
``--minutes`` or given more rounds now) continues from its checkpoint with ``resume-from``,
clients included (their state is on disk), so a grid can be stopped and continued later, also
in another session. ``--minutes`` bounds each launch's wall time; the cell then continues at
the next invocation. ``-c`` overrides preset keys for every cell (e.g. fewer local epochs to
fit a CPU budget); they and the preset's config are recorded in ``grid.json`` and must not change
between invocations. One grid at a time works in a grid folder (:func:`grid_lock`): a second one
on the same ``--out`` is refused, naming the folder and the first one's PID.
``--in-process`` runs each cell with ``tools.inprocess`` instead (the same run without Ray's and Flower's
start-up, clients one after another: for many small runs). ``python -m tools.report <grid>`` summarises a grid.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import functools
import json
import os
import platform
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from common.errors import ConfigError
from common.files import CHECKPOINT, SUMMARY_FILE, atomic_write, read_json_object, read_rows, read_summary
from common.options import number
from tools.processes import interrupt, stop_on_signals
from tools.runconfig import ROOT, add_config_arguments, read_config, read_preset, validate_configs

GRID_FILE = "grid.json"
#: the lock file of a grid folder (:func:`grid_lock`); it holds the PID of the grid that has the lock
LOCK_FILE = "grid.lock"
#: the entries every grid.json has (``record_invocation``) and their types
GRID_KEYS = {"preset": str, "preset_config": dict, "methods": list, "seeds": list, "rounds": int, "invocations": list}
STATE_DIR = "client-state"

#: launcher(preset, overrides, minutes) -> exit status; the default runs ``tools.run``
Launcher = Callable[[Path, dict, float], int]


def cell_name(method: str, seed: int) -> str:
    return f"{method}-seed{seed}"


def run_summary(run: Path) -> dict:
    """``summary.json`` of a cell's run; when it is unreadable or not a summary of ours, one made from
    the run's rows: ``status`` ``unreadable``, ``rounds_completed`` = its rows, and the reason under
    ``unreadable`` (so the grid can still resume the run from its checkpoint and the report still
    shows it). Rows that cannot be read count as none."""
    try:
        return read_summary(run)
    except ConfigError as exc:
        try:
            rows = len(read_rows(run))
        except ConfigError:
            rows = 0
        return {"status": "unreadable", "rounds_completed": rows, "unreadable": str(exc)}


def newest_run(cell: Path) -> tuple[Path, dict] | None:
    """The cell's run folder with the most completed rounds and its summary (:func:`run_summary`); on a
    tie one with a checkpoint, then the newest (a resumed run stopped before its first round holds the
    rows it resumed, and without a checkpoint, if an older version of this system wrote it)."""
    runs = [(summary.parent, run_summary(summary.parent)) for summary in cell.glob(f"*/{SUMMARY_FILE}")]
    if not runs:
        return None
    return max(runs, key=lambda r: (r[1]["rounds_completed"], (r[0] / CHECKPOINT).is_file(), r[0].name))


def plan(cell: Path, rounds: int) -> tuple[str, Path | None]:
    """``("done", run)``, ``("resume", run)`` or ``("new", None)`` for a cell that should reach ``rounds``.

    A run is done when it completed ``rounds`` rounds, or completed earlier because run config
    ``stop-patience`` stopped it; one with a checkpoint after at least one round resumes from it,
    also when its summary is unreadable.
    """
    found = newest_run(cell)
    if found is None:
        return "new", None
    run, summary = found
    if summary["status"] == "completed" and (summary["rounds_completed"] >= rounds or summary.get("stop_reason")):
        return "done", run
    if summary["rounds_completed"] > 0 and (run / CHECKPOINT).is_file():
        return "resume", run
    return "new", None


class CpuMeter:
    """CPU seconds (user + system) of a process tree, sampled every ``interval`` seconds.

    Each process's last sample counts, so processes that live shorter than ``interval`` are
    missed; the simulation's ClientApps (Ray actors), its ServerApp and the SuperLink live long.
    """

    def __init__(self, pid: int, interval: float = 2.0) -> None:
        import psutil

        self.root, self.interval = psutil.Process(pid), interval
        self.seen: dict[tuple[int, float], float] = {}  # (pid, create time) -> CPU seconds
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        import psutil

        while not self.done.is_set():
            try:
                procs = [self.root, *self.root.children(recursive=True)]
            except psutil.Error:
                procs = []
            for p in procs:
                try:
                    t = p.cpu_times()
                    self.seen[(p.pid, p.create_time())] = t.user + t.system
                except psutil.Error:
                    continue
            self.done.wait(self.interval)

    def stop(self) -> float:
        """Stop sampling; the tree's CPU seconds."""
        self.done.set()
        self.thread.join()
        return sum(self.seen.values())


def launch_tools_run(preset: Path, overrides: dict, minutes: float, module: str = "tools.run") -> int:
    """Run one cell through ``python -m <module> --preset`` (``tools.run``, or ``tools.inprocess``: the same
    run without Ray); interrupt it after ``minutes`` (> 0).

    Prints the launch's wall and CPU seconds (``CpuMeter``) as its last line.
    """
    cmd = [sys.executable, "-m", module, "--preset", str(preset)]
    for key, value in overrides.items():
        cmd += ["-c", f"{key}={json.dumps(value)}"]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT)
    meter = CpuMeter(proc.pid)
    stopped: KeyboardInterrupt | None = None
    try:
        code = proc.wait(timeout=60 * minutes if minutes > 0 else None)
    except subprocess.TimeoutExpired:
        print(f"grid: {minutes} min budget reached; stopping this launch (the cell resumes next time)", flush=True)
        interrupt(proc)
        code = 124
    except KeyboardInterrupt as exc:  # Ctrl-C, SIGTERM or SIGHUP to the grid: stop the launch as Ctrl-C would
        interrupt(proc)
        code, stopped = 130, exc
    cpu = meter.stop()
    print(f"grid: launch wall {time.perf_counter() - start:.0f} s, CPU {cpu:.0f} s", flush=True)
    record_launch(
        Path(overrides["output-dir"]).parent, Path(overrides["output-dir"]).name, time.perf_counter() - start, cpu, code
    )
    if stopped is not None:
        raise stopped
    return code


def record_launch(grid: Path, cell: str, wall: float, cpu: float, code: int) -> None:
    """Append a launch's wall and CPU seconds to ``grid.json`` (``launches``)."""
    info = read_grid_info(grid)
    info.setdefault("launches", []).append(
        {"cell": cell, "wall_seconds": round(wall, 1), "cpu_seconds": round(cpu, 1), "exit": code}
    )
    write_info(grid, info)


def read_grid_info(grid: Path) -> dict:
    """``<grid>/grid.json``, checked to hold :data:`GRID_KEYS`.

    Raises:
        ConfigError: naming the file and what is wrong.
    """
    return read_json_object(grid / GRID_FILE, GRID_KEYS)


def write_info(grid: Path, info: dict) -> None:
    """Replace ``grid.json`` atomically (``common.files.atomic_write``: a temporary file of a unique name)."""
    text = json.dumps(info, indent=2).encode("utf-8")
    atomic_write(grid / GRID_FILE, lambda f: f.write(text))


@contextlib.contextmanager
def grid_lock(grid: Path):
    """Hold the grid folder ``grid`` for this process within the block: an exclusive ``flock`` on
    ``<grid>/grid.lock``, which then holds this PID. The kernel releases the lock when the process
    ends, however it ends, so a stale lock file does not block the next grid. Two grids on one folder
    would run every cell twice and race on ``grid.json``.

    Raises:
        ConfigError: another process holds the lock, naming the folder and that process's PID.
    """
    with open(grid / LOCK_FILE, "a+", encoding="utf-8") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "unknown"
            raise ConfigError(
                f"grid folder {grid} is in use by another tools.grid (PID {holder}): wait for it to end, "
                "or give this grid another --out folder"
            ) from None
        f.truncate(0)
        f.write(f"{os.getpid()}\n")
        f.flush()
        yield


def git_commit() -> str:
    out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False)
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True, check=False
    ).stdout.strip()
    return out.stdout.strip() + ("-dirty" if dirty else "")


def read_by_new_cells_only(key: str, grid: Path, methods: list[str]) -> bool:
    """Whether only cells ``grid`` does not hold yet read preset key ``key``: an option ``<method>.<option>``
    of one of ``methods`` (this invocation's) of which the grid has no cell."""
    section, _, option = key.partition(".")
    return bool(option) and section in methods and not any(grid.glob(f"{section}-seed*"))


def record_invocation(
    grid: Path,
    preset: Path,
    methods: list[str],
    seeds: list[int],
    rounds: int,
    minutes: float,
    argv: list[str],
    overrides: dict,
) -> None:
    """Add this invocation to ``grid.json`` (created with the preset's config on the first one): its command,
    commit and machine under ``invocations``, its methods and seeds added to the grid's (``methods`` in the
    order first asked, ``seeds`` sorted), its ``rounds``.

    A preset key added or changed since is taken (and recorded) when only cells the grid does not hold yet
    read it: an option ``<method>.<key>`` of one of ``methods`` that has no cell in the grid (e.g. the
    section of a method a later invocation adds).

    Raises:
        ValueError: ``overrides`` differ from those the grid was started with, or the preset's
            config has changed since in a key its cells read (they would mix two configs); the keys are named.
    """
    path = grid / GRID_FILE
    config = {**read_preset(preset), **overrides}
    info = (
        read_grid_info(grid)
        if path.is_file()
        else {"preset": preset.name, "preset_config": config, "overrides": overrides, "invocations": []}
    )
    if info.get("overrides", {}) != overrides:
        raise ValueError(
            f"this grid was started with overrides {info.get('overrides')}, not {overrides}: use another --out folder"
        )
    started = info["preset_config"]
    changed = sorted(k for k in set(started) | set(config) if started.get(k) != config.get(k))
    if changed := [k for k in changed if not read_by_new_cells_only(k, grid, methods)]:
        raise ValueError(
            f"{preset} has changed since this grid started ("
            + ", ".join(f"{k!r}: {started.get(k)!r}, now {config.get(k)!r}" for k in changed)
            + "): use another --out folder"
        )
    # the grid's methods and seeds are those of every invocation (a grid is often run a seed or a method at a
    # time), in the order they were first asked; ``rounds`` is this invocation's, which every cell continues to
    held_methods = info.get("methods", [])
    info.update(
        preset_config=config,
        methods=held_methods + [m for m in methods if m not in held_methods],
        seeds=sorted({*info.get("seeds", []), *seeds}),
        rounds=rounds,
    )
    info["invocations"].append(
        {
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "commit": git_commit(),
            "command": "python -m tools.grid " + " ".join(argv),
            "minutes_per_launch": minutes,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
        }
    )
    write_info(grid, info)


def run_grid(
    preset: Path,
    methods: list[str],
    seeds: list[int],
    grid: Path,
    rounds: int | None = None,
    minutes: float = 0.0,
    launcher: Launcher = launch_tools_run,
    argv: list[str] | None = None,
    overrides: dict | None = None,
) -> dict[str, str]:
    """Bring every (method, seed) cell of ``grid`` to ``rounds`` rounds; returns cell -> outcome.

    Outcomes: ``done`` (already complete, skipped), ``completed``, ``resumed`` (and completed),
    or ``stopped (exit N)`` (the launch ended early: budget, failure; it continues next time).
    ``overrides`` (run config keys) apply on top of the preset in every cell.

    Raises:
        ValueError: ``preset`` has no ``num-server-rounds`` and ``rounds`` is not given, or
            ``overrides`` differ from the grid's.
        ConfigError: the preset cannot be read, ``grid`` cannot be created as a folder, or another grid
            works in it (:func:`grid_lock`).
    """
    overrides = dict(overrides or {})
    config = {**read_preset(preset), **overrides}
    rounds = rounds or config.get("num-server-rounds")
    if not rounds:
        raise ValueError(f"{preset} sets no 'num-server-rounds': pass --rounds")
    try:
        grid.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file of that name, or a folder above it that cannot be written
        raise ConfigError(f"grid folder {grid} cannot be created: {exc.strerror or exc}") from None
    with grid_lock(grid):
        return _run_cells(preset, methods, seeds, grid, rounds, minutes, launcher, argv or [], overrides)


def _run_cells(
    preset: Path,
    methods: list[str],
    seeds: list[int],
    grid: Path,
    rounds: int,
    minutes: float,
    launcher: Launcher,
    argv: list[str],
    overrides: dict,
) -> dict[str, str]:
    """:func:`run_grid`'s work, in a grid folder this process holds."""
    record_invocation(grid, preset, methods, seeds, rounds, minutes, argv, overrides)
    outcomes = {}
    for seed in seeds:
        for method in methods:
            cell = grid / cell_name(method, seed)
            action, run = plan(cell, rounds)
            if action == "done":
                print(f"grid: {cell.name} done ({run.name}); skipped", flush=True)
                outcomes[cell.name] = "done"
                continue
            keys = {
                **overrides,
                "method": method,
                "seed": seed,
                "num-server-rounds": rounds,
                "output-dir": str(cell),
                "state-dir": str(cell / STATE_DIR),
            }
            if action == "resume":
                keys["resume-from"] = str(run)
            print(
                f"grid: {cell.name}: {'resuming ' + run.name if run else 'starting'} towards {rounds} rounds",
                flush=True,
            )
            code = launcher(preset, keys, minutes)
            finished = plan(cell, rounds)[0] == "done"
            outcomes[cell.name] = ("resumed" if run else "completed") if finished else f"stopped (exit {code})"
    return outcomes


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("preset", type=Path, help="presets/<name>.toml")
    parser.add_argument("--methods", required=True, help="comma-separated methods, e.g. fedre,local,fedgh")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per run (default: the preset's)")
    parser.add_argument("--minutes", type=float, default=0.0, help="wall-time budget per launch (0: none)")
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="run each cell with tools.inprocess (no Ray: for many small runs; needs num-clients)",
    )
    add_config_arguments(parser, preset=False)  # preset keys overridden in every cell
    parser.add_argument("--out", type=Path, default=None, help="grid folder (default outputs/grids/<preset>)")
    args = parser.parse_args(argv)
    # an unknown method is refused by validate_configs below, in a child process: the grid, which waits
    # for hours beside its runs, never imports torch and the methods itself
    methods = [m for m in args.methods.split(",") if m]
    if not methods:
        print(f"error: --methods {args.methods!r}: allowed values are method names, comma-separated")
        return 2
    grid = (args.out or ROOT / "outputs" / "grids" / args.preset.stem).resolve()
    with stop_on_signals():
        try:
            seeds = [number("--seeds", int(s), kind=int, low=0) for s in args.seeds.split(",") if s]
            if not seeds:
                raise ConfigError(f"--seeds {args.seeds!r}: allowed values are integers >= 0, comma-separated")
            _, overrides = read_config(None, args.run_config)
            # every cell's config as its launch will have it, checked before the first launch (one per
            # method: seeds differ in no other key)
            preset_config, _ = read_config(args.preset, [])
            rounds = {} if args.rounds is None else {"num-server-rounds": args.rounds}
            validate_configs([{**preset_config, **overrides, **rounds, "method": m, "seed": seeds[0]} for m in methods])
            launcher = functools.partial(launch_tools_run, module="tools.inprocess" if args.in_process else "tools.run")
            outcomes = run_grid(
                args.preset.resolve(),
                methods,
                seeds,
                grid,
                args.rounds,
                args.minutes,
                launcher,
                argv=argv,
                overrides=overrides,
            )
        except (ConfigError, ValueError) as exc:  # a bad key, or a grid.json the grid did not write: no traceback
            print(f"error: {exc}")
            return 2
        except KeyboardInterrupt:
            print("grid: interrupted; the stopped cell resumes from its checkpoint next time", flush=True)
            return 130
    for cell, outcome in outcomes.items():
        print(f"{cell:>24}  {outcome}")
    print(f"grid folder: {grid}")
    return 0 if all(o in ("done", "completed", "resumed") for o in outcomes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
