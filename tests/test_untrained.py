"""A run that trained nothing never reports success: rounds without a valid training reply are
recorded as such, ``max-untrained-rounds`` of them in a row fail the run with the clients' errors,
a run that ends on them fails, and a full disk leaves a summary that says why."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
from flwr.app import Error, Message

import common.run_folder
from common.config import ConfigError, RunConfig
from common.errors import RunFailed
from common.files import read_rows, read_summary
from conftest import federation
from server_app.app import run


def failing_train(rounds: set[int] | None = None):
    """A fake-grid ``tamper`` turning every train reply (of ``rounds``; all when None) into a client error."""

    def tamper(node, reply: Message) -> Message:
        if reply.metadata.message_type == "train" and (rounds is None or int(reply.metadata.group_id) in rounds):
            reply.__dict__["_content"] = None  # the reply the real runtime sends for a failed handler
            reply.error = Error(code=0, reason=f"disk full on node {node}")
        return reply

    return tamper


def run_folder(rc: dict, tamper=None):
    """Run ``rc`` on the fake grid through the ServerApp's ``run``; returns (folder, raised exception or None)."""
    strategy, grid = federation(rc, tamper)
    cfg = RunConfig.from_dict(rc)
    try:
        results = run(grid, cfg, 1)
    except Exception as exc:  # the ServerApp re-raises what failed the run
        (folder,) = Path(rc["output-dir"]).iterdir()
        return folder, exc
    return results.path, None


def test_clients_that_never_train_fail_the_run_with_their_errors(run_config, tmp_path):
    # a state-dir below a regular file: no client can store its model, every train reply is an error
    (tmp_path / "file").write_text("not a folder")
    rc = run_config(method="local", num_server_rounds=6, max_untrained_rounds=2, state_dir=str(tmp_path / "file" / "x"))
    folder, exc = run_folder(rc)
    assert isinstance(exc, RunFailed)
    summary, rows = read_summary(folder), read_rows(folder)
    assert summary["status"] == "failed" and "max-untrained-rounds' = 2" in summary["error"]
    assert [r["round"] for r in rows] == [1, 2] and all(r["untrained"] and r["num_clients"] == 0 for r in rows)
    assert summary["client_errors"] and all("Dropped" not in e for e in summary["client_errors"])
    assert any("file" in e for e in summary["client_errors"])  # the real cause, naming the path
    assert summary["rounds_completed"] == 2


def test_a_run_that_ends_on_untrained_rounds_is_not_completed(run_config):
    rc = run_config(method="local", num_server_rounds=3, max_untrained_rounds=3)
    folder, exc = run_folder(rc, failing_train({3}))
    assert isinstance(exc, RunFailed) and "round 3 (the run ended on it)" in str(exc)
    summary, rows = read_summary(folder), read_rows(folder)
    assert summary["status"] == "failed" and summary["client_errors"] == [
        f"client error 0: disk full on node {n}" for n in (1000, 1001, 1002, 1003)
    ]
    assert [r["untrained"] for r in rows] == [False, False, True]
    # the accuracy an earlier round reached is said to be that round's
    assert summary["final_round"] in (2, 3) and summary["rounds_completed"] == 3


def test_resuming_a_run_that_ended_on_untrained_rounds_fails_again(run_config):
    """Its checkpoint holds every round: the resumed run plays none, and ends on the same untrained rows."""
    rc = run_config(method="local", num_server_rounds=3, max_untrained_rounds=3)
    folder, exc = run_folder(rc, failing_train({3}))
    assert isinstance(exc, RunFailed)
    again = run_config(method="local", num_server_rounds=3, max_untrained_rounds=3, resume_from=str(folder))
    strategy, grid = federation(again)
    with pytest.raises(RunFailed, match="round 3"):
        strategy.start(grid)


def test_an_untrained_round_between_trained_ones_is_recorded_and_the_run_goes_on(run_config):
    rc = run_config(method="fedproto", num_server_rounds=3, max_untrained_rounds=2)
    folder, exc = run_folder(rc, failing_train({2}))
    assert exc is None
    summary, rows = read_summary(folder), read_rows(folder)
    assert summary["status"] == "completed" and summary["final_round"] == 3
    assert [r["untrained"] for r in rows] == [False, True, False]
    assert rows[1]["client_errors"][0] == "client error 0: disk full on node 1000"
    assert "client_errors" not in rows[0]


def test_a_resume_with_fewer_rounds_than_done_is_refused(run_config):
    rc = run_config(method="local", num_server_rounds=3)
    folder, exc = run_folder(rc)
    assert exc is None
    rc2 = run_config(method="local", num_server_rounds=2, resume_from=str(folder))
    strategy, grid = federation(rc2)
    with pytest.raises(ConfigError, match="has 3 completed rounds, more than 'num-server-rounds' = 2"):
        strategy.start(grid)


def test_a_full_disk_fails_the_run_naming_the_file_and_rows_agree_with_the_summary(run_config, monkeypatch):
    rc = run_config(method="local", num_server_rounds=3)
    real_write = common.run_folder.os.write
    writes = {"rows": 0}

    def write(fd, data):
        # the second row finds the disk full after 10 bytes
        if bytes(data[:10]) == b'{"round": ':
            writes["rows"] += 1
            if writes["rows"] >= 2:
                real_write(fd, bytes(data[:10]))
                raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    real_atomic = common.run_folder.atomic_write

    def atomic_write(path, fill):  # the full disk has no room for a new summary either
        if writes["rows"] >= 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_atomic(path, fill)

    monkeypatch.setattr(common.run_folder.os, "write", write)
    monkeypatch.setattr(common.run_folder, "atomic_write", atomic_write)
    folder, exc = run_folder(rc)
    assert isinstance(exc, OSError) and exc.errno == errno.ENOSPC
    summary = read_summary(folder)
    assert summary["status"] == "failed" and "metrics.jsonl" in summary["error"] and "No space" in summary["error"]
    assert summary["config"] is None  # the compact summary written in place
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1] and summary["rounds_completed"] == 1
