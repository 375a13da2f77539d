"""What differential privacy costs and buys: accuracy and attack scores against ε, over grids of one preset.

Usage (from the repository root)::

    uv run --frozen python -m tools.dp_report results/privacy-dp \\
        --grid inf=outputs/grids/privacy-cifar10-cnn5 --grid 8=outputs/grids/privacy-dp-eps8 ...
    uv run --frozen python -m tools.dp_report results/privacy-dp      # regenerate from the copies

Each ``--grid <ε>=<folder>`` is a ``tools.grid`` folder of the same preset run with run config
``dp.epsilon`` = ε (``inf``: without DP; ``8-adaptive``: a variant at ε = 8, e.g. ``dp.adaptive-clip``,
in rows of its own; ``client-dp.epsilon`` grids too). Its ``grid.json``, each cell's newest ``metrics.jsonl`` and
``summary.json`` and, where ``tools.privacy`` attacked that run, its ``privacy/privacy.json`` are
copied to ``<folder>/eps-<ε>/`` (``tools.grid_rows.copy_runs``'s layout), so the report is regenerated
from the copies alone. Writes ``<folder>/report.md`` and ``<folder>/accuracy_vs_epsilon.png``.

Per method and ε, over its seeds (mean ± sample std): final pooled accuracy (percent, the last evaluated
round), its gain over the class prior of its seed (points) and the share of the no-DP gain that ε keeps; the
guarantee's parameters as the rows record them: the largest ε any client spent (PLD, and RDP beside it), and
the means over clients and seeds of the last round's noise multipliers, sampling rate q, steps a round and
clips. Record-level DP (run config ``dp.epsilon``) reads each row's ``dp_per_client`` (σ of DP-SGD and of the
payload releases, q = B / n, the DP-SGD clip C, ``clip_norm`` where ``dp.adaptive-clip`` left it, and the
payload clip); client-level DP (``client-dp.epsilon``) the rows' ``client_dp_*`` keys (σ, q, the update clip
C). From the privacy evaluation, where it was run on the cell's newest run, the server's attacks on the upload
scored as ``tools.privacy`` calibrates them: membership inference's AUC and TPR at 1 % FPR (0.5 and about
0.01-0.02: chance), the reconstruction's PSNR above a mid-gray image's (dB; for one image's input, both to
the victim's own image, ``psnr_own`` - ``gray_psnr_own``; for a class-mean payload, both best-matched over
the victim's examples of the class, with the exact pixel mean's gain beside as the ceiling any inversion of
a mean can reach), and the recall of the client's class set.
"""

from __future__ import annotations

import argparse
import math
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from common.errors import ConfigError  # noqa: E402
from common.files import new_folder_or_none  # noqa: E402
from tools.figures import method_colors  # noqa: E402
from tools.grid_rows import copy_files, load_grid  # noqa: E402
from tools.grid_stats import mean_std, prior_by_seed, prior_stats  # noqa: E402
from tools.privacy import read_privacy_rows  # noqa: E402
from tools.privacy_attacks import REFERENCE_INPUTS  # noqa: E402
from tools.privacy_report import PRIVACY, grid_copies  # noqa: E402
from tools.privacy_report import cell as score_cell  # noqa: E402
from tools.report import pct  # noqa: E402

#: subfolder of a report folder holding the grid run at one ε
PREFIX = "eps-"
#: the label of the grid without DP
NO_DP = "inf"
#: the privacy evaluation's output inside a run folder (``tools.privacy``'s default ``--out``)
#: payloads of the Q2 ladder, attacked from the victim's model rather than from its upload


def epsilon_value(label: str) -> float:
    """ε of a label: ``inf``, a positive number, or a positive number and a variant's name after a hyphen
    (``8-adaptive``: a grid at ε = 8 with other ``dp.*`` settings, reported in rows of its own and left out
    of the figure's curves).

    Raises:
        ConfigError: any other label.
    """
    if label == NO_DP:
        return math.inf
    number, hyphen, variant = label.partition("-")
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if not 0 < value < math.inf or (hyphen and not re.fullmatch(r"[a-z0-9][a-z0-9-]*", variant)):
        raise ConfigError(
            f"ε label {label!r}: allowed are '{NO_DP}', positive numbers and a number with a variant, e.g. 8-adaptive"
        )
    return value


def is_variant(label: str) -> bool:
    """Whether the label names a variant grid (:func:`epsilon_value`)."""
    return label != NO_DP and "-" in label


def attack_rows(grid: Path, method: str) -> list[dict[str, Any]]:
    """Every row of the method's cells' ``privacy.json`` in ``grid``.

    Raises:
        ConfigError: naming a ``privacy.json`` that is not a list of rows.
    """
    rows = []
    for path in sorted(grid.glob(f"{method}-seed*/*/{PRIVACY}")):
        rows += read_privacy_rows(path)
    return rows


def upload_attacks(rows: list[dict[str, Any]]) -> dict[str, tuple[float, float] | None]:
    """The server's attacks on the upload, over the rows (mean ± std over rows; None where no row has it):
    ``gain`` (a white-box reconstruction's PSNR above a mid-gray image's, dB: to the victim's own image where
    the row has ``psnr_own``, else best-matched), ``ceiling`` (the exact class mean's gain, class-mean payloads),
    ``auc`` and ``tpr`` (membership inference's AUC and TPR at 1 % FPR); ``gain_n`` and ``auc_n``, the rows
    (attacked victims and rounds) behind them."""
    uploads = [
        r for r in rows if r.get("threat") == "server" and not str(r.get("payload")).startswith(REFERENCE_INPUTS)
    ]
    inversions = [
        r for r in uploads if r.get("knowledge") == "white-box" and r.get("attack") in ("inversion", "update")
    ]
    gains = [
        r["psnr_own"] - r["gray_psnr_own"] if r.get("psnr_own") is not None else r["best_psnr"] - r["gray_psnr"]
        for r in inversions
        if r.get("psnr_own") is not None or r.get("best_psnr") is not None
    ]
    ceilings = [r["ceiling_psnr"] - r["gray_psnr"] for r in inversions if r.get("ceiling_psnr") is not None]
    membership = [r for r in uploads if r.get("attack") == "membership" and r.get("mia_auc") is not None]
    return {
        "gain": mean_std(gains) if gains else None,
        "gain_n": len(gains),
        "ceiling": mean_std(ceilings) if ceilings else None,
        "auc": mean_std([r["mia_auc"] for r in membership]) if membership else None,
        "auc_n": len(membership),
        "tpr": mean_std([r["mia_tpr_at_1pct_fpr"] for r in membership]) if membership else None,
    }


def collect(folder: Path, data_dir: str | None = None) -> tuple[dict, dict[str, dict[str, dict[str, Any]]]]:
    """(the first grid's ``grid.json``, method -> ε label -> its numbers) over ``<folder>/eps-*``, for the
    methods run at two ε or more; a cell counts once its newest run completed. The grid info also gets
    ``prior``, the class prior's accuracy over every cell's seed (``tools.grid_stats.prior_by_seed``,
    :func:`tools.grid_stats.prior_stats`), and each method and ε ``above_prior``: its
    final pooled accuracy minus its seed's prior, mean ± std over seeds; without readable data the info
    gets ``prior_error`` instead and ``above_prior`` is None.

    Raises:
        ConfigError: no ``eps-*`` grid, a bad label, or grids of different presets.
    """
    grids = sorted(p for p in folder.glob(PREFIX + "*") if p.is_dir())
    if not grids:
        raise ConfigError(f"{folder} holds no {PREFIX}<ε> grid: give them with --grid <ε>=<grid folder>")
    info, out, every_cell, finals = None, {}, [], {}
    for grid in sorted(grids, key=lambda p: -epsilon_value(p.name[len(PREFIX) :])):  # no DP first, then ε down
        label = grid.name[len(PREFIX) :]
        grid_info, cells = load_grid(grid)
        # an interrupted run's last round is not its final accuracy: only completed runs count
        cells = [c for c in cells if c.summary.get("status") == "completed"]
        every_cell += cells
        if info is None:
            info = grid_info
        elif grid_info["preset"] != info["preset"]:
            raise ConfigError(f"{grid}: preset {grid_info['preset']!r}, the others {info['preset']!r}")
        for method in sorted({c.method for c in cells}):
            mine = [c for c in cells if c.method == method]
            attacks = attack_rows(grid, method)
            recalls = [r["label_recall"] for r in attacks if r.get("label_recall") is not None]
            finals[method, label] = [(c.seed, c.curve("accuracy_weighted")[1][-1]) for c in mine]
            out.setdefault(method, {})[label] = {
                "seeds": sorted(c.seed for c in mine),
                "weighted": mean_std([c.curve("accuracy_weighted")[1][-1] for c in mine]),
                "mean": mean_std([c.curve("accuracy_mean")[1][-1] for c in mine]),
                **guarantee(mine),
                **upload_attacks(attacks),
                "labels": mean_std(recalls) if recalls else None,  # one recall per (round, victim): no pooling
            }
    try:
        priors = prior_by_seed(info["preset_config"], every_cell, data_dir)["training"]
        info["prior"] = prior_stats(priors)
    except ConfigError as exc:  # regenerating without the dataset: the rest of the report stands
        info["prior_error"], priors = str(exc), None
    for (method, label), seeds in finals.items():
        out[method][label]["above_prior"] = None if priors is None else mean_std([a - priors[s][1] for s, a in seeds])
    for by_eps in out.values():
        base = by_eps.get(NO_DP, {}).get("above_prior")
        for s in by_eps.values():  # the share of the no-DP gain over the prior this ε keeps (means over seeds)
            s["kept"] = s["above_prior"][0] / base[0] if base and s["above_prior"] and base[0] > 0 else None
    # a method run at one ε only (the no-DP grid may hold every method) has no curve, unless DP is what it
    # refuses: then its no-DP row is all there is, and the report says why
    info["refused"] = sorted(m for m, by_eps in out.items() if set(by_eps) == {NO_DP} and refuses_dp(m, info))
    return info, {m: by_eps for m, by_eps in out.items() if len(by_eps) > 1 or m in info["refused"]}


def refuses_dp(method: str, info: dict) -> bool:
    """Whether ``method``'s options refuse record-level DP (``dp.epsilon`` > 0) on the grid's preset (its
    ``check`` raises: FedL2G, FedGen, FedSA; docs/privacy.md)."""
    from common.config import RunConfig
    from methods.registry import METHODS
    from tools.runconfig import app_defaults

    if method not in METHODS:
        return False
    try:
        cfg = RunConfig.from_dict({**app_defaults(), **info["preset_config"], "method": method, "dp.epsilon": 1.0})
        METHODS[method].read_options(cfg)
    except ConfigError:
        return True
    return False


def guarantee(cells: list) -> dict[str, Any]:
    """What the cells' rows record of their DP: ``level`` (``record``, ``client`` or None without DP), the
    largest ε spent (``spent``, PLD; ``spent_rdp``) and the last round's means over clients and cells of σ
    (``sigma``; ``release_sigma``), q, steps a round, the clip C and the payload clip."""
    spent = [r["dp_epsilon_max"] for c in cells for r in c.rows if r.get("dp_epsilon_max") is not None]
    if spent:
        clients = [entry for c in cells for r in c.rows for entry in (r.get("dp_per_client") or {}).values()]
        last = [entry for c in cells if c.rows for entry in (c.rows[-1].get("dp_per_client") or {}).values()]
        return {
            "level": "record",
            "spent": max(spent),
            "spent_rdp": max((e["epsilon_rdp"] for e in clients), default=None),
            **{key: mean_of(last, field) for key, field in RECORD_FIELDS.items()},
        }
    last = [c.rows[-1] for c in cells if c.rows and c.rows[-1].get("client_dp_epsilon") is not None]
    if last:
        return {
            "level": "client",
            "spent": max(r["client_dp_epsilon"] for r in last),
            "spent_rdp": max(r["client_dp_epsilon_rdp"] for r in last),
            **{key: mean_of(last, field) if field else None for key, field in CLIENT_FIELDS.items()},
        }
    return {"level": None, "spent": None, "spent_rdp": None, **dict.fromkeys(RECORD_FIELDS)}


#: report key -> the ``dp_per_client`` entry's key (record-level DP)
RECORD_FIELDS = {
    "sigma": "noise_multiplier",
    "release_sigma": "release_noise_multiplier",
    "q": "sample_rate",
    "steps": "steps",
    "clip": "clip_norm",
    "payload_clip": "payload_clip",
}
#: report key -> the row's key (client-level DP; no releases, steps or payload clip)
CLIENT_FIELDS = {
    "sigma": "client_dp_noise_multiplier",
    "release_sigma": None,
    "q": "client_dp_sample_rate",
    "steps": None,
    "clip": "client_dp_clip_norm",
    "payload_clip": None,
}


def mean_of(entries: list[dict[str, Any]], key: str) -> float | None:
    """The mean of ``key`` over the rows' ``dp_per_client`` ``entries`` that carry it (None: none does)."""
    values = [e[key] for e in entries if e.get(key) is not None]
    return sum(values) / len(values) if values else None


def number(value: float | None, digits: int = 3) -> str:
    """``value`` to ``digits`` significant digits, "-" for None."""
    return "-" if value is None else f"{value:.{digits}g}"


def prior_line(info: dict) -> str:
    """The class prior's accuracy (the floor a DP run that learnt only its clients' label skew reaches)."""
    if "prior" not in info:
        return f"Class prior alone: not computed ({info['prior_error']}; pass --data-dir)."
    prior = info["prior"]
    return (
        "Class prior alone (every client predicts its most frequent training class; "
        "`tools.grid_stats.prior_accuracy`): "
        f"{pct(prior['weighted'])} pooled, {pct(prior['mean'])} mean over clients. A model at this accuracy has "
        "learnt its client's label skew and nothing of the images."
    )


def counted(value: tuple[float, float] | None, n: int, digits: int) -> str:
    """``mean ± std (n)`` over n rows; one row: ``value (1)``; none: ``-``."""
    if value is None:
        return "-"
    return f"{value[0]:.{digits}f} (1)" if n == 1 else f"{score_cell(value, digits)} ({n})"


def render(info: dict, stats: dict[str, dict[str, dict[str, Any]]]) -> str:
    lines = [
        f"# What differential privacy costs and buys: {info['preset']}",
        "",
        "Per method and ε (docs/privacy.md; `python -m tools.dp_report`): final pooled accuracy (percent, mean ±",
        "sample std over seeds), its gain over its seed's class prior (points) and the share of the no-DP gain",
        "that ε keeps; the guarantee as the rows record it: DP level (record: `dp.epsilon`, every upload of a",
        "client's examples; client: `client-dp.epsilon`, a client's whole update), the largest ε a client spent",
        "(at the run's δ: PLD, RDP beside it), and the last round's means of the noise multipliers σ (DP-SGD or",
        "the server's noise on the updates; the payload releases), the sampling rate q, DP-SGD steps a round,",
        "the clip C and the payload clip. Then the server's attacks on the upload (`tools.privacy`, where it was",
        "run): membership inference AUC and TPR at 1 % FPR (chance: 0.5 and about 0.01-0.02), the white-box",
        "reconstruction's PSNR above a mid-gray image's (dB; for a class-mean payload with the exact class mean's",
        f"gain beside, the most any inversion of a mean can reach), the recall of the client's class set. ε = {NO_DP}:",
        "without DP. In brackets: the attacked victims and rounds behind a mean (± their sample std).",
        "",
        prior_line(info),
        "",
        "| method | ε | seeds | final acc pooled | above prior (points) | gain kept | level | ε spent (max) "
        "| ε RDP (max) | σ | σ release | q | steps a round | C | payload clip | membership AUC | TPR at 1 % FPR "
        "| reconstruction gain (dB) | class-mean ceiling (dB) | label recall |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for method, by_eps in stats.items():
        for label, s in by_eps.items():
            if method in info.get("refused", ()):
                s = {**s, "level": "refused"}
            kept = "-" if s["kept"] is None else f"{s['kept']:.2f}"
            guarantee = " | ".join(
                number(s[k]) for k in ("spent", "spent_rdp", "sigma", "release_sigma", "q", "steps", "clip")
            )
            lines.append(
                f"| {method} | {label} | {','.join(map(str, s['seeds']))} | {pct(s['weighted'])} "
                f"| {pct(s['above_prior'])} | {kept} | {s['level'] or '-'} | {guarantee} | {number(s['payload_clip'])} "
                f"| {counted(s['auc'], s['auc_n'], 2)} | {score_cell(s['tpr'], 3)} "
                f"| {counted(s['gain'], s['gain_n'], 1)} "
                f"| {score_cell(s['ceiling'])} | {score_cell(s['labels'], 2)} |"
            )
    if info.get("refused"):
        lines += [
            "",
            f"Run without DP only, their options refusing `dp.epsilon` > 0 (level `refused`; docs/privacy.md): "
            f"{', '.join(info['refused'])}.",
        ]
    return "\n".join(lines) + "\n"


def plot(info: dict, stats: dict[str, dict[str, dict[str, Any]]], out: Path) -> None:
    """``accuracy_vs_epsilon.png``: per method against ε (log scale; ε = ∞ drawn at the right edge), the
    final pooled accuracy beside the class prior (what DP costs; mean ± std over seeds), and what it buys
    against the server's attacks on the upload: membership inference's AUC beside chance (0.5), and the
    white-box reconstruction's PSNR above a mid-gray image's (0 dB: no more than a constant image); both
    mean ± std over the attacked victims and rounds."""
    labels = sorted(
        {label for by_eps in stats.values() for label in by_eps if label != NO_DP and not is_variant(label)}, key=float
    )
    positions = {label: float(label) for label in labels}
    positions[NO_DP] = 4 * max([float(v) for v in labels], default=1.0)
    colors = method_colors(list(stats))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = (("weighted", 100.0), ("auc", 1.0), ("gain", 1.0))
    for method, by_eps in stats.items():
        points = sorted((positions[label], s) for label, s in by_eps.items() if label in positions)
        for ax, (key, scale) in zip(axes, panels, strict=True):
            shown = [(p, s[key]) for p, s in points if s[key] is not None]
            if shown:
                ax.errorbar(
                    [p for p, _ in shown],
                    [scale * v[0] for _, v in shown],
                    yerr=[scale * v[1] for _, v in shown],
                    label=method,
                    color=colors[method],
                    marker="o",
                    capsize=3,
                )
    if "prior" in info:
        axes[0].axhline(100 * info["prior"]["weighted"][0], color="gray", linestyle="--", label="class prior alone")
    axes[1].axhline(0.5, color="gray", linestyle="--", label="chance")
    axes[2].axhline(0.0, color="gray", linestyle="--", label="a mid-gray image")
    ticks = [*labels, NO_DP]
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xticks([positions[t] for t in ticks], [("∞ (no DP)" if t == NO_DP else t) for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("ε per client over the run (δ as configured)")
        ax.legend(fontsize=7)
    axes[0].set_ylabel("final accuracy, pooled (%)")
    axes[1].set_ylabel("membership inference AUC")
    axes[2].set_ylabel("reconstruction PSNR − gray image's (dB)")
    axes[0].set_title(f"{info['preset']}: what DP costs", fontsize=10)
    axes[1].set_title("what it buys: membership of the upload", fontsize=10)
    axes[2].set_title("what it buys: white-box reconstruction from the upload", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "accuracy_vs_epsilon.png", dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folder", type=Path, help="the report folder (holds eps-<ε>/ grid copies)")
    parser.add_argument("--grid", action="append", default=[], help="<ε>=<grid folder> (ε: inf or a number)")
    parser.add_argument("--data-dir", default=None, help="dataset folder for the class prior (default: the runs')")
    args = parser.parse_args(argv)
    try:
        with new_folder_or_none(args.folder):
            copies = {}  # every grid is checked before any copy replaces an earlier one
            for item in args.grid:
                label, _, path = item.partition("=")
                epsilon_value(label)
                if not Path(path).is_dir():
                    raise ConfigError(f"--grid {item!r}: {path!r} is no folder")
                target = args.folder / f"{PREFIX}{label}"
                copies[target] = grid_copies(Path(path), target)
            for target, files in copies.items():
                if target.exists():  # a stale cell of an earlier copy must not stay
                    shutil.rmtree(target)
                copy_files(files)
            info, stats = collect(args.folder, args.data_dir)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    (args.folder / "report.md").write_text(render(info, stats))
    plot(info, stats, args.folder)
    print(f"wrote {args.folder / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
