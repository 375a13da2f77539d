"""Single-round collapses: the rounds where a run's pooled accuracy drops by more than a threshold
and later recovers, with what the run's rows say of that round.

Usage (from the repository root):

    uv run --frozen python -m tools.collapses results [more folders] [--drop 0.2] [--out collapses.md]

Every ``metrics.jsonl`` under the folders (our runs: grids, cross-checks, generalisation runs) is
read with :func:`common.files.read_rows` (pooled accuracy ``accuracy_weighted``); every cross-check's
``ours.json`` (our side's compared curve, e.g. FedGH's global-head accuracy, named by its ``metric``,
with the rows of the ``metrics.jsonl`` beside it as evidence) and ``reference-seed-*.json`` (the
reference implementation's curve) are read too, so a collapse on one side of a paired check can be
told from one on both. For a round t with pooled accuracy a_t the rule is

    a_{t-1} - a_t > drop   and   max_{s > t} a_s >= a_t + drop

(it fell by more than ``drop`` in one round and won at least that much back later). For each such
round of ours the listing gives the row's evidence: the clients that trained and were dropped, the
rows the transport clipped, the server's own metrics (``server_*``: its step's size, FedTGP's
margin and prototype movement, rolled-back or bounded uploads), the clients missing from the
evaluation, and the same keys one round before, so a reader can see what changed.

Accuracies are fractions in [0, 1]; ``drop`` likewise (0.2 = 20 points).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.errors import ConfigError
from common.files import ROWS_FILE, read_rows, read_text

#: a collapse falls by more than this and wins it back (fraction of test examples: 20 points)
DROP = 0.2
#: row keys that are the round's evidence beside every ``server_*`` key
EVIDENCE = ("num_clients", "dropped_clients", "clipped_rows", "eval_missing", "untrained", "train_loss")


@dataclass(frozen=True)
class Collapse:
    """One collapse: ``run`` (a path relative to the folder listed), its round, pooled accuracy one
    round before, at it and the best after it (fractions), and the rows' evidence of the round and the
    round before (empty for a reference curve)."""

    run: str
    side: str  # "ours" (rows), "ours: <metric>" (a cross-check's compared curve) or "reference"
    round: int
    before: float
    at: float
    recovered: float
    evidence: dict[str, Any] = field(default_factory=dict)
    previous: dict[str, Any] = field(default_factory=dict)


def collapse_rounds(curve: Sequence[float | None], drop: float = DROP) -> list[tuple[int, float, float, float]]:
    """(round, a_{t-1}, a_t, best later) of every collapse of ``curve`` (index 0 = round 1; None: a
    round without evaluation, skipped: the comparison is with the last evaluated round)."""
    points = [(i + 1, a) for i, a in enumerate(curve) if a is not None]
    found = []
    for k in range(1, len(points)):
        (_, before), (t, at) = points[k - 1], points[k]
        later = [a for _, a in points[k + 1 :]]
        if before - at > drop and later and max(later) >= at + drop:
            found.append((t, before, at, max(later)))
    return found


def _evidence(row: dict[str, Any]) -> dict[str, Any]:
    keys = [k for k in EVIDENCE if k in row] + sorted(k for k in row if k.startswith("server_"))
    return {k: row[k] for k in keys}


def _curve(path: Path) -> tuple[list[float | None], str | None]:
    """(``curve``, ``metric`` or None) of a cross-check JSON file; ([], None) for a JSON object
    without ``curve`` (a cross-check of another kind, e.g. one against an authors' tree).

    Raises:
        ConfigError: naming the file, when it cannot be read (:func:`common.files.read_text`), is no JSON
            object or its ``curve`` no list of accuracies.
    """
    try:
        data = json.loads(read_text(path))  # bounded: a regular file of at most common.files.MAX_READ_BYTES
        if not isinstance(data, dict):
            raise TypeError("not a JSON object")
        curve = data.get("curve", [])
        if not isinstance(curve, list) or not all(a is None or isinstance(a, (int, float)) for a in curve):
            raise TypeError("'curve' is not a list of accuracies")
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError(f"{path}: not a cross-check curve file ({exc})") from None
    return curve, data.get("metric")


def run_collapses(path: Path, root: Path, drop: float = DROP) -> list[Collapse]:
    """The collapses of one run: ``path`` a ``metrics.jsonl``, a cross-check's ``ours.json`` or its
    ``reference-seed-*.json``.

    Raises:
        ConfigError: the file is not what its name says (one line naming it).
    """
    name = str(path.relative_to(root))
    rows = read_rows(path.parent) if path.name in (ROWS_FILE, "ours.json") else []
    by_round = {int(r["round"]): r for r in rows}
    if path.name == ROWS_FILE:
        side = "ours"
        curve = [by_round.get(t, {}).get("accuracy_weighted") for t in range(1, max(by_round, default=0) + 1)]
    else:
        curve, metric = _curve(path)
        side = f"ours: {metric}" if path.name == "ours.json" else "reference"
    return [
        Collapse(name, side, t, b, a, r, _evidence(by_round.get(t, {})), _evidence(by_round.get(t - 1, {})))
        for t, b, a, r in collapse_rounds(curve, drop)
    ]


def runs_under(folders: Iterable[Path]) -> list[tuple[Path, Path]]:
    """(file, the folder it was found under) of every run under ``folders``, sorted: our rows files and
    the cross-checks' curves of both sides."""
    found = []
    for folder in folders:
        if not folder.is_dir():
            raise ConfigError(f"{folder}: not a folder")
        patterns = (ROWS_FILE, "ours.json", "reference-seed-*.json")
        for path in sorted(p for pattern in patterns for p in folder.rglob(pattern)):
            found.append((path, folder))
    return found


def _value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return json.dumps(v, sort_keys=True) if isinstance(v, (dict, list)) else str(v)


def listing(collapses: Sequence[Collapse], drop: float, scanned: int) -> str:
    """A markdown listing: one section per collapse, its evidence against the round before."""
    ours = sum(c.side != "reference" for c in collapses)
    lines = [
        "# Single-round collapses",
        "",
        f"Rounds whose pooled accuracy fell by more than {drop:.0%} in one round and later won that back "
        f"(`python -m tools.collapses`): {len(collapses)} in {scanned} runs, {ours} of ours and "
        f"{len(collapses) - ours} of the reference implementations.",
        "",
    ]
    for c in collapses:
        lines += [
            f"## {c.run}, round {c.round} ({c.side})",
            "",
            f"Pooled accuracy {c.before:.4f} -> {c.at:.4f} -> best later {c.recovered:.4f}.",
            "",
        ]
        if c.evidence:
            lines += ["| row key | round before | this round |", "| --- | --- | --- |"]
            for k, v in c.evidence.items():
                lines.append(f"| {k} | {_value(c.previous.get(k, '-'))} | {_value(v)} |")
            lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path, help="folders to search for runs (e.g. results)")
    parser.add_argument("--drop", type=float, default=DROP, help="fraction, default 0.2 (20 points)")
    parser.add_argument("--out", type=Path, help="write the markdown listing here (default: print it)")
    args = parser.parse_args(argv)
    try:
        if not 0 < args.drop < 1:
            raise ConfigError(f"--drop {args.drop}: a fraction in (0, 1)")
        runs = runs_under(args.folders)
        collapses = [c for path, root in runs for c in run_collapses(path, root, args.drop)]
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    text = listing(collapses, args.drop, len(runs))
    if args.out:
        args.out.write_text(text + "\n", encoding="utf-8")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
