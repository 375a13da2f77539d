"""Processes an entry point starts and must stop: loopback ports, stopping a process group or a whole
tree, adopting orphans, and one clean-up path for Ctrl-C, SIGTERM and SIGHUP (:func:`stop_on_signals`).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

#: where :func:`free_port` looks when the kernel's ephemeral range cannot be read (Linux's default starts at 32768)
EPHEMERAL_FALLBACK = (32768, 60999)


#: one past the last port of Ray's default worker port range (``ray start --max-worker-port`` 19999)
RAY_WORKER_PORTS_END = 20000


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (``ip_local_port_range``), inclusive."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return EPHEMERAL_FALLBACK


def free_port() -> int:
    """A loopback TCP port nothing listens on, chosen below the kernel's ephemeral range.

    Why not the port the kernel picks for ``bind(0)``: that port comes from the ephemeral range, which
    every outgoing connection draws from too, so between this check and the server's own bind a client
    of another process (nginx connecting upstream, a CLI, the other test worker) can take it: the
    SuperLink then exits with "address already in use". Ports below the range are only taken by
    listeners that ask for them by number; the range starts at 20000, above the ports Ray's nodes
    take for their workers by default (10002-19999) and its client server (10001).

    Raises:
        RuntimeError: 200 random ports in ``[20000, low)`` were all taken.
    """
    low = ephemeral_range()[0]
    start = RAY_WORKER_PORTS_END if low > RAY_WORKER_PORTS_END + 1000 else 1024
    for _ in range(200):
        port = random.randrange(start, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port in [{start}, {low}) after 200 tries")


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
    bounded (:func:`tools.run._run`: about 90 s at most); SIGKILL still ends it. The previous handlers come
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
