"""Ask a SuperLink's Control API from this process, as ``flwr run``, ``flwr log --stream``, ``flwr list``
and ``flwr stop`` ask it (Flower 1.42's ``ControlHttpClient``, built by ``flwr.cli.utils``), and build
the app's FAB as ``flwr run`` builds it, without walking the folders no FAB file can come from.

Why not the CLI: each ``flwr`` process imports the CLI (2-3 s of CPU here), and ``flwr run`` collects
every file under the app before filtering (``flwr.cli.utils.collect_files``), ``.venv``'s tens of
thousands included: 6-7 s on these 2 cores before the run is submitted. ``tools.run`` submits, streams,
asks the status and stops through :class:`LocalControl`; deployments on other SuperLinks keep the CLI
(:class:`CliControl`), whose connections (TLS, accounts) live in a Flower home's ``config.toml``.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

from tools.runconfig import ROOT


def flwr_cli(*args: str, env: dict, capture: bool = True, timeout: float | None = None) -> subprocess.CompletedProcess:
    """The ``flwr`` CLI of this environment with ``args``, run from the repository root; output
    captured unless ``capture`` is False (e.g. ``flwr log --stream``)."""
    exe = str(Path(sys.executable).with_name("flwr"))
    return subprocess.run(
        [exe, *args], env=env, cwd=ROOT, text=True, capture_output=capture, check=False, timeout=timeout
    )


def app_files(root: Path) -> dict[str, Path]:
    """The files under ``root`` that can be in the app's FAB, as ``{relative POSIX path: path}``: what
    ``flwr.cli.utils.collect_files`` gives (every file that is no symlink and resolves inside ``root``;
    symlinked folders are not entered), less the folders Flower's publish rules exclude whole
    (``flwr.supercore.constant.APP_PUBLISH_EXCLUDE_PATTERNS``: ``.flwr``, ``.venv``, ``__pycache__``) and,
    when the app's ``.gitignore`` re-includes nothing (no ``!`` line), the folders it ignores. Both
    rules drop every file under such a folder, so ``flwr.cli.build.build_fab_from_files`` keeps the
    same files from this mapping as from ``collect_files``'s, and the FAB is byte for byte the one
    ``flwr run`` builds."""
    from flwr.cli.utils import build_pathspec, load_gitignore_patterns
    from flwr.supercore.constant import APP_PUBLISH_EXCLUDE_PATTERNS

    root = root.resolve()
    gitignore = root / ".gitignore"
    patterns = load_gitignore_patterns(gitignore.read_bytes()) if gitignore.is_file() else []
    specs = [build_pathspec(APP_PUBLISH_EXCLUDE_PATTERNS)]
    if not any(p.lstrip().startswith("!") for p in patterns):
        specs.append(build_pathspec(patterns))
    files: dict[str, Path] = {}
    for folder, subfolders, names in os.walk(root, followlinks=False):
        relative = Path(folder).relative_to(root)
        subfolders[:] = [
            d
            for d in subfolders
            if not any(spec.match_file(f"{(relative / d).as_posix()}/") for spec in specs)
            and not (Path(folder) / d).is_symlink()
        ]
        for name in names:
            path = Path(folder) / name
            if not path.is_symlink() and path.resolve().is_relative_to(root):
                files[(relative / name).as_posix()] = path
    return files


def build_fab(root: Path = ROOT) -> bytes:
    """The app at ``root`` as the FAB ``flwr run`` submits (``flwr.cli.build.build_fab_from_files`` on
    :func:`app_files`).

    Raises:
        ValueError: the app's ``pyproject.toml`` is missing or invalid (Flower's message).
    """
    from flwr.cli.build import build_fab_from_files

    return build_fab_from_files(app_files(root))[0]


class LocalControl:
    """The Control API of a SuperLink at ``address`` (insecure, no account: the simulation SuperLink
    ``tools.run`` starts on loopback), asked from this process.

    Raises:
        click.ClickException: from any method, when the SuperLink does not answer or refuses (Flower's
        message, as the CLI prints it).
    """

    def __init__(self, address: str) -> None:
        from flwr.cli.typing import SuperLinkConnection
        from flwr.cli.utils import init_http_client_from_connection, load_cli_auth_plugin_from_connection
        from flwr.common.constant import AuthnType

        connection = SuperLinkConnection(name="sim", address=address, insecure=True)
        # no account: named here, so that no credential store (in a Flower home) is read for it
        self.client = init_http_client_from_connection(
            connection, load_cli_auth_plugin_from_connection(address, AuthnType.NOOP)
        )

    def submit(self, fab: bytes, run_config: Path, num_supernodes: int, cpus: int, gpus: float) -> int:
        """Start a run of ``fab`` (:func:`build_fab`) with the run config TOML file ``run_config``
        (:func:`tools.runconfig.run_config_file`) on ``num_supernodes`` simulated SuperNodes of ``cpus``
        CPUs and ``gpus`` GPUs each, as ``flwr run APP --run-config FILE --federation-config
        "num-supernodes=... client-resources-num-cpus=... client-resources-num-gpus=..."``; returns the
        run ID."""
        import hashlib

        import click
        from flwr.cli.utils import flwr_cli_exc_handler
        from flwr.common.config import parse_config_args
        from flwr.common.serde import fab_to_proto, user_config_to_proto
        from flwr.proto.control_pb2 import StartRunRequest
        from flwr.proto.federation_config_pb2 import SimulationConfig
        from flwr.supercore.fab import Fab

        request = StartRunRequest(
            fab=fab_to_proto(Fab(hashlib.sha256(fab).hexdigest(), fab, {})),
            override_config=user_config_to_proto(parse_config_args([str(run_config)])),
            federation="",
            override_federation_config=SimulationConfig(
                num_supernodes=num_supernodes, client_resources_num_cpus=cpus, client_resources_num_gpus=gpus
            ),
            app_spec="",
        )
        with flwr_cli_exc_handler():
            response = self.client.StartRun(request)
        if not response.HasField("run_id"):
            raise click.ClickException("the SuperLink started no run" + (f": {response.note}" if response.note else ""))
        return response.run_id

    def stream(self, run_id: int, timeout: float | None = None) -> None:
        """Print run ``run_id``'s log from its start until the SuperLink ends the stream, which it does
        when the run has finished or when it stops answering. The stream is read in a thread of its
        own, so that this one waits on it interruptibly (Ctrl-C) and for at most ``timeout`` seconds.

        Raises:
            TimeoutError: the stream had not ended after ``timeout`` seconds.
        """
        import threading

        import click
        from flwr.cli.log import AllLogsRetrieved, stream_logs

        def read() -> None:
            # the end of the stream, or a SuperLink gone: the caller asks the status next
            with contextlib.suppress(AllLogsRetrieved, click.ClickException):
                stream_logs(run_id, self.client, 0.0)

        reader = threading.Thread(target=read, name=f"log-stream-{run_id}", daemon=True)
        reader.start()
        reader.join(timeout)
        if reader.is_alive():
            raise TimeoutError(f"the log stream of run {run_id} was still open after {timeout:.0f} s")

    def status(self, run_id: int) -> str:
        """Run ``run_id``'s status as ``flwr list`` prints it (``finished:completed``, ``running``, ...;
        ``unknown`` when the SuperLink does not answer or lists no such run)."""
        import click
        from flwr.cli.ls import _display_one_run

        try:
            (row,) = _display_one_run(self.client, run_id)
        except (click.ClickException, ValueError):
            return "unknown"
        return row.status_text

    def stop(self, run_id: int) -> None:
        """Stop run ``run_id``, as ``flwr stop`` does (no error when it has already ended)."""
        import click
        from flwr.cli.utils import flwr_cli_exc_handler
        from flwr.proto.control_pb2 import StopRunRequest

        try:
            with flwr_cli_exc_handler():
                self.client.StopRun(request=StopRunRequest(run_id=run_id))
        except click.ClickException:
            pass

    def close(self) -> None:
        self.client.close()


class CliControl:
    """The Control API of the SuperLink behind CLI connection ``connection`` of the Flower home in
    ``env["FLWR_HOME"]``, asked through ``flwr`` CLI processes (a deployment's SuperLink, whose
    connection the home's ``config.toml`` holds with its TLS settings)."""

    def __init__(self, env: dict, connection: str, echo: bool = False) -> None:
        self.env, self.connection, self.echo = env, connection, echo

    def stream(self, run_id: int, timeout: float | None = None) -> None:
        """``flwr log RUN CONNECTION --stream`` (its output printed when ``echo``): returns when the
        SuperLink ends the stream.

        Raises:
            TimeoutError: it had not ended after ``timeout`` seconds.
        """
        args = ("log", str(run_id), self.connection, "--stream")
        try:
            flwr_cli(*args, env=self.env, capture=not self.echo, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise TimeoutError(f"the log stream of run {run_id} was still open after {timeout:.0f} s") from exc

    def status(self, run_id: int) -> str:
        """Run ``run_id``'s status from ``flwr list`` (``finished:completed``, ...; ``unknown`` when the
        SuperLink does not answer or lists no such run)."""
        import json

        out = flwr_cli("list", self.connection, "--run-id", str(run_id), "--format", "json", env=self.env).stdout
        try:
            runs = json.loads(out).get("runs", [])
        except json.JSONDecodeError:
            return "unknown"
        return runs[0].get("status", "unknown") if runs else "unknown"


def wait_finished(
    control: LocalControl | CliControl,
    run_id: int,
    timeout: float | None,
    superlink: subprocess.Popen | None = None,
) -> str:
    """Wait up to ``timeout`` seconds (None: no limit) for run ``run_id`` to finish on ``control``'s
    SuperLink; returns its status (``finished:completed``, ...). ``superlink``: that SuperLink's process,
    when this process started it (a run whose SuperLink has exited never finishes).

    The log stream (``control.stream``) waits for the end of the run (the SuperLink closes the
    stream then); the status is asked only afterwards, and the stream opened again should it have
    ended early. Asking ``flwr list`` every second instead costs about 2 s of CPU per call (the
    CLI's imports), which a 2-core machine takes from the run itself.

    Raises:
        TimeoutError: the run did not finish within ``timeout`` seconds.
        RuntimeError: ``superlink`` exited before the run finished.
    """
    deadline = time.monotonic() + timeout if timeout is not None else None
    while True:
        left = deadline - time.monotonic() if deadline is not None else None
        try:
            control.stream(run_id, left)
        except TimeoutError:
            break
        status = control.status(run_id)
        if status.startswith("finished"):
            return status
        if superlink is not None and superlink.poll() is not None:
            raise RuntimeError(f"flower-superlink exited with {superlink.returncode} before run {run_id} finished")
        if deadline is not None and time.monotonic() >= deadline:
            break
        time.sleep(2.0)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for run {run_id} to finish")
