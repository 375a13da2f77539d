"""tools.collapses: the rounds whose pooled accuracy falls by more than 20 points and recovers, with
the rows' evidence; results/collapses/README.md holds the listing over the committed results."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools.collapses import collapse_rounds, listing, main, run_collapses, runs_under

RESULTS = Path(__file__).resolve().parents[1] / "results"


def test_a_collapse_falls_by_more_than_the_threshold_and_wins_it_back():
    """0.6 -> 0.3 -> 0.55 is one (round 2); a fall that never recovers, a fall of 20 points or less
    and a round without evaluation (None: compared with the last evaluated round) are not."""
    assert collapse_rounds([0.6, 0.3, 0.55]) == [(2, 0.6, 0.3, 0.55)]
    assert collapse_rounds([0.6, 0.3, 0.45]) == []  # won back only 15 points
    assert collapse_rounds([0.6, 0.41, 0.7]) == []  # fell 19 points
    assert collapse_rounds([0.6, None, 0.3, None, 0.6]) == [(3, 0.6, 0.3, 0.6)]
    assert collapse_rounds([0.6, 0.3]) == []  # nothing after it


def write_run(folder: Path, curve: list[float], **extra) -> Path:
    folder.mkdir(parents=True)
    rows = [
        {"round": t + 1, "accuracy_weighted": a, "num_clients": 4, "server_ce_after": t, **extra}
        for t, a in enumerate(curve)
    ]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder / "metrics.jsonl"


def test_the_listing_gives_the_rounds_evidence_against_the_round_before(tmp_path):
    path = write_run(tmp_path / "run", [0.5, 0.7, 0.2, 0.7])
    (tmp_path / "cc").mkdir()
    (tmp_path / "cc" / "reference-seed-0.json").write_text(json.dumps({"curve": [0.5, 0.1, 0.5]}))
    found = [c for p, root in runs_under([tmp_path]) for c in run_collapses(p, root)]
    assert [(c.run, c.side, c.round) for c in found] == [
        ("cc/reference-seed-0.json", "reference", 2),
        ("run/metrics.jsonl", "ours", 3),
    ]
    ours = found[1]
    assert ours.evidence["server_ce_after"] == 2 and ours.previous["server_ce_after"] == 1
    text = listing(found, 0.2, 2)
    assert "2 in 2 runs, 1 of ours and 1 of the reference" in text
    assert "| server_ce_after | 1 | 2 |" in text
    assert path.is_file()


def test_a_bad_file_is_one_line_naming_it(tmp_path, capsys):
    (tmp_path / "reference-seed-0.json").write_text("[1, 2")
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "reference-seed-0.json" in err


@pytest.mark.skipif(not (RESULTS / "collapses" / "README.md").is_file(), reason="no committed listing")
def test_the_committed_listing_is_the_tools_over_results(tmp_path):
    """results/collapses/README.md holds what ``tools.collapses results`` prints now; every collapse
    of ours in it has a cause written under it."""
    out = tmp_path / "listing.md"
    assert main([str(RESULTS), "--out", str(out)]) == 0
    committed = (RESULTS / "collapses" / "README.md").read_text(encoding="utf-8")
    listed = out.read_text(encoding="utf-8").split("\n## ", 1)
    assert listed[0].split("\n", 2)[2].strip() in committed
    for section in listed[1].split("\n## ") if len(listed) > 1 else []:
        assert section.strip() in committed, section.splitlines()[0]
        after = committed.split(section.strip(), 1)[1].split("\n## ", 1)[0]
        assert "**Cause.**" in after, section.splitlines()[0]


def test_a_curve_file_that_is_no_regular_file_is_one_line_naming_it_with_exit_2(tmp_path):
    """A FIFO named like a cross-check curve held the listing forever (a child process, so that the test
    fails instead of hanging)."""
    import os
    import subprocess
    import sys

    (tmp_path / "cc").mkdir()
    os.mkfifo(tmp_path / "cc" / "reference-seed-0.json")
    cmd = [sys.executable, "-m", "tools.collapses", str(tmp_path)]
    try:
        done = subprocess.run(cmd, cwd=RESULTS.parent, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("tools.collapses still reading a FIFO after 60 s")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert f"{tmp_path / 'cc' / 'reference-seed-0.json'} cannot be read: it is a FIFO" in lines[0]
