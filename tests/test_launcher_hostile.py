"""The launchers against hostile or faulty input: concurrent launches and grids, an ``--ray-address`` that
is not Ray, huge or impossible values, a missing or broken preset, a run that recorded its failure without
raising. Everything is refused before anything starts, named, quoted short; whatever ends a run, nothing it
started outlives it and its summary is not left ``running``."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from common.config import RunConfig
from common.errors import ConfigError
from common.options import excerpt
from conftest import DATA_DIR, ROOT
from tools import grid as grids
from tools import processes, ray_cluster, runconfig
from tools import run as launcher

#: a launch as cheap as a real one gets: MNIST, 2 clients, 1 round, 50 examples each
TINY = {
    "dataset": "mnist",
    "num-clients": 2,
    "num-server-rounds": 1,
    "max-examples-per-client": 50,
    "model-group": "cnn1",
    "data-dir": str(DATA_DIR),
}


def never(*args, **kwargs):
    raise AssertionError("started something before the input was checked")


def tools_run(config: dict) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tools.run"]
    for key, value in config.items():
        cmd += ["-c", f"{key}={json.dumps(value)}"]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
def test_two_concurrent_launches_from_one_checkout_both_finish(tmp_path):
    """SLOW (a real pair of simulations, about 100 s on 2 busy cores). The second launch starts once the
    first has submitted its run, so it connects later: with one Flower home per checkout its connection
    replaced the first's, and the first then asked the second's (stopped) SuperLink for ever."""
    first = tools_run({**TINY, "output-dir": str(tmp_path / "a")})
    lines = []
    for line in first.stdout:  # until the first run is submitted
        lines.append(line)
        if line.startswith("Submitted run"):
            break
    second = tools_run({**TINY, "output-dir": str(tmp_path / "b")})
    threading.Thread(target=lambda: lines.extend(first.stdout), daemon=True).start()
    try:
        out_b, _ = second.communicate(timeout=300)
        first.wait(timeout=120)
    finally:
        for proc in (first, second):
            if proc.poll() is None:
                processes.interrupt(proc, grace=30)
    out_a = "".join(lines)
    assert second.returncode == 0, out_b[-3000:]
    assert first.returncode == 0, out_a[-3000:]
    for out, folder in ((out_a, "a"), (out_b, "b")):
        assert "finished:completed" in out and "the SuperLink's log" not in out
        (summary,) = (tmp_path / folder).glob("*/summary.json")
        assert json.loads(summary.read_text())["status"] == "completed"


def test_the_superexec_starts_beside_the_superlink_and_goes_with_it(tmp_path):
    """Started together (the SuperExec no longer waits for the SuperLink to spawn it), the SuperExec
    connects to the SuperLink's runtime API when it answers, and exits when the SuperLink is stopped."""
    env = {**os.environ, "FLWR_HOME": str(tmp_path)}
    superlink, address = launcher.start_superlink(env, tmp_path)
    try:
        # a child shows the parent's command line until its exec: look again until both have exec'd
        deadline = time.monotonic() + 30
        while True:
            found = [p for p in psutil.Process().children() if "flower-superexec" in " ".join(p.cmdline())]
            if found or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        (superexec,) = found
        assert superexec.cmdline()[-4:] == ["--runtime-api-address", address, "--parent-pid", str(superlink.pid)]
        launcher.wait_healthy(superlink, address, tmp_path)
        assert superexec.is_running()
    finally:
        processes.stop(superlink)
    superexec.wait(timeout=30)  # psutil.TimeoutExpired: it outlived its SuperLink


class FakeLaunch:
    """What ``_launch`` starts, faked: a "SuperLink" process whose child detaches into a session of
    its own (as flwr-simulation and Ray do, out of the SuperLink's process group), a submission that
    gives run 7, and a run that ends with ``status`` after the ServerApp wrote ``summary``; with
    ``status`` None the SuperLink dies instead while the run is streamed (the real
    ``wait_finished`` then finds it gone)."""

    def __init__(self, monkeypatch, tmp_path: Path, status: str | None, summary: dict) -> None:
        self.homes: list[Path] = []
        self.detached: list[psutil.Process] = []
        self.out = tmp_path / "outputs"
        self.status, self.summary = status, summary
        monkeypatch.setattr(launcher, "LAUNCHES", tmp_path / "launches")
        monkeypatch.setattr(launcher, "start_superlink", self.start_superlink)
        monkeypatch.setattr(launcher, "wait_healthy", lambda *args: None)
        # this test process's own children from before (multiprocessing's resource tracker) are not the launch's
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        descendants = launcher.descendants
        monkeypatch.setattr(launcher, "descendants", lambda: [p for p in descendants() if p.pid not in before])
        monkeypatch.setattr(launcher, "build_fab", lambda: b"fab")
        monkeypatch.setattr(launcher, "LocalControl", self.control)
        if status is not None:
            monkeypatch.setattr(launcher, "wait_finished", self.wait_finished)

    def start_superlink(self, env: dict, home: Path):
        self.homes.append(Path(env["FLWR_HOME"]))
        assert home == self.homes[-1]
        (home / "superlink.log").write_text("the SuperLink's own words\n")
        script = (
            "import subprocess, sys, time; "
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'], start_new_session=True); "
            "time.sleep(300)"
        )
        self.superlink = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
        processes.wait_for(lambda: psutil.Process(self.superlink.pid).children(), 30, "the detached child")
        self.detached += psutil.Process(self.superlink.pid).children()
        return self.superlink, "127.0.0.1:1"

    def write_summary(self) -> None:
        run = self.out / "20260101-000000-fedgh-mnist-7"
        run.mkdir(parents=True, exist_ok=True)
        (run / "summary.json").write_text(json.dumps(self.summary))

    def control(self, address: str):
        """The Control API client of the launch, faked: run 7 is submitted (after the CLI's connection
        was written into this launch's home); its log stream writes the summary (the ServerApp has
        started) and kills the SuperLink; the SuperLink then lists no such run."""
        assert address == "127.0.0.1:1" and (self.homes[-1] / "config.toml").is_file()
        fake = self

        class Control:
            def submit(self, fab, run_config, num_supernodes, cpus, gpus):
                assert fab == b"fab" and run_config.is_file() and (num_supernodes, cpus, gpus) == (2, 1, 0.0)
                return 7

            def stream(self, run_id, timeout=None):
                fake.write_summary()
                fake.superlink.kill()

            def status(self, run_id):
                return "unknown"

            def stop(self, run_id):
                pass

            def close(self):
                pass

        return Control()

    def wait_finished(self, control, run_id, timeout, superlink=None):
        self.write_summary()
        return self.status

    def launch(self, config: dict) -> int:
        args = argparse.Namespace(ray_address=ray_cluster.LOCAL_RAY, gpus_per_client=None, cpus_per_client=1)
        return launcher._run(args, {**config, "output-dir": str(self.out)}, 2, False)

    def left_running(self) -> list[psutil.Process]:
        time.sleep(0.5)
        return [p for p in self.detached if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]

    def written(self) -> dict:
        (summary,) = self.out.glob("*/summary.json")
        return json.loads(summary.read_text())


@pytest.fixture
def fake_launch(tmp_path, monkeypatch):
    """Factory of :class:`FakeLaunch`; whatever they leave is killed after the test."""
    fakes: list[FakeLaunch] = []

    def factory(status: str | None, summary: dict) -> FakeLaunch:
        fakes.append(FakeLaunch(monkeypatch, tmp_path, status, summary))
        return fakes[-1]

    yield factory
    for p in (p for fake in fakes for p in fake.detached):
        with contextlib.suppress(psutil.Error):
            p.kill()


def test_each_launch_has_a_flower_home_of_its_own_removed_after_a_completed_run(tmp_path, fake_launch):
    config = {"lr": 0.05}
    fake = fake_launch("finished:completed", {"status": "completed", "rounds_completed": 1})
    fake.summary["config"] = {**config, "output-dir": str(fake.out)}  # the run used what was asked
    assert fake.launch(config) == 0
    assert fake.launch(config) == 0
    first, second = fake.homes
    assert first != second and first.parent == second.parent == tmp_path / "launches"
    assert list((tmp_path / "launches").iterdir()) == []  # a completed run's home is removed
    assert not fake.left_running()  # a completed run's detached processes too


@pytest.mark.parametrize(
    "status, summary, reason",
    [
        # the ServerApp recorded its failure and returned: Flower says completed
        ("finished:completed", {"status": "failed", "error": "RunFailed: no client trained for 3 rounds"}, None),
        # it was killed (or died) before it could write anything: the summary still said running
        ("finished:failed", {"status": "running", "error": None}, "the Flower run ended finished:failed"),
        # the SuperLink died while the run was streamed (it waited for ever before)
        (None, {"status": "running", "error": None}, "tools.run ended before the run did"),
    ],
)
def test_a_run_whose_summary_is_not_completed_exits_1_and_stops_everything(
    fake_launch, capsys, status, summary, reason
):
    fake = fake_launch(status, {**summary, "rounds_completed": 0, "config": {}})
    assert fake.launch({}) == 1
    out = capsys.readouterr().out
    written = fake.written()
    assert written["status"] == "failed"  # never left running
    assert (reason or summary["error"]) in written["error"]
    assert status is None or written["error"] in out  # the reason is printed with the outcome
    if status is None:
        assert "error: flower-superlink exited with -9 before run 7 finished" in out
    (home,) = fake.homes
    assert f"the SuperLink's log: {home / 'superlink.log'}" in out
    assert [p.name for p in home.iterdir()] == ["superlink.log"]  # kept for the user; the state database goes
    assert fake.detached and not fake.left_running()  # the detached "simulation" was killed too


def http_server() -> tuple[subprocess.Popen, int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    processes.wait_for(lambda: not socket.socket().connect_ex(("127.0.0.1", port)), 30, "http.server")
    return server, port


@pytest.mark.slow
def test_a_ray_address_that_is_not_ray_fails_within_the_join_limit_naming_the_option(monkeypatch, capsys):
    """A TCP service that is not Ray passes the TCP check; Ray then retried its GCS without end."""
    server, port = http_server()
    monkeypatch.setattr(ray_cluster, "RAY_JOIN_TIMEOUT", 20.0)
    monkeypatch.setattr(launcher, "validate_configs", lambda configs, then=None: [(2, False)])
    monkeypatch.setattr(launcher, "_run", never)
    start = time.monotonic()
    try:
        assert launcher.main(["--ray-address", f"127.0.0.1:{port}"]) == 2
    finally:
        server.kill()
        server.wait()
    assert time.monotonic() - start < 60
    out = capsys.readouterr().out
    assert f"--ray-address 127.0.0.1:{port}: Ray cannot join the cluster" in out
    children = psutil.Process().children(recursive=True)
    assert not [p for p in children if "ray" in " ".join(p.cmdline()).lower()]  # the joining child is gone


def test_huge_values_are_refused_before_anything_starts_quoting_only_their_start(tmp_path, monkeypatch, capsys):
    """A 100 MB state-dir ran for 179 s and left a 100 MB summary; a 10 MB method was echoed whole."""
    monkeypatch.setattr(launcher, "validate_configs", never)
    monkeypatch.setattr(launcher, "_run", never)
    preset = tmp_path / "huge.toml"
    preset.write_text(f'state-dir = "{"d" * 5_000_000}"\n')
    assert launcher.main(["--preset", str(preset)]) == 2
    out = capsys.readouterr().out
    assert "run config key 'state-dir' = '/ddd" not in out  # quoted as given, not resolved first
    assert "'state-dir' = 'ddd" in out and "(5000000 characters)" in out and len(out) < 400
    # a path whose one name is longer than any file system takes
    assert launcher.main(["-c", f"state-dir='{tmp_path}/{'n' * 256}/x'"]) == 2
    out = capsys.readouterr().out
    assert "'state-dir'" in out and "every name is at most 255 bytes" in out and "256 bytes" in out and len(out) < 500
    # any other string: bounded where every value is checked (the ServerApp's RunConfig too)
    config = {**runconfig.app_defaults(), "method": "m" * 10_000_000}
    error, _, _ = runconfig.check_config(config)
    assert error.startswith("run config key 'method' = 'mmm") and len(error) < 2000
    with pytest.raises(ConfigError, match=r"'data-dir' = 'xxx.*\(5000 characters\).*at most 4096") as caught:
        RunConfig.from_dict({**runconfig.app_defaults(), "data-dir": "x" * 5000})
    assert len(str(caught.value)) < 600


@pytest.mark.parametrize("kind", ["file", "below a file", "long name", "read-only"])
def test_an_output_dir_that_cannot_be_a_writable_folder_fails_fast_naming_it(tmp_path, monkeypatch, capsys, kind):
    monkeypatch.setattr(launcher, "validate_configs", never)
    monkeypatch.setattr(launcher, "_run", never)
    (tmp_path / "file").write_text("not a folder")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    value = {
        "file": tmp_path / "file",
        "below a file": tmp_path / "file" / "runs",
        "long name": tmp_path / ("o" * 300),
        "read-only": locked / "runs",
    }[kind]
    if kind == "read-only" and psutil.Process().uids().effective == 0:
        pytest.skip("root writes into a read-only folder")
    start = time.monotonic()
    assert launcher.main(["-c", f"output-dir='{value}'"]) == 2
    out = capsys.readouterr().out
    assert "run config key 'output-dir'" in out and time.monotonic() - start < 10, out
    expected = {"file": "is a file", "below a file": "which is a file", "long name": "255 bytes"}
    assert expected.get(kind, "is not writable") in out


def memory_capped() -> None:
    """A child's address space capped at 4 GiB: a launcher that reads an endless preset whole fails
    there instead of taking the machine's memory."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))


@pytest.mark.parametrize("kind", ["a device", "a FIFO", "over the cap"])
def test_a_preset_that_is_no_regular_file_under_the_cap_is_refused_naming_it(tmp_path, kind):
    """``--preset /dev/zero`` was read whole until the process was killed for memory, and a FIFO held the
    launcher forever: each is refused by name, with what is allowed (a child process, so that neither can
    hang or fill this one)."""
    path = {"a device": Path("/dev/zero"), "a FIFO": tmp_path / "fifo.toml", "over the cap": tmp_path / "big.toml"}[
        kind
    ]
    if kind == "a FIFO":
        os.mkfifo(path)
    elif kind == "over the cap":
        with open(path, "wb") as f:
            f.truncate((1 << 30) + 1)  # sparse: no disk, one byte over common.files.MAX_READ_BYTES
    cmd = [sys.executable, "-m", "tools.run", "--preset", str(path)]
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, preexec_fn=memory_capped)
    except subprocess.TimeoutExpired:
        pytest.fail(f"tools.run --preset {kind} still running after 120 s")
    lines = [line for line in (done.stdout + done.stderr).splitlines() if "error" in line.lower()]
    assert done.returncode == 2 and len(lines) == 1, done.stdout + done.stderr
    expected = {
        "a device": "it is a device",
        "a FIFO": "it is a FIFO",
        "over the cap": f"it holds {(1 << 30) + 1} bytes",
    }
    assert f"preset {excerpt(str(path))} cannot be read: {expected[kind]}" in lines[0], lines
    assert f"allowed is a regular file of at most {1 << 30} bytes" in lines[0]


@pytest.mark.parametrize("module", ["tools.run", "tools.grid"])
@pytest.mark.parametrize("kind", ["missing", "not toml", "a list"])
def test_a_preset_that_cannot_be_read_is_named_with_exit_2(tmp_path, monkeypatch, capsys, module, kind):
    import importlib

    entry = importlib.import_module(module)
    monkeypatch.setattr(entry, "validate_configs", never)
    # a relative path: the error quotes a long one cut short, and pytest-xdist's tmp_path is longer
    monkeypatch.chdir(tmp_path)
    path = Path("nope.toml")
    if kind == "not toml":
        path.write_text("method: fedgh\n")  # YAML
    elif kind == "a list":
        path.write_text("method = ['fedgh']\n")
    argv = ["--preset", str(path)] if module == "tools.run" else [str(path), "--methods", "fedgh"]
    assert entry.main(argv) == 2
    out = capsys.readouterr().out
    assert f"preset {str(path)!r}" in out, out
    assert ("cannot be read" if kind == "missing" else "is not a TOML file of run config keys") in out


def instant_launcher(launches: list, release: threading.Event):
    """A grid launcher that records each cell and finishes it at once (after ``release``)."""

    def launch(preset: Path, overrides: dict, minutes: float) -> int:
        launches.append(Path(overrides["output-dir"]).name)
        release.wait(30)
        run = Path(overrides["output-dir"]) / f"20260101-000000-{len(launches)}"
        run.mkdir(parents=True)
        summary = {"status": "completed", "rounds_completed": overrides["num-server-rounds"]}
        (run / "summary.json").write_text(json.dumps(summary))
        return 0

    return launch


def test_two_grids_on_one_folder_run_each_cell_once(tmp_path):
    preset = tmp_path / "p.toml"
    preset.write_text("num-server-rounds = 2\n")
    out, launches, release = tmp_path / "grid", [], threading.Event()
    outcomes = {}
    first = threading.Thread(
        target=lambda: outcomes.update(
            grids.run_grid(preset, ["local", "fedgh"], [0], out, launcher=instant_launcher(launches, release))
        )
    )
    first.start()
    processes.wait_for(lambda: launches, 30, "the first grid's first launch")
    expected = rf"grid folder {re.escape(str(out))} is in use by another tools.grid \(PID {os.getpid()}\)"
    with pytest.raises(ConfigError, match=expected):
        grids.run_grid(preset, ["local", "fedgh"], [0], out, launcher=instant_launcher(launches, release))
    release.set()
    first.join(30)
    assert outcomes == {"local-seed0": "completed", "fedgh-seed0": "completed"}
    assert sorted(launches) == ["fedgh-seed0", "local-seed0"]  # each cell once
    # the lock goes with the grid: the next one finds every cell done
    assert grids.run_grid(preset, ["local", "fedgh"], [0], out, launcher=never) == {
        "local-seed0": "done",
        "fedgh-seed0": "done",
    }
    assert len(grids.read_grid_info(out)["invocations"]) == 2
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]


def test_a_grid_held_by_another_process_is_refused_naming_its_pid(tmp_path, capsys):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from tools.grid import grid_lock\n"
            "with grid_lock(Path(sys.argv[1])):\n    print('held', flush=True); time.sleep(60)",
            str(tmp_path),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        expected = rf"{re.escape(str(tmp_path))} is in use by another tools.grid \(PID {holder.pid}\)"
        with pytest.raises(ConfigError, match=expected), grids.grid_lock(tmp_path):
            pass
    finally:
        holder.kill()
        holder.wait()
    with grids.grid_lock(tmp_path):  # released with its holder, killed or not
        assert (tmp_path / grids.LOCK_FILE).read_text().strip() == str(os.getpid())


def test_a_grid_folder_that_is_a_file_is_refused_naming_it(tmp_path):
    preset = tmp_path / "p.toml"
    preset.write_text("num-server-rounds = 2\n")
    (tmp_path / "taken").write_text("a file")
    with pytest.raises(ConfigError, match=r"grid folder .*taken cannot be created: File exists"):
        grids.run_grid(preset, ["local"], [0], tmp_path / "taken", launcher=never)


def test_an_item_flower_cannot_parse_is_named_with_exit_2(monkeypatch, capsys):
    """Flower raises a click error (not a ValueError) for it: it ended in a traceback."""
    monkeypatch.setattr(launcher, "validate_configs", never)
    assert launcher.main(["-c", "lr=[1"]) == 2
    out = capsys.readouterr().out
    assert "run config overrides ['lr=[1'] cannot be parsed: The provided configuration string" in out


@pytest.mark.parametrize("user", [None, "15"])
def test_the_launch_starts_ray_workers_at_niceness_0_unless_the_user_sets_it(tmp_path, monkeypatch, user):
    """Ray's own default (`worker_niceness` 15) puts the ClientApp actors below Flower's engine; the
    launch's environment, which flwr-simulation and its Ray instance inherit, sets 0, and a user's
    ``RAY_worker_niceness`` stands."""
    if user is None:
        monkeypatch.delenv("RAY_worker_niceness", raising=False)
    else:
        monkeypatch.setenv("RAY_worker_niceness", user)
    seen: dict = {}

    class Started(Exception):
        pass

    def start_superlink(env: dict, home: Path):
        seen.update(env)
        raise Started

    monkeypatch.setattr(launcher, "start_superlink", start_superlink)
    args = argparse.Namespace(ray_address=ray_cluster.LOCAL_RAY, gpus_per_client=None, cpus_per_client=1)
    with pytest.raises(Started):
        launcher._launch(tmp_path, args, {"output-dir": str(tmp_path)}, 2, False)
    assert seen["RAY_worker_niceness"] == (user or "0")


def refused_before_the_launch(monkeypatch, capsys, config: dict) -> str:
    """``tools.run`` with ``config`` as ``-c`` items exits 2 before it starts a SuperLink; its output."""
    monkeypatch.setattr(launcher, "_run", never)
    monkeypatch.setattr(launcher, "start_superlink", never)
    argv = [arg for key, value in config.items() for arg in ("-c", f"{key}={json.dumps(value)}")]
    assert launcher.main(argv) == 2
    return capsys.readouterr().out


def test_partitions_too_small_to_split_are_refused_before_any_node_starts(tmp_path, monkeypatch, capsys):
    """They were refused only by the handshake, once every node had started and answered (10,000 MNIST
    clients: 7.5 minutes after the launch)."""
    from test_data_faults import write_mnist

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    write_mnist(tmp_path)  # 60 examples: 30 iid partitions of 2, two classes in most of them
    for handshake in ("all", "sampled"):  # every partition decoded into the cache, or only split
        config = {**TINY, "data-dir": str(tmp_path), "partitioner": "iid", "num-clients": 30}
        config.update({"max-examples-per-client": 0, "handshake": handshake, "output-dir": str(tmp_path / "out")})
        if handshake == "sampled":
            config["eval-clients"] = "trained"
        out = refused_before_the_launch(monkeypatch, capsys, config)
        assert re.search(r"error: \d+ of 30 partitions cannot serve the run, refused before any node starts", out)
        assert "has 2 examples: too few for a train and a test set at test-fraction 0.2" in out, out


def test_a_resume_of_a_run_with_other_dp_settings_is_refused_before_the_launch(tmp_path, monkeypatch, capsys):
    """It was refused by the checkpoint's check, after the launch and the handshake (51 s)."""
    from common.run_folder import ResultsWriter

    given = {**TINY, "output-dir": str(tmp_path)}
    done = ResultsWriter(tmp_path, "done", RunConfig.from_dict({**runconfig.app_defaults(), **given}).as_dict())
    out = refused_before_the_launch(monkeypatch, capsys, {**given, "resume-from": str(done.path), "dp.epsilon": 8.0})
    assert (
        f"'resume-from' = '{done.path}': the run it resumes used other values for 'dp.epsilon' (0.0, now 8.0); "
        "only 'num-server-rounds' may change on resume"
    ) in out


def test_a_recording_above_its_disk_cap_is_refused_before_the_launch(tmp_path, monkeypatch, capsys):
    config = {**TINY, "record-payloads": "all", "record-payloads-max-gib": 1e-4, "output-dir": str(tmp_path)}
    out = refused_before_the_launch(monkeypatch, capsys, config)
    assert "error: run config key 'record-payloads' = 'all' writes up to" in out
    assert "above 'record-payloads-max-gib' = 0.0001" in out
