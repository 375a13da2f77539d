"""``tools.privacy_report``: the cross-method report's numbers are the pooled rows, its verdicts compare with
the gray image, and FedRE's Q2 ordering is judged from the rows."""

import json

import pytest

from tools import privacy_report


def row(payload, attack="inversion", threat="server", knowledge="white-box", round_=1, **scores):
    return {
        "payload": payload,
        "attack": attack,
        "threat": threat,
        "knowledge": knowledge,
        "round": round_,
        "partition": 0,
        "cpu_seconds": 1.0,
        "n": 2,
        **scores,
    }


def write(folder, method, rows):
    (folder / method).mkdir(parents=True)
    (folder / method / "privacy.json").write_text(json.dumps(rows))


def test_report_pools_judges_and_checks_the_q2_ordering(tmp_path):
    write(
        tmp_path,
        "fedre",
        [
            row("z", best_psnr=10.0, best_psnr_std=0.0, gray_psnr=13.0, gray_psnr_std=0.0, best_mse=6000.0),
            row(
                "z",
                knowledge="black-box (global head)",
                attack="decoder",
                best_psnr=7.0,
                best_psnr_std=0.0,
                gray_psnr=13.0,
            ),
            row("per-sample representation", psnr_own=14.0, psnr_own_std=1.0, gray_psnr_own=11.0, best_psnr=16.0),
            row("class mean representation", best_psnr=12.0, best_psnr_std=0.0, gray_psnr=15.0, best_mse=4000.0),
            row(
                "entangled label y",
                attack="labels",
                knowledge="payload only",
                label_precision=1.0,
                label_recall=1.0,
                distribution_l1=0.5,
            ),
        ],
    )
    write(
        tmp_path,
        "mh-pfedhngd",
        [
            row(
                "global model: update as one gradient (iDLG)",
                attack="update",
                best_psnr=20.0,
                best_psnr_std=0.0,
                gray_psnr=17.0,
            ),
            row(
                "global model: update as one gradient (iDLG)",
                attack="update",
                round_=1,
                best_psnr=22.0,
                best_psnr_std=0.0,
                gray_psnr=17.0,
            ),
        ],
    )
    assert privacy_report.main([str(tmp_path)]) == 0
    text = (tmp_path / "report.md").read_text()
    assert "| fedre | 1 | z | 10.0 ± 0.0 | 7.0 ± 0.0 | 13.0 ± 0.0 | no better than a gray image |" in text
    assert "| fedre | 1 | entangled label y | 1.00 ± 0.00 | 1.00 ± 0.00 | 0.50 ± 0.00 |" in text
    assert "| 1 | per-sample (to its image) | 14.0 ± 1.0 | - | 11.0 ± 0.0 | - | - |" in text
    assert "| 1 | per-sample (best match) | 16.0 ± 0.0 |" in text
    assert "round 1: per-sample 16.0, prototype 12.0, entangled 10.0 dB: holds" in text
    # two rows of 2 reconstructions each at 20 and 22 dB pool to 21 ± 1, 4 dB above the gray image
    assert "| 1 | global model | update as one gradient (iDLG) | 21.0 ± 1.0 | 17.0 ± 0.0 | recovers more" in text


def test_an_empty_folder_is_refused(tmp_path, capsys):
    assert privacy_report.main([str(tmp_path)]) == 2
    assert "privacy.json" in capsys.readouterr().err


@pytest.mark.parametrize(
    "rows, expected",
    [
        ({"round": 1}, "holds a JSON dict, not a list of rows"),
        (["fedgh"], "row 0 holds a JSON str, not an object"),
        ([row("z", round_="1")], "row 0: key 'round' is '1', expected a int"),
        ([row("z", best_psnr="high")], "row 0: key 'best_psnr' is 'high', expected a number or null"),
    ],
)
def test_a_malformed_privacy_json_is_one_line_naming_it_with_exit_2(tmp_path, capsys, rows, expected):
    """A ``privacy.json`` that is not a list of rows raised a TypeError deep in the tables."""
    write(tmp_path, "fedgh", rows)
    assert privacy_report.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{tmp_path / 'fedgh' / 'privacy.json'}" in err[0] and expected in err[0], err
    assert not (tmp_path / "report.md").exists()
