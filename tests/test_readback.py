"""Every file read back is validated as what we wrote: client state, the partition cache, checkpoints,
``metrics.jsonl``, ``summary.json`` and ``grid.json``. A file we own that fails is logged, ignored and
rewritten; one a user gave fails with a ConfigError naming the file and what is wrong."""

from __future__ import annotations

import json
import logging
import os
import threading

import pytest
import torch
from flwr.app import Context, RecordDict

from common import files
from common.config import ConfigError, RunConfig
from common.data import DataSpec, _cache_file, load_client_data
from common.files import read_bounded, read_rows, read_summary, resume_chain
from common.run_folder import CHECKPOINT, load_checkpoint
from common.runtime import MODEL_STATE, ClientRuntime
from models.groups import MODEL_GROUPS
from tools import grid as grid_tool
from tools import report as report_tool


def runtime(rc: dict, state_dir, server_round: int | None = None) -> ClientRuntime:
    """Partition 0's runtime with its state in ``state_dir`` and an empty context (a restarted node)."""
    node = {"partition-id": 0, "num-partitions": rc["num-clients"], "state-dir": str(state_dir)}
    ctx = Context(run_id=1, node_id=1, node_config=node, state=RecordDict(), run_config=rc)
    return ClientRuntime(ctx, "run", server_round)


def other_architecture() -> dict:
    """Weights of partition 1's CNN-2: the wrong shapes for partition 0's CNN-1."""
    return MODEL_GROUPS["hetero-cnn5"].build(1, 10, 3, 32, 0, 512).state_dict()


STATE_FILES = {
    "truncated": lambda good: b"PK\x03\x04 torn",
    "a tensor": lambda good: torch.zeros(3),
    "other keys": lambda good: {"round": 1, "weights": good},
    "another architecture": lambda good: {"round": 1, "state": other_architecture()},
    "a missing tensor": lambda good: {"round": 1, "state": dict(list(good.items())[1:])},
    "another dtype": lambda good: {"round": 1, "state": {k: v.double() for k, v in good.items()}},
    "a text round": lambda good: {"round": "3", "state": good},
    "a float round": lambda good: {"round": 2.5, "state": good},
    "a negative round": lambda good: {"round": -1, "state": good},
}


@pytest.mark.parametrize("kind", list(STATE_FILES))
@pytest.mark.parametrize("which", ["model.pt", "model.prev.pt"])
def test_a_state_file_that_is_not_what_we_wrote_is_ignored_and_rewritten(run_config, tmp_path, caplog, kind, which):
    rc = run_config(**{"max-examples-per-client": 60})
    fresh = runtime(rc, tmp_path / "empty").model.state_dict()
    folder = tmp_path / "state" / "run" / "partition-0"
    folder.mkdir(parents=True)
    content = STATE_FILES[kind](fresh)
    if isinstance(content, bytes):
        (folder / which).write_bytes(content)
    else:
        torch.save(content, folder / which)
    if which == "model.prev.pt":  # a newer file than the round asked: the foreign .prev is what rollback finds
        torch.save({"round": 5, "state": fresh}, folder / "model.pt")
    client = runtime(rc, tmp_path / "state", server_round=2)
    with caplog.at_level(logging.WARNING):
        model = client.model  # restores: must not raise
    assert "ignoring state file" in caplog.text
    assert all(torch.equal(model.state_dict()[k], v) for k, v in fresh.items())  # started afresh
    client.save_model()
    saved = torch.load(folder / "model.pt", weights_only=True)
    assert saved["round"] == 2 and saved["state"].keys() == fresh.keys()
    assert runtime(rc, tmp_path / "state", server_round=3).restore(MODEL_STATE, model)  # readable again


def test_a_foreign_partition_cache_file_is_rebuilt(run_config, tmp_path, caplog):
    cfg = RunConfig.from_dict(run_config(dataset="mnist", **{"max-examples-per-client": 60}))
    spec = DataSpec.from_config(cfg, 4)
    path, key = _cache_file(spec, 0, str(tmp_path))
    tmp_path.mkdir(exist_ok=True)
    bogus = {
        "key": key,
        "train_x": torch.zeros(2, 1, 28, 28),
        "train_y": torch.zeros(2),
        "test_x": torch.zeros(1, 1, 28, 28),
        "test_y": torch.zeros(1),
    }
    torch.save(bogus, path)  # the right key and lengths, but float tensors: not what we write
    load_client_data.cache_clear()
    with caplog.at_level(logging.WARNING):
        data = load_client_data(spec, 0, str(tmp_path))
    assert "ignoring partition cache" in caplog.text and data.train_x.dtype == torch.uint8 and len(data.train_y) > 2
    assert torch.load(path, weights_only=True)["train_x"].dtype == torch.uint8  # rewritten
    load_client_data.cache_clear()


GOOD_CHECKPOINT = {
    "round": 1,
    "method": "fedgh",
    "config": {},
    "state-key": "run",
    "rng": {},
    "traffic": {},
    "dropped": {},
    "rows": [{"round": 1}],
    "server": {},
}


@pytest.mark.parametrize(
    "content, fragment",
    [
        (torch.zeros(3), "holds a Tensor"),
        ([1, 2], "holds a list"),
        ({"round": 1}, "entry 'method'"),
        ({**GOOD_CHECKPOINT, "round": "1"}, "entry 'round' is str"),
        ({**GOOD_CHECKPOINT, "rows": {"round": 1}}, "entry 'rows' is dict"),
        ({**GOOD_CHECKPOINT, "rows": [{"round": "1"}]}, "rows are malformed"),
        ({**GOOD_CHECKPOINT, "round": -2}, "'round' = -2"),
        ({**GOOD_CHECKPOINT, "server": [1]}, "not dict or NoneType"),
    ],
)
def test_a_checkpoint_that_is_not_ours_fails_with_a_config_error(tmp_path, content, fragment):
    torch.save(content, tmp_path / CHECKPOINT)
    with pytest.raises(ConfigError) as err:
        load_checkpoint(tmp_path)
    assert "'resume-from'" in str(err.value) and str(tmp_path / CHECKPOINT) in str(err.value)
    assert fragment in str(err.value)


def test_a_checkpoint_of_ours_still_loads(tmp_path):
    torch.save(GOOD_CHECKPOINT, tmp_path / CHECKPOINT)
    assert load_checkpoint(tmp_path)["state-key"] == "run"


ROW = json.dumps({"round": 1, "accuracy_mean": 0.5})


@pytest.mark.parametrize(
    "text, rows, error",
    [
        (f"{ROW}\n" + '{"round": 2, "accur', 1, None),  # torn last line: a crash mid-append
        (f"{ROW}\n{ROW}\n", 2, None),
        (f"{ROW}\ngarbage\n{ROW}\n", None, "metrics.jsonl line 2 is not valid JSON"),
        (f"{ROW}\n[1, 2]\n", None, "metrics.jsonl line 2 holds a JSON list"),
        (f'{ROW}\n{{"round": NaN}}\n', None, "non-finite number NaN"),
        ('{"accuracy_mean": 1}\n', None, "line 1: key 'round'"),
    ],
)
def test_metrics_rows_are_strict_and_name_file_and_line(tmp_path, text, rows, error):
    (tmp_path / "metrics.jsonl").write_text(text)
    if error is None:
        assert len(read_rows(tmp_path)) == rows
    else:
        with pytest.raises(ConfigError, match=error):
            read_rows(tmp_path)


@pytest.mark.parametrize("text", ["{torn", "[1]", '{"status": "completed"}', '{"status": 1, "rounds_completed": 2}'])
def test_a_summary_that_is_not_ours_names_the_file(tmp_path, text):
    (tmp_path / "summary.json").write_text(text)
    with pytest.raises(ConfigError, match="summary.json"):
        read_summary(tmp_path)


def within(seconds: float, call):
    """``call()``'s result or error, or a test failure when it has not returned after ``seconds``: a read
    that blocks (a FIFO) must fail the test, not hang it (the thread is left behind, a daemon)."""
    done = {}

    def run():
        try:
            done["value"] = call()
        except Exception as exc:
            done["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f"still reading after {seconds} s")
    if "error" in done:
        raise done["error"]
    return done["value"]


@pytest.mark.parametrize("kind", ["FIFO", "folder", "over the cap"])
def test_a_summary_or_rows_file_that_is_no_regular_file_under_the_cap_is_refused_naming_it(tmp_path, kind):
    """A FIFO held a reader of ``summary.json`` forever; every file read back is a regular file of at most
    ``MAX_READ_BYTES``, refused by name otherwise before it is read."""
    cap = 100
    for name in ("summary.json", "metrics.jsonl"):
        path = tmp_path / name
        if kind == "FIFO":
            os.mkfifo(path)
        elif kind == "folder":
            path.mkdir()
        else:
            path.write_text(json.dumps({"status": "completed", "rounds_completed": 1, "pad": "x" * cap}))
    expected = {"FIFO": "it is a FIFO", "folder": "it is a folder", "over the cap": f"at most {cap} bytes"}[kind]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(files, "MAX_READ_BYTES", cap)
        for read in (read_summary, read_rows):
            with pytest.raises(ConfigError, match=expected) as caught:
                within(10, lambda read=read: read(tmp_path))
            assert str(tmp_path) in str(caught.value) and "regular file" in str(caught.value)


def test_an_endless_device_is_refused_before_a_byte_is_read():
    with pytest.raises(ConfigError, match=r"/dev/zero cannot be read: it is a device.*regular file of at most"):
        within(10, lambda: read_bounded("/dev/zero"))


def write_summary(run, resume_from=None):
    run.mkdir(exist_ok=True)
    config = {"resume-from": str(resume_from)} if resume_from else {}
    (run / "summary.json").write_text(json.dumps({"status": "completed", "rounds_completed": 1, "config": config}))


def test_a_resume_from_chain_is_walked_newest_first_and_a_loop_is_refused_naming_its_folders(tmp_path, monkeypatch):
    """A run folder whose ``resume-from`` named itself, or two naming each other, held ``tools.privacy``
    in an endless walk; the chain stops at a folder that is gone and holds at most ``MAX_CHAIN`` runs."""
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    write_summary(a, tmp_path / "gone")
    write_summary(b, a)
    write_summary(c, b)
    assert within(10, lambda: resume_chain(c)) == [c, b, a]
    write_summary(a, a)  # itself
    with pytest.raises(ConfigError, match=f"chain of {c} is a loop: {a} -> {a};"):
        within(10, lambda: resume_chain(c))
    write_summary(a, b / ".." / "c")  # a cycle through another spelling of c
    with pytest.raises(ConfigError, match="is a loop") as caught:
        within(10, lambda: resume_chain(c))
    assert str(caught.value).count("\n") == 0 and f"{c} -> {b} -> {a} -> {b}/../c;" in str(caught.value)
    write_summary(a)
    monkeypatch.setattr(files, "MAX_CHAIN", 2)
    with pytest.raises(ConfigError, match="holds more than 2 runs"):
        resume_chain(c)
    (a / "summary.json").write_text(json.dumps({"status": "completed", "rounds_completed": 1, "config": [1]}))
    with pytest.raises(ConfigError, match=f"{a / 'summary.json'}: key 'config'"):
        resume_chain(a)


def cell_with_unreadable_summary(grid, rounds: int = 2):
    run = grid / "fedgh-seed0" / "20260101-000000-fedgh-cifar10-1"
    run.mkdir(parents=True)
    traffic = {"bytes_up": 8, "bytes_down": 8, "eval_bytes_up": 0, "eval_bytes_down": 0}
    rows = [
        {
            "round": r + 1,
            "accuracy_mean": 0.5,
            "accuracy_weighted": 0.5,
            "num_clients": 2,
            "round_seconds": 1.0,
            **traffic,
        }
        for r in range(rounds)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "summary.json").write_text("{torn")
    (run / CHECKPOINT).write_bytes(b"checkpoint")
    return run


def test_the_grid_resumes_a_cell_from_its_checkpoint_when_its_summary_is_unreadable(tmp_path):
    run = cell_with_unreadable_summary(tmp_path)
    assert grid_tool.plan(tmp_path / "fedgh-seed0", 5) == ("resume", run)


def test_a_run_stopped_by_stop_patience_is_done(tmp_path):
    run = tmp_path / "fedgh-seed0" / "r"
    run.mkdir(parents=True)
    summary = {"status": "completed", "rounds_completed": 3, "stop_reason": "no new best"}
    (run / "summary.json").write_text(json.dumps(summary))
    assert grid_tool.plan(tmp_path / "fedgh-seed0", 10) == ("done", run)


def test_a_corrupt_grid_json_stops_grid_and_report_naming_it(tmp_path, capsys):
    (tmp_path / "grid.json").write_text('{"preset": "x.toml", "preset_con')
    preset = str(grid_tool.ROOT / "presets" / "fedre-table12-cifar10.toml")
    assert grid_tool.main([preset, "--methods", "fedre", "--out", str(tmp_path)]) == 2
    assert report_tool.main([str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert (out + err).count(f"{tmp_path / 'grid.json'} is not valid JSON") == 2


def test_the_report_shows_a_cell_whose_summary_is_unreadable(tmp_path):
    cell_with_unreadable_summary(tmp_path)
    preset = {"dataset": "cifar10", "num-clients": 2}
    (tmp_path / "grid.json").write_text(
        json.dumps(
            {
                "preset": "fedre-table12-cifar10.toml",
                "preset_config": preset,
                "invocations": [],
                "methods": ["fedgh"],
                "seeds": [0],
                "rounds": 5,
            }
        )
    )
    stats = report_tool.report(tmp_path, figures=False)
    assert "fedgh" in stats and stats["fedgh"]["seeds"] == [0]
    text = (tmp_path / "report.md").read_text()
    assert "summary.json is unreadable" in text and "fedgh-seed0" in text


def test_a_round_repeated_twice_after_two_crashes_rolls_back_both_times(run_config, tmp_path, caplog):
    """The server crashed twice in round 2, after the clients stored it each time: both resumed
    runs start round 2 from the round-1 state (the first rollback must not keep the ahead file
    as ``.prev``, where the second would find it instead of round 1's)."""
    rc = run_config(**{"max-examples-per-client": 60})
    state = tmp_path / "state"
    first = runtime(rc, state, server_round=1)
    with torch.no_grad():
        next(first.model.parameters()).add_(0.5)  # round 1's training: not the initial weights
    round1 = {k: v.clone() for k, v in first.model.state_dict().items()}
    first.save_model()
    for attempt in range(3):  # the first run of round 2, then two resumed runs
        client = runtime(rc, state, server_round=2)  # a new Flower run: empty context, state from disk
        with caplog.at_level(logging.WARNING):
            model = client.model
        assert client.state_rollbacks == min(attempt, 1), attempt
        assert all(torch.equal(model.state_dict()[k], v) for k, v in round1.items()), attempt
        with torch.no_grad():
            next(model.parameters()).add_(1.0)  # round 2's training
        client.save_model()  # then the server crashes before its round-2 checkpoint
    assert "starting afresh" not in caplog.text
    assert (
        "'model' on disk is from round 2, later than the server's state (round 1); rolled back to round 1"
        in caplog.text
    )
