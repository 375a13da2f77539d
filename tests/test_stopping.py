"""The stopping rule (run config ``stop-patience``): a run stops after exactly that many rounds without a
new best ``stop-metric`` (``accuracy_mean`` by default), says why in its last row, and a resumed run goes
on counting."""

import pytest
from flwr.app import MetricRecord
from test_resume import run_with_results

from engine.round_rows import patience_exhausted

#: accuracy_mean of rounds 1, 2, ...: best 0.6 first reached in round 2 (round 3 ties it: no new best)
SCRIPT = [0.5, 0.6, 0.6, 0.55, 0.9, 0.9, 0.9, 0.9]


def rows(accuracies):
    return [{"round": i + 1, "accuracy_mean": a} for i, a in enumerate(accuracies)]


@pytest.mark.parametrize("patience, stops_after", [(1, 3), (2, 4), (4, None), (0, None)])
def test_patience_counts_rounds_since_the_first_round_of_the_best(patience, stops_after):
    reasons = [patience_exhausted(rows(SCRIPT[:n]), patience) for n in range(1, 5)]
    first = next((n + 1 for n, r in enumerate(reasons) if r), None)
    assert first == stops_after
    if stops_after:
        assert "best 0.6000 in round 2" in reasons[stops_after - 1] and "'stop-patience'" in reasons[stops_after - 1]


def test_the_watched_metric_is_stop_metric():
    """Pooled accuracy stuck at its round-1 best while the mean over clients rises: only a rule
    watching ``accuracy_weighted`` stops."""
    history = [{**r, "accuracy_weighted": 0.7} for r in rows([0.5, 0.6, 0.7])]
    assert patience_exhausted(history, 2) is None
    assert "no new best accuracy_weighted for 2 rounds (best 0.7000 in round 1)" in patience_exhausted(
        history, 2, "accuracy_weighted"
    )


def test_rounds_without_evaluation_count_as_rounds():
    assert patience_exhausted([*rows([0.5]), {"round": 2, "accuracy_mean": None}], 1) is not None
    assert patience_exhausted([{"round": 1, "accuracy_mean": None}], 1) is None


def scripted(strategy):
    """Replace the strategy's evaluation with :data:`SCRIPT` (one value per evaluated round)."""

    def evaluate_round(server_round, evaluated):
        acc = SCRIPT[server_round - 1]
        return MetricRecord(
            {"accuracy-mean": acc, "accuracy-weighted": acc, "partition-ids": [0], "accuracy-per-client": [acc]}
        )

    strategy.evaluate_round = evaluate_round
    return strategy


def test_a_run_stops_after_patience_rounds_and_a_resumed_run_keeps_counting(run_config, monkeypatch):
    import methods.registry as registry

    build = registry.build_run
    monkeypatch.setattr("test_resume.build_run", lambda cfg, results=None: scripted(build(cfg, results)))
    base = run_config(method="local", **{"num-clients": 2, "max-examples-per-client": 60, "stop-patience": 2})
    whole, _ = run_with_results({**base, "num-server-rounds": 8}, name="whole")
    assert [r["round"] for r in whole.rows] == [1, 2, 3, 4]
    assert "stop_reason" not in whole.rows[2] and "best 0.6000 in round 2" in whole.rows[3]["stop_reason"]
    assert whole.results.summary()["status"] == "completed"
    assert whole.results.summary()["stop_reason"] == whole.rows[-1]["stop_reason"]

    first, grid = run_with_results({**base, "num-server-rounds": 3}, name="first")
    assert [r["round"] for r in first.rows] == [1, 2, 3] and "stop_reason" not in first.rows[-1]
    second, _ = run_with_results(
        {**base, "num-server-rounds": 8, "resume-from": str(first.results.path)}, grid, name="second"
    )
    assert [r["round"] for r in second.rows] == [1, 2, 3, 4] and second.rows[-1]["stop_reason"] == whole.rows[-1][
        "stop_reason"
    ]
    # resuming a run that already stopped runs no further round
    third, _ = run_with_results(
        {**base, "num-server-rounds": 8, "resume-from": str(second.results.path)}, grid, name="third"
    )
    assert [r["round"] for r in third.rows] == [1, 2, 3, 4]


def test_a_round_whose_evaluation_some_clients_failed_is_left_out_of_final_best_and_patience(tmp_path):
    """Round 2's 0.9 comes from the one client of three whose evaluation did not fail (a worker killed
    for memory): not comparable with the complete rounds, so neither the best nor the final nor
    the patience count rests on it; a run without any complete round keeps its rows."""
    from common.run_folder import ResultsWriter

    history = [
        {"round": 1, "accuracy_mean": 0.5, "accuracy_weighted": 0.5, "eval_missing": []},
        {"round": 2, "accuracy_mean": 0.9, "accuracy_weighted": 0.9, "eval_missing": [1, 2]},
        {"round": 3, "accuracy_mean": 0.6, "accuracy_weighted": 0.6, "eval_missing": []},
        {"round": 4, "accuracy_mean": 0.95, "accuracy_weighted": 0.95, "eval_missing": [0]},
    ]
    writer = ResultsWriter(tmp_path, "run", {})
    writer.rows = history
    summary = writer.summary()
    assert (summary["best_accuracy_mean"], summary["best_round"]) == (0.6, 3)
    assert (summary["best_accuracy_weighted"], summary["best_round_weighted"]) == (0.6, 3)
    assert (summary["final_accuracy_mean"], summary["final_round"]) == (0.6, 3)
    assert summary["incomplete_evaluations"] == [2, 4]
    assert "best 0.5000 in round 1" in patience_exhausted(history[:2], 1)  # round 2 is no new best
    writer.rows = [r for r in history if r["eval_missing"]]  # none complete: the rows are all there is
    summary = writer.summary()
    assert (summary["best_round"], summary["final_round"], summary["incomplete_evaluations"]) == (4, 4, [])
