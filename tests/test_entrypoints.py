"""One way in: every entry point parses ``-c`` as ``tools.run`` does and checks the whole config before it
starts anything; a failed run ends with its status and reason; SIGTERM and SIGHUP stop everything an
entry point started, as Ctrl-C does, and leave the run's files with a final status."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import psutil
import pytest

from common.errors import ConfigError
from conftest import DATA_DIR, ROOT
from tools import outcome, processes, runconfig

ITEMS = ["num-server-rounds=3 lr=0.05", "method='fedproto'"]


def test_every_entry_point_reads_several_pairs_per_c_item():
    config, overrides = runconfig.read_config(None, ITEMS)
    assert overrides == {"num-server-rounds": 3, "lr": 0.05, "method": "fedproto"}
    assert config["num-server-rounds"] == 3 and config["batch-size"] == runconfig.app_defaults()["batch-size"]
    with pytest.raises(ConfigError, match="unknown run config key.*'no-such-key'"):
        runconfig.read_config(None, ["no-such-key=1"])


def test_c_items_of_one_table_all_count():
    # Flower merges its items' nested tables shallowly: the second item used to drop fedgh.server-mode
    _, overrides = runconfig.read_config(None, ["fedgh.server-mode='minibatch'", "fedgh.server-lr=0.5"])
    assert overrides == {"fedgh.server-mode": "minibatch", "fedgh.server-lr": 0.5}


def test_the_run_config_reaches_flower_whole():
    from flwr.common.config import fuse_dicts, parse_config_args

    config, _ = runconfig.read_config(None, ["fedgh.server-mode='minibatch' fedgh.server-lr=0.5 lr=0.05"])
    config["output-dir"] = "/tmp/a \"quoted\" 'path' = x"
    with runconfig.run_config_file(config) as path:
        parsed = parse_config_args([str(path)])  # what flwr run does with the file
    assert not path.exists()
    assert parsed == config
    assert fuse_dicts(runconfig.app_defaults(), parsed) == config


def test_a_run_that_did_not_use_the_requested_config_is_named(tmp_path, capsys):
    (tmp_path / "summary.json").write_text(
        json.dumps(
            {
                "status": "completed",
                "rounds_completed": 1,
                "config": {"lr": 0.05, "fedgh.server-lr": 0.01, "handshake": "sampled"},
            }
        )
    )
    assert outcome.used_requested_config(tmp_path, {"lr": 0.05})
    assert not outcome.used_requested_config(tmp_path, {"lr": 0.05, "fedgh.server-lr": 0.5})
    assert outcome.used_requested_config(tmp_path, {"handshake": "auto"})  # the run records what auto chose
    assert not outcome.used_requested_config(tmp_path, {"handshake": "all"})
    assert "fedgh.server-lr: 0.5 -> 0.01" in capsys.readouterr().out


def refuse(configs, then=None):
    """A validate_configs that records the configs it was given and refuses them."""
    refuse.seen = configs
    raise ConfigError("run config key 'lr' refused by the test")


def never(*args, **kwargs):
    raise AssertionError("started something before the config was checked")


@pytest.mark.parametrize(
    "module, argv, starts",
    [
        ("tools.run", ["-c", ITEMS[0], "-c", ITEMS[1]], ["start_superlink", "_run"]),
        ("bench.simulation", ["-c", ITEMS[0], "-c", ITEMS[1]], ["run_one"]),
        ("bench.deployment", ["-c", ITEMS[0], "-c", ITEMS[1]], ["LoopbackDeployment"]),
        (
            "tools.grid",
            [str(ROOT / "presets" / "fedre-table12-cifar10.toml"), "--methods", "fedproto", "-c", ITEMS[0]],
            ["run_grid"],
        ),
        ("tools.compose_demo", ["-c", ITEMS[0]], ["run_demo"]),
    ],
)
def test_every_entry_point_checks_the_whole_config_before_starting_anything(monkeypatch, capsys, module, argv, starts):
    import importlib

    entry = importlib.import_module(module)
    monkeypatch.setattr(entry, "validate_configs", refuse)
    for name in starts:
        monkeypatch.setattr(entry, name, never)
    assert entry.main(argv) == 2
    printed = capsys.readouterr()
    assert "'lr' refused by the test" in printed.out + printed.err
    (config, *_) = refuse.seen
    assert config["num-server-rounds"] == 3 and config["lr"] == 0.05


def test_a_bad_value_stops_bench_deployment_before_any_node_starts(monkeypatch, capsys):
    from bench import deployment

    monkeypatch.setattr(deployment, "LoopbackDeployment", never)
    # the whole string was the value of 'method' before; now both keys are read and the bad lr is named
    assert deployment.main(["-c", "method='fedgh' num-clients=3 lr=-1.0"]) == 2
    assert "'lr' = -1.0 is invalid" in capsys.readouterr().out


def test_a_failed_run_ends_with_its_status_and_reason(tmp_path, monkeypatch, capsys):
    from bench import deployment

    class FailedDeployment:
        """A deployment whose run fails in round 1: a failed summary, no rows."""

        def __init__(self, folder, nodes, data_dir):
            self.out = folder / "outputs"

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def start(self, started=None):
            pass

        def submit(self, run_config):
            run = self.out / "20260101-000000-fedgh-cifar10-7"
            run.mkdir(parents=True)
            summary = {"status": "failed", "rounds_completed": 0, "error": "RuntimeError: only 2 of 3 clients answered"}
            (run / "summary.json").write_text(json.dumps(summary))
            return 7

        def finished(self, run_id, timeout):
            return "finished:failed"

    monkeypatch.setattr(deployment, "LoopbackDeployment", FailedDeployment)
    monkeypatch.setattr(deployment, "import_floor", lambda *a, **k: 1.0)
    assert deployment.main(["--nodes", "3"]) == 1  # was StatisticsError: no median for empty data
    out = capsys.readouterr().out
    assert "run finished:failed after 0 rounds" in out and "only 2 of 3 clients answered" in out


def test_sigterm_and_sighup_raise_keyboard_interrupt_inside_the_block_only():
    for sig in processes.STOP_SIGNALS:
        with pytest.raises(KeyboardInterrupt), processes.stop_on_signals():
            os.kill(os.getpid(), sig)
            time.sleep(5)
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_later_signals_do_not_break_off_the_clean_up_the_first_started(capfd):
    """A terminal's Ctrl-C reaches a launcher and its tools.run at once, and the launcher then sends
    that tools.run one more SIGINT: the second signal must not abort the clean-up of the first."""
    cleaned = []
    with pytest.raises(KeyboardInterrupt), processes.stop_on_signals():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        except KeyboardInterrupt:
            for sig in processes.STOP_SIGNALS:
                os.kill(os.getpid(), sig)
            time.sleep(0.2)
            cleaned.append("done")
            raise
    assert cleaned == ["done"]
    assert "SIGINT ignored: still stopping after SIGTERM" in capfd.readouterr().err
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


@pytest.mark.parametrize(
    "before, after, expected",
    [
        ("running", "running", "interrupted"),  # the ServerApp was killed before it could write
        ("running", "failed", "interrupted"),  # it recorded the stop as its failure
        (None, "failed", "interrupted"),  # it started (and failed on the stop) after the signal
        ("failed", "failed", "failed"),  # it had failed on its own before the signal
        ("running", "completed", "completed"),  # it finished just before the stop
    ],
)
def test_a_stopped_run_is_marked_interrupted_unless_it_had_ended(tmp_path, before, after, expected):
    error = "RunNotRunningException: run 7 was stopped" if after == "failed" else None
    (tmp_path / "summary.json").write_text(json.dumps({"status": after, "rounds_completed": 2, "error": error}))
    outcome.mark_stopped(tmp_path, "stopped by a signal", before)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == expected and summary["rounds_completed"] == 2
    if expected == "interrupted":
        assert summary["error"].startswith("stopped by a signal")
        assert error is None or error in summary["error"]  # the ServerApp's own words are kept
    else:
        assert summary["error"] == error


def test_bench_simulation_reports_a_failed_run_with_its_status_and_reason(tmp_path, monkeypatch, capsys):
    """A run that fails before its first row: the status and the summary's reason are printed, no
    table over no rows, and the comparison names it failed (exit 1)."""
    from bench import simulation

    popen = subprocess.Popen
    failing_run = (
        "import json, pathlib, sys; out = pathlib.Path(json.loads(sys.argv[1].split('=', 1)[1])); "
        "run = out / '20260101-000000-fedgh-cifar10-7'; run.mkdir(parents=True); "
        "(run / 'summary.json').write_text(json.dumps({'status': 'failed', 'rounds_completed': 0, "
        "'error': 'ValueError: client 1 sent no prototypes'})); print('Run 7: finished:failed'); sys.exit(1)"
    )

    def fake_tools_run(cmd, **kwargs):
        return popen([sys.executable, "-c", failing_run, cmd[cmd.index("-c") + 1]], **kwargs)

    monkeypatch.setattr(simulation, "ROOT", tmp_path)
    monkeypatch.setattr(simulation, "validate_configs", lambda configs: [(0, False)] * len(configs))
    monkeypatch.setattr(simulation.subprocess, "Popen", fake_tools_run)
    assert simulation.main(["--methods", "fedgh,local", "-c", "num-server-rounds=1"]) == 1
    out = capsys.readouterr().out
    # each run its own folder and its own report, also when both fail within one second
    assert out.count("status tools.run exit 1 (failed): ValueError: client 1 sent no prototypes") == 2
    assert "0 rounds: final accuracy -" in out and "fedgh failed" in out and "local failed" in out


def test_the_app_bundle_carries_the_code_and_not_the_curated_results():
    """``flwr run`` submits the repository as a FAB, stored uncompressed and refused above 10 MiB;
    ``results/`` grows with every curated run (9.6 MB of rows on 2026-11-27) and must stay out."""
    from flwr.cli.build import build_fab_from_disk
    from flwr.common.constant import FAB_MAX_SIZE

    fab = build_fab_from_disk(ROOT)
    names = zipfile.ZipFile(io.BytesIO(fab)).namelist()
    assert {"server_app/app.py", "client_app/app.py", "common/config.py"} <= set(names)
    assert not [n for n in names if n.startswith("results/")]
    assert len(fab) < FAB_MAX_SIZE / 4  # room for the code to grow


def test_a_finished_run_prints_final_and_both_best_accuracies_with_rounds_bytes_and_folder(tmp_path, capsys):
    # the best over clients and the best pooled accuracy come in different rounds (as in FedProto's
    # Fashion-MNIST grid: 97.25 % in round 315, 97.31 % pooled in round 280)
    summary = {
        "status": "completed",
        "rounds_completed": 3,
        "final_accuracy_mean": 0.5,
        "final_accuracy_weighted": 0.55,
        "best_accuracy_mean": 0.625,
        "best_round": 2,
        "best_accuracy_weighted": 0.75,
        "best_round_weighted": 1,
        "total_bytes_up": 2**20,
        "total_bytes_down": 2**20,
        "total_eval_bytes_up": 0,
        "total_eval_bytes_down": 2**19,
    }
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    outcome.print_outcome(tmp_path, "exit 0")
    out = capsys.readouterr().out
    assert "3 rounds: final accuracy 50.00 % (mean over clients), 55.00 % (pooled)" in out
    assert "best 62.50 % (mean over clients) in round 2, 75.00 % (pooled) in round 1" in out
    assert "payload 2.50 MiB in all" in out and f"results: {tmp_path} " in out
    assert "left out of final and best" not in out
    (tmp_path / "summary.json").write_text(json.dumps({**summary, "incomplete_evaluations": [2, 4]}))
    outcome.print_outcome(tmp_path, "exit 0")
    assert "rounds [2, 4] left out of final and best" in capsys.readouterr().out


def test_bench_deployment_that_cannot_start_ends_with_the_reason(tmp_path, monkeypatch, capsys):
    from bench import deployment

    stopped = []

    class NoSuperLink:
        def __init__(self, folder, nodes, data_dir):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            stopped.append(True)

        def start(self, started=None):
            raise TimeoutError("timed out after 60 s waiting for the SuperLink (TLS) to become healthy")

    monkeypatch.setattr(deployment, "LoopbackDeployment", NoSuperLink)
    monkeypatch.setattr(deployment, "import_floor", lambda *a, **k: 1.0)
    monkeypatch.setattr(deployment, "validate_configs", lambda configs: [(3, False)])
    assert deployment.main([]) == 1  # was a traceback
    assert "deployment failed: timed out after 60 s waiting for the SuperLink" in capsys.readouterr().out
    assert stopped == [True]


def test_the_grid_checks_its_rounds_with_the_config(monkeypatch, capsys):
    """--rounds is part of every cell's config: a bad one is refused before the grid folder or a launch."""
    from tools import grid

    monkeypatch.setattr(grid, "validate_configs", refuse)
    monkeypatch.setattr(grid, "run_grid", never)
    preset = str(ROOT / "presets" / "fedre-table12-cifar10.toml")
    assert grid.main([preset, "--methods", "fedproto,local", "--rounds", "0", "--seeds", "3"]) == 2
    assert [(c["method"], c["num-server-rounds"], c["seed"]) for c in refuse.seen] == [
        ("fedproto", 0, 3),
        ("local", 0, 3),
    ]
    assert grid.main([preset, "--methods", "fedproto", "--seeds", ","]) == 2
    assert "--seeds ','" in capsys.readouterr().out


def test_the_grid_stops_its_launch_on_sigterm(tmp_path, monkeypatch):
    """SIGTERM to the grid while a launch runs: the launch is stopped as Ctrl-C would stop it, the
    launch is recorded, and the grid stops."""
    from tools import grid

    child = []
    popen = subprocess.Popen

    def sleeping_launch(cmd, cwd=None):
        child.append(popen([sys.executable, "-c", "import time; time.sleep(120)"]))
        return child[0]

    monkeypatch.setattr(grid.subprocess, "Popen", sleeping_launch)
    recorded = []
    monkeypatch.setattr(grid, "record_launch", lambda *args: recorded.append(args))
    threading.Timer(2.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
    with pytest.raises(KeyboardInterrupt), processes.stop_on_signals():
        grid.launch_tools_run(tmp_path / "p.toml", {"output-dir": str(tmp_path / "cell")}, 0)
    assert child[0].poll() is not None and recorded and recorded[0][-1] == 130


@pytest.mark.slow
def test_sigterm_stops_a_simulation_and_everything_it_started(tmp_path):
    """A real ``tools.run`` simulation, stopped by SIGTERM once its ServerApp runs (and sent a Ctrl-C while
    it stops): exit 130, no process it started is left, and the run folder's summary is ``interrupted``."""
    items = {
        "num-clients": 2,
        "num-server-rounds": 200,
        "max-examples-per-client": 60,
        "model-group": "cnn1",
        "data-dir": str(DATA_DIR),
        "output-dir": str(tmp_path),
    }
    cmd = [sys.executable, "-m", "tools.run"]
    for key, value in items.items():
        cmd += ["-c", f"{key}={json.dumps(value) if isinstance(value, str) else value}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 240
    # the ServerApp writes summary.json as it starts: the run is under way, Ray's processes with it
    while not list(tmp_path.glob("*/summary.json")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(1)
    assert proc.poll() is None, proc.stdout.read()[-3000:]
    started = psutil.Process(proc.pid).children(recursive=True)
    assert any("flwr-simulation" in " ".join(p.cmdline()) for p in started)
    proc.send_signal(signal.SIGTERM)
    # while it stops (about a second since the launcher asks its SuperLink in-process: 0.2 s later is
    # within it), a Ctrl-C as a terminal (or tools.grid's interrupt) would send it
    time.sleep(0.2)
    assert proc.poll() is None, "the clean-up ended within 0.2 s: the second signal would come too late"
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out[-3000:]
    assert "interrupted: stopped the run" in out, out[-3000:]
    assert "SIGINT ignored: still stopping after SIGTERM" in out, out[-3000:]
    time.sleep(1)
    alive = [p for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, [" ".join(p.cmdline())[:120] for p in alive]
    (summary,) = tmp_path.glob("*/summary.json")
    summary = json.loads(summary.read_text())
    assert summary["status"] == "interrupted" and summary["error"].startswith("stopped by a signal"), summary


def test_bench_simulation_adds_each_finished_run_to_its_json_with_the_startup_phases(tmp_path, monkeypatch, capsys):
    """``--out``: each run's totals are added to one JSON list as it ends; the start-up split reads the
    sampled handshake's line as the end of start-up, as it reads the full handshake's."""
    from bench import simulation

    popen = subprocess.Popen
    row = {
        "round": 1, "accuracy_mean": 0.5, "accuracy_weighted": 0.5, "bytes_up": 0, "bytes_down": 0,
        "round_seconds": 2.0, "client_train_seconds": 1.0, "num_clients": 3, "elapsed_seconds": 2.0,
    }  # fmt: skip
    fake_run = (
        "import json, pathlib, sys, time; out = pathlib.Path(json.loads(sys.argv[1].split('=', 1)[1])); "
        "run = out / '20260101-000000-local-mnist-7'; run.mkdir(parents=True); "
        f"(run / 'metrics.jsonl').write_text(json.dumps({row!r}) + '\\n'); "
        "[print(line, flush=True) or time.sleep(0.05) for line in ('Submitted run 7', "
        "'Starting Flower Simulation', 'Writing results to x', "
        "'Handshake sampled: 300 nodes listed; each round asks only the nodes it samples')]"
    )

    def fake_tools_run(cmd, **kwargs):
        if "tools.run" not in cmd:  # git, for the commit
            return popen(cmd, **kwargs)
        return popen([sys.executable, "-c", fake_run, cmd[cmd.index("-c") + 1]], **kwargs)

    monkeypatch.setattr(simulation, "ROOT", tmp_path)
    monkeypatch.setattr(simulation, "validate_configs", lambda configs: [(0, False)] * len(configs))
    monkeypatch.setattr(simulation.subprocess, "Popen", fake_tools_run)
    out = tmp_path / "scale.json"
    for n in (100, 1000):
        assert simulation.main(["-c", f"num-clients={n}", "--out", str(out)]) == 0
    assert "300 nodes listed" in capsys.readouterr().out
    runs = json.loads(out.read_text())
    assert [r["command"].split()[-3] for r in runs] == ["num-clients=100", "num-clients=1000"]
    for r in runs:
        phases = ["launcher", "simulation start", "ServerApp start", "Ray start + handshake"]
        assert list(r["startup_seconds"]) == phases
        assert all(s >= 0 for s in r["startup_seconds"].values()) and sum(r["startup_seconds"].values()) >= 0.1
        assert r["round_seconds"] == [2.0] and r["rounds"] == 1 and r["cpus"] == os.cpu_count()


def test_the_committed_scale_table_and_its_quoted_seconds_are_what_the_rows_give():
    from bench.simulation import scale_table

    readme = (ROOT / "results" / "scale" / "README.md").read_text()
    runs = json.loads((ROOT / "results" / "scale" / "simulation-sampled.json").read_text())
    assert scale_table(runs) in readme
    auto = json.loads((ROOT / "results" / "scale" / "simulation-auto.json").read_text())
    assert scale_table(auto) in readme  # one quoted -c "k=v ..." argument, parsed word by word
    launch = [sum(run["startup_seconds"].values()) for run in auto]
    assert f"{launch[1] / launch[0]:.2f}x the launch at 100 ({launch[1]:.1f} s against {launch[0]:.1f} s)" in readme
    # the Flower move's two tables, the labels-only pool's before and after
    for name in ("flower-1.41", "flower-1.42", "auto-labels-only-before", "auto-labels-only-after"):
        assert scale_table(json.loads((ROOT / "results" / "scale" / f"simulation-{name}.json").read_text())) in readme
    for version, runs_of_version in (("1.41", ("141-8a", "141-8b")), ("1.42", ("142-8a", "142-8b"))):
        overheads = [  # bench.deployment's printed table: round, round_s, compute_s, overhead_s, ...
            float(cells[3])
            for name in runs_of_version
            for cells in map(str.split, (ROOT / "results" / "scale" / "deployment-flower-ab" / f"{name}.txt").open())
            if len(cells) > 4 and cells[0].isdigit() and int(cells[0]) >= 2
        ]
        quoted = f"{statistics.median(overheads):.2f} s\nunder {version} ({min(overheads):.2f}-{max(overheads):.2f} s"
        assert " ".join(quoted.split()) in " ".join(readme.split()), quoted
    trial = json.loads((ROOT / "results" / "scale" / "simulation-sampled-window4.json").read_text())[0]
    assert f"{min(trial['round_seconds'][1:]):.2f}-{max(trial['round_seconds'][1:]):.2f} s per later round" in readme
    for run, handler, beyond in zip(runs[::2], ("4.9-6.0 s at 100", "10.5-11.4 s at 10,000"), ("30-40", "72-77")):
        sums = run["client_handler_seconds"][1:]
        extra = [1000 * (h - t) / 100 for h, t in zip(sums, run["client_train_seconds"][1:])]  # ms per message
        low, high = handler.split(" s ")[0].split("-")
        assert float(low) <= min(sums) and max(sums) <= float(high) + 0.05 and handler in readme
        assert int(beyond.split("-")[0]) <= min(extra) and max(extra) <= int(beyond.split("-")[1]) + 0.5
        assert f"{beyond} ms" in readme or f"against {beyond} at 100" in readme
    train = [sum(r["client_train_seconds"][1:]) / len(r["client_train_seconds"][1:]) for r in runs]
    quoted = f"{train[0]:.2f} s of the\n  ClientApps' time a round at 100, {train[1]:.2f} s at 1,000 and {train[2]:.2f}"
    assert quoted in readme


def test_the_committed_memory_table_is_what_its_files_give():
    """results/scale/README.md's memory table: each run's peak PSS (GiB) and, where its file has them,
    the actors' and the ServerApp's PSS at the peak (MiB), and the 3.2x, from the committed files."""
    memory = ROOT / "results" / "scale" / "memory"
    readme = (ROOT / "results" / "scale" / "README.md").read_text()
    rows = {
        line.split("| `")[1].split("`")[0]: line
        for line in readme.splitlines()
        if line.startswith("|") and "| `" in line
    }
    load = lambda name: json.loads((memory / name).read_text())  # noqa: E731
    for name in ("htfllib-crosscheck.json", "ours-before-cold-cache-crosscheck.json"):
        assert f"| {load(name)['peak_pss_gib']:.2f} GiB |" in rows[name]
    kinds = load("ours-before-cold-cache-kinds.json")["kinds"]
    row = rows["ours-before-cold-cache-crosscheck.json"]
    assert f"| {kinds['ray::ClientAppActor.run'][1]:,.0f} MiB | {kinds['flwr-simulation'][1]:.0f} MiB |" in row
    names = ("ours-before-warm-cache.json", "ours-after-cold-cache.json", "ours-launcher-in-process.json")
    for name in (*names, "ours-bytecode-cold-cache.json"):
        (run,) = load(name)
        at_peak = run["pss_mib_at_peak"]
        assert (
            f"| {run['peak_pss_gib']:.2f} GiB | {at_peak['ray::ClientAppActor.run'][1]:,.0f} MiB "
            f"| {at_peak['flwr-simulation'][1]:.0f} MiB |" in rows[name]
        )
    ratio = load("ours-after-cold-cache.json")[0]["peak_pss_gib"] / load("htfllib-crosscheck.json")["peak_pss_gib"]
    assert f"Still {ratio:.1f}x HtFLlib's peak" in readme
    (run,) = load("ours-bytecode-cold-cache.json")
    text = " ".join(readme.split())
    assert f"in {sum(run['startup_seconds'].values()):.1f} s (`ours-bytecode-cold-cache.json`" in text
    reference = load("htfllib-crosscheck.json")["peak_pss_gib"]
    ratio = run["peak_pss_gib"] / reference
    assert f"its peak is no lower: {run['peak_pss_gib']:.2f} GiB, {ratio:.1f}x HtFLlib's" in text
    (default,), (one,) = load("ours-2026-12-04-default.json"), load("ours-2026-12-04-cpus-per-client-2.json")
    assert (
        f"| {default['pss_mib_at_peak']['ray::ClientAppActor.run'][1]:,.0f} MiB |"
        in rows["ours-2026-12-04-default.json"]
    )
    actors = one["pss_mib_at_peak"]["ray::ClientAppActor.run"]
    assert actors[0] == 1 and f"| one actor: {actors[1]:,.0f} MiB |" in rows["ours-2026-12-04-cpus-per-client-2.json"]
    for name, run in (("ours-2026-12-04-default.json", default), ("ours-2026-12-04-cpus-per-client-2.json", one)):
        at_peak = run["pss_mib_at_peak"]["flwr-simulation"][1]
        assert f"| {run['peak_pss_gib']:.2f} GiB |" in rows[name] and f"| {at_peak:.0f} MiB |" in rows[name]
    assert (
        f"by default {default['peak_pss_gib']:.2f} GiB ({default['peak_pss_gib'] / reference:.1f}x HtFLlib's), "
        f"and with one ClientApp of 2 threads {one['peak_pss_gib']:.2f} GiB ({one['peak_pss_gib'] / reference:.1f}x)"
    ) in text
    assert f"({one['round_seconds'][1]:.2f} s against {default['round_seconds'][1]:.2f} s for round 2" in text


def paired_speed(
    folder: str, text: str, methods: tuple[str, ...] = ("local", "fedproto", "fedtgp")
) -> tuple[dict, dict, dict, list, dict]:
    """Check a speed table of results/scale/README.md (``text``, whitespace joined) against the paired
    cross-check ``results/crosscheck/<folder>/``: each method's wall and CPU seconds over its seeds
    (``ours.json``, ``reference-seed-<s>.json``) and ours in and outside rounds (``elapsed_seconds``
    of round 20). Returns per method ours' seconds a round, ours' seconds outside rounds, HtFLlib's
    mean seconds an iteration (methods that print them), HtFLlib's seconds outside its iterations
    and (wall, CPU) ratios. ``methods``: the table's rows."""
    base = ROOT / "results" / "crosscheck" / folder
    per_round, outside, iteration, fixed, ratios = {}, {}, {}, [], {}
    for method in methods:
        ours = [json.loads((base / method / f"seed-{s}" / "ours.json").read_text()) for s in range(3)]
        ref = [json.loads((base / method / f"reference-seed-{s}.json").read_text()) for s in range(3)]
        rows = [(base / method / f"seed-{s}" / "metrics.jsonl").read_text().splitlines() for s in range(3)]
        inside = [json.loads(r[-1])["elapsed_seconds"] for r in rows]
        wall, ref_wall = sum(o["wall_seconds"] for o in ours), sum(r["wall_seconds"] for r in ref)
        cpu, ref_cpu = sum(o["cpu_seconds"] for o in ours), sum(r["cpu_seconds"] for r in ref)
        row = f"| {method} | {wall:.0f} / {ref_wall:.0f} | {wall / ref_wall:.2f}x | {cpu:.0f} / {ref_cpu:.0f} |"
        assert f"{row} {sum(inside):.0f} s | {wall - sum(inside):.0f} s |" in text
        per_round[method] = [x / 20 for x in inside]
        outside[method] = [o["wall_seconds"] - x for o, x in zip(ours, inside)]
        ratios[method] = (wall / ref_wall, cpu / ref_cpu)
        if ref[0]["iteration_seconds"]:
            iteration[method] = [sum(r["iteration_seconds"]) / len(r["iteration_seconds"]) for r in ref]
            fixed += [r["wall_seconds"] - sum(r["iteration_seconds"]) for r in ref]
    return per_round, outside, iteration, fixed, ratios


def span(xs, decimals):
    return f"{min(xs):.{decimals}f}-{max(xs):.{decimals}f}"


def test_the_speed_against_htfllib_is_what_the_paired_rows_give():
    """results/scale/README.md's speed section: the tables and the ranges and ratios its text quotes,
    for Fashion-MNIST and for CIFAR-10 (each checked in its own part of the section)."""
    readme = (ROOT / "results" / "scale" / "README.md").read_text()
    fmnist, cifar = readme.split("## Speed against HtFLlib at small work")[1].split("### CIFAR-10 `htfe2`")
    text = " ".join(fmnist.split())
    per_round, outside, iteration, fixed, ratios = paired_speed("fedtgp-fmnist-htcnn8-paired", text)
    assert f"{span(per_round['local'], 2)} s a round for Local" in text
    assert f"{span(per_round['fedproto'], 2)} s for FedProto and {span(per_round['fedtgp'], 2)} s for FedTGP" in text
    assert f"{span(iteration['fedproto'], 1)} s an iteration for FedProto and {span(iteration['fedtgp'], 1)} s" in text
    cold, *warm = outside["local"]
    assert f"ours pays {span(warm + outside['fedproto'] + outside['fedtgp'], 0)} s a run ({cold:.0f} s" in text
    assert f"process {span(fixed, 0)} s" in text
    assert f"{ratios['local'][0]:.2f}x and {ratios['fedproto'][0]:.2f}x HtFLlib's wall time" in text
    assert f"The CPU is {span([c for _, c in ratios.values()], 1)}x HtFLlib's" in text

    text = " ".join(cifar.split())
    per_round, outside, iteration, fixed, ratios = paired_speed("fedtgp-cifar10-htfe2-paired", text)
    assert all(wall < 1 for wall, _ in ratios.values()) and "below HtFLlib's wall time on all three" in text
    assert f"{span(per_round['local'], 2)} s a round for Local" in text
    assert f"{span(per_round['fedproto'], 2)} s for FedProto and {span(per_round['fedtgp'], 2)} s for FedTGP" in text
    assert f"{span(iteration['fedproto'], 1)} s an iteration for FedProto and {span(iteration['fedtgp'], 1)} s" in text
    assert (
        f"ours pays {span([x for xs in outside.values() for x in xs], 0)} s a run and HtFLlib {span(fixed, 0)} s"
        in text
    )
    assert f"The CPU is {span([c for _, c in ratios.values()], 1)}x HtFLlib's" in text


def test_the_speed_after_the_launcher_cut_is_what_its_paired_rows_give():
    """results/scale/README.md's section on the launcher's fixed cost: its table, the range of ours
    outside the rounds, HtFLlib's outside its iterations and the ratios it quotes, from the committed
    paired cross-check it names."""
    readme = (ROOT / "results" / "scale" / "README.md").read_text()
    text = " ".join(readme.split("## The launcher's fixed cost, cut")[1].split("\n## ")[0].split())
    _, outside, _, fixed, ratios = paired_speed("fedtgp-fmnist-htcnn8-paired-launcher", text)
    first, *rest = outside["local"]
    assert f"ours now pays {span(rest + outside['fedproto'] + outside['fedtgp'], 0)} s a run ({first:.0f} s" in text
    assert f"HtFLlib {span(fixed, 0)} s outside its printed iterations" in text
    assert f"from 1.27x to {ratios['local'][0]:.2f}x and FedProto from 1.30x to {ratios['fedproto'][0]:.2f}x" in text
    assert f"{ratios['fedtgp'][0]:.2f}x" in text and ratios["fedtgp"][0] <= 1.005  # "level"


def test_the_launch_start_section_is_what_its_rows_and_launches_give():
    """results/scale/README.md's second section on the launch's start: both paired tables (before: Local
    and FedProto), the ranges and ratios its text quotes, and the alternating launches' means."""
    import statistics

    readme = (ROOT / "results" / "scale" / "README.md").read_text()
    text = " ".join(readme.split("## The launch's start, cut again")[1].split("\n## ")[0].split())
    text = text.replace("| before: method |", "| method |").replace("| after: method |", "| method |")
    _, before, _, _, _ = paired_speed("fedtgp-fmnist-htcnn8-paired-start-before", text, ("local", "fedproto"))
    per_round, after, iteration, fixed, ratios = paired_speed("fedtgp-fmnist-htcnn8-paired-start", text)
    before, after = [x for v in before.values() for x in v], [x for v in after.values() for x in v]
    assert f"went from {span(before, 1)} s a run to {span(after, 1)} s" in text
    assert f"pays {span(after, 0)} s outside them against HtFLlib's {span(fixed, 0)} s" in text
    met = f"met for FedTGP ({ratios['fedtgp'][0]:.2f}x) but not for Local ({ratios['local'][0]:.2f}x) and FedProto"
    assert met in text and f"({ratios['fedproto'][0]:.2f}x)" in text
    assert f"({span(per_round['local'], 2)} s a round for Local, {span(per_round['fedproto'], 2)} s" in text
    assert f"printed {span(iteration['fedproto'], 2)} s and {span(iteration['fedtgp'], 2)} s an" in text
    launches = json.loads((ROOT / "results" / "scale" / "launch-start-ab.json").read_text())["launches"]
    for side, said in (("before", "s a launch before"), ("after", "s after,")):
        wall = [x["wall_seconds"] for x in launches if x["side"] == side]
        out = [x["wall_seconds"] - x["in_rounds_seconds"] for x in launches if x["side"] == side]
        assert f"{statistics.mean(wall):.1f} ± {statistics.pstdev(wall):.1f} {said}" in text
        assert f"{statistics.mean(out):.1f} ± {statistics.pstdev(out):.1f} s {side}" in text
    launches = json.loads((ROOT / "results" / "scale" / "restore-assign-ab.json").read_text())["launches"]

    def spread(side: str, key: str) -> str:
        xs = [x[key] for x in launches if x["side"] == side]
        return f"{statistics.mean(xs):.1f} ± {statistics.pstdev(xs):.1f} s"

    said = (
        f"{spread('before', 'in_rounds_seconds')} in the rounds before and {spread('after', 'in_rounds_seconds')} after"
    )
    assert f"{said}, {spread('before', 'wall_seconds')} and {spread('after', 'wall_seconds')} a launch" in text


def gpu_throughput_table(base: Path, text: str) -> list[float]:
    """Check a GPU check README's throughput table (``text``, whitespace joined) against the
    ``throughput.json`` in ``base``: one row per architecture, ours / plain images per second and
    their ratio per batch size. Returns the ratios."""
    speed, ratios = {}, []
    for entry in json.loads((base / "throughput.json").read_text()):
        ours, plain = entry["images_per_second"]["ours"], entry["images_per_second"]["plain"]
        speed.setdefault(entry["arch"], []).append(f"{ours:.0f} / {plain:.0f} ({ours / plain:.2f})")
        ratios.append(ours / plain)
    for arch, cells in speed.items():
        assert f"| {arch} | {' | '.join(cells)} |" in text
    return ratios


def listed(xs, scale=1):
    """Seconds or fractions (times ``scale``) as a README lists them: ``1.23, 4.56``."""
    return ", ".join(f"{scale * x:.2f}" for x in xs)


def test_the_gpu_check_numbers_are_what_its_files_give():
    """results/scale/gpu-h200/README.md: the throughput table and the FedTGP table regenerate from the
    committed files of the H200 check."""
    base = ROOT / "results" / "scale" / "gpu-h200"
    text = " ".join((base / "README.md").read_text().split())
    ratios = gpu_throughput_table(base, text)
    assert f"{min(ratios):.2f}-{max(ratios):.2f}x of the plain loop" in text

    ours = json.loads((base / "gpu_check-call2.json").read_text())["simulation-gpus-0.25"]["result"]
    ref = json.loads((base / "htfllib-fedtgp-seed-0.json").read_text())
    ref_gpu = json.loads((base / "gpu_check-call1.json").read_text())["htfllib"]["result"]["gpu_peak_mib"]
    rows = [json.loads(line) for line in (base / "ours-fedtgp-gpus-0.25-metrics.jsonl").read_text().splitlines()]

    assert f"| {listed(ours['round_seconds'])} | {listed(ref['iteration_seconds'])} (its 4 iterations) |" in text
    start = ours["startup_seconds"]
    to_round_1 = f"to round 1: {sum(start.values()):.1f}, of which the launcher {start['launcher']:.1f}"
    assert f"| {ours['wall_seconds']:.1f} ({to_round_1}) | {ref['wall_seconds']:.1f} |" in text
    assert f"| {listed([r['accuracy_weighted'] for r in rows], 100)} % | {listed(ref['curve'], 100)} % |" in text
    assert f"| {ours['gpu_peak_mib']} MiB | {ref_gpu} MiB |" in text
    peaks = [c["peak_mib"] for r in rows for c in r["gpu_per_client"].values()]
    assert f"| {min(peaks):.0f}-{max(peaks):.0f} MiB |" in text
    processes = ours["pss_mib_at_peak"]["python"][0]
    assert f"| {ours['peak_pss_gib']:.2f} GiB ({processes} Python processes) | {ref['peak_pss_gib']:.2f} GiB |" in text
    mine, theirs = statistics.mean(ours["round_seconds"][1:]), statistics.mean(ref["iteration_seconds"][1:3])
    assert f"costs {mine / theirs:.2f}x an iteration of HtFLlib's ({mine:.2f} s against {theirs:.2f} s" in text
    assert f"memory, {ours['peak_pss_gib'] / ref['peak_pss_gib']:.1f}x HtFLlib's, is that of {processes}" in text
    running = " ".join((ROOT / "docs" / "running.md").read_text().split())
    seconds, iterations = ours["round_seconds"], ref["iteration_seconds"]
    assert (
        f"at {min(seconds):.1f}-{max(seconds):.1f} s a round against {min(iterations):.1f}-{max(iterations):.1f} s"
        in running
    )
    assert f"({100 * rows[-1]['accuracy_weighted']:.2f} against {100 * ref['curve'][-1]:.2f} %" in running
    assert f"{min(peaks):.0f}-{max(peaks):.0f} MiB of CUDA allocator per client ({ours['gpu_peak_mib']} MiB" in running
    assert (
        f"was {ours['wall_seconds']:.1f} s against {ref['wall_seconds']:.1f} s, of which {sum(start.values()):.1f} s"
        in running
    )
    assert f"at {min(ratios):.2f}-{max(ratios):.2f}x of a plain PyTorch loop" in running


def test_the_second_gpu_check_numbers_are_what_its_files_give():
    """results/scale/gpu-h200/2026-12-04/README.md: the throughput table, the table of both GPU shares
    against HtFLlib and the ratios quoted under it regenerate from that run's files."""
    base = ROOT / "results" / "scale" / "gpu-h200" / "2026-12-04"
    text = " ".join((base / "README.md").read_text().split())
    ratios = gpu_throughput_table(base, text)
    assert f"Ours runs at {min(ratios):.2f}-{max(ratios):.2f}x of the plain loop" in text

    report = json.loads((base / "gpu_check.json").read_text())
    ref = json.loads((base / "htfllib-fedtgp-seed-0.json").read_text())
    ref_gpu = json.loads((base / "gpu_check-htfllib.json").read_text())["htfllib"]["result"]["gpu_peak_mib"]
    shares = ("0.25", "0.5")
    ours = {g: report[f"simulation-gpus-{g}"]["result"] for g in shares}
    rows = {
        g: [json.loads(line) for line in (base / f"ours-fedtgp-gpus-{g}-metrics.jsonl").read_text().splitlines()]
        for g in shares
    }

    def cells(values):
        return " | ".join(values)

    iterations = f"{listed(ref['iteration_seconds'])} (its 4 iterations)"
    assert f"| seconds per round | {cells(listed(ours[g]['round_seconds']) for g in shares)} | {iterations} |" in text
    walls = [
        f"{o['wall_seconds']:.1f} (to round 1: {sum(o['startup_seconds'].values()):.1f}, "
        f"of which the launcher {o['startup_seconds']['launcher']:.1f})"
        for o in ours.values()
    ]
    assert f"| wall seconds | {cells(walls)} | {ref['wall_seconds']:.1f} |" in text
    accuracy = [f"{listed([r['accuracy_weighted'] for r in rows[g]], 100)} %" for g in shares]
    assert f"| {cells(accuracy)} | {listed(ref['curve'], 100)} % |" in text
    gpu_in_use = [f"{ours[g]['gpu_peak_mib']} MiB" for g in shares]
    assert f"| {cells(gpu_in_use)} | {ref_gpu} MiB |" in text
    peaks = [[c["peak_mib"] for r in rows[g] for c in r["gpu_per_client"].values()] for g in shares]
    assert f"| {cells(f'{min(p):.0f}-{max(p):.0f} MiB' for p in peaks)} | - |" in text
    pss = [f"{ours[g]['peak_pss_gib']:.2f} GiB" for g in shares]
    assert f"| {cells(pss)} | {ref['peak_pss_gib']:.2f} GiB |" in text
    theirs = statistics.mean(ref["iteration_seconds"][1:3])
    mine = {g: statistics.mean(ours[g]["round_seconds"][1:]) for g in shares}
    for g, said in (("0.25", "an iteration of HtFLlib's (the mean of its iterations 1-2) with"), ("0.5", "with")):
        assert f"{mine[g] / theirs:.2f}x {said} the {g} share ({mine[g]:.2f} s against {theirs:.2f} s)" in text
    assert f"made a round {mine['0.5'] / mine['0.25']:.2f}x longer" in text
    log = (base / "gpu_check.log").read_text()
    images = re.findall(r"fedavgcnn ([\d.]+), resnet18 ([\d.]+)", log)
    (cnn_25, resnet_25), (cnn_5, resnet_5) = [(float(a), float(b)) for a, b in images]
    assert (
        f"(FedAvgCNN {cnn_5:.0f} against {cnn_25:.0f} images/s, ResNet-18 {resnet_5:.0f} against {resnet_25:.0f}"
        in text
    )
    actors = ours["0.5"]["pss_mib_at_peak"]["ray::ClientAppActor.run"]
    assert f"the two training actors held {actors[1]:.0f} MiB of the {ours['0.5']['peak_pss_gib']:.2f} GiB" in text
    iteration_range = f"{min(ref['iteration_seconds']):.1f}-{max(ref['iteration_seconds']):.1f} s here"
    assert f"HtFLlib's iterations took {iteration_range}" in text
    first = json.loads((base.parent / "gpu_check-call2.json").read_text())["simulation-gpus-0.25"]["result"]
    first_ref = json.loads((base.parent / "htfllib-fedtgp-seed-0.json").read_text())["iteration_seconds"]
    there = statistics.mean(first["round_seconds"][1:]) / statistics.mean(first_ref[1:3])
    assert f"({mine['0.25'] / theirs:.2f}x here, {there:.2f}x there)" in text
    assert f"against {min(first_ref):.1f}-{max(first_ref):.1f} s there" in text
    ours_then, theirs_then = statistics.mean(first["round_seconds"][1:]), statistics.mean(first_ref[1:3])
    assert f"took {mine['0.25']:.2f} s against {ours_then:.2f} s there ({mine['0.25'] / ours_then:.2f}x)" in text
    assert f"{theirs:.2f} s against {theirs_then:.2f} s ({theirs / theirs_then:.2f}x)" in text
    running = " ".join((ROOT / "docs" / "running.md").read_text().split())
    final = [f"{100 * rows[g][-1]['accuracy_weighted']:.2f}" for g in shares]
    gpu = [ours[g]["gpu_peak_mib"] for g in shares]
    memory = [f"{ours[g]['peak_pss_gib']:.2f}" for g in shares]
    assert (
        f"took {mine['0.25']:.2f} s with `--gpus-per-client 0.25` (4 ClientApps on the GPU) and {mine['0.5']:.2f} s "
        f"with 0.5 (2 ClientApps), against {theirs:.2f} s for an iteration of HtFLlib's FedTGP on that machine "
        f"({mine['0.25'] / theirs:.2f}x and {mine['0.5'] / theirs:.2f}x), at {final[0]} and {final[1]} % pooled "
        f"accuracy after round 3 against {100 * ref['curve'][-1]:.2f} %; {gpu[0]} and {gpu[1]} MiB of GPU "
        f"memory in use against HtFLlib's {ref_gpu} MiB, and {memory[0]} and {memory[1]} GiB of process memory "
        f"against {ref['peak_pss_gib']:.2f} GiB" in running
    )
    assert f"round {mine['0.5'] / mine['0.25']:.2f}x longer with half of them" in running
    assert (
        f"{theirs / theirs_then:.2f}x as long as on the first machine and ours {mine['0.25'] / ours_then:.2f}x"
        in running
    )


def test_htfllib_one_float_step_off_parts_as_far_as_its_readme_says():
    """results/crosscheck/fedtgp-cifar10-htfe2-paired/fedproto/htfllib-one-ulp/README.md: the largest gap
    of HtFLlib one step off against HtFLlib, and of ours against HtFLlib, per seed, from the rows."""
    base = ROOT / "results" / "crosscheck" / "fedtgp-cifar10-htfe2-paired" / "fedproto"
    text = (base / "htfllib-one-ulp" / "README.md").read_text()
    summary = " ".join((ROOT / "results" / "README.md").read_text().split())

    def largest(curve, against):
        gaps = [100 * (a - b) for a, b in zip(curve, against)]
        at = max(range(len(gaps)), key=lambda k: abs(gaps[k]))
        return f"{gaps[at]:+.2f}".replace("-", "−") + f" points (round {at + 1})"

    for seed in (0, 1):
        reference = json.loads((base / f"reference-seed-{seed}.json").read_text())
        off = json.loads((base / "htfllib-one-ulp" / f"reference-seed-{seed}.json").read_text())
        assert off["content_digest"] == reference["content_digest"]
        assert off["initial_digest"] == reference["initial_digest"]
        rows = (base / f"seed-{seed}" / "metrics.jsonl").read_text().splitlines()
        ours = [json.loads(row)["accuracy_weighted"] for row in rows]
        assert (
            f"| {seed} |" in text
            and f"| {largest(off['curve'], reference['curve'])} | {largest(ours, reference['curve'])} |" in text
        )
    quoted = largest(off["curve"], reference["curve"]).replace(" points (round", " points, seed 1, round")
    assert f"({quoted.rstrip(')')};" in summary


def test_lg_fedavg_paired_with_and_without_the_server_head_is_what_its_pages_say():
    """results/crosscheck/fedtgp-fmnist-htcnn8-paired/lg-fedavg: with the server's head paired, every round
    but one within HtFLlib's printed decimals and that one one test image apart; with the head each
    side's own draw (``server-head-unpaired/``), the largest paired gap and HtFLlib's final as
    docs/methods/lg-fedavg.md and that folder's README quote them, from the rows."""
    from bench.crosscheck_report import PRINTED_HALF_STEP, compare, verdict

    base = ROOT / "results" / "crosscheck" / "fedtgp-fmnist-htcnn8-paired" / "lg-fedavg"
    page = " ".join((ROOT / "docs" / "methods" / "lg-fedavg.md").read_text().split())
    readme = " ".join((base / "server-head-unpaired" / "README.md").read_text().split())
    tests = sum(json.loads((base.parent / "partitions-config.json").read_text())["test_examples"])
    ours = [json.loads((base / f"seed-{s}" / "ours.json").read_text())["curve"] for s in range(3)]
    paired, unpaired = (
        [json.loads((folder / f"reference-seed-{s}.json").read_text())["curve"] for s in range(3)]
        for folder in (base, base / "server-head-unpaired")
    )
    gaps = [a - b for o, r in zip(ours, paired) for a, b in zip(o, r)]
    apart = [g for g in gaps if abs(g) > PRINTED_HALF_STEP]
    assert len(apart) == 1 and abs(abs(apart[0]) - 1 / tests) <= PRINTED_HALF_STEP  # one test image
    assert (
        f"{len(gaps) - 1} of the {len(gaps)} rounds" in page and f"{len(gaps) - 1} of the {len(gaps)} rounds" in readme
    )
    gap = verdict(ours, unpaired)
    assert (gap["seed_index"], gap["round"]) == (1, 1)
    assert f"{100 * gap['largest_paired_gap']:.2f}".replace("-", "−") + " points" in page
    final = compare(ours, unpaired)["reference"]
    quoted = f"{100 * final['final_mean']:.2f} ± {100 * final['final_std']:.2f} %"
    assert quoted in page and quoted in readme


def test_the_in_process_bench_reports_each_federation_size_and_only_new_clients_are_asked(tmp_path, capsys):
    """``bench.inprocess``: one run per N over the in-process grid, K clients a round, the rows' seconds
    per round; with handshake ``sampled`` a round at N = K meets only known clients after round 1, one at
    N = 3K mostly new ones (each answers the handshake in its train reply)."""
    from bench import inprocess

    out = tmp_path / "runs.json"
    config = (
        f"data-dir='{DATA_DIR}' output-dir='{tmp_path}' dataset='mnist' model-group='cnn1' handshake='sampled' "
        "eval-clients='trained' max-examples-per-client=20 num-server-rounds=2 batch-size=16"
    )
    assert inprocess.main(["-c", config, "--clients", "4,12", "--per-round", "4", "--out", str(out)]) == 0
    runs = json.loads(out.read_text())
    assert [(r["num_clients"], r["per_round"]) for r in runs] == [(4, 4), (12, 4)]
    for run in runs:
        assert run["command"].startswith("python -m bench.inprocess -c") and run["cpus"] == os.cpu_count()
        assert all(len(run[key]) == 2 for key in inprocess.KEYS)
        assert all(h >= t > 0 for h, t in zip(run["client_handler_seconds"], run["client_train_seconds"]))
    table = inprocess.table(runs)
    assert table in capsys.readouterr().out and len(table.splitlines()) == 4 and "| 1.00x |" in table
    # N = K: round 2 meets the clients of round 1, loaded and known; N = 3K: its clients decode their partitions
    assert runs[0]["client_data_seconds"][1] == 0.0 < runs[0]["client_data_seconds"][0]


def test_the_query_in_train_section_is_what_its_rows_give():
    """results/scale/README.md's section on the query in the train message: its four tables from the
    committed rows (``bench.simulation`` and ``bench.inprocess``), and the seconds it quotes."""
    from bench.inprocess import table
    from bench.simulation import scale_table

    scale = ROOT / "results" / "scale"
    readme = (scale / "README.md").read_text()
    load = lambda name: json.loads((scale / name).read_text())  # noqa: E731
    assert scale_table(load("simulation-sampled-fold.json")) in readme
    steps = load("simulation-10k-steps.json")
    assert scale_table(steps) in readme
    for name in ("inprocess-sampled.json", "inprocess-sampled-warm.json"):
        assert table(load(name)) in readme
    for run in steps[2:]:
        later = run["round_seconds"][1:]
        assert f"{min(later):.2f}-{max(later):.2f} s" in readme
    fold, cold = load("simulation-sampled-fold.json")[-1], load("inprocess-sampled.json")[-1]
    train = fold["client_train_seconds"][1:]
    cold_train = cold["client_train_seconds"][1:]
    quoted = f"{sum(cold_train) / len(cold_train):.2f} s of the ClientApps' time a round at"
    assert quoted.replace(" ", "") in readme.replace("\n", "").replace(" ", "")
    assert f"{min(train):.2f}-{max(train):.2f} s in the simulation" in readme
    profile = load("engine-profile-10k.json")
    share = {k: round(100 * v / profile["samples"]) for k, v in profile["samples_in"].items()}
    text = " ".join(readme.split())
    assert f"`_check_stored_messages`) in {share['add_messages_to_queue']} % of the process's samples" in text
    assert f"the ServerApp in {share['HeteroStrategy.start']} %" in text


def test_the_paired_check_with_the_restore_is_what_its_rows_give():
    """results/scale/README.md's last paired Fashion-MNIST section: its table, ratios and quoted ranges."""
    readme = (ROOT / "results" / "scale" / "README.md").read_text()
    text = " ".join(
        readme.split("## The paired Fashion-MNIST check again, with the restore")[1].split("\n## ")[0].split()
    )
    per_round, outside, iteration, fixed, ratios = paired_speed(
        "fedtgp-fmnist-htcnn8-paired-restore", text, ("local", "fedproto")
    )
    assert f"Local {ratios['local'][0]:.2f}x and FedProto {ratios['fedproto'][0]:.2f}x HtFLlib's wall time" in text
    assert f"({span(per_round['fedproto'], 2)} s a round for FedProto against" in text
    assert f"printed {span(iteration['fedproto'], 2)} s an iteration" in text
    assert f"ours pays {span([x for xs in outside.values() for x in xs], 0)} s a run" in text
    assert f"against HtFLlib's {span(fixed, 0)} s" in text
    finals = {}
    for folder in ("fedtgp-fmnist-htcnn8-paired-restore", "fedtgp-fmnist-htcnn8-paired-start"):
        report = (ROOT / "results" / "crosscheck" / folder / "report.md").read_text()
        finals[folder] = next(line for line in report.splitlines() if line.startswith("| local |")).split(" | ")[2:4]
    ours, theirs = finals["fedtgp-fmnist-htcnn8-paired-start"]
    assert finals["fedtgp-fmnist-htcnn8-paired-restore"] == ["88.77 ± 0.08"] * 2 and "88.77 ± 0.08 % here" in text
    assert f"against {ours.split()[0]} / {theirs.split()[0]} on the other machine" in text


def test_the_bytecode_section_is_what_its_rows_give():
    """results/scale/README.md's section on the bytecode at install: the table of ``bench.bytecode``'s
    launches, the seconds it quotes, every launch at the same accuracy, and the profile's shares."""
    from bench.bytecode import table

    scale = ROOT / "results" / "scale"
    text = (scale / "README.md").read_text().split("## Bytecode at install")[1].split("\n## ")[0]
    record = json.loads((scale / "bytecode-launch.json").read_text())
    assert table(record) in text
    sides = {side: [r for r in record["launches"] if r["side"] == side] for side in ("source", "bytecode")}
    outside = {k: sum(r["outside_rounds_seconds"] for r in v) / len(v) for k, v in sides.items()}
    flat = " ".join(text.split())
    assert f"pays {outside['bytecode']:.1f} s outside the rounds instead of {outside['source']:.1f} s, half" in flat
    assert 0.4 < outside["bytecode"] / outside["source"] < 0.6
    assert len({r["final_accuracy_mean"] for r in record["launches"]}) == 1 and len(record["launches"]) == 6
    samples = json.loads((scale / "launch-profile-bytecode.json").read_text())["samples"]

    def share(side: str, prefix: str = "") -> str:
        kinds = [v for k, v in samples[side].items() if k.startswith(prefix)]
        return f"{100 * sum(v['compiling'] for v in kinds) / sum(v['samples'] for v in kinds):.0f} %"

    assert f"on the stack in {share('source')} of the samples, {share('source', 'ClientApp')} of the ClientApp" in flat
    assert f"{share('source', 'Ray')} of Ray's five Python agents' and {share('source', 'flwr')} of" in flat
    bytecode = samples["bytecode"].values()
    assert f"{100 * sum(v['compiling'] for v in bytecode) / sum(v['samples'] for v in bytecode):.1f} %." in flat


def at_or_below_htfllib(text: str, folder: str) -> None:
    """Check a paired speed section of results/scale/README.md (``text``, whitespace joined) whose
    claim is ours at or below HtFLlib's wall time on Local, FedProto and FedTGP: its table
    (:func:`paired_speed`), the quoted ratios, and the ranges of seconds and CPU it quotes."""
    per_round, outside, iteration, fixed, ratios = paired_speed(folder, text)
    assert all(wall <= 1 for wall, _ in ratios.values())
    quoted = ", ".join(f"{m} {ratios[m.lower()][0]:.2f}x" for m in ("Local", "FedProto", "FedTGP"))
    assert f"({quoted})" in text
    assert f"{span(per_round['fedproto'], 2)} s a round for FedProto and {span(per_round['fedtgp'], 2)} s" in text
    assert f"printed {span(iteration['fedproto'], 1)} s and {span(iteration['fedtgp'], 1)} s an iteration" in text
    assert f"ours pays {span([x for xs in outside.values() for x in xs], 0)} s a run" in text
    assert f"against HtFLlib's {span(fixed, 0)} s" in text
    assert f"The CPU is {span([c for _, c in ratios.values()], 2)}x HtFLlib's" in text


def test_the_paired_check_with_the_bytecode_is_what_its_rows_give():
    """results/scale/README.md's paired Fashion-MNIST check with the bytecode: its table, the ratios, ours
    at or below HtFLlib's wall time on all three, and the ranges it quotes."""
    readme = (ROOT / "results" / "scale" / "README.md").read_text()
    text = " ".join(readme.split("### The paired Fashion-MNIST check with the bytecode")[1].split("\n## ")[0].split())
    at_or_below_htfllib(text, "fedtgp-fmnist-htcnn8-paired-bytecode")


@pytest.mark.parametrize("dataset, folder", [("Fashion-MNIST", "fmnist-htcnn8"), ("CIFAR-10", "cifar10-htfe2")])
def test_the_paired_check_at_niceness_0_is_what_its_rows_give(dataset, folder):
    """results/scale/README.md's paired check at the ClientApps' new priority, on each dataset: its
    table, ours at or below HtFLlib's wall time on all three, and the ranges it quotes."""
    readme = (ROOT / "results" / "scale" / "README.md").read_text()
    section = f"### The paired {dataset} check at the ClientApps' new priority"
    text = " ".join(readme.split(section)[1].split("\n#")[0].split())
    folder = f"fedtgp-{folder}-paired-nice0"
    at_or_below_htfllib(text, folder)
    report = (ROOT / "results" / "crosscheck" / folder / "report.md").read_text()
    verdicts = {line.split(" | ")[0][2:]: line.split(" | ")[1] for line in report.splitlines() if line.startswith("| ")}
    assert verdicts["local"] == "identical" and verdicts["fedproto"].startswith("within seed spread")


def test_the_three_sizes_on_another_machine_are_what_their_rows_give():
    """results/scale/README.md, "The three sizes on another machine": both tables, the 2.20x, the
    engine trial, the handler seconds and the profile's entries, from the committed JSONs."""
    from bench.simulation import scale_table

    scale = ROOT / "results" / "scale"
    text = " ".join((scale / "README.md").read_text().split())
    runs = {k: json.loads((scale / f"simulation-2026-12-04-{k}.json").read_text()) for k in "ab"}
    for rows in runs.values():
        for line in scale_table(rows).splitlines()[2:]:
            assert " ".join(line.split()) in text
    mean = {k: [statistics.mean(r["round_seconds"][1:]) for r in rows] for k, rows in runs.items()}
    assert {f"{m[2] / m[0]:.2f}" for m in mean.values()} == {"2.20"}
    assert "costs 2.20x the same round at 100 in both repetitions" in text
    before = json.loads((scale / "simulation-niceness-0.json").read_text())
    there = [statistics.mean(r["round_seconds"][1:]) for r in before]
    assert f"({there[2] / there[0]:.2f}x there)" in text
    shares = [m / t for ms in mean.values() for m, t in zip(ms, there)]
    assert f"took {min(shares):.2f}-{max(shares):.2f}x of the same N's in the niceness table" in text
    (trial,) = json.loads((scale / "simulation-2026-12-04-engine-nice10.json").read_text())
    later = trial["round_seconds"][1:]
    said = f"{statistics.mean(later):.2f} s ({min(later):.2f}-{max(later):.2f}) against {mean['a'][2]:.2f} s"
    assert said in text
    handler = [statistics.mean(r["client_handler_seconds"][1:]) for r in runs["a"]]
    assert f"{handler[2]:.2f} s a round at 10,000 against {handler[0]:.2f} s at 100" in text
    profile = {
        r["entry"].strip(): r for r in json.loads((scale / "inprocess-profile-2026-12-04.json").read_text())["rows"]
    }

    def at(entry):
        row = profile[entry]
        return f"{row['seconds_10000']:.2f} s against {row['seconds_100']:.2f} s"

    assert f"model build took {at('model build (common/runtime.py build)')}" in text
    assert f"`uniform_` ({at('of it torch uniform_ (initialisation)')})" in text
    save = profile["state save (common/runtime.py save_model)"]
    assert (
        f"state save took {at('state save (common/runtime.py save_model)')} for the same {save['calls_100']} saves"
        in text
    )
    select = profile["of it datasets Dataset.select"]
    per = 1000 * select["seconds_10000"] / select["calls_10000"]
    assert f"took {per:.1f} ms a partition ({select['seconds_10000']:.2f} s for {select['calls_10000']})" in text
    new_clients = f"({select['calls_100']} new clients, all in round 1) against 10,000 ({select['calls_10000']} new)"
    assert f"at 100 clients {new_clients}" in text


def test_the_niceness_table_is_what_its_rows_give():
    """results/scale/README.md's niceness table: each N's later rounds (mean and range) and their ratio
    to N = 100 under both settings, and the quoted gain at 10,000 clients, from the two JSONs."""
    scale = ROOT / "results" / "scale"
    text = " ".join((scale / "README.md").read_text().split())
    runs = [json.loads((scale / f"simulation-niceness-{n}.json").read_text()) for n in (0, 15)]
    means = [[statistics.mean(r["round_seconds"][1:]) for r in rows] for rows in runs]
    for i, n in enumerate((100, 1000, 10000)):
        cells = []
        for rows, mean in zip(runs, means):
            later = rows[i]["round_seconds"][1:]
            assert f"num-clients={n} " in rows[i]["command"]
            cells.append(f"{mean[i]:.2f} s ({min(later):.2f}-{max(later):.2f}) | {mean[i] / mean[0]:.2f}x")
        assert f"| {n:,} | {cells[0]} | {cells[1]} |" in text
    assert f"{round(100 * (1 - means[0][2] / means[1][2]))} % faster" in text


@pytest.mark.parametrize("broken", ["handshake", "config"])
def test_a_config_error_ends_the_serverapp_with_one_line_and_a_failed_summary(run_config, broken):
    """A ConfigError the ServerApp raised (here a partition too small to split, met at the handshake, or a
    run config it cannot read) reached Flower, which printed the ServerApp's traceback and 'Exit Code'."""
    import logging

    from flwr.app import Context, RecordDict

    from conftest import federation
    from server_app import app

    rc = run_config(**{"num-clients": 2, "max-examples-per-client": 1})
    _, grid = federation(rc)
    if broken == "config":
        rc = {**rc, "min-clients": 3}
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("flwr").addHandler(handler)
    try:
        context = Context(run_id=5, node_id=0, node_config={}, state=RecordDict(), run_config=rc)
        app.main(grid, context)  # returns: Flower gets no exception to print
    finally:
        logging.getLogger("flwr").removeHandler(handler)
    errors = [r for r in records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info is None and "\n" not in errors[0].getMessage()
    message = errors[0].getMessage()
    summaries = list(Path(rc["output-dir"]).glob("*/summary.json"))
    if broken == "config":
        assert "'min-clients' = 3" in message and not summaries  # before the run folder
    else:
        assert "too few for a train and a test set" in message
        (summary,) = [json.loads(s.read_text()) for s in summaries]
        assert summary["status"] == "failed" and "too few for a train and a test set" in summary["error"]


def test_bench_deployment_reports_each_late_partition_where_it_was_first_served():
    from bench.deployment import late_lines

    rows = [
        {"round": 1, "elapsed_seconds": 10.0, "accuracy_per_client": {"0": 0.5, "1": 0.5}},
        {"round": 2, "elapsed_seconds": 30.0, "accuracy_per_client": {"0": 0.6, "1": 0.6, "2": 0.4}},
        {
            "round": 3,
            "elapsed_seconds": 50.0,
            "accuracy_per_client": {"0": 0.7, "1": 0.7, "2": 0.5},
            "heldout_partitions": [3],
            "heldout_bytes_down": 1234,
        },
    ]
    assert late_lines(rows, {2: 12.0, 3: 12.5, 4: 13.0}) == [
        "late partition 2: started 12.0 s into the run, first served in round 2 (training), 18.0 s after its start",
        "late partition 3: started 12.5 s into the run, first served in round 3 (held out, phase downloads 1234 B), "
        "37.5 s after its start",
        "late partition 4: started 13.0 s into the run, never served",
    ]


def test_the_committed_import_memory_table_and_its_sums_are_what_the_file_gives():
    """results/scale/README.md's table of what each import adds to a ClientApp actor, and the sums its
    text quotes (Ray's and Flower's side, the htfe2 actor's imports, the app, datasets), from the file."""
    from bench.import_memory import table

    run = json.loads((ROOT / "results" / "scale" / "memory" / "import-uss.json").read_text())
    readme = (ROOT / "results" / "scale" / "README.md").read_text()
    assert table(run) in readme
    step = dict(zip(run["modules"], run["step_mib"], strict=True))
    ray_flower = step["ray"] + step["flwr.clientapp"] + step["flwr.server.superlink.fleet.vce.backend.raybackend"]
    htfe2 = run["start_mib"] + sum(run["step_mib"][: run["modules"].index("torchvision") + 1])
    text = " ".join(readme.split())
    quoted = f"the imports alone hold {htfe2:.0f} MiB before any client is served: Ray's and Flower's side"
    assert f"{quoted} {ray_flower:.0f} MiB" in text
    assert f"`torch` {step['torch']:.0f} MiB and `torch._dynamo` {step['torch._dynamo']:.0f} MiB" in text
    assert f"all methods, adds {step['client_app.handlers'] + step['methods.registry']:.1f} MiB" in text
    assert f"adds {step['datasets'] + step['flwr_datasets']:.0f} MiB of `datasets`" in text
