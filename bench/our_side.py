"""Our side of a cross-check against another implementation: our method's options as a run will have
them (:func:`method_options`), and one run of ours (``tools.run``, or ``tools.inprocess``) for a
training seed, measured, reused when it ran the same run config, refused when a round ran without every
client (:func:`run_ours`)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
from pathlib import Path

from bench.crosscheck_pairing import CLIENT_THREADS
from bench.measure import run_measured
from common.files import read_rows, read_summary
from tools.runconfig import ROOT, read_config


def method_options(config: dict, method: str) -> dict:
    """Our options of ``method`` as the run will have them: declared defaults, then ``config``'s
    ``<method>.<key>`` values (the flat run config :func:`tools.runconfig.read_config` gives)."""
    from common.options import option_key
    from methods.registry import METHODS

    declared = {option_key(f): f.default for f in dataclasses.fields(METHODS[method].options)}
    prefix = f"{method}."
    return {**declared, **{k[len(prefix) :]: v for k, v in config.items() if k.startswith(prefix)}}


def run_faults(rows: list[dict], summary: dict, config: dict, metric: str) -> list[str]:
    """Why a run of ours that ended ``completed`` is no result to compare: every round from 1 to
    ``num-server-rounds`` recorded once, in order; in each a client trained (row key ``untrained``, rows
    before it: ``num_clients`` > 0), no sampled client dropped (``dropped_clients``), ``metric``
    evaluated and every client evaluated (``accuracy_per_client``, where the row has it); and no
    clients' errors in the summary (``client_errors``). A simulation whose Ray node crashed ends
    ``completed`` with its last rounds untrained or with dropped clients. [] when none."""
    faults = []
    if summary.get("client_errors"):
        faults.append("the clients' errors: " + "; ".join(summary["client_errors"][:3]))
    recorded = [row.get("round") for row in rows]
    if recorded != list(range(1, config["num-server-rounds"] + 1)):
        faults.append(f"rounds recorded {recorded}, not 1..{config['num-server-rounds']}")
    for row in rows:
        r = row.get("round")
        if row.get("untrained", row.get("num_clients") == 0):
            errors = "; ".join(row.get("client_errors", [])[:3]) or "no error recorded"
            faults.append(f"round {r}: no client trained ({errors})")
        elif row.get("dropped_clients"):
            faults.append(f"round {r}: no valid reply from clients {row['dropped_clients']}")
        if row.get(metric) is None:
            faults.append(f"round {r}: no {metric}")
        elif "accuracy_per_client" in row and len(row["accuracy_per_client"]) != config["num-clients"]:
            faults.append(f"round {r}: {len(row['accuracy_per_client'])} of {config['num-clients']} clients evaluated")
    return faults


def failure_cause(log: Path) -> str:
    """What a run of ``tools.run`` that left no run folder said about why: its ``error:`` and
    ``ERROR`` lines, and the ``ERROR`` lines of the SuperLink log it names (the last few of each),
    else its last lines."""
    text = log.read_text(errors="replace") if log.is_file() else ""
    lines = [line.strip() for line in text.splitlines() if line.startswith("error:") or "ERROR" in line]
    superlink = re.search(r"the SuperLink's log: (.+)$", text, re.M)
    if superlink and Path(superlink.group(1).strip()).is_file():
        said = Path(superlink.group(1).strip()).read_text(errors="replace").splitlines()
        lines += [f"SuperLink: {line.strip()}" for line in said if "ERROR" in line][-3:]
    lines = list(dict.fromkeys(lines))[-6:] or [line for line in text.splitlines() if line.strip()][-5:]
    return " | ".join(lines) or f"{log} is empty"


#: the launchers a run of ours can go through: Flower's simulation (SuperLink, Ray, a ClientApp actor a
#: CPU) and the in-process grid (one process, the clients one after another; ``tools.inprocess``)
RUNNERS = ("tools.run", "tools.inprocess")


def kept_run(done: Path, config: dict, threads: int, metric: str, runner: str = "tools.run") -> dict | None:
    """The run of ours kept in ``done`` (``ours.json``), its curve the row key ``metric``, when it ran
    ``config`` with ``threads`` threads through ``runner`` and its rows, in its folder beside ``done``,
    show no fault (:func:`run_faults`); else None."""
    if not done.exists():
        return None
    saved = json.loads(done.read_text())
    folder = done.parent / Path(saved["folder"]).name
    same = saved.get("config") == config and saved.get("threads") == threads
    # a run kept before the runner was recorded went through tools.run
    if not same or saved.get("runner", "tools.run") != runner or not (folder / "metrics.jsonl").is_file():
        return None
    rows = read_rows(folder)
    if run_faults(rows, read_summary(folder), config, metric):
        return None
    return {**saved, "metric": metric, "curve": [r[metric] for r in rows]}


def completed_rows(folder: Path, code: int, seed: int, log: Path, config: dict, metric: str) -> list[dict]:
    """The rows of the run of ours in ``folder`` that has just ended with exit code ``code`` (its log
    ``log``).

    Raises:
        RuntimeError: it did not complete (its status, the summary's error and the clients' errors), or
            completed with faults (:func:`run_faults`).
    """
    summary = read_summary(folder)
    if code != 0 or summary["status"] != "completed":
        errors = "; ".join(summary.get("client_errors") or [])
        raise RuntimeError(
            f"our run (seed {seed}) ended {summary['status']}: {summary.get('error')}"
            + (f" (the clients' errors: {errors})" if errors else "")
            + f"; log {log}"
        )
    rows = read_rows(folder)
    if faults := run_faults(rows, summary, config, metric):
        raise RuntimeError(
            f"our run (seed {seed}) ended completed but is refused: {'; '.join(faults)}; run folder {folder}"
        )
    return rows


def run_ours(
    config_items: list[str],
    preset: str | None,
    seed: int,
    out: Path,
    metric: str = "accuracy_weighted",
    threads: int = CLIENT_THREADS,
    env: dict[str, str] | None = None,
    runner: str = "tools.run",
) -> dict:
    """Run ours (``tools.run``, ``threads`` CPUs per client and ``OMP_NUM_THREADS`` = ``threads``) for
    one training seed into ``out``, or reuse its completed run when that ran the same whole run config
    (the preset's content and every override; any other is run again) with the same threads and runner
    and has no fault (:func:`run_faults`). ``env``: environment variables set for the launch besides
    (``bench.bytecode``: where Python looks for bytecode). ``runner`` ``tools.inprocess`` runs the same
    ServerApp and ClientApp handlers in one process, the clients one after another on ``threads``
    torch threads, with no Ray and no Flower engine (one of :data:`RUNNERS`).

    Returns:
        ``{"curve": [row key metric by round], "metric", "command", "config", "threads", "runner",
        "wall_seconds", "cpu_seconds", "peak_pss_gib", "folder"}``.

    Raises:
        ValueError: ``runner`` is not one of :data:`RUNNERS`.
        RuntimeError: the run did not complete (its status and why: the summary's error, or when it
            left no run folder what its log says, :func:`failure_cause`), or completed with faults
            (:func:`run_faults`); nothing is kept for reuse.
    """
    done = out / "ours.json"
    items = [*config_items, f"seed={seed} output-dir={json.dumps(str(out.resolve()))}"]
    config, _ = read_config(preset, items)
    if runner not in RUNNERS:
        raise ValueError(f"runner {runner!r}: allowed {', '.join(RUNNERS)}")
    if (saved := kept_run(done, config, threads, metric, runner)) is not None:
        return saved
    # tools.inprocess has no actors to give CPUs to: its one process runs OMP_NUM_THREADS torch threads
    cpus = ["--cpus-per-client", str(threads)] if runner == "tools.run" else []
    cmd = [sys.executable, "-m", runner, *cpus, *(["--preset", preset] if preset else [])]
    for item in items:
        cmd += ["-c", item]
    out.mkdir(parents=True, exist_ok=True)
    earlier = set(out.glob("*/summary.json"))  # a run cut off before: this one starts again from round 1
    log = out / "ours.log"
    launch_env = {**os.environ, "OMP_NUM_THREADS": str(threads), **(env or {})}
    code, wall, cpu, peak_pss, _ = run_measured(cmd, ROOT, log, launch_env)
    folders = sorted(p.parent for p in set(out.glob("*/summary.json")) - earlier)
    if not folders:
        raise RuntimeError(f"our run (seed {seed}) left no run folder: {failure_cause(log)}; log {log}")
    rows = completed_rows(folders[-1], code, seed, log, config, metric)
    result = {
        "curve": [r[metric] for r in rows],
        "metric": metric,
        "command": " ".join(cmd[1:]),
        "config": config,
        "threads": threads,
        "runner": runner,
        "wall_seconds": wall,
        "cpu_seconds": cpu,
        "peak_pss_gib": peak_pss / 2**30,
        "folder": str(folders[-1]),
    }
    done.write_text(json.dumps(result, indent=1))
    return result
