"""A SuperExec whose ClientApp processes start warm: forked from a process that has already
imported Flower's ClientApp runtime and the app's heavy libraries.

Flower 1.42 runs every message in a fresh ``flwr-clientapp`` process (the ClientApp is
short-lived by design), and each one pays the interpreter start, Flower's own imports (~2 s of
CPU here: ``flwr.supernode`` pulls in sqlalchemy, fastapi, alembic), ``import torch`` (~2.3 s)
and, for model groups with torchvision models, ``import torchvision`` (~4 s, it imports
``torch._dynamo``). On a SuperNode these imports are the same for every message, so this
SuperExec does them once: ClientApp tasks run in children of :mod:`multiprocessing`'s fork
server, started with :data:`PRELOAD` imported, and each child runs Flower's own
``run_clientapp`` exactly as ``flwr-clientapp`` does (same Runtime API, token, TLS, parent
monitor). The app's code is *not* preloaded: Flower loads it from the run's FAB in each child,
so a new FAB version is picked up as with Flower's executor. Other task types go to Flower's
subprocess executor unchanged.

Usage (next to a SuperNode started with ``--isolation process``; :mod:`tools.deploy` does this):

    python -m tools.superexec --runtime-api-address 127.0.0.1:9094 --insecure [--parent-pid PID]
    python -m tools.superexec --runtime-api-address supernode-0:9094 --root-certificates ca.crt

The fork server imports nothing that starts threads, opens sockets or initialises CUDA, so the
children are as clean as a fresh process: CUDA, the Runtime API connection and torch's thread
pools are created in the child.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
from pathlib import Path

from flwr.supercore.constant import TaskType
from flwr.supercore.superexec import run_superexec as flower_superexec
from flwr.supercore.superexec.executor import ExecutionSpec, LaunchResult, SubprocessExecutor
from flwr.supercore.tls import validate_and_resolve_root_certificates
from flwr.supernode.runtime.run_clientapp import run_clientapp

#: modules the fork server imports once: Flower's ClientApp runtime, torch, and torchvision (which
#: model groups with torchvision models import); one that is not installed is skipped
PRELOAD = ("flwr.supernode.runtime.run_clientapp", "torch", "torchvision")


class ForkserverExecutor(SubprocessExecutor):
    """Flower's subprocess executor, except that ClientApp tasks fork from a warm fork server.

    Args:
        preload: modules the fork server imports before its first fork (one not installed is skipped).
    """

    def __init__(self, preload: tuple[str, ...] = PRELOAD) -> None:
        self.context = multiprocessing.get_context("forkserver")
        self.context.set_forkserver_preload(list(preload))
        self.children: list[multiprocessing.process.BaseProcess] = []

    def warm_up(self) -> None:
        """Start the fork server now (its imports take seconds), not on the first task."""
        child = self.context.Process(target=os.getpid)
        child.start()
        self.children.append(child)

    def launch(self, spec: ExecutionSpec) -> LaunchResult:
        """Fork a ClientApp process for ``spec``; other task types start as with Flower's executor."""
        if spec.task_type != TaskType.CLIENT_APP or spec.suppress_output:
            return super().launch(spec)
        # what `flwr-clientapp` runs (flwr/supernode/cli/flwr_clientapp.py); Flower's own function
        # is the target, so the child needs nothing from this module
        child = self.context.Process(
            target=run_clientapp,
            kwargs={
                "runtime_api_address": spec.runtime_api_address,
                "token": spec.token,
                "insecure": spec.insecure,
                "certificates": validate_and_resolve_root_certificates(spec.root_certificates_path, spec.insecure),
                "parent_pid": spec.parent_pid,
                "runtime_dependency_install": spec.runtime_dependency_install,
            },
            name=f"clientapp-{spec.task_id}",
        )
        child.start()
        self.children.append(child)
        return LaunchResult.accepted()

    def reconcile(self) -> None:
        """Reap finished ClientApp processes (called by Flower between task polls)."""
        self.children = [child for child in self.children if child.is_alive()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runtime-api-address", required=True, help="the SuperNode's Runtime API, host:port")
    tls = parser.add_mutually_exclusive_group(required=True)
    tls.add_argument("--insecure", action="store_true", help="the Runtime API has no TLS (a SuperNode's default)")
    tls.add_argument("--root-certificates", help="CA certificate of the Runtime API's TLS")
    parser.add_argument("--parent-pid", type=int, help="exit when this process (the SuperNode) exits")
    args = parser.parse_args(argv)
    # run as a script, this file's folder (tools/, /app in the image) leads sys.path, which the fork
    # server hands on to every ClientApp: its neighbours (run.py, deploy.py ...) must not shadow
    # same-named modules there
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        del sys.path[0]
    executor = ForkserverExecutor()
    executor.warm_up()
    # Flower 1.42 picks its executor from a closed set (subprocess, kubernetes) inside
    # run_superexec; this is the one place to hand it another implementation of its Executor protocol
    flower_superexec.get_executor = lambda *_, **__: executor
    flower_superexec.run_superexec(
        runtime_api_address=args.runtime_api_address,
        insecure=args.insecure,
        root_certificates_path=args.root_certificates,
        parent_pid=args.parent_pid,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
