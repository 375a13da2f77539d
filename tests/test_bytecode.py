"""The installed packages' bytecode (``[tool.uv] compile-bytecode``) and ``bench.bytecode``, which measures
what it saves a launch."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from bench import bytecode


@pytest.mark.parametrize("module", ["flwr.simulation.app", "ray.actor", "torch.nn.modules.module"])
def test_the_installed_packages_come_with_their_bytecode(module):
    """uv writes each installed module's bytecode at install: with PYTHONDONTWRITEBYTECODE set, Python
    writes none, and every process of a simulation compiled these from source at each launch."""
    source = importlib.util.find_spec(module).origin
    assert Path(importlib.util.cache_from_source(source)).is_file(), source


def test_the_bench_alternates_the_sides_skips_what_is_done_and_tables_both(tmp_path, monkeypatch, capsys):
    """Pairs alternate which side launches first; only the ``source`` side gets the prefix holding the
    standard library's bytecode; a rerun with more pairs launches only the new ones; the table gives
    each side's count, means and population stds."""
    launched, seeds = [], []

    def fake_launch(items, preset, seed, out, prefix):
        side = "source" if prefix is not None else "bytecode"
        assert out.parent.parent == tmp_path and out.parent.name.endswith("-runs")  # in <out name>-runs/
        launched.append((side, out.name))
        seeds.append(seed)
        wall = 80.0 if side == "source" else 60.0 + len(launched)
        return {
            "wall_seconds": wall,
            "in_rounds_seconds": 40.0,
            "outside_rounds_seconds": wall - 40.0,
            "cpu_seconds": 2 * wall,
            "peak_pss_gib": 2.0,
            "final_accuracy_mean": 0.9,
        }

    prefixes = []
    monkeypatch.setattr(bytecode, "launch", fake_launch)
    monkeypatch.setattr(bytecode, "stdlib_bytecode", prefixes.append)
    out = tmp_path / "launches.json"
    assert bytecode.main(["--pairs", "2", "--out", str(out)]) == 0
    assert launched == [
        ("source", "source-1"),
        ("bytecode", "bytecode-1"),
        ("bytecode", "bytecode-2"),
        ("source", "source-2"),
    ]
    assert prefixes and prefixes[0].name == "stdlib-bytecode"
    assert seeds == [0] * 4  # the default run's training seed, as the config gives it
    assert bytecode.main(["--pairs", "3", "--out", str(out)]) == 0
    assert launched[4:] == [("source", "source-3"), ("bytecode", "bytecode-3")]
    record = json.loads(out.read_text())
    assert [(r["side"], r["pair"]) for r in record["launches"]][-2:] == [("source", 3), ("bytecode", 3)]
    assert record["command"] == f"python -m bench.bytecode --pairs 3 --out {out}"
    assert record["run"] == [
        "--preset",
        bytecode.DEFAULT_PRESET,
        *(a for i in bytecode.DEFAULT_CONFIG for a in ("-c", i)),
    ]
    table = bytecode.table(record)
    # bytecode walls 62, 63, 66: mean 63.7, population std 1.7; source 80 each
    assert "| source | 3 | 80.0 ± 0.0 | 40.0 ± 0.0 | 40.0 ± 0.0 | 160 ± 0 | 2.00 ± 0.00 |" in table
    assert "| bytecode | 3 | 63.7 ± 1.7 | 23.7 ± 1.7 | 40.0 ± 0.0 | 127 ± 3 | 2.00 ± 0.00 |" in table
    assert table in capsys.readouterr().out
    assert bytecode.main(["--table", str(out)]) == 0 and capsys.readouterr().out.strip() == table
    # -c overrides the default run's keys (its items come last); --preset replaces the default run
    other = tmp_path / "other.json"
    assert bytecode.main(["-c", "method='fedproto'", "--pairs", "1", "--out", str(other)]) == 0
    assert json.loads(other.read_text())["run"][-2:] == ["-c", "method='fedproto'"]
    preset = "presets/fedtgp-cifar10-htfe2.toml"
    assert bytecode.main(["--preset", preset, "--pairs", "1", "--out", str(tmp_path / "preset.json")]) == 0
    assert json.loads((tmp_path / "preset.json").read_text())["run"] == ["--preset", preset]


def test_the_bench_refuses_a_bad_key_before_any_launch(monkeypatch, capsys):
    monkeypatch.setattr(bytecode, "launch", lambda *args: pytest.fail("launched"))
    monkeypatch.setattr(bytecode, "stdlib_bytecode", lambda prefix: pytest.fail("compiled"))
    assert bytecode.main(["-c", "no-such-key=1"]) == 2
    assert "unknown run config key(s) ['no-such-key']" in capsys.readouterr().out
