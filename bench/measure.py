"""What a benchmark records of a run it starts: its wall time and the CPU time of its whole process
tree (:func:`run_measured`), and the commit of the checkout it ran from (:func:`git_head`)."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from pathlib import Path


def run_measured(cmd: list[str], cwd: Path, log: Path, env: dict | None = None) -> tuple[int, float, float]:
    """Run ``cmd`` with its output in ``log``; ``(exit code, wall seconds, CPU seconds)``, the CPU
    time summed over its whole process tree (user + system, each process as last sampled, every
    second), so Ray's workers count too."""
    import psutil

    cpu: dict[int, float] = {}
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, env=env)
        root = psutil.Process(proc.pid)
        try:
            while proc.poll() is None:
                for p in [root, *root.children(recursive=True)]:
                    try:
                        t = p.cpu_times()
                        cpu[p.pid] = t.user + t.system + t.children_user + t.children_system
                    except psutil.Error:
                        continue
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
    return proc.returncode, time.perf_counter() - start, sum(cpu.values())


def git_head(path: Path) -> str:
    """The checked-out commit of the git checkout at ``path`` (``-dirty`` when tracked files differ)."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=path, capture_output=True, text=True, check=False)
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"], cwd=path, capture_output=True, text=True, check=False
    ).stdout.strip()
    return (head.stdout.strip() or "unknown") + ("-dirty" if dirty else "")
