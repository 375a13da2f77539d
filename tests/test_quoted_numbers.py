"""Every accuracy results/README.md quotes for committed rows is the one those rows give.

Numbers typed by hand from a report drift from the rows (a rounded per-seed table re-averaged, a digit
mistyped). This test regenerates from the committed rows alone, with the report's own functions
(``tools.grid_rows``, ``tools.grid_stats``, ``tools.report``) and ``bench.crosscheck_report``'s, the
numbers of every kind the README quotes, and checks each quote against them at the quote's own decimals (``%.Nf``
of the unrounded number, as the reports round), section by section: a ``## <grid>`` section against
``results/<grid>/`` and every ``crosscheck/<folder>/`` it names, ``## crosscheck/`` against all of
``results/crosscheck/``. The same holds for a paragraph of ``docs/`` that names a committed grid, for
the ``A ± B`` of each committed ``report.md`` table, and for results/byzantine/README.md's table against
:func:`bench.byzantine.table` of its rows. The kinds of quote:

- ``A ± B``: a method's final or best accuracy (mean over clients or pooled) over any two or more of
  its seeds (:func:`tools.grid_stats.method_stats`, sample std), a paired-by-seed difference of two
  methods (best round, final round or mean of the last 10 rounds, pooled; sample std), the paper's
  number with its ± (``presets/<preset>.paper.toml``), or a cross-check's final or best
  (:func:`bench.crosscheck_report.compare`, population std);
- a per-seed table row ``| <seed> | best / final / last 10 | ...``: each cell a run of that seed;
- ``X % at round R`` (``in round R``, ``(round R``, and ``X % at R`` in a list), ``final X %``:
  some run's pooled accuracy at that round, at its end;
- the report's verdict ``(X below, tolerance Y)`` (:func:`tools.report.paper_comparison`) and its
  differences in standard errors ``(+0.8 and +1.3 SE)``, ``0.6 standard errors``
  (:func:`tools.grid_stats.difference`), over any two or more seeds.

Not checked: numbers of other phrasings (a seed-mean curve's level or gain, gaps in points, seconds,
bytes, rounds, margins, losses) and sections about no committed rows.
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass, field, fields
from functools import cache, reduce
from operator import or_
from pathlib import Path

import numpy as np
import pytest

from bench.byzantine import ATTACKS, table
from bench.crosscheck_report import compare
from bench.fedre_authors import OURS_FILE, final, our_curve, paired_gap
from bench.fedre_authors import stats as authors_stats
from common.files import read_rows
from tools.grid_rows import Cell, load_ablations, load_grid, paper_info
from tools.grid_stats import difference, mean_std, method_stats
from tools.report import paper_comparison

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"
README = RESULTS / "README.md"
CROSSCHECK = RESULTS / "crosscheck"
PRIVACY = RESULTS / "privacy"
DATA_DIR = ROOT.parent / "shared" / "data"
BYZANTINE = RESULTS / "byzantine"
LAST = 10  # the README's "mean of the last 10 rounds"
ACCURACIES = ("accuracy_mean", "accuracy_weighted")  # mean over clients, pooled

MINUS = str.maketrans({"−": "-"})
NUMBER = r"\d+\.\d+"
PAIR = re.compile(rf"([+\-−]?{NUMBER})\s+±\s+({NUMBER})")
TRIPLE = re.compile(rf"({NUMBER}) / ({NUMBER}) / ({NUMBER})")
SEED_ROW = re.compile(r"^[ \t]*\| (\d+) \|(.*)\|[ \t]*$", re.M)
#: "97.38 % at round 104", "90.46 % in round 120", "96.79 % (round 43", "97.11 % at 100" (in a list)
AT_ROUND = re.compile(rf"(?<!±\s)(?<![\d.])({NUMBER})\s+%\s+(?:at\s+round|in\s+round|\(round|at)\s+(\d+)")
#: "final 97.26 %", "final pooled 59.33 %"
FINAL = re.compile(rf"final(?:\s+pooled)?\s+({NUMBER})\s+%")
#: the report's verdict against the paper: "(2.47 below, tolerance 1.5)"
VERDICT = re.compile(rf"\(({NUMBER})\s+(?:below|above),\s+tolerance\s+({NUMBER})\)")
#: the report's differences in standard errors: "(−0.5, +0.8 and +1.3 SE)", "0.6 standard errors"
SE = re.compile(rf"\(([+\-−\d., and]+?)\s+SE\)|({NUMBER})\s+standard\s+errors")
NUMBERS = re.compile(rf"[+\-−]?{NUMBER}")


@dataclass
class Numbers:
    """What committed rows give, unrounded (percent; points for differences)."""

    pairs: set[tuple[float, float]] = field(default_factory=set)  # (mean, std)
    triples: set[tuple[int, tuple[float, float, float]]] = field(default_factory=set)  # (seed, (best, final, last))
    at_round: set[tuple[int, float]] = field(default_factory=set)  # (round, accuracy)
    finals: set[float] = field(default_factory=set)  # a run's final accuracy
    verdicts: set[tuple[float, float]] = field(default_factory=set)  # (|gap to the paper|, tolerance)
    z: set[float] = field(default_factory=set)  # a difference in standard errors (one of the two over all its seeds)

    def __or__(self, other: Numbers) -> Numbers:
        return Numbers(*(getattr(self, f.name) | getattr(other, f.name) for f in fields(self)))


def rounds_to(quoted: str, value: float) -> bool:
    """Whether ``value`` printed with ``quoted``'s decimals (``%.Nf``, as the reports round) is ``quoted``
    (a Unicode or plus sign allowed; -0.00 is 0.00)."""
    decimals = len(quoted.split(".")[1])
    printed, typed = (float(x) for x in (f"{value:.{decimals}f}", quoted.translate(MINUS)))
    return printed == typed


def pooled(cell: Cell) -> tuple[float, float, float]:
    """A run's best, final and mean-of-the-last-10 pooled accuracy (``accuracy_weighted``), percent."""
    values = 100 * cell.curve("accuracy_weighted")[1]
    return float(values.max()), float(values[-1]), float(values[-LAST:].mean())


@cache
def grid_numbers(grid: str) -> Numbers:
    """What ``results/<grid>/``'s rows (its ablations' too) and its paper file give, over any two or
    more seeds of each method: final and best accuracy (:func:`tools.grid_stats.method_stats`), the
    verdict against the paper (:func:`tools.report.paper_comparison`), the difference to another
    method in standard errors (:func:`tools.grid_stats.difference`); over all seeds the two methods
    share, the paired-by-seed differences (best, final, last 10; mean ± sample std); the paper's
    numbers with their ±; each run's best / final / last 10 and its accuracy at every round."""
    info, cells = load_grid(RESULTS / grid)
    cells += load_ablations(RESULTS / grid, info)[0]
    paper = paper_info(info["preset"])
    methods = sorted({c.method for c in cells})
    runs = {m: {c.seed: c for c in cells if c.method == m} for m in methods}
    stats = {  # method -> seeds -> method_stats
        m: {
            seeds: method_stats([runs[m][s] for s in seeds], "accuracy_weighted", None)
            for n in range(2, len(runs[m]) + 1)
            for seeds in itertools.combinations(sorted(runs[m]), n)
        }
        for m in methods
    }
    found = Numbers()
    keys = [f"{k}_{a}" for k in ("final", "best") for a in ACCURACIES]
    key = paper.get("ours", "final_accuracy_mean")  # the report's verdicts and standard errors are on it
    for m, by_seeds in stats.items():
        for s in by_seeds.values():
            found.pairs |= {(100 * s[k][0], 100 * s[k][1]) for k in keys}
            verdicts = re.findall(
                r"\| ([+-]\d+\.\d+) \(tolerance (\d+\.\d+)\)", "\n".join(paper_comparison(paper, {m: s}))
            )
            found.verdicts |= {(abs(float(gap)), float(tolerance)) for gap, tolerance in verdicts}
    for a, b in itertools.permutations(methods, 2):
        full_a, full_b = max(stats[a], key=len, default=()), max(stats[b], key=len, default=())
        for sa, sb in itertools.product(stats[a], stats[b]):  # one of the two over all its seeds
            z = difference(stats[a][sa][key], len(sa), stats[b][sb][key], len(sb))[1]
            if (sa == full_a or sb == full_b) and z is not None:
                found.z.add(z)
        seeds = sorted(set(runs[a]) & set(runs[b]))
        for i in range(3) if len(seeds) > 1 else ():
            found.pairs.add(mean_std([pooled(runs[a][s])[i] - pooled(runs[b][s])[i] for s in seeds]))
    for m, number in paper.get("reported", {}).items():
        found.pairs.add((number, paper.get("reported-std", {}).get(m, 0.0)))
    for c in cells:
        found.triples.add((c.seed, pooled(c)))
        found.finals.add(pooled(c)[1])
        rounds, values = c.curve("accuracy_weighted")
        found.at_round |= {(int(r), 100 * float(v)) for r, v in zip(rounds, values)}
    return found


def curves(paths: list[Path], key: str) -> list[list[float]]:
    """One accuracy curve (fractions, NaN where a run diverged) per seed file: ``key`` of a json file,
    or of each row of a ``metrics.jsonl``."""
    out = []
    for path in paths:
        if path.name == "metrics.jsonl":
            out.append([r[key] for r in read_rows(path.parent)])
        else:
            out.append(json.loads(path.read_text(encoding="utf-8"))[key])
    return [[np.nan if x is None else x for x in curve] for curve in out]


@cache
def crosscheck_numbers(folder: str) -> Numbers:
    """What ``results/crosscheck/<folder>/``'s per-seed files give: final and best of each side by
    :func:`bench.crosscheck_report.compare` (population std), against HtFLlib (``<method>/seed-<s>/ours.json``
    beside ``<method>/reference-seed-<s>.json``) or the authors' code (``seed-<s>/metrics.jsonl``
    beside ``seed-<s>/authors.json``, pooled and mean over clients), each side's final and best over
    its seeds of ``bench.fedre_authors``' ``<side>-seed-<s>.json`` (sample std, as its report), and
    every round's accuracy of every run kept there (``metrics.jsonl``, ``ours.json``, a reference's
    curve, the authors' ``authors.json``, a ``<side>-seed-<s>.json`` or a ``rows*.jsonl``)."""
    base = CROSSCHECK / folder
    comparisons = []
    for method in sorted(p for p in base.iterdir() if p.is_dir()):
        ours, reference = sorted(method.glob("seed-*/ours.json")), sorted(method.glob("reference-seed-*.json"))
        if ours and len(ours) == len(reference):
            comparisons.append((curves(ours, "curve"), curves(reference, "curve")))
    authors = sorted(base.glob("seed-*/authors.json"))
    rows = [p.parent / "metrics.jsonl" for p in authors]
    for ours_key, their_key in (("accuracy_weighted", "curve"), ("accuracy_mean", "accuracy_mean")) if authors else ():
        comparisons.append((curves(rows, ours_key), curves(authors, their_key)))
    found = Numbers()
    for ours, reference in comparisons:
        result = compare(ours, reference)
        for side, key in itertools.product(("ours", "reference"), ("final", "best")):
            if result[side][f"{key}_mean"] is not None:
                found.pairs.add((100 * result[side][f"{key}_mean"], 100 * result[side][f"{key}_std"]))
    kept = [*curves(sorted(base.glob("**/metrics.jsonl")), "accuracy_weighted"), *curves(authors, "curve")]
    kept += curves(sorted(base.glob("**/reference-seed-*.json")), "curve")
    # bench.fedre_authors: <side>-seed-<s>.json in the folder itself, side -> seed -> curve
    sides: dict[str, dict[int, list[float]]] = {}
    for path in sorted(base.glob("*-seed-*.json")):
        side, seed = path.stem.rsplit("-seed-", 1)
        sides.setdefault(side, {})[int(seed)] = curves([path], "curve")[0]
    if (base / OURS_FILE).is_file():  # our runs the report shows beside theirs, from their own folders
        seeds = sorted(sides["fedre"])
        rounds = len(sides["fedre"][seeds[0]])
        for pattern in json.loads((base / OURS_FILE).read_text(encoding="utf-8")).values():
            found_curves = {s: our_curve(ROOT / pattern.format(seed=s), rounds) for s in seeds}
            sides[pattern] = {s: c for s, c in found_curves.items() if c is not None}
    for by_seed in sides.values():
        kept += list(by_seed.values())
        if by_seed:  # bench.fedre_authors.stats: mean ± sample std over seeds (0.00 for one seed, as printed)
            s = authors_stats([by_seed[k] for k in sorted(by_seed)])
            found.pairs |= {(s["final"], s["final_std"]), (s["best"], s["best_std"])}
        # the report's paired gaps to the authors' FedRE and to PFLlib's Local, in final and in best
        for other, at in itertools.product((sides.get("fedre", {}), sides.get("local", {})), (final, max)):
            gap = paired_gap(by_seed, other, at)
            if gap is not None and gap[1] is not None:
                found.pairs.add((gap[0], gap[1]))
    for rows in sorted(base.glob("rows*.jsonl")):  # a reference's long runs, one file per seed
        kept.append([json.loads(line)["accuracy"] for line in rows.read_text(encoding="utf-8").splitlines()])
    for curve in kept:  # a reference's rows hold None where it diverged
        found.finals |= {100 * float(curve[-1])} if curve[-1] is not None else set()
        found.at_round |= {(r, 100 * float(x)) for r, x in enumerate(curve, 1) if x is not None}
    return found


def named_grids(text: str) -> set[str]:
    """The committed grids ``text`` names (``results/<grid>/`` with its ``grid.json``)."""
    return {g for g in re.findall(r"results/([\w.-]+)/", text) if (RESULTS / g / "grid.json").is_file()}


def named_numbers(text: str, grid: str | None = None) -> Numbers | None:
    """What the rows behind ``text`` give: ``grid``'s, every committed grid it names
    (``results/<grid>/``) and every cross-check folder it names (``crosscheck/<folder>/``); None
    when it names none."""
    grids = named_grids(text)
    folders = {f for f in re.findall(r"crosscheck/([\w.-]+)/", text) if (CROSSCHECK / f).is_dir()}
    if grid is not None:
        grids.add(grid)
    if not grids and not folders:
        return None
    return reduce(or_, [*map(grid_numbers, sorted(grids)), *map(crosscheck_numbers, sorted(folders))], Numbers())


def readme_units(text: str) -> list[tuple[int, str, Numbers | None]]:
    """``(offset, body, numbers)`` of each ``## `` section of results/README.md: its body and what
    the rows behind it give: a ``## <grid>`` section's grid and the cross-check folders it names;
    ``## crosscheck/``, every cross-check folder; None for another section."""
    found = []
    for match in re.finditer(r"^## (.*)\n((?:(?!## ).*\n?)*)", text, flags=re.M):
        name = match[1].split()[0]
        if name == "crosscheck/":
            folders = sorted(p.name for p in CROSSCHECK.iterdir() if p.is_dir())
            numbers = reduce(or_, map(crosscheck_numbers, folders), Numbers())
        else:
            numbers = named_numbers(match[2], name) if (RESULTS / name / "grid.json").is_file() else None
        found.append((match.start(2), match[2], numbers))
    return found


def doc_units(text: str) -> list[tuple[int, str, Numbers | None]]:
    """``(offset, paragraph, numbers)`` of each paragraph of a Markdown page and, where it names a
    committed grid, what the rows it names give (:func:`named_numbers`; None for another paragraph:
    the methods' pages quote cross-checks without naming each folder)."""
    paragraphs = re.finditer(r"(?:.+\n?)+", text)
    return [(m.start(), m[0], named_numbers(m[0]) if named_grids(m[0]) else None) for m in paragraphs]


#: kind of quote -> (its pattern, whether some number of a Numbers gives the quoted groups)
CHECKS = {
    "pair": (PAIR, lambda n, a, b: any(rounds_to(a, m) and rounds_to(b, s) for m, s in n.pairs)),
    "at round": (AT_ROUND, lambda n, x, r: any(int(r) == at and rounds_to(x, v) for at, v in n.at_round)),
    "final": (FINAL, lambda n, x: any(rounds_to(x, v) for v in n.finals)),
    "verdict": (VERDICT, lambda n, a, b: any(rounds_to(a, g) and rounds_to(b, t) for g, t in n.verdicts)),
    "standard errors": (
        SE,
        lambda n, *xs: all(any(rounds_to(x, z) for z in n.z) for x in NUMBERS.findall(xs[0] or xs[1])),
    ),
}


@dataclass
class Quote:
    """One quoted number: where, what, and whether the rows give it."""

    line: int
    kind: str
    text: str
    digit: int  # offset in the text of the last digit of its first number
    given: bool

    def __str__(self) -> str:
        return f"line {self.line}: {self.kind} {self.text}"


def quotes(text: str, units: list[tuple[int, str, Numbers | None]]) -> list[Quote]:
    """Every quote in ``text``'s ``units`` (:func:`readme_units`, :func:`doc_units`) that name
    committed rows, checked against them; a quote may break across lines."""
    found = []
    for offset, body, numbers in units:
        if numbers is None:
            continue
        for row in SEED_ROW.finditer(body):
            for triple in TRIPLE.finditer(row[2]):
                given = any(s == int(row[1]) and all(map(rounds_to, triple.groups(), v)) for s, v in numbers.triples)
                digit = offset + row.start(2) + triple.end(1) - 1
                found.append(Quote(text.count("\n", 0, digit) + 1, f"seed {row[1]}", triple[0], digit, given))
        for kind, (pattern, gives) in CHECKS.items():
            for match in pattern.finditer(body):
                digit = offset + match.start() + NUMBERS.search(match[0]).end() - 1
                quote = " ".join(match[0].split())
                found.append(Quote(text.count("\n", 0, digit) + 1, kind, quote, digit, gives(numbers, *match.groups())))
    return found


def misquoted(text: str, units: list[tuple[int, str, Numbers | None]]) -> list[str]:
    """The quotes of ``text`` that the rows behind them do not give (:func:`quotes`)."""
    return [str(q) for q in quotes(text, units) if not q.given]


#: kinds whose numbers over every subset of seeds lie close together (one decimal of standard errors,
#: the report's gaps to the paper for 2 and 3 seeds): a changed last digit may land on another subset's
DENSE = ("standard errors", "verdict")


def test_every_number_results_readme_quotes_is_the_one_its_rows_give():
    text = README.read_text(encoding="utf-8")
    units = readme_units(text)
    assert misquoted(text, units) == []
    # every kind of quote is found (a pattern that matched nothing would check nothing), and every
    # committed grid has its section (one under another heading would go unchecked)
    assert {q.kind.split()[0] for q in quotes(text, units)} >= {"seed", *(k.split()[0] for k in CHECKS)}
    headed = set(re.findall(r"^## (\S+)", text, flags=re.M))
    assert {p.parent.name for p in RESULTS.glob("*/grid.json")} <= headed


@pytest.mark.parametrize("page", sorted((ROOT / "docs").rglob("*.md")), ids=lambda p: p.name)
def test_a_page_that_names_a_committed_grid_quotes_its_rows(page):
    text = page.read_text(encoding="utf-8")
    assert misquoted(text, doc_units(text)) == []


def test_a_mistyped_digit_fails_the_check():
    """The last digit of every quote's first number, changed by one up and then by one down: each quote
    is caught by one of the two, but for the :data:`DENSE` kinds, where another subset of seeds may
    give the changed number (a quote's number one digit away from another of its section's rows,
    e.g. one cross-check's 88.71 ± 0.08 beside another's 88.72 ± 0.08, is caught by the other typo)."""
    text = README.read_text(encoding="utf-8")
    checked = quotes(text, readme_units(text))
    caught = [False] * len(checked)
    for step in (1, 9):
        typed = list(text)
        for quote in checked:
            typed[quote.digit] = str((int(text[quote.digit]) + step) % 10)
        mistyped = "".join(typed)
        after = quotes(mistyped, readme_units(mistyped))
        assert [(q.line, q.kind) for q in after] == [(q.line, q.kind) for q in checked]
        caught = [c or not q.given for c, q in zip(caught, after)]
    assert [str(q) for q, c in zip(checked, caught) if not c and q.kind not in DENSE] == []
    assert sum(c for q, c in zip(checked, caught) if q.kind in DENSE) > 0


@pytest.mark.parametrize(
    "report",
    # the grids' reports; the privacy, DP and generalisation reports have tests of their own
    sorted(
        [
            *(p for p in RESULTS.glob("*/report.md") if (p.parent / "grid.json").is_file()),
            *CROSSCHECK.glob("*/report.md"),
        ]
    ),
    ids=lambda p: str(p.parent.relative_to(RESULTS)),
)
def test_each_committed_report_table_is_its_rows(report):
    """Every ``A ± B`` of a committed report.md's tables is what its folder's rows give (the text
    around them, such as the paper file's cross-check notes, is not computed by the report)."""
    folder = report.parent
    table = "".join(line for line in report.read_text(encoding="utf-8").splitlines(True) if line.startswith("|"))
    numbers = grid_numbers(folder.name) if folder.parent == RESULTS else crosscheck_numbers(folder.name)
    pairs = [q for q in quotes(table, [(0, table, numbers)]) if q.kind == "pair"]
    assert pairs
    assert [str(q) for q in pairs if not q.given] == []


def test_the_byzantine_table_is_its_rows():
    """results/byzantine/README.md: each table row's aggregation, clean, attacked and drop, and each
    clean ``mean / norm-bound`` pair, is a line of :func:`bench.byzantine.table` over its rows.jsonl."""
    rows = [json.loads(line) for line in (BYZANTINE / "rows.jsonl").read_text(encoding="utf-8").splitlines()]
    regenerated = table(rows, list(ATTACKS), sorted({r["aggregation"] for r in rows}))
    attacked = set(
        re.findall(
            r"^\S+\s+(\S+)\s+\d+\s+\d+\s+(-?\d\.\d{3})\s+(-?\d\.\d{3})\s+(-?\d\.\d{3})\s+\d+\s+\d+$", regenerated, re.M
        )
    )
    clean = set(re.findall(r"^\S+\s+(\d\.\d{3})\s+(\d\.\d{3})\s+-?\d\.\d{3}$", regenerated, re.M))
    text = (BYZANTINE / "README.md").read_text(encoding="utf-8")
    quoted = re.findall(r"^\|[^|]*\| (\S+)[^|]*\| (-?\d\.\d{3}) \| (-?\d\.\d{3}) \| (-?\d\.\d{3})", text, re.M)
    assert len(quoted) >= len(ATTACKS)
    assert set(quoted) <= attacked, set(quoted) - attacked
    pairs = re.findall(r"(\d\.\d{3}) / (\d\.\d{3})", text.split("Clean runs", 1)[1].split("\n\n", 1)[0])
    assert pairs and set(pairs) <= clean, set(pairs) - clean


#: the bench folders whose README quotes :func:`bench.byzantine.table` in a ```text block (several
#: colluding clients, a trial rule)
BENCH_TABLES = sorted(p.parent for p in BYZANTINE.glob("*/rows.jsonl"))


@pytest.mark.parametrize("folder", BENCH_TABLES, ids=[p.name for p in BENCH_TABLES])
def test_a_byzantine_bench_table_is_its_rows(folder):
    """A results/byzantine/<bench>/README.md's table is :func:`bench.byzantine.table` of its rows, line
    for line, and each quoted ``clean -> attacked`` pair in its text is a cell of that table."""
    rows = [json.loads(line) for line in (folder / "rows.jsonl").read_text(encoding="utf-8").splitlines()]
    attacks = [a for a in ATTACKS if any(r["attack"] == a for r in rows)]
    regenerated = table(rows, attacks, ["mean", "norm-bound", "median"]).split("\n\n", 1)[0]
    text = (folder / "README.md").read_text(encoding="utf-8")
    block = text.split("```text\n", 1)[1].split("```", 1)[0]
    assert block.strip("\n") == regenerated
    cells = set(re.findall(r"(\d\.\d{3})\s+(\d\.\d{3})\s+-?\d\.\d{3}\s+\d+\s+\d+$", regenerated, re.M))
    quoted = set(re.findall(r"(\d\.\d{3}) -> (\d\.\d{3})", text.split("```", 2)[2]))
    assert quoted <= cells, quoted - cells


@pytest.mark.skipif(not (PRIVACY / "report.md").is_file(), reason="no committed privacy evaluation")
def test_the_privacy_reports_are_their_rows():
    """results/privacy/report.md is what ``tools.privacy_report`` makes of the committed grid copy, and each
    run's privacy.md tables are what ``tools.privacy.table`` makes of its privacy.json."""
    from tools.privacy import table as privacy_table
    from tools.privacy_report import report

    assert (PRIVACY / "report.md").read_text(encoding="utf-8") == report(PRIVACY, str(DATA_DIR))
    for rows in sorted(PRIVACY.glob("grid/*/*/privacy/privacy.json")):
        text = (rows.parent / "privacy.md").read_text(encoding="utf-8")
        assert privacy_table(json.loads(rows.read_text(encoding="utf-8"))) in text, rows.parent.parent.name
