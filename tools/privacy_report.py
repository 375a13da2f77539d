"""One report over a grid of attacked runs: ``python -m tools.privacy_report results/privacy --grid <grid>``.

``--grid`` copies the grid's rows into ``<folder>/grid`` (``grid.json``, each cell's newest ``metrics.jsonl``,
``summary.json`` and ``privacy/privacy.json`` written by ``tools.privacy``) and each method's seed-0
``reconstructions.png`` into ``<folder>/<method>/``; the report is made from the copies alone, so
``python -m tools.privacy_report results/privacy`` regenerates it from committed files.

``<folder>/report.md`` says, per method and round, over every attacked victim and seed (a *cell*: one
victim of one seed in one round), with a 95 % Student-t interval over cells:

- the setting's accuracy against the class prior (an attack on models that learnt nothing says nothing);
- what the honest-but-curious server recovers from one upload, white-box: the reconstruction's best-match
  PSNR above a mid-gray image's (*gain*, dB), beside the gain of the exact pixel mean of the images the
  upload stands for (an image that shows the class or the client and no one example) and, for per-class
  uploads, of the same attack on public non-members' class mean through the victim's model, with the
  paired difference; and the share of reconstructions a classifier of the public split assigns their class
  (*recognised*, chance 1/C), which needs no pixel match. Verdicts: :func:`verdict`;
- the controls on the victims' own trained models (one image's representation, to that image, above the
  better of gray and the victim's mean image; the class mean representation): the attack fires there;
- membership inference (AUC, TPR at 1 % FPR), label leakage, a curious client's reconstructions;
- FedRE's Q2 ladder (one image's representation, the class prototype, the entangled ``z``) scored against
  one sample of the victim's images, with paired differences; MH-pFedHNGD's iDLG check (its appendix C.8);
- leakage against round (``leakage_vs_round.png``) and the CPU seconds per cell.

What the scores mean: ``results/privacy/calibration/`` (``tools.privacy_calibration``).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from common.datasets import DATASETS  # noqa: E402
from common.errors import ConfigError  # noqa: E402
from common.files import new_folder_or_none  # noqa: E402
from tools.figures import method_colors  # noqa: E402
from tools.grid import newest_run  # noqa: E402
from tools.grid_rows import Cell, copy_files, load_grid, run_copies  # noqa: E402
from tools.grid_stats import mean_ci, mean_std, prior_by_seed, prior_stats  # noqa: E402
from tools.privacy import FIGURE, LABEL_COLUMNS, read_privacy_rows, spread  # noqa: E402
from tools.privacy_attacks import REFERENCE_INPUTS  # noqa: E402
from tools.report import pct  # noqa: E402
from tools.runconfig import ROOT  # noqa: E402

#: FedRE's Q2 (TinyImageNet, its reference [35]): PSNR (dB) and MSE (0-255 scale) of images reconstructed
#: from per-sample representations, prototypes and entangled representations
FEDRE_Q2 = {"per-sample": (12.89, 4514.91), "prototype": (10.25, 6992.04), "entangled": (9.66, 7781.87)}
#: how far a gain's lower 95 % bound must be above zero to count as recovering something (dB)
MARGIN_DB = 1.0
#: the grid copy's folder in the report folder, and where a run's attack rows are
GRID = "grid"
PRIVACY = Path("privacy") / "privacy.json"
#: a run's attack tables, which name the budgets of its cells (``tools.privacy.write_report``)
TABLES = Path("privacy") / "privacy.md"
#: where a run's FedRE Q2 attack with the deep image prior writes (``tools.privacy <run> --prior dip --out
#: <run>/privacy-dip``), read for the Q2 ladder only
DIP = "privacy-dip"
BUDGET_LINE = "Budgets (tools.privacy flags) of the cells: "
FIGURE_NAME = "leakage_vs_round.png"


def grid_copies(grid: Path, target: Path, tables: bool = False) -> list[tuple[Path, Path]]:
    """(file, its copy) of :func:`tools.grid_rows.run_copies` plus each cell's ``privacy/privacy.json``
    (when attacked; with ``tables`` also its ``privacy/privacy.md``), all read and checked first.

    Raises:
        ConfigError: ``grid`` is no grid, or a file of it is not what the grid or ``tools.privacy``
            wrote (naming the file).
    """
    copies = run_copies(grid, target)
    for folder in sorted(p for p in grid.iterdir() if p.is_dir() and "-seed" in p.name):
        newest = newest_run(folder)
        if newest is not None and (newest[0] / PRIVACY).is_file():
            read_privacy_rows(newest[0] / PRIVACY)
            copies.append((newest[0] / PRIVACY, target / folder.name / newest[0].name / PRIVACY))
            if tables and (newest[0] / TABLES).is_file():
                copies.append((newest[0] / TABLES, target / folder.name / newest[0].name / TABLES))
        if tables and newest is not None and (newest[0] / DIP / PRIVACY.name).is_file():
            read_privacy_rows(newest[0] / DIP / PRIVACY.name)
            for name in (PRIVACY.name, TABLES.name):
                copies.append((newest[0] / DIP / name, target / folder.name / newest[0].name / DIP / name))
    return copies


def budgets(folder: Path) -> list[str]:
    """The distinct attack budgets the grid copy's runs name in their ``privacy.md`` (JSON of the flags)."""
    found = set()
    tables = [*(folder / GRID).glob(f"*-seed*/*/{TABLES}"), *(folder / GRID).glob(f"*-seed*/*/{DIP}/{TABLES.name}")]
    for path in tables:
        for line in path.read_text(encoding="utf-8").splitlines():
            if BUDGET_LINE in line:
                found.update(line.split(BUDGET_LINE, 1)[1].rstrip(".").split("; "))
    return sorted(found)


def figure_copies(grid: Path, folder: Path) -> list[tuple[Path, Path]]:
    """(seed 0's ``privacy/reconstructions.png``, ``<folder>/<method>/reconstructions.png``) per method."""
    copies = []
    for cell in sorted(grid.glob("*-seed0")):
        newest = newest_run(cell)
        if newest is not None and (newest[0] / "privacy" / FIGURE).is_file():
            copies.append((newest[0] / "privacy" / FIGURE, folder / cell.name.rsplit("-seed", 1)[0] / FIGURE))
    return copies


def load(folder: Path) -> tuple[dict, list[Cell], dict[str, list[dict]], dict[str, list[dict]]]:
    """(``grid.json``, the completed cells, method -> every attack row of its cells with ``seed`` added,
    method -> the same of its deep-image-prior rows, :data:`DIP`) of the grid copy ``<folder>/grid``.

    Raises:
        FileNotFoundError: no grid copy (naming the folder and the flag that makes one).
        ConfigError: a copied file is not what the grid or ``tools.privacy`` wrote.
    """
    if not (folder / GRID / "grid.json").is_file():
        raise FileNotFoundError(f"{folder / GRID} holds no grid copy: give the attacked grid with --grid <folder>")
    info, cells = load_grid(folder / GRID)
    cells = [c for c in cells if c.summary.get("status") == "completed"]
    rows: dict[str, list[dict[str, Any]]] = {}
    dip: dict[str, list[dict[str, Any]]] = {}
    for c in sorted(cells, key=lambda c: (c.method, c.seed)):
        newest = newest_run(folder / GRID / f"{c.method}-seed{c.seed}")
        if newest is None:
            continue
        for found, path in ((rows, newest[0] / PRIVACY), (dip, newest[0] / DIP / PRIVACY.name)):
            if path.is_file():
                found.setdefault(c.method, []).extend(r | {"seed": c.seed} for r in read_privacy_rows(path))
    return info, cells, rows, dip


def gain(row: dict[str, Any]) -> float | None:
    """A row's reconstruction gain (dB): to the one image it was made from over the best of the gray image,
    the victim's mean image and the image's class mean (those the row has) where it has one
    (``psnr_own``), else best-matched over gray's best."""
    if row.get("psnr_own") is not None:
        floors = [row.get(k) for k in ("gray_psnr_own", "mean_image_psnr_own", "class_mean_psnr_own")]
        return row["psnr_own"] - max(f for f in floors if f is not None)
    if row.get("best_psnr") is None:
        return None
    return row["best_psnr"] - row["gray_psnr"]


def ceiling_gain(row: dict[str, Any]) -> float | None:
    """The exact pixel mean's best-match PSNR above gray's on the same images (dB), or None."""
    return None if row.get("ceiling_psnr") is None else row["ceiling_psnr"] - row["gray_psnr"]


def interval(values: list[float], digits: int = 1) -> str:
    """``mean [lower, upper]`` (95 % Student t), ``-`` without values."""
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    m, lo, hi = mean_ci(values)
    return f"{m:.{digits}f} [{lo:.{digits}f}, {hi:.{digits}f}]"


def counted(group: list[dict[str, Any]], key: str) -> tuple[int, int]:
    """(reconstructions the recogniser assigned their class, reconstructions) over the rows' fraction ``key``
    (``recognised`` or ``ceiling_recognised``, each row's mean over its ``<key>_n`` reconstructions where
    it has that count, else its ``n``)."""
    found = [(r[key], r.get(key + "_n", r["n"])) for r in group if r.get(key) is not None]
    return sum(round(f * n) for f, n in found), sum(n for _, n in found)


def share(group: list[dict[str, Any]], key: str) -> tuple[str, float | None]:
    """(``k/n`` with the share and its 95 % Clopper-Pearson interval, the interval's lower bound) of the
    pooled reconstructions of ``group`` (:func:`counted`); ``-`` and None without any. Pooled, not a mean
    over cells: a victim of 2 classes has shares of 0, 0.5 or 1 only, whose spread over few cells says
    little."""
    from scipy import stats  # imported here, as tools.grid_stats.mean_ci does

    k, n = counted(group, key)
    if not n:
        return "-", None
    ci = stats.binomtest(k, n).proportion_ci(0.95)
    return f"{k}/{n} = {k / n:.2f} [{ci.low:.2f}, {ci.high:.2f}]", float(ci.low)


def lower(values: list[float]) -> float:
    """The 95 % interval's lower bound of the present values; -inf under two, which give no interval."""
    values = [v for v in values if v is not None]
    return mean_ci(values)[1] if len(values) > 1 else float("-inf")


def verdict(group: list[dict[str, Any]], chance: float, control: list[dict[str, Any]] | None = None) -> str:
    """What the upload's reconstructions show, over the cells ``group`` (95 % lower bounds; ``-`` under two
    cells, which give no interval), the first that holds:

    - ``recovers examples``: the gain beats :data:`MARGIN_DB` and the exact mean's gain (a reconstruction
      closer to one of the images than their mean is), or, for rows scored to their own image
      (:func:`gain`), the gain beats :data:`MARGIN_DB`;
    - ``beyond the class``: a per-class upload whose gain beats the non-members' (``control``, paired by
      seed, victim and round) by :data:`MARGIN_DB`;
    - ``shows the class``: recognised above ``chance`` (the lower bound of :func:`share`);
    - ``the images' mean look``: a gain above :data:`MARGIN_DB` that no classifier reads as the class (on
      dark-background images a dark reconstruction beats gray);
    - ``nothing found``: none of these at this budget.
    """
    if len(group) < 2:
        return "-"
    gains = [gain(r) for r in group]
    above_mean = [gain(r) - ceiling_gain(r) for r in group if r.get("ceiling_psnr") is not None]
    own = all(r.get("psnr_own") is not None for r in group)  # already scored to its own image over the floors
    if lower(gains) > MARGIN_DB and (own or lower(above_mean) > 0):
        return "recovers examples"
    paired = pair(group, control or [])
    if lower([a - b for a, b in paired]) > MARGIN_DB:
        return "beyond the class"
    recognised = share(group, "recognised")[1]
    if recognised is not None and recognised > chance:
        return "shows the class"
    if lower(gains) > MARGIN_DB:
        return "the images' mean look"
    return "nothing found"


def pair(group: list[dict[str, Any]], control: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """(gain of ``group``'s row, gain of ``control``'s row) for every (seed, partition, round) both have."""
    by_key = {(r["seed"], r["partition"], r["round"]): gain(r) for r in control}
    return [(gain(r), by_key[k]) for r in group if (k := (r["seed"], r["partition"], r["round"])) in by_key]


def setting_table(info: dict, cells: list[Cell], data_dir: str | None) -> list[str]:
    """Per method its final pooled accuracy and its gain over its seed's class prior (points)."""
    try:
        priors = prior_by_seed(info["preset_config"], cells, data_dir)["training"]
        prior = prior_stats(priors)
        head = [
            f"Class prior alone (every client predicts its most frequent training class): {pct(prior['weighted'])} "
            "pooled. Attacks on models at that accuracy would say nothing; every method here is well above it.",
            "",
        ]
    except ConfigError as exc:  # regenerating without the dataset: the rest of the report stands
        priors, head = None, [f"Class prior: not computed ({exc}; pass --data-dir).", ""]
    lines = head + [
        "| method | seeds | final accuracy (pooled, %) | above the class prior (points) |",
        "|---|---|---|---|",
    ]
    for method in sorted({c.method for c in cells}):
        mine = [c for c in cells if c.method == method]
        finals = [(c.seed, c.curve("accuracy_weighted")[1][-1]) for c in mine]
        acc = mean_std([a for _, a in finals])
        above = (
            "-"
            if priors is None
            else "{:.1f} ± {:.1f}".format(*(100 * x for x in mean_std([a - priors[s][1] for s, a in finals])))
        )
        lines.append(
            f"| {method} | {','.join(str(s) for s, _ in finals)} | {100 * acc[0]:.1f} ± {100 * acc[1]:.1f} | {above} |"
        )
    return lines


def server_uploads(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The server's white-box reconstructions of an upload (no reference input, no black-box decoder); also
    those of an attacker who holds the victim's private models too (knowledge ``white-box + private
    models``: a shared module simulated in its training with them, ``tools.privacy_attacks``)."""
    return [
        r
        for r in rows
        if r["threat"] == "server"
        and r["knowledge"].startswith("white-box")
        and r["attack"] in ("inversion", "update")
        and not r["payload"].startswith(REFERENCE_INPUTS)
    ]


def upload_name(row: dict[str, Any]) -> str:
    """A server upload row's payload, with what the attacker knew beyond the white-box model when it did."""
    extra = row["knowledge"].removeprefix("white-box")
    return row["payload"] + (f" [white-box{extra}]" if extra else "")


def server_table(methods: dict[str, list[dict[str, Any]]], chance: float) -> list[str]:
    """Per method, upload and round: the white-box reconstruction's gain, the exact mean's, the non-members'
    and the paired difference, recognised, and the verdict (:func:`verdict`)."""
    lines = [
        "| method | upload | round | cells | gain over gray (dB) | exact mean's gain | non-members' gain | "
        "upload − non-members | recognised | exact mean recognised | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for method, rows in methods.items():
        uploads = server_uploads(rows)
        for payload in dict.fromkeys(upload_name(r) for r in uploads):
            for rnd in sorted({r["round"] for r in uploads if upload_name(r) == payload}):
                group = [r for r in uploads if upload_name(r) == payload and r["round"] == rnd]
                control = [r for r in rows if r["payload"].startswith("non-member") and r["round"] == rnd]
                paired = pair(group, control)
                lines.append(
                    f"| {method} | {payload} | {rnd} | {len(group)} | {interval([gain(r) for r in group])} | "
                    f"{interval([ceiling_gain(r) for r in group])} | {interval([b for _, b in paired])} | "
                    f"{interval([a - b for a, b in paired])} | "
                    f"{share(group, 'recognised')[0]} | {share(group, 'ceiling_recognised')[0]} | "
                    f"{verdict(group, chance, control)} |"
                )
    return lines


def control_table(methods: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Per method and round, the attack on the victim's own model's inputs no method sends: one image's
    representation (gain to that image over the best of gray, the victim's mean image and the class mean) and the class
    mean representation (best-match gain over gray), with recognised: where these fire, the attack works
    on that model."""
    lines = [
        "| method | round | cells | one image: gain to its image | one image: recognised | class mean: gain | "
        "class mean: recognised |",
        "|---|---|---|---|---|---|---|",
    ]
    for method, rows in methods.items():
        ref = [r for r in rows if r["threat"] == "server" and r["payload"].startswith(("per-sample", "class mean"))]
        for rnd in sorted({r["round"] for r in ref}):
            single = [r for r in ref if r["round"] == rnd and r["payload"].startswith("per-sample")]
            means = [r for r in ref if r["round"] == rnd and r["payload"].startswith("class mean")]
            lines.append(
                f"| {method} | {rnd} | {len(single)} | {interval([gain(r) for r in single])} | "
                f"{share(single, 'recognised')[0]} | {interval([gain(r) for r in means])} | "
                f"{share(means, 'recognised')[0]} |"
            )
    return lines


def recogniser_line(methods: dict[str, list[dict[str, Any]]], chance: float) -> str:
    """The recogniser's accuracy on the attacked victims' real training images (``recogniser_accuracy``,
    one value per attacked cell)."""
    found = {
        (m, r["seed"], r["partition"], r["round"], r["attack"]): r["recogniser_accuracy"]
        for m, rows in methods.items()
        for r in rows
        if r.get("recogniser_accuracy") is not None
    }
    if not found:
        return "The recogniser's accuracy on the victims' images: not recorded."
    return (
        f"The recogniser reads the attacked victims' real training images at {interval(list(found.values()), 2)} "
        f"({len(found)} cells; chance {chance:.2f})."
    )


def membership_table(methods: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Per method, round and upload: membership AUC and TPR at 1 % FPR over the cells (95 % intervals)."""
    lines = [
        "| method | round | upload | attacker knows | cells | AUC | TPR at 1 % FPR | distance AUC | members | "
        "non-members |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for method, rows in methods.items():
        tested = sorted((x for x in rows if x["attack"] == "membership"), key=lambda x: x["round"])
        for r, payload, knowledge in dict.fromkeys((x["round"], x["payload"], x["knowledge"]) for x in tested):
            mine = [x for x in tested if (x["round"], x["payload"], x["knowledge"]) == (r, payload, knowledge)]
            lines.append(
                f"| {method} | {r} | {payload} | {knowledge} | {len(mine)} | "
                f"{interval([x.get('mia_auc') for x in mine], 2)} | "
                f"{interval([x.get('mia_tpr_at_1pct_fpr') for x in mine], 3)} | "
                f"{interval([x.get('mia_distance_auc') for x in mine], 2)} | "
                f"{fmt_mean([x.get('mia_members') for x in mine])} | "
                f"{fmt_mean([x.get('mia_nonmembers') for x in mine])} |"
            )
    return lines


def fmt_mean(values: list) -> str:
    """The mean of the present values as a whole number, ``-`` without any."""
    present = [v for v in values if v is not None]
    return f"{sum(present) / len(present):.0f}" if present else "-"


def label_table(methods: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Per method, round and payload, the label leakage over the cells (mean ± std)."""
    lines = [
        "| method | round | from | cells | " + " | ".join(t for _, t in LABEL_COLUMNS) + " |",
        "|" + "---|" * (4 + len(LABEL_COLUMNS)),
    ]
    for method, rows in methods.items():
        labelled = sorted((x for x in rows if x["attack"] == "labels"), key=lambda x: x["round"])
        for r, payload in dict.fromkeys((x["round"], x["payload"]) for x in labelled):
            mine = [x for x in labelled if x["round"] == r and x["payload"] == payload]
            cells = [cell(spread([x.get(k) for x in mine]), 2) for k, _ in LABEL_COLUMNS]
            lines.append(f"| {method} | {r} | {payload} | {len(mine)} | " + " | ".join(cells) + " |")
    return lines


def client_table(methods: dict[str, list[dict[str, Any]]], chance: float) -> list[str]:
    """Per method and round, what a curious client recovers from its per-class downloads through its own
    model (inversion, decoder): gain over gray against the other clients' images of each class, recognised."""
    lines = [
        "| method | round | download | attack | cells | gain over gray (dB) | exact mean's gain | recognised | "
        "verdict |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for method, rows in methods.items():
        client = [x for x in rows if x["threat"] == "client"]
        for key in sorted({(x["round"], x["payload"], x["attack"]) for x in client}):
            group = [x for x in client if (x["round"], x["payload"], x["attack"]) == key]
            lines.append(
                f"| {method} | {key[0]} | {key[1]} | {key[2]} | {len(group)} | {interval([gain(r) for r in group])} | "
                f"{interval([ceiling_gain(r) for r in group])} | {share(group, 'recognised')[0]} | "
                f"{verdict(group, chance)} |"
            )
    return lines


def cell(value: tuple[float, float] | None, digits: int = 1) -> str:
    """``mean ± std`` or ``-``."""
    return "-" if value is None else f"{value[0]:.{digits}f} ± {value[1]:.{digits}f}"


def fedre_ladder(rows: list[dict[str, Any]]) -> list[str]:
    """FedRE's Q2 on our FedRE runs, white-box from the victim's own model: per round the mean PSNR of each
    rung's reconstructions over one sample of the victim's images (the same sample for the three rungs), one
    image's PSNR to itself, the paired differences per cell, and whether the paper's ordering holds (both
    differences' 95 % intervals above zero)."""
    rungs = {
        "per-sample": "per-sample representation",
        "prototype": "class mean representation",
        "entangled": "z",
    }
    lines = [
        "| round | cells | per-sample: PSNR to its image | per-sample | prototype | entangled | "
        "per-sample − prototype | prototype − entangled | ordering | paper (PSNR / MSE) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    wb = [x for x in rows if x["attack"] == "inversion" and x["threat"] == "server" and x["knowledge"] == "white-box"]
    for rnd in sorted({x["round"] for x in wb}):
        by = {
            name: {(x["seed"], x["partition"]): x for x in wb if x["round"] == rnd and x["payload"] == p}
            for name, p in rungs.items()
        }
        keys = sorted(set.intersection(*(set(v) for v in by.values())))
        if not keys:
            continue
        mean = {name: [by[name][k]["mean_psnr"] for k in keys] for name in rungs}
        first = [a - b for a, b in zip(mean["per-sample"], mean["prototype"], strict=True)]
        second = [a - b for a, b in zip(mean["prototype"], mean["entangled"], strict=True)]
        holds = len(keys) > 1 and lower(first) > 0 and lower(second) > 0
        paper = ", ".join(f"{FEDRE_Q2[n][0]} / {FEDRE_Q2[n][1]}" for n in rungs)
        lines.append(
            f"| {rnd} | {len(keys)} | {interval([by['per-sample'][k]['psnr_own'] for k in keys])} | "
            f"{interval(mean['per-sample'])} | {interval(mean['prototype'])} | {interval(mean['entangled'])} | "
            f"{interval(first)} | {interval(second)} | {'holds' if holds else 'not shown'} | {paper} |"
        )
    return lines


def idlg_check(rows: list[dict[str, Any]], chance: float) -> list[str]:
    """MH-pFedHNGD's appendix C.8: iDLG and inverting gradients on the global model's and the personal
    model's change, per round: gain over gray, the exact mean's, and the verdict (:func:`verdict`)."""
    lines = [
        "| round | change | attack | cells | gain over gray (dB) | exact mean's gain | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for rnd, payload in sorted({(r["round"], r["payload"]) for r in rows if r["attack"] == "update"}):
        group = [r for r in rows if r["round"] == rnd and r["payload"] == payload]
        change = "global model" if payload.startswith("global model") else "personal model"
        lines.append(
            f"| {rnd} | {change} | {payload.removeprefix('global model: ')} | {len(group)} | "
            f"{interval([gain(r) for r in group])} | {interval([ceiling_gain(r) for r in group])} | "
            f"{verdict(group, chance)} |"
        )
    return lines


def cost_table(methods: dict[str, list[dict[str, Any]]]) -> list[str]:
    """CPU seconds per cell by method and attack (one thread): mean and largest."""
    lines = ["| method | attack | cells | CPU s / cell (mean) | largest |", "|---|---|---|---|---|"]
    for method, rows in methods.items():
        for attack in sorted({r["attack"] for r in rows}):
            seconds = {(r["seed"], r["round"], r["partition"]): r["cpu_seconds"] for r in rows if r["attack"] == attack}
            values = list(seconds.values())
            lines.append(
                f"| {method} | {attack} | {len(values)} | {sum(values) / len(values):.0f} | {max(values):.0f} |"
            )
    return lines


def round_stats(rows: list[dict[str, Any]], kind: str) -> dict[int, tuple[float, float, float]]:
    """Round -> (value, lower, upper) of one panel of :func:`plot`: ``gain`` (the server's white-box
    gain over gray of the upload's inversion or inverting gradients, mean over cells, 95 % t),
    ``recognised`` (the same reconstructions' pooled share, 95 % Clopper-Pearson) or ``auc`` (membership
    AUC, mean over cells, 95 % t)."""
    from scipy import stats

    out = {}
    # one attack per upload: the inversion of a vector upload, inverting gradients on a weight change (its
    # iDLG row and MH-pFedHNGD's global model are in their tables)
    uploads = [r for r in server_uploads(rows) if "(iDLG)" not in r["payload"] and "global model" not in r["payload"]]
    if kind == "recognised":
        for rnd in sorted({r["round"] for r in uploads}):
            k, n = counted([r for r in uploads if r["round"] == rnd], "recognised")
            if n:
                ci = stats.binomtest(k, n).proportion_ci(0.95)
                out[rnd] = (k / n, ci.low, ci.high)
        return out
    points = (
        [(r["round"], gain(r)) for r in uploads]
        if kind == "gain"
        else [(r["round"], r.get("mia_auc")) for r in rows if r["attack"] == "membership"]
    )
    for rnd in sorted({x for x, y in points if y is not None}):
        out[rnd] = mean_ci([y for x, y in points if x == rnd and y is not None])
    return out


def plot(methods: dict[str, list[dict[str, Any]]], chance: float, out: Path) -> None:
    """``leakage_vs_round.png``: per method against round, the upload's white-box gain over gray (dB),
    recognised (chance dashed) and membership AUC (0.5 dashed), with 95 % intervals (:func:`round_stats`)."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    colors = method_colors(list(methods))
    panels = (
        ("gain", "gain over gray (dB), server, white-box", 0.0),
        ("recognised", "recognised (share of reconstructions)", chance),
        ("auc", "membership AUC", 0.5),
    )
    for ax, (kind, title, level) in zip(axes, panels, strict=True):
        means = []
        for n, (method, rows) in enumerate(methods.items()):
            found = round_stats(rows, kind)
            if not found:
                continue
            means += [v[0] for v in found.values()]
            xs = [x + 0.08 * (n - len(methods) / 2) for x in found]  # side by side, so the bars stay apart
            values = list(found.values())
            ax.errorbar(
                xs,
                [v[0] for v in values],
                yerr=[[v[0] - v[1] for v in values], [v[2] - v[0] for v in values]],
                label=method,
                color=colors[method],
                marker="o",
                capsize=3,
            )
        ax.axhline(level, color="gray", linestyle="--", linewidth=1)
        if kind == "gain" and means:  # intervals over two or three cells are wide: keep the means readable
            ax.set_ylim(min(means + [level]) - 4, max(means + [level]) + 4)
        ax.set_title(title)
        ax.set_xlabel("round")
    axes[2].legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(out / FIGURE_NAME, dpi=110)
    plt.close(fig)


def chance_of(info: dict) -> float:
    """One over the number of classes of the grid's dataset: a recogniser's chance level."""
    return 1 / DATASETS[info["preset_config"]["dataset"]].num_classes


def report(folder: Path, data_dir: str | None = None) -> str:
    """The Markdown of ``<folder>/report.md`` (its figure: :func:`plot`)."""
    return render(folder, *load(folder), data_dir)


def render(
    folder: Path,
    info: dict,
    cells: list[Cell],
    methods: dict[str, list[dict[str, Any]]],
    dip: dict[str, list[dict[str, Any]]],
    data_dir: str | None = None,
) -> str:
    """The Markdown of ``<folder>/report.md`` from :func:`load`'s grid info, cells and rows."""
    chance = chance_of(info)
    inside = folder.resolve().is_relative_to(ROOT)
    shown = folder.resolve().relative_to(ROOT) if inside else folder
    found = budgets(folder)
    calls = info.get("invocations") or []
    command = (
        (calls[0]["command"] + (f" (and {len(calls) - 1} more, `grid/grid.json`)" if len(calls) > 1 else ""))
        if calls
        else "-"
    )
    parts = [
        "# Privacy evaluation: every method's payload attacked",
        "",
        f"Generated by `python -m tools.privacy_report {shown}` from the grid copy `{GRID}/` (`tools.privacy`'s "
        f"rows of every attacked run). Runs: `{command}`. A cell is one victim of one seed in one round; each "
        f"number is the mean over cells with its 95 % Student-t interval. PSNR in dB. Gain: a reconstruction's "
        "best-match PSNR over the images it stands for, above a mid-gray image's on the same images; the exact "
        "mean's gain is that of the pixel mean of those images (it shows the class or the client and no one "
        f"example). Recognised: the share of reconstructions a classifier of the public split assigns their "
        f"class (chance {chance:.2f}; a weight change's reconstruction labelled with a class the victim holds no "
        "example of is scored against all of its images and counts as not recognised). "
        f"Verdicts (lower 95 % bounds, margin {MARGIN_DB} dB; none under two cells): "
        "*recovers examples* (gain above the margin and above the exact mean's), *beyond the class* (above the "
        "same attack on public non-members' class mean by the margin), *shows the class* (recognised above "
        "chance), *the images' mean look* (a gain above the margin, not recognised), *nothing found* (none of "
        "these at this budget). What the scores mean: `calibration/`; threat "
        "models and attacks: docs/privacy.md. Budgets (each run's `privacy/privacy.md`): "
        + ("; ".join(f"`{b}`" for b in found) or "-")
        + ".",
        "",
        "## The setting learns",
        "",
        *setting_table(info, cells, data_dir),
        "",
        "## Honest-but-curious server, one victim's upload (white-box)",
        "",
        *server_table(methods, chance),
        "",
        f"![leakage against round]({FIGURE_NAME})",
        "",
        "## Controls on the victims' trained models (inputs no method sends)",
        "",
        recogniser_line(methods, chance),
        "",
        *control_table(methods),
        "",
        "## Membership inference, from each upload (the server)",
        "",
        "Members: the victim's training examples; non-members: its held-out test examples of the same classes. "
        "AUC 0.5 and TPR at 1 % FPR (⌊0.01 m⌋ + 1) / (m + 1) with m non-members is what a score that knows "
        "nothing gets; docs/privacy.md says how to read them.",
        "",
        *membership_table(methods),
        "",
        "## Label leakage, from each upload (the server)",
        "",
        *label_table(methods),
        "",
        "## Curious client, its per-class downloads (scored against the other clients' images)",
        "",
        *client_table(methods, chance),
    ]
    if "fedre" in methods:
        parts += [
            "",
            "## FedRE's Q2 ladder (white-box, from the victim's own model)",
            "",
            "Total-variation prior (every cell of the upload table):",
            "",
            *fedre_ladder(methods["fedre"]),
        ]
    if "fedre" in dip:
        parts += ["", "The deep image prior (FedRE's reference [35]; `privacy-dip/` of the runs it was run on):", ""]
        parts += fedre_ladder(dip["fedre"])
    if "mh-pfedhngd" in methods:
        parts += [
            "",
            "## MH-pFedHNGD: the iDLG check of its appendix C.8",
            "",
            *idlg_check(methods["mh-pfedhngd"], chance),
        ]
    figures = [f"- {m}: [{m}/{FIGURE}]({m}/{FIGURE})" for m in methods if (folder / m / FIGURE).is_file()]
    parts += [
        "",
        "## CPU seconds per cell (one thread)",
        "",
        *cost_table(methods),
        "",
        "## Reconstructions (seed 0; best-matching original above each reconstruction)",
        "",
        *figures,
    ]
    return "\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.privacy_report", description=__doc__.split("\n")[0])
    parser.add_argument("folder", type=Path, help="the report folder (holds the grid copy grid/)")
    parser.add_argument("--grid", type=Path, help="an attacked grid to copy into <folder>/grid first")
    parser.add_argument("--data-dir", default=None, help="dataset folder for the class prior (default: the runs')")
    args = parser.parse_args(argv)
    try:
        with new_folder_or_none(args.folder):
            if args.grid is not None:
                if not args.grid.is_dir():
                    raise ConfigError(f"--grid {str(args.grid)!r} is no folder")
                copies = grid_copies(args.grid, args.folder / GRID, tables=True)
                copies += figure_copies(args.grid, args.folder)
                if (args.folder / GRID).exists():  # a stale cell of an earlier copy must not stay
                    shutil.rmtree(args.folder / GRID)
                copy_files(copies)
            info, cells, methods, dip = load(args.folder)  # read once for the report and its figure
            text = render(args.folder, info, cells, methods, dip, args.data_dir)
            plot(methods, chance_of(info), args.folder)
    except (FileNotFoundError, ConfigError) as exc:
        print(f"tools.privacy_report: {exc}", file=sys.stderr)
        return 2
    (args.folder / "report.md").write_text(text)
    print(f"tools.privacy_report: {args.folder / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
