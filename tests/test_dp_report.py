"""tools.dp_report on two small synthetic grids (no DP and ε = 8): numbers, the attack columns, the figure,
and regeneration from the copies alone."""

import json
import statistics

import pytest
from test_report import ACC, CLIENTS, write_grid

from conftest import DATA_DIR, ROOT
from tools.dp_report import collect, main, render

COMMITTED = ROOT / "results" / "privacy-dp"


def test_accuracy_and_attacks_against_epsilon_regenerate_from_the_copies(tmp_path, small_config):
    write_grid(tmp_path / "plain", small_config)
    write_grid(tmp_path / "private", small_config, overrides={"dp.epsilon": 8.0}, shift=-0.2)
    for cell in (tmp_path / "private").glob("*-seed*/*"):
        rows = [json.loads(line) for line in (cell / "metrics.jsonl").read_text().splitlines()]
        for r in rows:
            r["dp_epsilon_max"] = 2.0 * r["round"]
            mechanism = {"sample_rate": 0.16, "steps": 7, "clip_norm": 7.0 + r["round"], "payload_clip": 10.0}
            r["dp_per_client"] = {
                "0": {"epsilon_rdp": 3.0 * r["round"], "noise_multiplier": 1.5, "release_noise_multiplier": 6.0}
                | mechanism,
                "1": {"epsilon_rdp": 1.0, "noise_multiplier": 2.5 + r["round"], "release_noise_multiplier": 8.0}
                | mechanism,
            }
        (cell / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    last = rows[-1]["round"]
    attacked = next((tmp_path / "private").glob("fedre-seed0/*")) / "privacy"
    attacked.mkdir()
    cell = {"round": 2, "partition": 0, "cpu_seconds": 1.0}  # every row tools.privacy writes has these
    attack = {**cell, "threat": "server", "knowledge": "white-box", "attack": "inversion", "payload": "z", "n": 2}
    rows = [
        # a class-mean upload: best-matched, with the exact class mean's ceiling; one image's: to its own image
        {**attack, "best_psnr": 11.0, "best_psnr_std": 0.0, "gray_psnr": 17.0, "gray_psnr_std": 0.0}
        | {"ceiling_psnr": 19.0},
        {**attack, "attack": "update", "payload": "weights", "best_psnr": 9.0, "gray_psnr": 9.0}
        | {"psnr_own": 20.0, "gray_psnr_own": 12.0},
        {**attack, "payload": "class mean representation", "best_psnr": 30.0, "gray_psnr": 17.0},
        {**cell, "threat": "server", "knowledge": "white-box + public class means", "attack": "membership"}
        | {"payload": "z", "mia_auc": 0.6, "mia_tpr_at_1pct_fpr": 0.05},
        {**cell, "threat": "server", "knowledge": "payload only", "attack": "labels", "payload": "lar"}
        | {"label_recall": 0.5},
    ]
    (attacked / "privacy.json").write_text(json.dumps(rows))
    out = tmp_path / "results"
    assert main([str(out), "--grid", f"inf={tmp_path / 'plain'}", "--grid", f"8={tmp_path / 'private'}"]) == 0
    text = (out / "report.md").read_text()
    final = [ACC["fedre"][s][-1] for s in (0, 1)]
    mean = sum(final) / 2
    assert f"| fedre | inf | 0,1 | {100 * mean:.2f} ± " in text
    assert f"| fedre | 8 | 0,1 | {100 * (mean - 0.2):.2f} ± " in text
    # ε spent: the largest over rows (PLD, then RDP), the σ, q, steps and clips of the last round's clients, mean
    # over clients and seeds; the upload's attacks only (not the ladder's class mean): the gains above gray
    # (11 - 17 best-matched, 20 - 12 to its own image), the class mean's ceiling (19 - 17), membership, labels
    sigma = (1.5 + 2.5 + last) / 2
    guarantee = f"| record | {2.0 * last:.3g} | {3.0 * last:.3g} | {sigma:.3g} | 7 | 0.16 | 7 | {7.0 + last:.3g} | 10 |"
    assert f"{guarantee} 0.60 (1) | 0.050 ± 0.000 | 1.0 ± 9.9 (2) | 2.0 ± 0.0 | 0.50 ± 0.00 |" in text
    assert "| - | - | - | - | - | - | - | - | - |" in text  # the grid without DP
    assert "Class prior alone (every client predicts" in text and " pooled, " in text
    # above prior: each seed's final pooled accuracy minus the class prior of that seed's partitions
    from tools.grid_stats import prior_accuracy

    gains = [ACC["fedre"][s][-1] - prior_accuracy({**small_config, "seed": s}, list(range(CLIENTS)))[1] for s in (0, 1)]
    gain = f"{100 * statistics.mean(gains):.2f} ± {100 * statistics.stdev(gains):.2f}"
    assert f"| fedre | inf | 0,1 | {100 * mean:.2f} ± {100 * statistics.stdev(final):.2f} | {gain} |" in text
    # the share of the no-DP gain over the prior that ε = 8 keeps: (gain - 20 points) / gain
    mean_gain = statistics.mean(gains)
    assert f"| {(mean_gain - 0.2) / mean_gain:.2f} | record |" in text
    assert (out / "accuracy_vs_epsilon.png").stat().st_size > 10_000
    (out / "report.md").unlink()
    assert main([str(out)]) == 0
    assert (out / "report.md").read_text() == text


@pytest.mark.parametrize("label", ["zero", "0", "8-", "8-Adaptive", "8 adaptive"])
def test_a_bad_epsilon_label_is_refused(tmp_path, small_config, label):
    write_grid(tmp_path / "plain", small_config)
    assert main([str(tmp_path / "out"), "--grid", f"{label}={tmp_path / 'plain'}"]) == 2


def test_a_variant_grid_gets_rows_of_its_own(tmp_path, small_config):
    write_grid(tmp_path / "plain", small_config)
    write_grid(tmp_path / "private", small_config, overrides={"dp.epsilon": 8.0}, shift=-0.2)
    write_grid(tmp_path / "adaptive", small_config, overrides={"dp.epsilon": 8.0, "dp.adaptive-clip": True}, shift=-0.1)
    out = tmp_path / "results"
    grids = [f"inf={tmp_path / 'plain'}", f"8={tmp_path / 'private'}", f"8-adaptive={tmp_path / 'adaptive'}"]
    assert main([str(out), *(a for g in grids for a in ("--grid", g))]) == 0
    text = (out / "report.md").read_text()
    final = statistics.mean(ACC["fedre"][s][-1] for s in (0, 1))
    assert f"| fedre | 8-adaptive | 0,1 | {100 * (final - 0.1):.2f} ± " in text
    assert f"| fedre | 8 | 0,1 | {100 * (final - 0.2):.2f} ± " in text


def test_a_grid_that_is_not_one_or_a_bad_privacy_json_is_one_line_naming_it_with_exit_2_and_no_output(
    tmp_path, small_config, capsys
):
    """A ``--grid`` folder that is no grid raised FileNotFoundError from copying its ``grid.json``; every
    grid and ``privacy.json`` is checked before the first copy, so a bad second grid leaves no output."""
    write_grid(tmp_path / "plain", small_config)
    write_grid(tmp_path / "private", small_config, overrides={"dp.epsilon": 8.0})
    attacked = next((tmp_path / "private").glob("fedre-seed0/*")) / "privacy"
    attacked.mkdir()
    (attacked / "privacy.json").write_text(json.dumps({"rows": []}))
    (tmp_path / "empty").mkdir()
    out = tmp_path / "out"
    cases = {
        "empty": f"{tmp_path / 'empty' / 'grid.json'} cannot be read",
        "private": f"{attacked / 'privacy.json'} holds a JSON dict, not a list of rows",
    }
    for folder, expected in cases.items():
        assert main([str(out), "--grid", f"inf={tmp_path / 'plain'}", "--grid", f"8={tmp_path / folder}"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and expected in err[0], err
        assert not out.exists(), folder


@pytest.fixture
def small_config():
    from test_report import small_config as config

    return config.__wrapped__()


@pytest.mark.skipif(not (COMMITTED / "report.md").is_file(), reason="no committed DP evaluation")
def test_the_committed_report_is_what_its_rows_give():
    assert (COMMITTED / "report.md").read_text() == render(*collect(COMMITTED, str(DATA_DIR)))


def test_an_interrupted_run_does_not_count_as_a_final_accuracy(tmp_path, small_config):
    write_grid(tmp_path / "plain", small_config)
    write_grid(tmp_path / "private", small_config, overrides={"dp.epsilon": 8.0}, shift=-0.2)
    stopped = next((tmp_path / "private").glob("local-seed1/*")) / "summary.json"
    stopped.write_text(json.dumps({"status": "interrupted", "rounds_completed": 4}))
    out = tmp_path / "results"
    assert main([str(out), "--grid", f"inf={tmp_path / 'plain'}", "--grid", f"8={tmp_path / 'private'}"]) == 0
    text = (out / "report.md").read_text()
    assert "| local | inf | 0,1 |" in text and "| local | 8 | 0 |" in text


def test_client_level_dp_is_read_from_its_own_row_keys(tmp_path, small_config):
    write_grid(tmp_path / "plain", small_config)
    write_grid(tmp_path / "private", small_config, overrides={"client-dp.epsilon": 4.0}, shift=-0.1)
    for cell in (tmp_path / "private").glob("*-seed*/*"):
        rows = [json.loads(line) for line in (cell / "metrics.jsonl").read_text().splitlines()]
        for r in rows:
            r |= {"client_dp_epsilon": 0.4 * r["round"], "client_dp_epsilon_rdp": 0.5 * r["round"]}
            r |= {"client_dp_noise_multiplier": 1.2, "client_dp_sample_rate": 0.5, "client_dp_clip_norm": 0.15}
        (cell / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    last = rows[-1]["round"]
    out = tmp_path / "results"
    assert main([str(out), "--grid", f"inf={tmp_path / 'plain'}", "--grid", f"4={tmp_path / 'private'}"]) == 0
    text = (out / "report.md").read_text()
    assert f"| client | {0.4 * last:.3g} | {0.5 * last:.3g} | 1.2 | - | 0.5 | - | 0.15 | - |" in text


def test_a_method_that_refuses_dp_keeps_its_no_dp_row_and_one_that_was_not_run_does_not(
    tmp_path, small_config, monkeypatch
):
    # FedSA's options refuse dp.epsilon > 0; Local's do not, so Local at one ε only is a grid not finished
    import test_report

    monkeypatch.setitem(test_report.ACC, "fedsa", test_report.ACC["local"])
    monkeypatch.setitem(test_report.BYTES, "fedsa", (4_016, 20_000))
    write_grid(tmp_path / "plain", small_config, methods=("fedre", "local", "fedsa"))
    write_grid(tmp_path / "private", small_config, methods=("fedre",), overrides={"dp.epsilon": 8.0})
    out = tmp_path / "results"
    assert main([str(out), "--grid", f"inf={tmp_path / 'plain'}", "--grid", f"8={tmp_path / 'private'}"]) == 0
    text = (out / "report.md").read_text()
    assert "| fedsa | inf | 0,1 |" in text and "| refused |" in text
    assert "| local |" not in text
    assert "their options refusing `dp.epsilon` > 0 (level `refused`; docs/privacy.md): fedsa." in text
