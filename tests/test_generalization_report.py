"""tools.generalization_report on two small synthetic grids with held-out phases: numbers, verdicts, figures,
and regeneration from the copies alone."""

import json

import pytest
from test_report import write_grid

from conftest import DATA_DIR, ROOT
from tools.generalization_report import collect, main, render, verdict_baselines
from tools.grid_stats import prior_accuracy

COMMITTED = ROOT / "results" / "generalization"

#: method -> (held-out personalisation curve of the last phase per seed 0, 1)
CURVES = {"fedre": ([0.2, 0.5, 0.9], [0.3, 0.6, 0.7]), "local": ([0.1, 0.2, 0.3], [0.1, 0.3, 0.4])}


def add_phases(grid):
    for method, curves in CURVES.items():
        for seed, curve in enumerate(curves):
            cell = next(grid.glob(f"{method}-seed{seed}/*"))
            rows = [json.loads(line) for line in (cell / "metrics.jsonl").read_text().splitlines()]
            rows[-1].update(
                heldout_curve_mean=curve, heldout_accuracy_mean=curve[-1], heldout_bytes_up=10, heldout_bytes_down=30
            )
            (cell / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_held_out_numbers_and_figures_regenerate_from_the_copies(tmp_path, small_config):
    write_grid(tmp_path / "homo", small_config)
    add_phases(tmp_path / "homo")
    out = tmp_path / "results"
    assert main([str(out), "--grid", f"homogeneous={tmp_path / 'homo'}"]) == 0
    text = (out / "report.md").read_text()
    # fedre: training finals 0.9 - 0.1 and 0.86 - 0.1 (test_report.ACC); held-out 0.9, 0.7; new 0.2, 0.3;
    # above the prior: each seed's final minus that seed's class prior of the training clients
    clients = list(range(small_config["num-clients"]))
    prior = {seed: prior_accuracy({**small_config, "seed": seed}, clients)[0] for seed in (0, 1)}
    above = ", ".join(f"{100 * (a - prior[seed]):.2f}" for seed, a in ((0, 0.8), (1, 0.76)))
    assert f"| fedre | 0,1 | 78.00 ± 2.83 | {above} | 25.00 ± 7.07 | 80.00 ± 14.14 | 2, - | 40 |" in text
    above = ", ".join(f"{100 * (a - prior[seed]):.2f}" for seed, a in ((0, 0.65), (1, 0.68)))
    assert f"| local | 0,1 | 66.50 ± 2.12 | {above} | 10.00 ± 0.00 | 35.00 ± 7.07 | -, - | 40 |" in text
    assert "not run" in text  # no hypernetwork method in this grid
    assert "(§4.4): no hypernetwork method run." in text  # a baseline alone is no verdict on the claim
    assert "| class prior alone | 0,1 |" in text  # the grid names no held-out partitions: training only
    for name in ("generalization_homogeneous.png", "personalization_homogeneous.png"):
        assert (out / name).stat().st_size > 10_000
    (out / "report.md").unlink()
    assert main([str(out)]) == 0
    assert (out / "report.md").read_text() == text


def test_a_bad_setting_is_refused(tmp_path, small_config):
    write_grid(tmp_path / "homo", small_config)
    assert main([str(tmp_path / "out"), "--grid", f"a/b={tmp_path / 'homo'}"]) == 2


def test_a_grid_that_is_not_one_is_one_line_naming_it_with_exit_2_and_no_output(tmp_path, small_config, capsys):
    """A ``--grid`` folder that is no grid raised FileNotFoundError from copying its ``grid.json`` and left
    the output folder behind; every grid is checked before the first copy."""
    write_grid(tmp_path / "homo", small_config)
    (tmp_path / "empty").mkdir()
    out = tmp_path / "out"
    assert main([str(out), "--grid", f"homo={tmp_path / 'homo'}", "--grid", f"hetero={tmp_path / 'empty'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{tmp_path / 'empty' / 'grid.json'} cannot be read" in err[0], err
    assert not out.exists()


@pytest.fixture
def small_config():
    from test_report import small_config as config

    return config.__wrapped__()


def test_the_class_prior_scores_one_client_class_fully_and_iid_clients_near_chance(small_config):
    one_class = {**small_config, "partitioner": "pathological", "classes-per-client": 1}
    assert prior_accuracy(one_class, [0, 1, 2]) == (1.0, 1.0)  # every test example is the client's class
    mean, pooled = prior_accuracy({**small_config, "partitioner": "iid", "max-examples-per-client": 400}, [0, 1])
    assert 0.05 < pooled < 0.25 and 0.05 < mean < 0.25, (mean, pooled)  # 10 balanced classes: about 1/10


@pytest.mark.parametrize("folder", [COMMITTED, COMMITTED / "runs"], ids=["report", "interim"])
def test_the_committed_report_is_what_its_rows_give(folder):
    """The report at the old budget and the interim one of the learning budget's finished cells."""
    if not (folder / "report.md").is_file():
        pytest.skip(f"no committed generalisation report in {folder}")
    assert (folder / "report.md").read_text() == render(collect(folder, str(DATA_DIR)))


def test_the_baselines_verdict_weighs_the_gap_against_the_seed_spread():
    """Held-out (mean, std) as fractions: a gap over the larger seed std holds, one within it does not, one
    seed is undecided."""

    def stats(hn, gd, fedgh, seeds=(0, 1, 2)):
        return {
            m: {"heldout": h, "seeds": list(seeds)}
            for m, h in (("mh-pfedhn", hn), ("mh-pfedhngd", gd), ("fedgh", fedgh))
        }

    text = verdict_baselines(stats((0.84, 0.02), (0.85, 0.025), (0.76, 0.013)))
    assert text.endswith("mh-pfedhn +8.00 points, mh-pfedhngd +9.00 points (the larger seed std 2.50): holds")
    text = verdict_baselines(stats((0.84, 0.02), (0.78, 0.03), (0.76, 0.013)))
    assert text.endswith("mh-pfedhngd +2.00 points (the larger seed std 3.00): does not hold")
    assert verdict_baselines(stats((0.84, 0.0), (0.85, 0.0), (0.76, 0.0), seeds=(0,))).endswith(
        "on one seed, no spread to judge it against: undecided"
    )
    assert verdict_baselines({"fedgh": {"heldout": (0.7, 0.0), "seeds": [0]}}) == "no hypernetwork method run"
