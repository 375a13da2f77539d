"""bench.measure: what a benchmark records of a process tree it starts (exit status, seconds, CPU, peak PSS)."""

import sys

import pytest

from bench.measure import run_measured


def test_run_measured_sees_a_child_processes_memory_and_cpu(tmp_path):
    """A parent that starts a child holding 300 MiB for 3 s or more: the tree's peak PSS counts the child's
    pages (at least 300 MiB, the parent alone holds about 10), the CPU time is the loop's, the exit
    status and the log are the command's."""
    # 1.5 CPU-seconds of busy loop, then 1.5 s asleep, so a sample sees all of it (samples are 1 s apart)
    child = "b = bytearray(300 * 2**20); import time\nwhile time.process_time() < 1.5: pass\ntime.sleep(1.5)"
    parent = (
        "import subprocess, sys; print('started'); "
        f"sys.exit(subprocess.run([sys.executable, '-c', {child!r}]).returncode + 4)"
    )
    log = tmp_path / "log"
    measured = run_measured([sys.executable, "-c", parent], tmp_path, log)
    assert measured.code == 4
    assert log.read_text().strip() == "started"
    assert 300 * 2**20 <= measured.peak_pss < 600 * 2**20
    # the child's busy loop, one core; psutil's CPU times come in clock ticks (0.01 s), summed as floats
    assert 1.49 <= measured.cpu <= measured.wall
    assert sum(total for _, total in measured.at_peak.values()) == measured.peak_pss
    assert sum(count for count, _ in measured.at_peak.values()) == 2  # the parent and its child


def test_run_measured_counts_a_reaped_child_once(tmp_path):
    """A parent that waits for a child's 1.5 CPU-seconds and then sleeps on: sampled after it reaped the
    child, the parent's children times hold the child's CPU, which its own sample counted already
    (counted twice, 3 CPU-seconds, before)."""
    child = "import time\nwhile time.process_time() < 1.5: pass\ntime.sleep(1.5)"
    parent = f"import subprocess, sys, time; subprocess.run([sys.executable, '-c', {child!r}]); time.sleep(2.5)"
    measured = run_measured([sys.executable, "-c", parent], tmp_path, tmp_path / "log")
    assert measured.code == 0
    assert 1.49 <= measured.cpu < 2.2


def test_import_memory_counts_what_an_import_adds_to_a_fresh_process():
    """bench.import_memory: a module that maps a large extension (numpy) adds megabytes of USS to a fresh
    interpreter, one already imported by the interpreter's start (sys) adds none, and the table names
    every step and the total."""
    from bench.import_memory import measure, table

    result = measure(["sys", "numpy"], repeats=1)
    assert result["modules"] == ["sys", "numpy"] and len(result["step_mib"]) == 2
    assert abs(result["step_mib"][0]) < 0.5 and result["step_mib"][1] > 2.0
    assert result["total_mib"] >= result["start_mib"] + result["step_mib"][1] - 0.5
    text = table(result)
    assert "| `numpy` |" in text and text.count("\n") == 5 and "all of them, one process" in text


def test_import_memory_refuses_fewer_than_one_repeat_naming_the_flag(capsys):
    from bench.import_memory import main

    with pytest.raises(SystemExit) as exit_:
        main(["--repeats", "0", "--modules", "sys"])
    assert exit_.value.code == 2
    assert "--repeats 0: allowed values are integers >= 1" in capsys.readouterr().err
