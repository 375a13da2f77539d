"""``tools.privacy_report`` on a small synthetic grid with attack rows: the intervals are the cells', each
verdict fires on a case built for it and only there, FedRE's Q2 ordering is judged from paired cells, the
report regenerates from its copies alone, and bad input is one line naming the file."""

import json
import statistics

import pytest
from scipy import stats
from test_report import write_grid

from tools import privacy_report
from tools.privacy_report import MARGIN_DB, main, verdict

T_3 = 3.182446305284263  # Student t, 97.5 % quantile, 3 degrees of freedom (four cells)


@pytest.fixture
def small_config():
    from test_report import small_config as config

    return config.__wrapped__()


def row(payload, seed=0, partition=0, round_=2, attack="inversion", threat="server", knowledge="white-box", **scores):
    base = {"payload": payload, "attack": attack, "threat": threat, "knowledge": knowledge, "round": round_}
    return base | {"seed": seed, "partition": partition, "cpu_seconds": 1.0, "n": 2, **scores}


def cells(payload, gains, gray=10.0, **scores):
    """One row per (seed, partition) of 2 x 2 with best-match gains ``gains`` over ``gray``."""
    keys = [(s, p) for s in (0, 1) for p in (0, 1)]
    return [
        row(payload, seed=s, partition=p, best_psnr=gray + g, gray_psnr=gray, **scores)
        for (s, p), g in zip(keys, gains, strict=True)
    ]


def test_each_verdict_fires_on_its_case():
    chance = 0.1
    # gain above the margin and above the exact mean's: examples
    assert verdict(cells("protos", [5, 5.2, 4.8, 5.1], ceiling_psnr=12.0), chance) == "recovers examples"
    # the same gains, below the exact mean's: not examples; beside non-members 3 dB lower: beyond the class
    upload = cells("protos", [5, 5.2, 4.8, 5.1], ceiling_psnr=18.0, recognised=0.0)
    control = cells("non-member class mean representation", [2, 2.1, 1.9, 2.0])
    assert verdict(upload, chance, control) == "beyond the class"
    # as good as non-members: no more than the class; recognised far above chance: shows the class
    same = cells("non-member class mean representation", [5, 5.2, 4.8, 5.1])
    recognised = cells("protos", [5, 5.2, 4.8, 5.1], ceiling_psnr=18.0, recognised=0.9)
    assert verdict(recognised, chance, same) == "shows the class"
    # a gain no classifier reads as the class: the images' mean look; nothing at all: nothing found
    assert verdict(cells("protos", [5, 5.2, 4.8, 5.1], ceiling_psnr=18.0, recognised=0.0), chance, same) == (
        "the images' mean look"
    )
    assert verdict(cells("protos", [0.2, -0.1, 0.0, 0.3], recognised=0.1), chance) == "nothing found"
    # one cell gives no interval, so no verdict; nor two of which one has no score
    assert verdict(cells("protos", [5, 5.2, 4.8, 5.1])[:1], chance) == "-"
    assert verdict(cells("protos", [5, 5.2, 4.8, 5.1])[:1] + [row("protos", seed=1, best_psnr=None)], chance) == (
        "nothing found"
    )
    # a per-example row is judged to its own image over the better of gray and the mean image
    own = [r | {"psnr_own": 20.0, "gray_psnr_own": 12.0, "mean_image_psnr_own": 18.5} for r in cells("x", [9] * 4)]
    assert privacy_report.gain(own[0]) == pytest.approx(MARGIN_DB + 0.5)
    assert verdict(own, chance) == "recovers examples"
    assert verdict([r | {"mean_image_psnr_own": 19.5} for r in own], chance) == "nothing found"


def write_rows(grid, method, seed, rows, folder="privacy", budget='{"steps": 5}'):
    out = next((grid / f"{method}-seed{seed}").glob("*")) / folder
    out.mkdir()
    (out / "privacy.json").write_text(json.dumps([{k: v for k, v in r.items() if k != "seed"} for r in rows]))
    (out / "privacy.md").write_text(f"Budgets (tools.privacy flags) of the cells: {budget}.\n")


def test_the_report_is_its_rows_and_regenerates_from_the_copies(tmp_path, small_config):
    grid = tmp_path / "grid"
    write_grid(grid, small_config)
    gains = [5.0, 5.5, 4.5, 6.0]
    upload = cells("z", gains, ceiling_psnr=20.0, recognised=0.5)
    ladder = []
    for r in cells("per-sample representation", [3] * 4):
        ladder.append(r | {"mean_psnr": 14.0 + r["seed"], "psnr_own": 16.0, "gray_psnr_own": 11.0})
    for r in cells("class mean representation", [2] * 4):
        ladder.append(r | {"mean_psnr": 12.0 + r["seed"] + 0.1 * r["partition"]})
    for r in upload:
        r["mean_psnr"] = 11.0 + r["seed"]
    membership = [
        row("z", seed=s, partition=p, attack="membership", knowledge="white-box", mia_auc=0.5 + 0.02 * (s + p))
        for s in (0, 1)
        for p in (0, 1)
    ]
    labels = [
        row("entangled label y", seed=s, attack="labels", knowledge="payload only", label_precision=1.0)
        | {"label_recall": 1.0, "distribution_l1": 0.2 * (s + 1), "counts_exact": 0.5}
        for s in (0, 1)
    ]
    for seed in (0, 1):
        mine = [r for r in upload + ladder + membership + labels if r["seed"] == seed]
        write_rows(grid, "fedre", seed, mine)
        dip = [r | {"mean_psnr": r["mean_psnr"] + 1.0} for r in upload + ladder if r["seed"] == seed]
        write_rows(grid, "fedre", seed, dip, privacy_report.DIP, '{"prior": "dip"}')
    out = tmp_path / "results"
    assert main([str(out), "--grid", str(grid)]) == 0
    text = (out / "report.md").read_text()
    m, sd = statistics.mean(gains), statistics.stdev(gains)
    half = T_3 * sd / 2
    assert f"| fedre | z | 2 | 4 | {m:.1f} [{m - half:.1f}, {m + half:.1f}] | 10.0 [10.0, 10.0] | - | - |" in text
    # recognised: pooled over the reconstructions (half of 2 in each of 4 cells), Clopper-Pearson 95 %
    low, high = stats.binomtest(4, 8).proportion_ci(0.95)
    assert f"| 4/8 = 0.50 [{low:.2f}, {high:.2f}] |" in text
    aucs = [0.5, 0.52, 0.52, 0.54]
    m, half = statistics.mean(aucs), T_3 * statistics.stdev(aucs) / 2
    assert f"| fedre | 2 | z | white-box | 4 | {m:.2f} [{m - half:.2f}, {m + half:.2f}] |" in text
    # label leakage: mean ± std over cells, the count leakage beside the class set; membership is no reconstruction
    assert "| fedre | 2 | entangled label y | 2 | 1.00 ± 0.00 | 1.00 ± 0.00 | 0.30 ± 0.10 | 0.50 ± 0.00 |" in text
    assert "| fedre | z | 2 | 4 |" in text and "| fedre | model as uploaded |" not in text
    # Q2: per-sample 14/15, prototype 12/13 (+0.1 for partition 1), entangled 11/12: both differences > 0
    assert "| 2 | 4 | 16.0 [16.0, 16.0] | 14.5 [" in text and "| holds | 12.89 / 4514.91" in text
    # the deep image prior's rows: a ladder of their own (every rung 1 dB up), in no other table
    dip = text.split("The deep image prior", 1)[1]
    assert "| 2 | 4 | 16.0 [16.0, 16.0] | 15.5 [" in dip and "| holds |" in dip
    assert text.count("| fedre | z | 2 | 4 |") == 1
    assert (
        '`{"prior": "dip"}`' in text
        and '`{"steps": 5}`' in text
        and (out / privacy_report.FIGURE_NAME).stat().st_size > 10_000
    )
    (out / "report.md").unlink()
    assert main([str(out)]) == 0
    assert (out / "report.md").read_text() == text


def test_without_a_grid_copy_or_with_a_bad_privacy_json_it_is_one_line_with_exit_2(tmp_path, small_config, capsys):
    assert main([str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds no grid copy" in err[0]
    grid = tmp_path / "grid"
    write_grid(grid, small_config)
    run = next((grid / "fedre-seed0").glob("*"))
    (run / "privacy").mkdir()
    (run / "privacy" / "privacy.json").write_text(json.dumps({"rows": []}))
    assert main([str(tmp_path / "out"), "--grid", str(grid)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds a JSON dict, not a list of rows" in err[0]


def test_a_shared_module_attacked_with_the_private_models_is_a_server_upload_named_with_that_knowledge():
    """FML's, FedKD's and FedMRL's update attack knows the victim's private models too: its rows were left
    out of the server's table (knowledge not exactly ``white-box``); they are in it, named with what the
    attacker knew, and a black-box decoder's rows stay out."""
    from tools.privacy_report import server_table

    update = "update over 7 steps (inverting gradients)"
    rows = cells(update, [3.0, 3.5, 4.0, 4.5], attack="update")
    rows = [{**r, "knowledge": "white-box + private models"} for r in rows]
    rows += [row("prototype", knowledge="black-box (decoder)", best_psnr=30.0, gray_psnr=10.0)]
    table = "\n".join(server_table({"fml": rows}, 0.1))
    assert f"| fml | {update} [white-box + private models] | 2 | 4 | 3.8 [" in table
    assert "prototype" not in table
