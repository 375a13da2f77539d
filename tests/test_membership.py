"""Membership inference and label-count leakage (``tools.privacy_membership``, ``tools.privacy``'s
``membership`` cells): the ROC summary against its definition, positive controls that must fire and
negative controls that must not, on the project's CNNs and real CIFAR-10 test images, and the attack
wired into ``tools.privacy`` on recorded FedGH and LG-FedAvg runs.

The measured numbers are beside each assertion (seed 0, one thread); each test takes a few seconds.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from common.data import normalize
from common.datasets import DATASETS
from conftest import CIFAR_TEST_SPLIT, cifar_test_images
from models.cnn import build_cnn
from privacy import labels
from tools import privacy
from tools import privacy_membership as membership
from tools.privacy_attacks import label_row

INFO = DATASETS["cifar10"]
needs_cifar = pytest.mark.skipif(not CIFAR_TEST_SPLIT.is_file(), reason=f"no CIFAR-10 test split at {CIFAR_TEST_SPLIT}")


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def cifar():
    """:func:`conftest.cifar_test_images`."""
    return cifar_test_images()


def model(name: str) -> torch.nn.Module:
    """CNN-i at initialisation (seed 0), eval mode."""
    torch.manual_seed(0)
    return build_cnn(name, INFO.num_classes).eval()


# ---------------------------------------------------------------------------------------------- ROC


def test_roc_summary_is_the_pairwise_auc_and_the_zero_false_positive_tpr():
    # by hand: member 0.9 beats all 4 non-members, 0.8 three, 0.3 two: AUC 9/12; with 4 non-members an
    # FPR of at most 1 % allows none above the threshold, so only 0.9 (> 0.85) is caught: TPR 1/3
    got = membership.roc_summary([0.9, 0.8, 0.3], [0.85, 0.1, 0.2, 0.4])
    assert got == pytest.approx({"auc": 0.75, "tpr_at_1pct_fpr": 1 / 3})
    # ties count one half, and a threshold catches every member tied with a false positive too
    assert membership.roc_summary([1.0, 1.0], [1.0, 0.0]) == pytest.approx({"auc": 0.75, "tpr_at_1pct_fpr": 0.0})
    assert membership.roc_summary([2.0], [1.0])["auc"] == 1.0
    assert membership.roc_summary([1.0], [2.0]) == {"auc": 0.0, "tpr_at_1pct_fpr": 0.0}
    rng = np.random.default_rng(0)
    for _ in range(50):  # integer scores: many ties
        pos, neg = rng.integers(0, 6, rng.integers(1, 40)), rng.integers(0, 6, rng.integers(1, 300))
        pairs = (pos[:, None] > neg[None, :]).mean() + 0.5 * (pos[:, None] == neg[None, :]).mean()
        caught = [(pos >= t).mean() for t in np.unique(np.r_[pos, neg]) if (neg >= t).mean() <= 0.01]
        got = membership.roc_summary(pos, neg)
        assert got["auc"] == pytest.approx(pairs) and got["tpr_at_1pct_fpr"] == pytest.approx(max(caught, default=0))
    # 1,000 non-members: 10 false positives are allowed
    neg = np.arange(1000.0)
    assert membership.roc_summary([989.5, 995.0, 980.0], neg)["tpr_at_1pct_fpr"] == pytest.approx(2 / 3)


def test_a_score_that_knows_nothing_gets_the_documented_chance_level():
    # continuous scores drawn alike for 200 members and m non-members: AUC 0.5 and TPR at 1 % FPR
    # (⌊0.01 m⌋ + 1) / (m + 1) on average (the threshold sits above the (⌊0.01 m⌋ + 1)-th highest
    # non-member). Over 2,000 draws: m = 100 (one false positive allowed): 0.4995 and 0.0201 (chance
    # 0.0198, std 0.017 a draw); m = 64 (none): 0.5003 and 0.0150 (0.0154); m = 300 (three): 0.4997 and
    # 0.0131 (0.0133)
    rng = np.random.default_rng(2)
    for m, chance in ((100, 2 / 101), (64, 1 / 65), (300, 4 / 301)):
        got = [membership.roc_summary(rng.normal(size=200), rng.normal(size=m)) for _ in range(2000)]
        assert np.mean([g["auc"] for g in got]) == pytest.approx(0.5, abs=0.005)
        assert np.mean([g["tpr_at_1pct_fpr"] for g in got]) == pytest.approx(chance, rel=0.1), m


def test_roc_summary_agrees_with_scikit_learn():
    metrics = pytest.importorskip("sklearn.metrics")  # the crosscheck extra, not a dependency
    rng = np.random.default_rng(1)
    pos, neg = rng.normal(0.5, 1, 300), rng.normal(0, 1, 2000)
    truth = np.r_[np.ones(300), np.zeros(2000)]
    fpr, tpr, _ = metrics.roc_curve(truth, np.r_[pos, neg], drop_intermediate=False)
    got = membership.roc_summary(pos, neg)
    assert got["auc"] == pytest.approx(metrics.roc_auc_score(truth, np.r_[pos, neg]))
    assert got["tpr_at_1pct_fpr"] == pytest.approx(tpr[fpr <= 0.01].max())


@pytest.mark.parametrize("members, nonmembers", [([], [1.0]), ([1.0], []), ([np.nan], [1.0]), ([1.0], [np.inf])])
def test_roc_summary_refuses_an_empty_or_non_finite_side(members, nonmembers):
    with pytest.raises(ValueError, match="members|finite"):
        membership.roc_summary(members, nonmembers)


# --------------------------------------------------------------------------------- loss threshold


@needs_cifar
def test_the_loss_threshold_finds_the_members_of_an_overfit_model_and_not_of_a_fresh_one(cifar):
    # CNN-1 trained to a loss of 6e-5 on 32 images (Adam 1e-3, 50 full-batch steps, about 2 s of CPU),
    # against 500 other test images of the same 10 classes: AUC 0.979, TPR at 1 % FPR 0.094 (a few
    # non-members are fitted as confidently as members: the loss threshold is weak at low FPR, Carlini et
    # al. 2022's point); the same CNN at initialisation: AUC 0.513
    images, labels_ = cifar
    members, nonmembers = (images[:32], labels_[:32]), (images[500:], labels_[500:])
    fresh = model("cnn1")
    got = membership.roc_summary(
        membership.loss_scores(fresh, *members, INFO), membership.loss_scores(fresh, *nonmembers, INFO)
    )
    assert abs(got["auc"] - 0.5) < 0.15, got
    net = model("cnn1").train()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    for _ in range(50):
        opt.zero_grad()
        F.cross_entropy(net(normalize(members[0], INFO)), members[1]).backward()
        opt.step()
    got = membership.roc_summary(
        membership.loss_scores(net, *members, INFO), membership.loss_scores(net, *nonmembers, INFO)
    )
    assert got["auc"] > 0.9 and got["tpr_at_1pct_fpr"] > 0.03, got


# --------------------------------------------------------------------------------- per-class vectors


def vector_test(features: torch.Tensor, labels_: torch.Tensor, k: int, other: bool = False) -> dict[str, dict]:
    """The likelihood-ratio and distance tests over the 10 classes of ``features`` ``[1000, w]``: per class
    the payload row is the mean of its first ``k`` examples' vectors (``other``: of the next ``k``, which
    are no candidates), candidates are those first ``k`` (members) and examples 60-79 of the class
    (non-members), the reference the mean of examples 80-99. Scores pooled over the classes."""
    found = {"ratio": ([], []), "distance": ([], [])}
    for c in range(10):
        f = features[labels_ == c]
        payload = f[k : 2 * k].mean(0) if other else f[:k].mean(0)
        for side, candidates in enumerate((f[:k], f[60:80])):
            found["ratio"][side].append(membership.likelihood_ratio_scores(candidates, payload, f[80:].mean(0)))
            found["distance"][side].append(membership.distance_scores(candidates, payload))
    return {test: membership.roc_summary(*(np.concatenate(s) for s in sides)) for test, sides in found.items()}


@needs_cifar
def test_a_prototype_of_four_members_gives_them_away_and_one_of_others_does_not(cifar):
    # CNN-5 at initialisation, 500-d representations, 40 members and 200 non-members over 10 classes.
    # Mean of 4 members: likelihood ratio AUC 0.92 and TPR at 1 % FPR 0.38, the plain distance AUC 0.81
    # and TPR 0.05 (it scores how typical of the class a candidate is, not only membership); mean of 16:
    # 0.74 (distance 0.58), of 32: 0.66 (0.53): the signal fades as the class grows (each member is 1/k of
    # the mean). Mean of 4 other examples of the class: 0.46 (distance 0.48); a random non-negative vector
    # of the class mean's norm: 0.56. CNN-1: 0.92, 0.73, 0.65, 0.42 and 0.58
    images, labels_ = cifar
    with torch.no_grad():
        features = model("cnn5").extractor(normalize(images, INFO))
    four = vector_test(features, labels_, 4)
    assert four["ratio"]["auc"] > 0.85 and four["ratio"]["tpr_at_1pct_fpr"] > 0.2, four
    assert four["ratio"]["auc"] > four["distance"]["auc"] > 0.65, four
    sixteen = vector_test(features, labels_, 16)
    assert 0.6 < sixteen["ratio"]["auc"] < four["ratio"]["auc"] - 0.1, sixteen
    others = vector_test(features, labels_, 4, other=True)
    assert abs(others["ratio"]["auc"] - 0.5) < 0.15 and abs(others["distance"]["auc"] - 0.5) < 0.15, others
    g = torch.Generator().manual_seed(0)
    random = {"ratio": ([], [])}
    for c in range(10):
        f = features[labels_ == c]
        payload = torch.rand(f.shape[1], generator=g) * (f[0] > 0)
        payload = payload * f.mean(0).norm() / payload.norm()
        for side, candidates in enumerate((f[:4], f[60:80])):
            random["ratio"][side].append(membership.likelihood_ratio_scores(candidates, payload, f[80:].mean(0)))
    got = membership.roc_summary(*(np.concatenate(s) for s in random["ratio"]))
    assert abs(got["auc"] - 0.5) < 0.15, got


# ------------------------------------------------------------------------------------- label counts


def test_count_leakage_counts_the_class_counts_a_distribution_gives_away():
    truth = np.array([0, 120, 30, 50, 0])
    exact = truth / truth.sum()
    # knowing the set only: 66.7 each, within 10 % of none of 120, 30, 50
    assert membership.count_leakage(exact, 200, truth) == {
        "counts_exact": 1.0,
        "counts_within_10pct": 1.0,
        "set_only_within_10pct": 0.0,
        "classes_held": 3.0,
    }
    # uniform over the held classes (FedRE's ``rap`` soft label): 66.7 each, none exact, none within 10 %
    uniform = (truth > 0) / 3
    assert membership.count_leakage(uniform, 200, truth)["counts_within_10pct"] == 0.0
    # 125 (+4 %) and 28 (-7 %) are within 10 %, 47 is too (-6 %), none exact
    off = np.array([0, 125, 28, 47, 0]) / 200
    assert membership.count_leakage(off, 200, truth) == {
        "counts_exact": 0.0,
        "counts_within_10pct": 1.0,
        "set_only_within_10pct": 0.0,
        "classes_held": 3.0,
    }
    assert membership.count_leakage(None, 200, truth)["counts_exact"] == 0.0
    # a balanced client (two classes of 100): the class set alone gives both counts
    assert membership.count_leakage(None, 200, np.array([100, 0, 100]))["set_only_within_10pct"] == 1.0
    assert membership.count_leakage(None, 205, np.array([100, 0, 105]))["set_only_within_10pct"] == 1.0


def test_label_rows_carry_the_count_leakage():
    truth = np.array([0, 120, 30, 50, 0])
    # FedRE's ``var`` soft label is n_c / n: every count, exactly; class ids: the set, no count
    row = label_row("entangled label y", labels.from_soft_label(truth / truth.sum()), truth)
    assert row["counts_exact"] == 1.0 and row["label_recall"] == 1.0 and row["distribution_l1"] < 1e-12
    row = label_row("lar class ids", labels.from_class_ids([1, 2, 3], 5), truth)
    assert row["counts_exact"] == row["counts_within_10pct"] == 0.0 and row["label_precision"] == 1.0


# --------------------------------------------------------------------------------- tools.privacy


def recorded_run(tmp_path_factory, method: str, **extra):
    """A 2-round run of ``method`` (run config ``extra`` on top), 3 clients of 60 examples on the fake
    grid, that recorded round 2."""
    from client_app.app import app as client_app
    from common.config import RunConfig
    from common.run_folder import ResultsWriter
    from conftest import make_run_config
    from fakegrid import FakeGrid
    from methods.registry import build_run

    out = tmp_path_factory.mktemp(method)
    rc = make_run_config(
        method=method,
        **{"output-dir": str(out), "num-clients": 3, "max-examples-per-client": 60, "record-payloads": "2"},
        **extra,
    )
    cfg = RunConfig.from_dict(rc)
    strategy = build_run(cfg, ResultsWriter(cfg.output_dir, method, cfg.as_dict()))
    strategy.start(FakeGrid(client_app, rc, cfg.num_clients), state_in_run_folder=True)
    return strategy.results.path


def membership_rows(run, out) -> list[dict]:
    """``tools.privacy``'s membership and label rows of victims 0 and 1 in round 2."""
    args = [str(run), "--rounds", "2", "--clients", "0,1", "--attacks", "membership,labels", "--out", str(out)]
    assert privacy.main(args) == 0
    return json.loads((out / "privacy.json").read_text())


def test_tools_privacy_tests_fedghs_lars_with_every_training_and_test_example(tmp_path_factory, tmp_path):
    from tools.privacy_view import RunView

    run = recorded_run(tmp_path_factory, "fedgh")
    rows = membership_rows(run, tmp_path)
    view = RunView(run)
    tested = [r for r in rows if r["attack"] == "membership"]
    assert len(tested) == 2
    for row in tested:
        data = view.data(row["partition"])
        held = set(data.train_y.tolist())
        # every training and test example of the classes the LARs stand for (fewer than the 256 cap)
        assert row["payload"] == "lar" and row["mia_members"] == len(data.train_y)
        assert row["mia_nonmembers"] == sum(int((data.test_y == c).sum()) for c in held)
        for key in ("mia_auc", "mia_tpr_at_1pct_fpr", "mia_distance_auc", "mia_distance_tpr_at_1pct_fpr"):
            assert 0.0 <= row[key] <= 1.0
    labelled = [r for r in rows if r["attack"] == "labels"]
    assert labelled and all(r["counts_exact"] == 0.0 and r["classes_held"] >= 1 for r in labelled)
    text = (tmp_path / "privacy.md").read_text()
    assert "Membership inference" in text and "| lar | 2 | 0,1 | white-box + public class means |" in text
    # a row of a class the victim does not hold (what a DP release's noisy count can keep) has no
    # candidates: left out, the other row still tested; with no row left the scores are null
    path = run / "payloads" / "round-2" / "partition-0" / "train.up.npz"
    arrays = dict(np.load(path))
    data = view.data(0)
    absent = min(set(range(10)) - set(data.train_y.tolist()))
    kept = int(arrays["lar_labels"][1])
    np.savez(path, **{**arrays, "lar_labels": np.array([absent, kept], dtype=arrays["lar_labels"].dtype)})
    (row,) = [
        r for r in membership_rows(run, tmp_path / "absent") if r["attack"] == "membership" and r["partition"] == 0
    ]
    assert row["mia_members"] == int((data.train_y == kept).sum()) and 0 <= row["mia_auc"] <= 1
    np.savez(path, **{**arrays, "lar_labels": np.array([absent, absent], dtype=arrays["lar_labels"].dtype)})
    (row,) = [r for r in membership_rows(run, tmp_path / "none") if r["attack"] == "membership" and r["partition"] == 0]
    assert row["mia_members"] == 0 and row["mia_auc"] is None


@pytest.mark.parametrize(
    ("method", "extra", "payload"),
    [
        ("lg-fedavg", {}, "head as uploaded"),
        ("mh-pfedhn", {"model-group": "mh-lenet", "mh-pfedhn.hidden-dim": 16}, "model as uploaded"),
    ],
)
def test_tools_privacy_scores_the_weights_as_uploaded_which_are_the_victims_kept_model(
    tmp_path_factory, tmp_path, method, extra, payload
):
    # LG-FedAvg's head as uploaded, on the victim's extractor, and MH-pFedHN's theta + delta_theta are the
    # victim's kept model: the loss threshold on them must give the AUC of the kept model's losses, and the
    # weights as sent another, so the change was applied, not left out. After 2 rounds the AUCs differ by
    # one pair of 48 x 12 (0.0017) for LG-FedAvg: compared exactly
    from tools.privacy_attacks import Attacker, Settings
    from tools.privacy_view import RunView

    run = recorded_run(tmp_path_factory, method, **extra)
    rows = [r for r in membership_rows(run, tmp_path) if r["attack"] == "membership"]
    view = RunView(run)
    assert [r["payload"] for r in rows] == [payload] * 2
    for row in rows:
        data, kept = view.data(row["partition"]), view.model(row["partition"], 2)
        expected = membership.roc_summary(
            membership.loss_scores(kept, data.train_x, data.train_y, view.info),
            membership.loss_scores(kept, data.test_x, data.test_y, view.info),
        )
        assert row["mia_auc"] == pytest.approx(expected["auc"], abs=1e-12)
        assert row["mia_members"] == len(data.train_y) and row["mia_nonmembers"] == len(data.test_y)
        sent = Attacker(view, Settings()).weight_update(2, row["partition"])[0]
        before = membership.roc_summary(
            membership.loss_scores(sent, data.train_x, data.train_y, view.info),
            membership.loss_scores(sent, data.test_x, data.test_y, view.info),
        )
        assert before["auc"] != pytest.approx(expected["auc"], abs=1e-12), (before, expected)


def test_tools_privacy_tests_fedres_z_against_every_training_and_test_example(tmp_path_factory, tmp_path):
    # z stands for every class: all training examples are members, all test examples non-members
    from tools.privacy_view import RunView

    run = recorded_run(tmp_path_factory, "fedre")
    rows = [r for r in membership_rows(run, tmp_path) if r["attack"] == "membership"]
    view = RunView(run)
    assert [r["payload"] for r in rows] == ["z"] * 2
    for row in rows:
        data = view.data(row["partition"])
        assert row["mia_members"] == len(data.train_y) and row["mia_nonmembers"] == len(data.test_y)
        assert 0 <= row["mia_auc"] <= 1 and 0 <= row["mia_distance_auc"] <= 1
