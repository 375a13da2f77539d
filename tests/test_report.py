"""The grid report on a small synthetic grid: numbers, figures, and regeneration from its copies."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from common.errors import ConfigError
from conftest import DATA_DIR
from tools.figures import FIGURES
from tools.report import report, setup_section

ACC = {  # method -> seed -> accuracy_weighted per round (accuracy_mean = that minus 0.1)
    "fedre": {0: [0.5, 0.7, 0.85, 0.9], 1: [0.6, 0.82, 0.8, 0.86]},
    "local": {0: [0.55, 0.6, 0.7, 0.75], 1: [0.5, 0.65, 0.72, 0.78]},
}
BYTES = {"fedre": (2_088, 20_520), "local": (0, 0)}  # per client-round up / down
CLIENTS = 3


def write_grid(grid, config, methods=tuple(ACC), overrides=None, shift=0.0):
    """A finished grid of ``methods`` (:data:`ACC` curves, ``shift`` added) started with ``overrides``."""
    grid.mkdir()
    (grid / "grid.json").write_text(
        json.dumps(
            {
                "preset": "fedre-table12-cifar10.toml",
                "preset_config": config,
                "overrides": overrides or {},
                "methods": list(methods),
                "seeds": [0, 1],
                "rounds": 4,
                "invocations": [
                    {
                        "started": "t",
                        "commit": "abc",
                        "command": "python -m tools.grid x",
                        "minutes_per_launch": 0,
                        "machine": "test",
                    }
                ],
                "launches": [
                    {"cell": f"{m}-seed{s}", "wall_seconds": 600.0, "cpu_seconds": 900.0, "exit": 0}
                    for m in methods
                    for s in (0, 1)
                ],
            }
        )
    )
    for method in methods:
        for seed, accs in ACC[method].items():
            run = grid / f"{method}-seed{seed}" / "20260101-000000-run"
            run.mkdir(parents=True)
            up, down = BYTES[method]
            rows = [
                {
                    "round": r + 1,
                    "accuracy_weighted": a + shift,
                    "accuracy_mean": a + shift - 0.1,
                    "bytes_up": up * CLIENTS,
                    "bytes_down": down * CLIENTS,
                    "eval_bytes_up": 0,
                    "eval_bytes_down": down * CLIENTS,
                    "num_clients": CLIENTS,
                    "round_seconds": 2.0 + seed + (20.0 if r == 0 else 0.0),  # a slow first round
                }
                for r, a in enumerate(accs)
            ]
            (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            (run / "summary.json").write_text(json.dumps({"status": "completed", "rounds_completed": 4}))


@pytest.fixture
def small_config():
    return {
        "dataset": "mnist",
        "partitioner": "dirichlet",
        "dirichlet-alpha": 0.5,
        "num-clients": CLIENTS,
        "model-group": "htcnn8",
        "max-examples-per-client": 60,
        "local-epochs": 2,
        "data-dir": str(DATA_DIR),
    }


def test_report_numbers_figures_and_regeneration(tmp_path, small_config):
    grid = tmp_path / "grid"
    write_grid(grid, small_config)
    out = tmp_path / "results"
    stats = report(grid, out, str(DATA_DIR))
    fedre, local = stats["fedre"], stats["local"]
    finals = [ACC["fedre"][s][-1] for s in (0, 1)]
    assert fedre["final_accuracy_weighted"] == pytest.approx((statistics.mean(finals), statistics.stdev(finals)))
    bests = [max(ACC["fedre"][s]) for s in (0, 1)]
    assert fedre["best_accuracy_weighted"] == pytest.approx((statistics.mean(bests), statistics.stdev(bests)))
    assert fedre["final_accuracy_mean"][0] == pytest.approx(statistics.mean(finals) - 0.1)
    # target 0.80 (the preset's paper file) on accuracy_weighted: seed 0 at round 3, seed 1 at round 2
    assert fedre["rounds_to_target"] == pytest.approx((2.5, statistics.stdev([3, 2]))) and fedre["reached"] == "2/2"
    per_round = CLIENTS * (2_088 + 2 * 20_520)
    assert fedre["bytes_to_target"] == pytest.approx((3 * per_round + 2 * per_round) / 2)
    assert local["rounds_to_target"] is None and local["reached"] == "0/2"
    assert fedre["up_per_client_round"] == 2_088 and fedre["down_per_client_round"] == 20_520
    assert fedre["seconds_per_round"] == 3.0 and fedre["rounds"] == [4]  # the median of 2,2,2,3,3,3,22,23
    for name in FIGURES:
        assert (out / name).stat().st_size > 10_000  # a real picture, not an empty canvas
    text = (out / "report.md").read_text()
    assert "| fedre | 0,1 | 4 | 78.00 ± 2.83 |" in text and "| 86.99 |" in text and "| 86.33 |" in text
    assert "up to the last round all have): fedre from round 1 to the end (first at round 1, 4 of 4 rounds)." in text
    assert "fedre 20 min wall, 30 min CPU" in text and "in all 0.67 h wall, 1.00 h CPU" in text
    # against the paper (86.99 ± 0.01 and 86.33 ± 0.11, 100 rounds): 4 rounds are provisional
    m, sd = (100 * v for v in fedre["final_accuracy_weighted"])
    tolerance = 2 * math.hypot(sd / math.sqrt(2), 0.01)
    assert f"| fedre | {m:.2f} ± {sd:.2f} (n=2) | 86.99 ± 0.01 | {m - 86.99:+.2f} (tolerance {tolerance:.2f}) |" in text
    assert abs(m - 86.99) <= tolerance and "| reproduced (provisional) |" in text
    lm, lsd = (100 * v for v in local["final_accuracy_weighted"])
    assert 86.33 - lm > 2 * math.hypot(lsd / math.sqrt(2), 0.11)
    assert f"| not reproduced ({86.33 - lm:.2f} below) (provisional) |" in text
    z = (m - lm) / math.sqrt(sd**2 / 2 + lsd**2 / 2)
    assert z > 2 and f"| fedre > local | +0.66 | {m - lm:+.2f} | {z:+.1f} | kept |" in text
    # the results folder alone regenerates the same report
    first = text
    report(out, None, str(DATA_DIR))
    assert (out / "report.md").read_text() == first


def test_a_cell_just_started_is_neither_copied_nor_counted(tmp_path, small_config, monkeypatch):
    """A grid invoked for seeds 0-2 whose seed-2 cell has only started (a summary, no finished
    round): the copy leaves it out, and the FLOPs are those of the partitions of the seeds reported."""
    from tools import report as report_tool

    grid = tmp_path / "grid"
    write_grid(grid, small_config)
    info = json.loads((grid / "grid.json").read_text())
    (grid / "grid.json").write_text(json.dumps({**info, "seeds": [0, 1, 2]}))
    started = grid / "fedre-seed2" / "20260101-000000-run"
    started.mkdir(parents=True)
    (started / "summary.json").write_text(json.dumps({"status": "running", "rounds_completed": 0}))
    seeds = []
    monkeypatch.setattr(report_tool, "training_flops", lambda config, data_dir: seeds.append(config["seed"]) or 1e9)
    out = tmp_path / "results"
    stats = report(grid, out, str(DATA_DIR))
    assert seeds == [0, 1] and stats["fedre"]["seeds"] == [0, 1]
    assert not (out / "fedre-seed2").exists() and (out / "fedre-seed1").is_dir()
    assert "| 1.0 | 86.99 |" in (out / "report.md").read_text()


def test_an_ablation_grid_is_reported_beside_its_method(tmp_path, small_config):
    """A grid of the same preset with one more override joins the report under its override, after
    its method, with its own numbers, time and command; the copies alone regenerate it."""
    from common.errors import ConfigError

    grid, ablation = tmp_path / "grid", tmp_path / "lr0"
    write_grid(grid, small_config)
    write_grid(ablation, small_config, methods=("fedre",), overrides={"fedre.server-lr": 0.0}, shift=-0.05)
    out = tmp_path / "results"
    stats = report(grid, out, figures=False, ablations=[ablation])
    label = "fedre (fedre.server-lr=0.0)"
    assert list(stats) == ["fedre", label, "local"]
    finals = [ACC["fedre"][s][-1] - 0.05 for s in (0, 1)]
    assert stats[label]["final_accuracy_weighted"] == pytest.approx((statistics.mean(finals), statistics.stdev(finals)))
    text = (out / "report.md").read_text()
    assert f"| {label} | 0,1 | 4 | {100 * (statistics.mean(finals) - 0.1):.2f} ± " in text
    assert "Ablation `fedre.server-lr=0.0`: fedre with it, 4 rounds per run, seeds [0, 1] (`ablations/lr0`)." in text
    assert f"; {label} 20 min wall, 30 min CPU;" in text and "in all 1.00 h wall, 1.50 h CPU" in text
    assert text.count(f"| {label} |") == 1  # no paper number: not in the verdicts
    diff = 100 * (statistics.mean(finals) - stats["fedre"]["final_accuracy_weighted"][0])
    z = diff / (100 * math.sqrt(2 * statistics.stdev(finals) ** 2 / 2))  # equal spreads: shift only
    assert f"{label} against fedre: {diff:+.2f} points ({z:+.1f} standard errors, not separated)" in text
    report(out, None, figures=False)
    assert (out / "report.md").read_text() == text
    same = tmp_path / "same"
    write_grid(same, small_config, methods=("fedre",))
    with pytest.raises(ConfigError, match=r"same/grid.json: adds no override"):
        report(grid, tmp_path / "again", figures=False, ablations=[same])
    assert not (tmp_path / "again").exists()  # refused before anything is copied


def test_the_grid_line_names_the_rounds_its_runs_have():
    """A grid whose cells were run with other ``--rounds`` than the grid's first invocation says so
    instead of the grid's own count."""
    info = {"preset": "presets/p.toml", "rounds": 10, "seeds": [0, 1], "invocations": [{"commit": "abc"}]}
    same = "\n".join(setup_section(info, {}, "final_accuracy_mean", [10]))
    mixed = "\n".join(setup_section(info, {}, "final_accuracy_mean", [10, 30]))
    assert "Grid: 10 rounds per run, seeds [0, 1], the preset as it is. Commits: abc." in same
    assert "Grid: 10 or 30 rounds per run (the table's rounds column), seeds [0, 1]," in mixed


def test_a_folder_that_is_no_grid_or_run_is_one_line_naming_the_file_with_exit_2_and_no_output(
    tmp_path, small_config, capsys
):
    """``tools.report <a folder that is no grid> --out X`` raised FileNotFoundError and left an empty X; a
    grid or run folder with a bad file left a half-written X. Each is one line on stderr naming the file,
    exit 2, and no X."""
    from tools.report import main

    empty, grid, run, out = tmp_path / "empty", tmp_path / "grid", tmp_path / "run", tmp_path / "out"
    empty.mkdir()
    write_grid(grid, small_config)
    next(grid.glob("local-seed1/*/metrics.jsonl")).write_text("garbage\n")
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"round": 1}\ngarbage\n')
    cases = {
        empty: f"{empty / 'grid.json'} cannot be read: No such file or directory",
        grid: "metrics.jsonl line 1 is not valid JSON",
        run: f"{run / 'metrics.jsonl'} line 2 is not valid JSON",
    }
    for folder, expected in cases.items():
        assert main([str(folder), "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and expected in err[0], err
        assert not out.exists(), folder


def test_report_of_one_run_folder_equals_its_rows(run_config, tmp_path):
    """``tools.report <run folder>``: the figures of that one run and a table whose numbers are its rows'."""
    from test_resume import run_with_results

    from common.files import read_rows
    from tools.report import main

    strategy, _ = run_with_results(run_config(**{"num-clients": 3, "num-server-rounds": 3}), name="one-run")
    run = strategy.results.path
    assert main([str(run), "--out", str(tmp_path / "report"), "--data-dir", str(DATA_DIR)]) == 0
    assert all((tmp_path / "report" / name).stat().st_size > 10_000 for name in FIGURES)
    rows, text = read_rows(run), (tmp_path / "report" / "report.md").read_text()
    final, best = rows[-1]["accuracy_mean"], max(r["accuracy_mean"] for r in rows)
    assert f"| accuracy_mean | {100 * final:.2f} | {100 * best:.2f} |" in text
    weighted = [r["accuracy_weighted"] for r in rows]
    assert f"| accuracy_weighted | {100 * weighted[-1]:.2f} | {100 * max(weighted):.2f} |" in text
    clients = sum(r["num_clients"] for r in rows)
    assert f"{sum(r['bytes_up'] for r in rows) / clients:.0f} B up" in text and "3 rounds" in text


def test_paper_verdicts_reversed_rankings_and_single_seeds():
    """A ranking the paper orders one way and ours the other beyond 2 standard errors is reversed;
    within them it is not separated; a single seed gets no verdict; at the paper's budget nothing
    is provisional, nor when the runs short of it were ended by stop-patience."""
    from tools.report import paper_comparison

    paper = {"ours": "final_accuracy_mean", "rounds": 10, "reported": {"a": 90.0, "b": 80.0, "c": 70.0}}
    done = {"seeds": [0, 1, 2], "rounds": [10], "stopped": 0, "open_rounds": [10]}
    stats = {
        "a": {**done, "final_accuracy_mean": (0.70, 0.01)},
        # seeds 0, 1 ended by stop-patience after 6 and 8 rounds: finished
        "b": {**done, "rounds": [6, 8, 10], "stopped": 2, "final_accuracy_mean": (0.80, 0.01)},
        "c": {**done, "seeds": [0], "final_accuracy_mean": (0.75, 0.0)},
        "d": {**done, "seeds": [0], "final_accuracy_mean": (0.5, 0.0)},  # no paper number: left out
    }
    text = "\n".join(paper_comparison(paper, stats))
    assert "provisional" not in text and "| d |" not in text
    assert "after 6 to 10 rounds (2 run(s) ended by stop-patience)." in text
    going = {**stats, "b": {**stats["b"], "stopped": 1, "open_rounds": [8, 10]}}  # seed 1 at round 8 goes on
    assert "has 8 of the paper's 10: every verdict is provisional" in "\n".join(paper_comparison(paper, going))
    assert "| a | 70.00 ± 1.00 (n=3) | 90.00 | -20.00 (tolerance 1.15) | not reproduced (20.00 below) |" in text
    assert "| b | 80.00 ± 1.00 (n=3) | 80.00 | +0.00 (tolerance 1.15) | reproduced |" in text
    assert "| c | 75.00 ± 0.00 (n=1) | 70.00 | +5.00 (tolerance 0.00) | one seed: no verdict |" in text
    assert "Ranking, paper: a > b > c; ours: b > c > a." in text
    assert "| a > b | +10.00 | -10.00 | -12.2 | reversed |" in text
    assert "| a > c | +20.00 | -5.00 | - | no spread |" in text
    lenient = "\n".join(paper_comparison({**paper, "tolerance": 25.0}, stats))  # a floor on the tolerance
    assert "| a | 70.00 ± 1.00 (n=3) | 90.00 | -20.00 (tolerance 25.00) | reproduced |" in lenient
    assert "| b | 80.00 ± 1.00 (n=3) | 80.00 | +0.00 (tolerance 25.00) |" in lenient and "or 25 points" in lenient
    alone = "\n".join(paper_comparison(paper, {"a": stats["a"]}))
    assert "| a | 70.00" in alone and "Ranking" not in alone  # one method: nothing to rank
    # a is not reproduced and b is in a reversed pair: the cross-check speaks to both, c (one seed) not
    assert "- a: no cross-check recorded" in text and "- b: no cross-check recorded" in text
    assert "- c:" not in text
    checked = "\n".join(paper_comparison({**paper, "crosscheck": {"a": "agrees with R (x/)", "c": "C"}}, stats))
    assert "- a: agrees with R (x/)" in checked and "- b: no cross-check recorded" in checked
    assert "- c:" not in checked
    level = {m: {**stats[m], "final_accuracy_mean": (r / 100, 0.01)} for m, r in paper["reported"].items()}
    assert "cross-check" not in "\n".join(paper_comparison(paper, level))  # all reproduced and kept
    assert paper_comparison({"reported": {}}, stats) == []


@pytest.mark.parametrize(
    "text,match",
    [
        ('paper = "P"\nreported_std = 1\n', r"unknown key\(s\) \['reported_std'\]"),
        ("[reported]\na = 90.0\n[reported-std]\nb = 0.1\n", r"\[reported-std\] names \['b'\]"),
        ("[crosscheck]\na = 1.0\n", r"\[crosscheck\] \['a'\]: allowed values are text"),
    ],
)
def test_a_paper_file_with_unknown_keys_is_refused_naming_it(tmp_path, monkeypatch, text, match):
    from common.errors import ConfigError
    from tools import grid_rows

    (tmp_path / "presets").mkdir()
    (tmp_path / "presets" / "x.paper.toml").write_text(text)
    monkeypatch.setattr(grid_rows, "ROOT", tmp_path)
    with pytest.raises(ConfigError, match="x.paper.toml.*" + match):
        grid_rows.paper_info("x.toml")


def test_where_a_method_is_above_local():
    """Mean over seeds against Local's mean: first round above, the final stretch above, the count."""
    from tools.grid_rows import Cell
    from tools.grid_stats import above_baseline
    from tools.report import describe_above

    def cells(*curves):
        return [Cell("m", s, [{"round": r + 1, "acc": a} for r, a in enumerate(c)], {}) for s, c in enumerate(curves)]

    local = cells([0.2, 0.4, 0.4, 0.5, 0.5], [0.2, 0.4, 0.4, 0.5, 0.5])
    # mean 0.1, 0.5, 0.3, 0.6, 0.7: above at round 2, below again at 3, above from round 4 on
    above = above_baseline(cells([0.0, 0.4, 0.3, 0.7, 0.6], [0.2, 0.6, 0.3, 0.5, 0.8]), local, "acc")
    assert above == {"first": 2, "stays_from": 4, "above": 3, "of": 5}
    assert describe_above("m", above) == "m from round 4 to the end (first at round 2, 3 of 5 rounds)"
    # above at round 3 only, level at the end: passed Local once, not above at the end
    above = above_baseline(cells([0.1, 0.4, 0.5, 0.4, 0.5]), local, "acc")
    assert above == {"first": 3, "stays_from": None, "above": 1, "of": 5}
    assert describe_above("m", above) == "m first at round 3, 1 of 5 rounds, not at the end"
    above = above_baseline(cells([0.1, 0.4, 0.4, 0.5, 0.5]), local, "acc")  # level is not above
    assert above == {"first": None, "stays_from": None, "above": 0, "of": 5}
    assert describe_above("m", above) == "m never"
    # up to the last round both have
    assert above_baseline(cells([0.3, 0.5, 0.5]), local, "acc") == {"first": 1, "stays_from": 1, "above": 3, "of": 3}


def test_report_of_a_plain_flwr_run_folder_takes_the_federation_size_from_the_run(small_config, tmp_path):
    """A run made with plain ``flwr run`` keeps ``num-clients = 0`` (every node) in its config: the partition
    figure asked flwr-datasets for 0 partitions and failed; the federation's size is in the summary or the rows."""
    from tools.grid_rows import Cell
    from tools.grid_stats import with_federation_size
    from tools.report import main

    config = {**small_config, "num-clients": 0, "method": "fedgh"}
    run = tmp_path / "20260101-000000-fedgh-mnist-7"
    run.mkdir()
    rows = [
        {
            "round": r,
            "accuracy_mean": 0.5,
            "accuracy_weighted": 0.6,
            "accuracy_per_client": {"0": 0.4, "1": 0.5, "2": 0.6},
            "bytes_up": 30,
            "bytes_down": 60,
            "eval_bytes_up": 0,
            "eval_bytes_down": 0,
            "num_clients": CLIENTS,
            "round_seconds": 1.0,
        }
        for r in (1, 2)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = {"status": "completed", "rounds_completed": 2, "num_clients": CLIENTS, "config": config}
    (run / "summary.json").write_text(json.dumps(summary))
    assert main([str(run), "--out", str(tmp_path / "report"), "--data-dir", str(DATA_DIR)]) == 0
    assert (tmp_path / "report" / "label_distribution.png").stat().st_size > 10_000
    assert "2 rounds" in (tmp_path / "report" / "report.md").read_text()

    assert with_federation_size(config, [Cell("fedgh", 0, rows, summary)])["num-clients"] == CLIENTS
    # an older summary without num_clients: the rows say it (fraction-train 0.5 of 6: partition id 5 seen)
    sampled = [{**rows[0], "num_clients": 3, "accuracy_per_client": {"1": 0.5, "5": 0.6}}]
    assert with_federation_size(config, [Cell("fedgh", 0, sampled, {"status": "completed"})])["num-clients"] == 6
    assert with_federation_size(small_config, [])["num-clients"] == CLIENTS  # a config that sets it is kept
    with pytest.raises(ConfigError, match="num-clients = 0 and no summary or round row"):
        with_federation_size(config, [])


def test_a_round_with_missing_evaluations_is_left_out_of_curves_and_numbers():
    """A row whose evaluation some clients failed (eval_missing) counts in no curve, mean or best,
    as in the run's summary; the seeds' curves stay aligned by round."""
    from tools.grid_rows import Cell
    from tools.grid_stats import above_baseline, method_stats, seed_curves

    def rows(curve, missing=()):
        return [
            {
                "round": r + 1,
                "accuracy_weighted": a,
                "accuracy_mean": a,
                "eval_missing": [7] if r + 1 in missing else [],
                **{"num_clients": 2, "bytes_up": 0, "bytes_down": 0, "round_seconds": 1.0},
            }
            for r, a in enumerate(curve)
        ]

    # seed 1's round 2 was evaluated on one client only (its 0.99 is not the federation's)
    cells = [Cell("m", 0, rows([0.2, 0.4, 0.5]), {}), Cell("m", 1, rows([0.3, 0.99, 0.6], missing={2}), {})]
    rounds, values = seed_curves(cells, "accuracy_weighted")
    assert rounds.tolist() == [1, 3]
    assert values.tolist() == [[0.2, 0.5], [0.3, 0.6]]
    stats = method_stats(cells, "accuracy_weighted", None)
    assert stats["best_accuracy_weighted"][0] == pytest.approx((0.5 + 0.6) / 2)  # not seed 1's 0.99
    local = [Cell("local", s, rows([0.25, 0.1, 0.5]), {}) for s in (0, 1)]
    # round 2 (seed 1 left it out) is not compared; round 1 is level (0.25), round 3 above (0.55 vs 0.5)
    assert above_baseline(cells, local, "accuracy_weighted") == {"first": 3, "stays_from": 3, "above": 1, "of": 2}


def test_a_single_seed_shows_its_value_without_a_spread():
    """Over two or more seeds a cell is ``mean ± sample std``; over one seed only its value (the
    sample std of one seed does not exist, and ``± 0.00`` would read as no spread)."""
    from tools.report import pct

    assert pct((0.9212, 0.0123)) == "92.12 ± 1.23"
    assert pct((0.9212, 0.0), seeds=1) == "92.12"
    assert pct(None, seeds=1) == "-"


def test_every_registered_method_has_a_colour_of_its_own():
    from methods.registry import METHODS
    from tools.figures import method_colors

    colours = method_colors(list(METHODS))
    assert len(set(colours.values())) == len(METHODS)
    assert method_colors(["fedgh", "not-a-method"])["fedgh"] == colours["fedgh"]
