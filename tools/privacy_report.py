"""One report over every method's privacy evaluation: ``python -m tools.privacy_report results/privacy``.

Reads ``<folder>/<method>/privacy.json`` (written by ``tools.privacy``, one folder per method) and writes
``<folder>/report.md``: per method and round what the honest-but-curious server recovers from an upload
(white-box and black-box reconstructions, weight-change inversions, label leakage) beside a mid-gray
image's score, which training examples an upload gives away (membership inference), what a curious
client recovers from its downloads, FedRE's Q2 ladder (one image's
representation, a class prototype, the entangled representation) against the paper's numbers, and
MH-pFedHNGD's iDLG check (its appendix C.8). Every number is computed from those rows.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from common.errors import ConfigError
from tools.privacy import LABEL_COLUMNS, MEMBERSHIP_COLUMNS, pooled, read_privacy_rows, spread
from tools.privacy_attacks import REFERENCE_INPUTS
from tools.runconfig import ROOT

#: FedRE's Q2 (TinyImageNet, its reference [35]): PSNR (dB) and MSE (0-255 scale) of images reconstructed
#: from per-sample representations, prototypes and entangled representations
FEDRE_Q2 = {"per-sample": (12.89, 4514.91), "prototype": (10.25, 6992.04), "entangled": (9.66, 7781.87)}
#: how far above the mid-gray image's score a reconstruction must be to count as recovering something (dB)
MARGIN_DB = 1.0


def load(folder: Path) -> dict[str, list[dict[str, Any]]]:
    """Method -> its rows, for every ``<folder>/<method>/privacy.json``.

    Raises:
        FileNotFoundError: naming the folder when it holds no method's rows.
        ConfigError: naming a ``privacy.json`` that is not a list of rows (``tools.privacy.read_privacy_rows``).
    """
    found = {p.parent.name: read_privacy_rows(p) for p in sorted(folder.glob("*/privacy.json"))}
    if not found:
        raise FileNotFoundError(f"{folder} holds no <method>/privacy.json (run tools.privacy --out {folder}/<method>)")
    return found


def stat(rows: list[dict[str, Any]], key: str, **match: Any) -> tuple[float, float] | None:
    """Mean and std of ``key`` over every reconstruction of the rows that match (see ``tools.privacy.pooled``)."""
    return pooled([r for r in rows if all(r.get(k) == v for k, v in match.items())], key)


def cell(value: tuple[float, float] | None, digits: int = 1) -> str:
    """``mean ± std`` or ``-``."""
    return "-" if value is None else f"{value[0]:.{digits}f} ± {value[1]:.{digits}f}"


def verdict(attack: tuple[float, float] | None, gray: tuple[float, float] | None) -> str:
    """``recovers more than a gray image`` when the attack's mean PSNR beats the gray image's by
    :data:`MARGIN_DB`, else ``no better than a gray image``; ``-`` without both."""
    if attack is None or gray is None:
        return "-"
    return "recovers more than a gray image" if attack[0] > gray[0] + MARGIN_DB else "no better than a gray image"


def server_table(methods: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Per method and round, the server's best reconstruction from one upload, beside the gray image."""
    lines = [
        "| method | round | upload | white-box PSNR best | black-box PSNR best | gray image PSNR best | "
        "verdict (white-box) |",
        "|---|---|---|---|---|---|---|",
    ]
    for method, rows in methods.items():
        for r in sorted({row["round"] for row in rows}):
            images = [
                x
                for x in rows
                if x["round"] == r and x["threat"] == "server" and x["attack"] not in ("labels", "membership")
            ]
            uploads = [x for x in images if not x["payload"].startswith(REFERENCE_INPUTS)]
            for payload in dict.fromkeys(x["payload"] for x in uploads):
                mine = [x for x in uploads if x["payload"] == payload]
                white = pooled([x for x in mine if x["knowledge"] == "white-box"], "best_psnr")
                black = pooled([x for x in mine if x["knowledge"] != "white-box"], "best_psnr")
                gray = pooled(mine, "gray_psnr")
                lines.append(
                    f"| {method} | {r} | {payload} | {cell(white)} | {cell(black)} | {cell(gray)} | "
                    f"{verdict(white, gray)} |"
                )
    return lines


def label_table(methods: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Per method, round and payload, the label leakage over the victims (mean ± std)."""
    lines = [
        "| method | round | from | " + " | ".join(t for _, t in LABEL_COLUMNS) + " |",
        "|" + "---|" * (3 + len(LABEL_COLUMNS)),
    ]
    for method, rows in methods.items():
        labelled = sorted((x for x in rows if x["attack"] == "labels"), key=lambda x: x["round"])
        for r, payload in dict.fromkeys((x["round"], x["payload"]) for x in labelled):
            mine = [x for x in labelled if x["round"] == r and x["payload"] == payload]
            cells = [cell(spread([x.get(k) for x in mine]), 2) for k, _ in LABEL_COLUMNS]
            lines.append(f"| {method} | {r} | {payload} | " + " | ".join(cells) + " |")
    return lines


def membership_table(methods: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Per method, round and upload, the membership inference over the victims (mean ± std; members and
    non-members: candidates per victim)."""
    lines = [
        "| method | round | upload | attacker knows | victims | " + " | ".join(t for _, t in MEMBERSHIP_COLUMNS) + " |",
        "|" + "---|" * (5 + len(MEMBERSHIP_COLUMNS)),
    ]
    for method, rows in methods.items():
        tested = sorted((x for x in rows if x["attack"] == "membership"), key=lambda x: x["round"])
        for r, payload, knowledge in dict.fromkeys((x["round"], x["payload"], x["knowledge"]) for x in tested):
            mine = [x for x in tested if (x["round"], x["payload"], x["knowledge"]) == (r, payload, knowledge)]
            cells = [
                cell(spread([x.get(k) for x in mine]), 0 if k.endswith("members") else 2) for k, _ in MEMBERSHIP_COLUMNS
            ]
            lines.append(f"| {method} | {r} | {payload} | {knowledge} | {len(mine)} | " + " | ".join(cells) + " |")
    return lines


def client_table(methods: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Per method and round, what a curious client recovers from its per-class downloads."""
    lines = [
        "| method | round | download | own model: inversion PSNR best | own model: decoder PSNR best | "
        "gray image PSNR best | verdict (inversion) |",
        "|---|---|---|---|---|---|---|",
    ]
    for method, rows in methods.items():
        client = [x for x in rows if x["threat"] == "client"]
        for r in sorted({x["round"] for x in client}):
            for payload in dict.fromkeys(x["payload"] for x in client if x["round"] == r):
                inv = stat(client, "best_psnr", round=r, payload=payload, attack="inversion")
                dec = stat(client, "best_psnr", round=r, payload=payload, attack="decoder")
                gray = stat(client, "gray_psnr", round=r, payload=payload)
                lines.append(
                    f"| {method} | {r} | {payload} | {cell(inv)} | {cell(dec)} | {cell(gray)} | {verdict(inv, gray)} |"
                )
    return lines


def fedre_ladder(rows: list[dict[str, Any]]) -> list[str]:
    """FedRE's Q2 on our FedRE run: per round, white-box PSNR/MSE of one image's representation (to that
    image), the class prototype and the entangled z (best match), beside the paper's numbers, and
    whether the paper's ordering holds."""
    lines = [
        "| round | input | PSNR (dB) | MSE | gray image PSNR | paper PSNR | paper MSE |",
        "|---|---|---|---|---|---|---|",
    ]
    orderings = []
    for r in sorted({x["round"] for x in rows}):
        wb = [x for x in rows if x["round"] == r and x["attack"] == "inversion" and x["threat"] == "server"]
        exact = stat(wb, "psnr_own", payload="per-sample representation")
        gray_exact = stat(wb, "gray_psnr_own", payload="per-sample representation")
        lines.append(f"| {r} | per-sample (to its image) | {cell(exact)} | - | {cell(gray_exact)} | - | - |")
        ladder = {
            "per-sample": (stat(wb, "best_psnr", payload="per-sample representation"), "best"),
            "prototype": (stat(wb, "best_psnr", payload="class mean representation"), "best"),
            "entangled": (stat(wb, "best_psnr", payload="z"), "best"),
        }
        mse = {
            "per-sample": stat(wb, "best_mse", payload="per-sample representation"),
            "prototype": stat(wb, "best_mse", payload="class mean representation"),
            "entangled": stat(wb, "best_mse", payload="z"),
        }
        gray = {
            "per-sample": stat(wb, "gray_psnr", payload="per-sample representation"),
            "prototype": stat(wb, "gray_psnr", payload="class mean representation"),
            "entangled": stat(wb, "gray_psnr", payload="z"),
        }
        for name, (value, how) in ladder.items():
            label = {"exact": "to its image", "best": "best match"}[how]
            lines.append(
                f"| {r} | {name} ({label}) | {cell(value)} | {cell(mse[name], 0)} | {cell(gray[name])} | "
                f"{FEDRE_Q2[name][0]} | {FEDRE_Q2[name][1]} |"
            )
        values = [ladder[k][0] for k in ("per-sample", "prototype", "entangled")]
        if all(v is not None for v in values):
            holds = values[0][0] > values[1][0] > values[2][0]
            orderings.append(
                f"round {r}: per-sample {values[0][0]:.1f}, prototype {values[1][0]:.1f}, entangled "
                f"{values[2][0]:.1f} dB: {'holds' if holds else 'does not hold'}"
            )
    return lines + [
        "",
        "The paper's ordering (per-sample > prototype > entangled, best-match PSNR): " + "; ".join(orderings) + ".",
    ]


def idlg_check(rows: list[dict[str, Any]]) -> list[str]:
    """MH-pFedHNGD's appendix C.8: iDLG (and inverting gradients) on the global model's and the personal
    model's change, beside the gray image, per round."""
    lines = ["| round | change | attack | PSNR best | gray image PSNR best | verdict |", "|---|---|---|---|---|---|"]
    for x in sorted({(r["round"], r["payload"]) for r in rows if r["attack"] == "update"}):
        r, payload = x
        value = stat(rows, "best_psnr", round=r, payload=payload)
        gray = stat(rows, "gray_psnr", round=r, payload=payload)
        change = "global model" if payload.startswith("global model") else "personal model"
        lines.append(
            f"| {r} | {change} | {payload.removeprefix('global model: ')} | {cell(value)} | {cell(gray)} | "
            f"{verdict(value, gray)} |"
        )
    return lines


def report(folder: Path) -> str:
    """The Markdown of ``<folder>/report.md``."""
    methods = load(folder)
    inside = folder.resolve().is_relative_to(ROOT)
    shown = folder.resolve().relative_to(ROOT) if inside else folder
    parts = [
        "# Privacy evaluation: every method's payload attacked",
        "",
        "Generated by `python -m tools.privacy_report " + str(shown) + "` from each method's `privacy.json` "
        "(`tools.privacy`; commands, runs and budgets in each method's `privacy.md`). PSNR in dB, best match "
        "among the images a reconstruction stands for, mean ± std over reconstructions (rounds x 3 victims x "
        f"rows). Verdict: the attack's mean PSNR beats a uniform mid-gray image's by more than {MARGIN_DB} dB. "
        "Threat models and attacks: docs/privacy.md.",
        "",
        "## Honest-but-curious server, one victim's upload",
        "",
        *server_table(methods),
        "",
        "## Label leakage, from each upload (the server)",
        "",
        *label_table(methods),
        "",
        "## Membership inference, from each upload (the server)",
        "",
        "Members: the victim's training examples; non-members: its held-out test examples of the same classes. "
        "AUC 0.5 and TPR at 1 % FPR (⌊0.01 m⌋ + 1) / (m + 1) with m non-members (0.02 at 100) is what a score "
        "that knows nothing gets; docs/privacy.md says how to read them.",
        "",
        *membership_table(methods),
        "",
        "## Curious client, its per-class downloads (scored against the other clients' images)",
        "",
        *client_table(methods),
    ]
    if "fedre" in methods:
        parts += [
            "",
            "## FedRE's Q2 ladder (white-box, from the victim's own model)",
            "",
            *fedre_ladder(methods["fedre"]),
        ]
    if "mh-pfedhngd" in methods:
        parts += ["", "## MH-pFedHNGD: the iDLG check of its appendix C.8", "", *idlg_check(methods["mh-pfedhngd"])]
    figures = [
        f"- {m}: [{m}/reconstructions.png]({m}/reconstructions.png)"
        for m in methods
        if (folder / m / "reconstructions.png").is_file()
    ]
    parts += ["", "## Reconstructions (best-matching original above each reconstruction)", "", *figures]
    return "\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.privacy_report", description=__doc__.split("\n")[0])
    parser.add_argument("folder", type=Path, help="the folder of per-method tools.privacy outputs")
    args = parser.parse_args(argv)
    try:
        text = report(args.folder)
    except (FileNotFoundError, ConfigError) as exc:
        print(f"tools.privacy_report: {exc}", file=sys.stderr)
        return 2
    (args.folder / "report.md").write_text(text)
    print(f"tools.privacy_report: {args.folder / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
