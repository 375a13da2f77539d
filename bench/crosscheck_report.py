"""The cross-check's numbers and ``report.md``: spread over seeds, gaps, a verdict per method, figures.

Each method's result is kept on disk (``<out>/<method>/result.json``, :func:`save_result`), so the
report of a later call with other ``--methods`` holds every method compared in that folder.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np

from bench.htfllib import REFERENCE_METHODS
from common.files import atomic_write

#: HtFLlib prints the pooled accuracy with 4 decimals (``Averaged Test Accuracy: {:.4f}``): a curve of
#: ours that rounds to it is equal at that precision
PRINTED_HALF_STEP = 0.5e-4
#: a method's result file in its folder of the cross-check's output
RESULT_FILE = "result.json"


def compare(ours: list[list[float]], reference: list[list[float]]) -> dict:
    """Final and best accuracy (mean and population std over seeds, ddof 0 as HtFLlib's
    ``get_mean_std``; fractions) of each implementation and the largest gap between the two mean
    curves (``ours - reference``, with its round, 1-based).

    A seed whose run diverged has None from its first missing round: it counts in ``diverged``
    (seeds) and is left out of ``final_*`` and ``best_*`` (None when every seed diverged); the mean
    curves average the seeds each round has.

    Args:
        ours, reference: accuracy per round, one list per seed, all of one length R.
    """
    a, b = np.asarray(ours, dtype=float), np.asarray(reference, dtype=float)

    def stats(x: np.ndarray) -> dict:
        done = x[~np.isnan(x).any(axis=1)]
        if not len(done):
            return {"final_mean": None, "final_std": None, "best_mean": None, "best_std": None, "diverged": len(x)}
        return {
            "final_mean": float(done[:, -1].mean()),
            "final_std": float(done[:, -1].std()),
            "best_mean": float(done.max(axis=1).mean()),
            "best_std": float(done.max(axis=1).std()),
            "diverged": len(x) - len(done),
        }

    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a round no seed of one side reached: NaN
        gap = np.nanmean(a, axis=0) - np.nanmean(b, axis=0)
    worst = int(np.nanargmax(np.abs(gap))) if not np.isnan(gap).all() else 0
    return {"ours": stats(a), "reference": stats(b), "largest_gap": float(gap[worst]), "largest_gap_round": worst + 1}


def verdict(ours: list[list[float | None]], reference: list[list[float | None]]) -> dict:
    """How close two sets of paired curves are (one per seed, the same seeds in the same order,
    fractions by round, None from a diverged run's first missing round).

    - ``identical``: every round of every seed has both values within :data:`PRINTED_HALF_STEP` (the
      reference's printed precision) or neither; with fewer than 10,000 pooled test images (one image
      above 0.01 %) that is the same number of correctly classified images;
    - ``within seed spread``: not identical, both sides' mean curves reach the same rounds (a round
      whose every seed diverged on one side only is ``apart``), and in each the mean curves are no
      further apart than the larger population std over seeds of the two sides that round (plus the
      printed precision); with one seed the std is 0, so any difference is ``apart``;
    - ``apart``: otherwise.

    Returns:
        ``{"verdict", "largest_paired_gap": ours - reference of one seed and round with the largest
        |difference| (fraction; None when no round has both), "seed_index", "round" (1-based)}``.
    """
    a, b = np.asarray(ours, dtype=float), np.asarray(reference, dtype=float)
    both = ~np.isnan(a) & ~np.isnan(b)
    paired = np.where(both, a - b, 0.0)
    worst = np.unravel_index(int(np.argmax(np.abs(paired))), paired.shape)
    largest = float(paired[worst]) if both.any() else None
    if np.array_equal(np.isnan(a), np.isnan(b)) and (np.abs(paired) <= PRINTED_HALF_STEP + 1e-12).all():
        name = "identical"
    else:
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a round that one side's every seed missed
            gap = np.abs(np.nanmean(a, axis=0) - np.nanmean(b, axis=0))
            spread = np.maximum(np.nanstd(a, axis=0), np.nanstd(b, axis=0))
        reached = ~np.isnan(gap)
        same_rounds = np.array_equal(np.isnan(a).all(axis=0), np.isnan(b).all(axis=0))
        within = same_rounds and reached.any() and (gap[reached] <= spread[reached] + PRINTED_HALF_STEP).all()
        name = "within seed spread" if within else "apart"
    return {"verdict": name, "largest_paired_gap": largest, "seed_index": int(worst[0]), "round": int(worst[1]) + 1}


def plot(
    method: str, ours: list[list[float]], reference: list[list[float]], out: Path, reference_name: str = "HtFLlib"
) -> None:
    """``out``: accuracy by round, mean line and min-max band over seeds, ours and the reference's
    (``reference_name`` in the legend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, curves, color in (("ours", ours, "tab:blue"), (reference_name, reference, "tab:orange")):
        x = np.asarray(curves, dtype=float)
        rounds = np.arange(1, x.shape[1] + 1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # rounds after every seed diverged: a gap in the line
            ax.plot(rounds, np.nanmean(x, axis=0), color=color, label=f"{label} (mean of {len(x)})")
            ax.fill_between(rounds, np.nanmin(x, axis=0), np.nanmax(x, axis=0), color=color, alpha=0.2)
    ax.set(xlabel="round", ylabel="test accuracy (pooled over clients)", title=method)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def save_result(out: Path, method: str, result: dict) -> None:
    """Keep one method's result (JSON) as ``<out>/<method>/result.json`` for later reports."""
    (out / method).mkdir(parents=True, exist_ok=True)
    atomic_write(out / method / RESULT_FILE, lambda f: f.write(json.dumps(result, indent=1).encode()))


def saved_results(out: Path, order: list[str]) -> dict[str, dict]:
    """Every method's kept result in ``out`` (:func:`save_result`), in the order of ``order`` (methods
    not in it last, by name)."""
    found = {p.parent.name: json.loads(p.read_text()) for p in out.glob(f"*/{RESULT_FILE}")}
    rank = {m: i for i, m in enumerate(order)}
    return dict(sorted(found.items(), key=lambda kv: (rank.get(kv[0], len(rank)), kv[0])))


def settings_line(settings: dict) -> str:
    """The settings a cross-check ran, ``key = value`` in the given order (Markdown code spans)."""
    return ", ".join(f"`{k} = {json.dumps(v)}`" for k, v in settings.items())


def _pct(side: dict, key: str) -> str:
    value = (
        "diverged"
        if side[f"{key}_mean"] is None
        else f"{100 * side[f'{key}_mean']:.2f} ± {100 * side[f'{key}_std']:.2f}"
    )
    return value + (
        f" ({side['diverged']} seeds diverged)" if side.get("diverged") and side[f"{key}_mean"] is not None else ""
    )


def _verdict_cell(v: dict, seeds: list[int]) -> str:
    if v["largest_paired_gap"] is None or v["verdict"] == "identical":
        return v["verdict"]
    return f"{v['verdict']}: {100 * v['largest_paired_gap']:+.2f} (seed {seeds[v['seed_index']]}, round {v['round']})"


def _total(runs: list[dict], key: str) -> float:
    """``key`` (wall or CPU seconds) summed over ``runs``."""
    return sum(run[key] for run in runs)


def _our_launch(info: dict) -> str:
    """How our runs of the call ``info`` were launched (``info["runner"]``; calls before it was recorded
    ran Flower's simulation)."""
    if info.get("runner", "tools.run") == "tools.inprocess":
        return "`tools.inprocess`, one process running the clients one after another, no Ray or Flower engine"
    return f"Flower's simulation (`tools.run`), each ClientApp's Ray actor has {info['threads']} CPU"


def _header(info: dict, name: str = "HtFLlib") -> list[str]:
    """The report's lines up to its table's header: the call's command, commits, settings, models,
    threads, test set and how to read the verdicts; ``name``: the reference's (``ReferenceMethod.repository``)."""
    n = info["test_examples"]
    return [
        f"# Cross-check against {name}: {info['preset'] or 'run config'}",
        "",
        f"Command: `{info['command']}`",
        f"Ours: commit {info['commit']}; {name}: {info['reference']} at {info['reference_commit']}.",
        f"Seeds {info['seeds']} on one partition. Settings as run: {settings_line(info['settings'])};"
        f" `-c` given: `{info['overrides'] or 'none'}`.",
        f"Models: {info['family']}.",
        f"Torch threads per client: {info['threads']} on both sides (ours: {_our_launch(info)},"
        f" `OMP_NUM_THREADS={info['threads']}`; {name}: `torch.set_num_threads` in the"
        " bootstrap, which runs its clients and server in one process; numpy's BLAS as"
        " well where a run's command sets `OMP_NUM_THREADS`).",
        f"Test set: {n} examples pooled over every client's test split; one test image is {100 / n:.4g} % of"
        f" the accuracy. Accuracy: pooled, % (mean ± population std over seeds, ddof 0 as {name}'s `get_mean_std`).",
        *([f"Wall and CPU seconds: the runs alone, {info['untimed']}."] if info.get("untimed") else []),
        "",
        "Paired: both sides start from the same weights (every client's initial model as ours builds it,"
        f" loaded into {name}'s client models right after it builds them, and the module a server starts"
        " from where the architectures agree; what a method cannot pair is in its section) and train with"
        " the same thread count. Verdict: `identical` when every round of every"
        f" seed agrees within {name}'s printed precision (4 decimals: {100 * PRINTED_HALF_STEP:.3f} points"
        ", the same number of correct test images while one image is more than that); `within seed spread`"
        " when not identical but in every round the two mean curves are no further apart than the larger"
        " of the two sides' std over seeds (with one seed: never); otherwise `apart`. After the verdict:"
        f" the largest gap of one seed's paired curves, ours − {name}, points (seed, round).",
        "",
        f"| method | verdict | ours final | {name} final | ours best | {name} best | largest gap of the means"
        f" (round) | wall s ours / {name} | CPU s ours / {name} |",
        "|---|---|---|---|---|---|---|---|---|",
    ]


def _summary_row(method: str, r: dict, info: dict) -> str:
    """``method``'s row of the report's table from its result ``r`` (``info``: this call's)."""
    c = r["comparison"]
    o, h = c["ours"], c["reference"]
    other = " (other settings: see its section)" if r["info"]["settings"] != info["settings"] else ""
    return (
        f"| {method} | {_verdict_cell(r['verdict'], r['info']['seeds'])}{other} | {_pct(o, 'final')} | "
        f"{_pct(h, 'final')} | {_pct(o, 'best')} | {_pct(h, 'best')} | "
        f"{100 * c['largest_gap']:+.2f} ({c['largest_gap_round']}) | "
        f"{_total(r['ours'], 'wall_seconds'):.0f} / {_total(r['reference'], 'wall_seconds'):.0f} | "
        f"{_total(r['ours'], 'cpu_seconds'):.0f} / {_total(r['reference'], 'cpu_seconds'):.0f} |"
    )


def _method_section(method: str, r: dict, info: dict) -> list[str]:
    """``method``'s section of the report from its result ``r``: the call that ran it when not this one
    (``info``) and its settings that differ, both sides' commands, what is compared, paired and not,
    where HtFLlib diverged, its recipe, our options it has no flag for that were run as its code does
    (:attr:`bench.htfllib.ReferenceMethod.as_code`) and those it cannot express."""
    seeds, name = r["info"]["seeds"], REFERENCE_METHODS[method].repository
    initial = ", ".join(f"{100 * x['initial']:.2f}" for x in r["reference"])
    diverged = [
        f"seed {s}: round {x['diverged_round']}" for s, x in zip(seeds, r["reference"]) if x.get("diverged_round")
    ]
    code = REFERENCE_METHODS[method].as_code
    as_code = {k: v for k, v in r["unexpressed"].items() if k in code and code[k] == v}
    unexpressed = {k: v for k, v in r["unexpressed"].items() if k not in as_code}
    earlier = r["info"]
    differs = {k: v for k, v in earlier["settings"].items() if info["settings"].get(k) != v}
    if earlier["seeds"] != info["seeds"]:
        differs["seeds"] = earlier["seeds"]
    return [
        f"## {method}",
        "",
        *(
            [f"- run by an earlier call at commit {earlier['commit']}: `{earlier['command']}`"]
            if earlier["command"] != info["command"]
            else []
        ),
        *([f"- its settings that differ from the above: {settings_line(differs)}"] if differs else []),
        f"- {name}, seed {seeds[0]} (cwd `system/`): `{r['reference'][0]['command']}`; round 0 (the "
        f"initial models) by seed: {initial} %",
        f"- ours, seed {seeds[0]}: `{r['ours'][0]['command']}`; compared: our row key "
        f"`{r['ours'][0]['metric']}` with {name}'s printed accuracy",
        *(
            []
            if r["same_model"]
            else [
                f"- {name} evaluates another model than this metric's: ours evaluates it with "
                f"`{method}.{r['reported_option'][0]} = {r['reported_option'][1]!r}`"
            ]
        ),
        f"- paired: {r['paired']}",
        f"- not paired: {r['unpaired'] or 'nothing'}",
        "- the other seeds differ only in the seed (and the output folder)",
        *(
            [
                f"- {name} diverged (NaN or infinite outputs or losses; curve left out from there) at "
                + ", ".join(diverged)
            ]
            if diverged
            else []
        ),
        f"- {name}'s built-in recipe for this method, ours run with it: " + _options(r["recipe"]),
        f"- set as {name}'s code does, which has no flag for them: " + _options(as_code),
        f"- not expressible in {name} (ours as run; see docs/methods): " + _options(unexpressed),
        "",
    ]


def _options(options: dict) -> str:
    """``options`` as the report lists them: `` `key` = value`` joined, or "none"."""
    return ", ".join(f"`{k}` = {v!r}" for k, v in options.items()) or "none"


def write_report(out: Path, info: dict, results: dict[str, dict]) -> None:
    """``out/report.md`` from this call's settings ``info`` and every method's ``results``
    (:func:`saved_results`: this call's and earlier calls' in the same folder).

    ``info``: ``preset``, ``command``, ``commit``, ``reference``, ``reference_commit``, ``seeds``,
    ``settings`` (run config keys as run, :func:`settings_line`), ``overrides``, ``family``, ``threads``,
    ``test_examples`` (pooled over clients). A result: ``comparison`` (:func:`compare`), ``verdict``
    (:func:`verdict`), ``reference`` and ``ours`` (one run each per seed), ``same_model``,
    ``unexpressed``, ``recipe``, ``reported_option``, ``paired``, ``unpaired``, and the ``info`` of the
    call that ran it (a method run with other settings says which).
    """
    names = sorted({REFERENCE_METHODS[method].repository for method in results}) or ["HtFLlib"]
    lines = _header(info, " and ".join(names))
    lines += [_summary_row(method, r, info) for method, r in results.items()]
    lines += ["", "Figures: `<method>.png` (mean line, min-max band over seeds).", ""]
    for method, r in results.items():
        lines += _method_section(method, r, info)
    atomic_write(out / "report.md", lambda f: f.write("\n".join(lines).encode()))
