"""Byzantine clients against the vector-payload methods (FedRE, FedProto, FedTGP, FedGH, FD): run
config ``aggregation`` bounds what one upload of representations, prototypes or logits can do.

The attacks are those of ``bench.byzantine.ATTACKS``: one client (partition 1) of 4 uploads a
well-formed payload within every schema check, every round, on MNIST with model group ``cnn1``.
With plain ``mean`` (the papers' steps, and this code before ``norm-bound``), seed 0, two rounds:
FedRE's z = 100 put every honest client at 0.0 accuracy, FD's next-class logits for every class
cost them 39 points, FedProto's constant prototypes for every class 17 and FedGH's constant LARs
for every class 14. FedTGP has no such test: its all-class attack costs about 10 points under
``mean`` and is not reduced by any bound here (docs/methods/fedtgp.md).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bench.byzantine import ATTACKS, HONEST, tamper_of
from common.config import ConfigError, RunConfig
from common.data import normalize
from common.payload import RECEIVED_PROTOTYPE_FACTOR, RECEIVED_ROW_FACTOR, ROW_NORM_FACTOR, ClientReply
from conftest import client_runtime, federation, make_run_config
from engine.aggregation import class_average
from engine.robust import BOUNDED
from methods.blocks.prototypes import _INITIAL_SCALES, bound_class_rows, initial_representation_scale, trusted_rows
from methods.fedgh import train_header
from methods.fedre import train_head
from methods.fedtgp import train_generator
from methods.registry import build_run

#: honest clients may lose at most this much accuracy to the attacker (fraction) by the last round
TOLERANCE = 0.05
#: FD and FedProto: what a row within the bound still does. The attacker's row of a class that one
#: honest client holds is half of that class's mean, pointing wherever it likes (measured: FD 5.8
#: points, FedProto 11.7 points at seed 0, against 39 and 17 with ``mean``)
RESIDUAL = 0.12
ROUNDS = 2


def mnist(tmp_path, method: str, options: dict, rounds: int, **overrides) -> dict:
    """4 MNIST clients with ``cnn1``, 200 examples each, ``rounds`` rounds, seed 0 (as the bench's
    first seed: with the default seed 42 every client still predicts its majority class after two
    rounds, so no attack could show)."""
    return make_run_config(
        **{
            "output-dir": str(tmp_path / "outputs"),
            "seed": 0,
            "dataset": "mnist",
            "model-group": "cnn1",
            "num-server-rounds": rounds,
            "method": method,
            **options,
            **overrides,
        }
    )


def honest_accuracy(rows) -> list[float]:
    """Per round, the mean accuracy of the honest partitions."""
    return [float(np.mean([r["accuracy_per_client"][str(p)] for p in HONEST])) for r in rows]


@pytest.mark.parametrize(
    "attack, tolerance",
    [("fedre-z-100", TOLERANCE), ("fedgh-1e5", TOLERANCE), ("fd-next-1e5", RESIDUAL), ("fedproto-1e5", RESIDUAL)],
)
def test_one_byzantine_upload_costs_the_honest_clients_little(tmp_path, attack, tolerance):
    """Under the default ``norm-bound`` the attacker's rows are bounded every round (counted in
    ``server_bounded``) and the honest clients end within ``tolerance`` of the same run without
    the attacker, after the last of ``ROUNDS``."""
    method, options, factory, rounds = *ATTACKS[attack], ROUNDS
    strategy, grid = federation(mnist(tmp_path / "attacked", method, options, rounds), tamper_of(factory(0)))
    strategy.start(grid)
    clean, clean_grid = federation(mnist(tmp_path / "clean", method, options, rounds))
    clean.start(clean_grid)
    attacked = strategy.rows
    assert [r["num_clients"] for r in attacked] == [4] * rounds
    assert all(r["server_bounded"] >= 1 for r in attacked)
    assert honest_accuracy(attacked)[-1] - honest_accuracy(clean.rows)[-1] >= -tolerance, (
        honest_accuracy(attacked),
        honest_accuracy(clean.rows),
    )


def reply(partition: int, rows: list[tuple[int, float]], width: int = 4, **names) -> ClientReply:
    """A reply of per-class rows: (class, L2 norm) each, all along one direction, float32."""
    values, labels = names.get("values", "protos"), names.get("labels", "proto_labels")
    direction = np.arange(1, width + 1, dtype=np.float64) / np.linalg.norm(np.arange(1, width + 1))
    return ClientReply(
        1000 + partition,
        partition,
        {
            values: np.array([n * direction for _, n in rows], np.float32).reshape(len(rows), width),
            labels: np.array([c for c, _ in rows], np.int64),
        },
        {"num-examples": 10},
    )


def norms(replies) -> list[list[float]]:
    return [np.linalg.norm(r.arrays["protos"].astype(np.float64), axis=1).round(4).tolist() for r in replies]


def test_rows_are_bounded_by_the_class_median_or_by_the_uploads_median():
    """Class 0 is held by four uploads (norms 1, 1000, 2, 4: lower median 2, the second smallest);
    classes 5 and 7 by fewer than three, so their rows are bounded by the lower median of the uploads'
    own median norms (5.5, 800, 2, 4: 4). Rows within their bound are left bit for bit; fewer than
    three uploads are not bounded at all. (With np.median's 3 for class 0 a second attacker of 1000
    among two honest holders would set the bound to 500; the lower median stays honest.)"""
    replies = [
        reply(0, [(0, 1.0), (5, 10.0)]),
        reply(1, [(0, 1000.0), (5, 500.0), (7, 800.0)]),
        reply(2, [(0, 2.0)]),
        reply(3, [(0, 4.0)]),
    ]
    bounded, scaled = bound_class_rows(replies, "protos", "proto_labels")
    assert scaled == 5
    assert norms(bounded) == [[1.0, 4.0], [2.0, 4.0, 4.0], [2.0], [2.0]]
    assert np.array_equal(bounded[0].arrays["protos"][0], replies[0].arrays["protos"][0])
    assert np.array_equal(bounded[2].arrays["protos"], replies[2].arrays["protos"])
    assert all(b.arrays["protos"].dtype == np.float32 for b in bounded)
    assert bound_class_rows(replies[:2], "protos", "proto_labels") == (replies[:2], 0)


def test_rows_of_a_sparse_class_are_bounded_by_their_change_from_the_row_sent():
    """With the global rows sent this round as reference, a class fewer than three uploads hold is
    bounded on each row's change from its class's reference: class 0 rows 1 and 1000 from the row
    sent, the others' changes 2 and 3 from none (zero), so the bound is their lower median, 2."""
    sent = np.zeros((10, 4))
    sent[0] = [5.0, 0.0, 0.0, 0.0]
    replies = [reply(0, [(0, 1.0)]), reply(1, [(0, 1000.0)]), reply(2, [(1, 2.0)]), reply(3, [(2, 3.0)])]
    for r in replies[:2]:
        r.arrays["protos"] = (r.arrays["protos"] + sent[0]).astype(np.float32)
    bounded, scaled = bound_class_rows(replies, "protos", "proto_labels", sent)
    changes = [
        float(np.linalg.norm(b.arrays["protos"][0].astype(np.float64) - sent[b.arrays["proto_labels"][0]]))
        for b in bounded
    ]
    assert scaled == 2 and changes == pytest.approx([1.0, 2.0, 2.0, 2.0], rel=1e-5)


@pytest.mark.parametrize("method", ["fedproto", "fd", "fedtgp", "fedgh", "fedre"])
def test_mean_is_the_papers_server_step_bit_for_bit(method):
    """``aggregation = "mean"`` runs the paper's server step on the uploads as they are (the same
    arrays as calling it directly, one row 1000 times the others included); ``norm-bound`` does not."""
    width = 10 if method == "fd" else 500
    names = {
        "fedproto": ("protos", "proto_labels"),
        "fedtgp": ("protos", "proto_labels"),
        "fd": ("logits", "logit_labels"),
        "fedgh": ("lar", "lar_labels"),
    }
    rng = np.random.default_rng(0)
    replies = []
    for p, classes in enumerate([[0, 1], [0, 1, 2], [1, 2], [0, 2]]):
        rows = rng.random((len(classes), width)).astype(np.float32) * (1000 if p == 1 else 1)
        if method == "fedre":
            arrays = {"z": rows[:1], "y": np.full((1, 10), 0.1, np.float32)}
        else:
            values, labels = names[method]
            dtype = np.int32 if method == "fedgh" else np.int64
            arrays = {values: rows, labels: np.array(classes, dtype)}
        replies.append(ClientReply(1000 + p, p, arrays, {"num-examples": 10}))
    overrides = {"fedtgp.server-epochs": 3} if method == "fedtgp" else {}

    def server(rule: str):
        return build_run(RunConfig.from_dict(make_run_config(method=method, aggregation=rule, **overrides))).method

    plain, bounded, direct = server("mean"), server("norm-bound"), server("mean")
    metrics = plain.aggregate_train(1, replies)
    bounded_metrics = bounded.aggregate_train(1, replies)
    if method in ("fedproto", "fd"):
        expected, _ = class_average(replies, *names[method], 10, width)
    else:
        step, state, rng = {
            "fedtgp": (train_generator, "generator", "batch_rng"),
            "fedgh": (train_header, "header", "header_generator"),
            "fedre": (train_head, "head", "head_generator"),
        }[method]
        step(getattr(direct, state), replies, direct.options, getattr(direct, rng))
        if method == "fedtgp":
            with torch.no_grad():
                direct.global_set["global_protos"] = direct.generator().numpy()
        expected = direct.global_arrays()
    got = plain.global_arrays()
    assert got.keys() == expected.keys() and all(np.array_equal(got[k], expected[k]) for k in got)
    assert BOUNDED not in metrics
    assert bounded_metrics[BOUNDED] >= 1
    assert any(not np.array_equal(bounded.global_arrays()[k], expected[k]) for k in expected)


@pytest.mark.parametrize(
    "method, rule, allowed",
    [
        ("fedre", "median", "'norm-bound', 'mean'"),
        ("fedgh", "krum", "'norm-bound', 'mean'"),
        ("fedtgp", "trimmed-mean", "'norm-bound', 'mean'"),
        ("fedproto", "krum", "'norm-bound', 'mean', 'median', 'trimmed-mean'"),
        ("fd", "bulyan", "'norm-bound', 'mean', 'median', 'trimmed-mean'"),
    ],
)
def test_an_aggregation_the_method_cannot_do_is_refused_before_the_run(method, rule, allowed):
    with pytest.raises(ConfigError, match=f"'aggregation' = '{rule}'.*allowed for it: {allowed}"):
        build_run(RunConfig.from_dict(make_run_config(method=method, aggregation=rule)))


@pytest.mark.parametrize("rule", ["median", "trimmed-mean"])
def test_per_class_median_and_trimmed_mean(rule):
    """FedProto under ``median`` / ``trimmed-mean`` (trim-fraction 0.25 cuts one of four rows at each
    end): class 0's rows of norms 1, 2, 4, 1000 give 3 (both): the row of 1000 is first capped at
    ROW_NORM_FACTOR times the uploads' vote (lower median of 1.5, 502, 2, 4: 2), which leaves the
    median where it was. Class 5's two rows (2 and 4) give their mean once the longer is bounded by the
    vote itself (a median of two rows is their mean): 2."""
    replies = [
        reply(0, [(0, 1.0), (5, 2.0)], 500),
        reply(1, [(0, 1000.0), (5, 4.0)], 500),
        reply(2, [(0, 2.0)], 500),
        reply(3, [(0, 4.0)], 500),
    ]
    cfg = RunConfig.from_dict(make_run_config(method="fedproto", aggregation=rule, **{"trim-fraction": 0.25}))
    strategy = build_run(cfg)
    metrics = strategy.method.aggregate_train(1, replies)
    protos = strategy.method.global_arrays()["protos"]
    assert np.linalg.norm(protos, axis=1) == pytest.approx([3.0, 2.0], rel=1e-5)
    assert metrics["server-num-classes"] == 2 and metrics[BOUNDED] == 2


def test_voted_only_leaves_the_classes_fewer_than_three_uploads_hold():
    """FedTGP's bound (``voted_only``): class 0, held by four uploads, is bounded by its lower median
    (2); classes 5 and 7, held by fewer than three, keep their rows bit for bit."""
    replies = [
        reply(0, [(0, 1.0), (5, 10.0)]),
        reply(1, [(0, 1000.0), (5, 500.0), (7, 800.0)]),
        reply(2, [(0, 2.0)]),
        reply(3, [(0, 4.0)]),
    ]
    bounded, scaled = bound_class_rows(replies, "protos", "proto_labels", voted_only=True)
    assert scaled == 2
    assert norms(bounded) == [[1.0, 10.0], [2.0, 500.0, 800.0], [2.0], [2.0]]


def test_colluders_that_claim_every_class_are_capped_by_the_uploads_vote():
    """Two uploads of five claim all four classes with rows of norm 1e6; each class has one honest
    holder (norms 1, 3, 4). Each class's median is an attacker's, so the class median bounds nothing;
    the uploads' vote (the lower median of 1, 3, 4, 1e6, 1e6: 4) is honest, and every attacker row ends at
    most ROW_NORM_FACTOR times it, under ``norm-bound`` and as the cap before a per-class median."""
    honest = [reply(p, [(p, float(p + 1))]) for p in (0, 2, 3)]
    colluders = [reply(p, [(c, 1e6) for c in range(4)]) for p in (1, 4)]
    replies = [honest[0], colluders[0], honest[1], honest[2], colluders[1]]
    for per_class in (True, False):
        bounded, scaled = bound_class_rows(replies, "protos", "proto_labels", per_class=per_class)
        assert scaled == 8
        assert max(max(n) for n in norms(bounded)) == pytest.approx(ROW_NORM_FACTOR * 4.0, rel=1e-5)
        assert [bounded[i].arrays["protos"].tobytes() for i in (0, 2, 3)] == [
            replies[i].arrays["protos"].tobytes() for i in (0, 2, 3)
        ]


def test_a_client_leaves_out_an_extreme_received_row():
    """Per example: a received row longer than the example's bound (or not finite, or not sent) is
    left out; FD's bound is RECEIVED_ROW_FACTOR times the example's own row, so one 300 times as long
    (the honest spread of htfe8) is kept and an example with a longer own row keeps a row another
    example of the same class leaves out."""
    own = torch.ones(5, 4)  # norm 2 each
    own[4] *= 100.0  # norm 200: 1e5 * 2 is within RECEIVED_ROW_FACTOR of it
    rows = torch.stack([torch.full((4,), 300.0), torch.full((4,), 1e5), torch.full((4,), float("inf")), torch.ones(4)])
    mask = torch.tensor([True, True, True, False])
    labels = torch.tensor([0, 1, 2, 3, 1])
    longest = RECEIVED_ROW_FACTOR * own.norm(dim=1)
    assert RECEIVED_ROW_FACTOR * 2 < 1e5 * 2 <= RECEIVED_ROW_FACTOR * 200
    assert trusted_rows(rows, mask, labels, longest).tolist() == [True, False, False, False, True]


def test_the_prototype_guard_is_anchored_where_training_cannot_move_it(tmp_path):
    """A client's bound on received prototypes is RECEIVED_PROTOTYPE_FACTOR times its initial
    extractor's longest representation of a fixed synthetic batch: the same before and after the
    client trained (its own representations grew), and an honest trained prototype is far inside it."""
    rc = mnist(tmp_path, "fedproto", {}, 1, **{"max-examples-per-client": 60})
    client = client_runtime(rc, 0)
    before = initial_representation_scale(client)
    with torch.no_grad():
        client.model.extractor[0].weight.mul_(50.0)  # a trained model, far from its start
    _INITIAL_SCALES.clear()
    assert initial_representation_scale(client) == before > 0
    trained = client.model.extractor.eval()(normalize(client.data.train_x[:32], client.data.info)).norm(dim=1).max()
    assert trained > before
    assert RECEIVED_PROTOTYPE_FACTOR * before > 100 * before


@pytest.mark.parametrize("aggregation", ["norm-bound", "median"])
def test_two_colluders_of_five_claiming_every_class_end_no_run(tmp_path, aggregation):
    """Partitions 1 and 2 of five upload FedProto rows of 1e5 for all 10 classes every round (60
    examples a client, two rounds). Before, under ``norm-bound`` only one client was left in round 2
    (the honest replies refused: their loss past the metric bound) and under ``median`` the run failed
    (no client trained in round 2). Now every honest client trains in every round with a finite loss."""
    rc = mnist(
        tmp_path, "fedproto", {}, 2, aggregation=aggregation, **{"num-clients": 5, "max-examples-per-client": 60}
    )
    strategy, grid = federation(rc, tamper_of(ATTACKS["fedproto-1e5"][2](0), attackers=(1, 2)))
    strategy.start(grid)
    assert [r["num_clients"] for r in strategy.rows] == [5, 5]
    losses = [r["train_loss"] for r in strategy.rows]
    assert all(np.isfinite(losses)) and max(losses) < 1e3, losses
