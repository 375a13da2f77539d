"""What a benchmark records of a run it starts: its wall time, the CPU time and the peak memory of
its whole process tree (:func:`run_measured`, :func:`tree_memory`), and the commit of the checkout it
ran from (:func:`git_head`)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import NamedTuple

import psutil


def process_kind(p: psutil.Process) -> str:
    """A short label for a process of a tree: Ray workers by their title, Python by its module
    or script, anything else by its executable."""
    name = p.name()
    cmd = p.cmdline()
    if name.startswith("ray::") or not cmd:
        return name
    if "-m" in cmd[:-1]:
        return cmd[cmd.index("-m") + 1]
    scripts = [os.path.basename(t) for t in cmd[:3] if not os.path.basename(t).startswith(("python", "-"))]
    return scripts[0] if scripts else name


def tree_memory(proc: psutil.Process) -> tuple[int, int, dict[str, tuple[int, int]]]:
    """(RSS, PSS, {process kind: (count, PSS)}) bytes summed over ``proc`` and its descendants.

    The RSS sum counts every shared page (torch's libraries, Ray's shared memory) once per
    process that maps it; PSS splits each shared page among its processes, so its sum is what
    the tree really occupies.
    """
    rss = pss = 0
    kinds: dict[str, tuple[int, int]] = {}
    try:
        tree = [proc, *proc.children(recursive=True)]
    except psutil.Error:  # a process of the tree exited during the walk: skip this sample
        return 0, 0, {}
    for p in tree:
        try:
            info = p.memory_full_info()
            kind = process_kind(p)
        except psutil.Error:
            continue
        rss, pss = rss + info.rss, pss + info.pss
        count, total = kinds.get(kind, (0, 0))
        kinds[kind] = (count + 1, total + info.pss)
    return rss, pss, kinds


class Measured(NamedTuple):
    """A finished run as :func:`run_measured` saw it."""

    code: int  # exit status
    wall: float  # seconds
    cpu: float  # CPU seconds (user + system) summed over the process tree
    peak_pss: int  # bytes: the largest PSS sum of the tree over the samples (shared pages split)
    at_peak: dict[str, tuple[int, int]]  # process kind -> (count, PSS bytes) at that sample


def run_measured(cmd: list[str], cwd: Path, log: Path, env: dict | None = None, append: bool = False) -> Measured:
    """Run ``cmd`` with its output in ``log`` (after what it holds with ``append``), sampling its whole
    process tree every second (so Ray's workers count too): the CPU time (user + system, each process's
    own as last sampled) and the peak of the tree's PSS (:func:`tree_memory`), the same measure for our
    runs and a reference's.

    A process's own times only: the times of its waited-for children (psutil's ``children_user``,
    ``children_system``), which this once added, count a child a second time once its parent has reaped
    it (Ray's raylet reaps the ClientApp actors at the end of a simulation: one launch counted 191 CPU
    seconds in 67 s on 2 cores). What a process spends after its last sample (at most the sampling
    second) and a process that lives less than a second are not counted."""
    cpu: dict[int, float] = {}
    peak, at_peak = 0, {}
    start = time.perf_counter()
    with open(log, "a" if append else "w") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, env=env)
        root = psutil.Process(proc.pid)
        try:
            while proc.poll() is None:
                for p in [root, *root.children(recursive=True)]:
                    try:
                        t = p.cpu_times()
                        cpu[p.pid] = t.user + t.system
                    except psutil.Error:
                        continue
                _, pss, kinds = tree_memory(root)
                if pss > peak:
                    peak, at_peak = pss, kinds
                with contextlib.suppress(subprocess.TimeoutExpired):  # not sleep: a run that ends is done at once
                    proc.wait(timeout=1.0)
        except BaseException:  # Ctrl-C or a signal: the run goes with us (tools.run stops its own tree on SIGINT)
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            raise
    return Measured(proc.returncode, time.perf_counter() - start, sum(cpu.values()), peak, at_peak)


def git_head(path: Path) -> str:
    """The checked-out commit of the git checkout at ``path`` (``-dirty`` when tracked files differ)."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=path, capture_output=True, text=True, check=False)
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"], cwd=path, capture_output=True, text=True, check=False
    ).stdout.strip()
    return (head.stdout.strip() or "unknown") + ("-dirty" if dirty else "")
