"""What a ClientApp actor's memory is made of before it serves a client: the unique memory (USS) of one
fresh Python process after each import, in the order a simulation's ClientApp actor meets them.

Usage (from the repository root):

    uv run --frozen python -m bench.import_memory [--modules ray,flwr.clientapp,...] [--repeats 3]
        [--out results/scale/memory/import-uss.json]

The default chain is Ray's worker side (``ray``), Flower's ClientApp and its Ray backend, ``torch``,
the app's handlers and every method (``client_app.handlers``, ``methods.registry``), then
``torch._dynamo`` and ``torchvision``, which an actor imports only when its model group has a
torchvision model (``torchvision.ops`` imports ``torch._dynamo`` at module level), and Hugging Face
``datasets`` with flwr-datasets, which only an actor that decodes partitions itself imports (the sampled
handshake without a filled partition cache; docs/running.md). Each repeat runs the chain in a new
process (``sys.executable``); a step's cost is the USS after it minus the USS before it, the median
over the repeats, in MiB (2**20 bytes). USS counts pages this process alone maps, so it is what a
second actor adds; shared library text is not in it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from bench.measure import git_head

ROOT = Path(__file__).resolve().parents[1]

#: the imports of a ClientApp actor, in order (module docstring)
ACTOR_CHAIN = (
    "ray",
    "flwr.clientapp",
    "flwr.server.superlink.fleet.vce.backend.raybackend",
    "torch",
    "client_app.handlers",
    "methods.registry",
    "torch._dynamo",
    "torchvision",
    "datasets",
    "flwr_datasets",
)

#: run in the child: imports each module of argv and prints the USS (bytes) before the first and after each
_CHILD = """
import importlib, json, sys, psutil
p = psutil.Process()
out = [p.memory_full_info().uss]
for m in sys.argv[1:]:
    importlib.import_module(m)
    out.append(p.memory_full_info().uss)
print(json.dumps(out))
"""


def chain_uss(modules: list[str]) -> list[int]:
    """USS in bytes of a fresh process before any of ``modules`` and after each import, in order.

    Raises:
        subprocess.CalledProcessError: a module failed to import (its traceback on stderr).
    """
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, *modules], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(modules: list[str], repeats: int) -> dict:
    """``{"modules", "repeats", "start_mib", "step_mib", "total_mib"}``: the medians over ``repeats``
    fresh processes of the start USS (the interpreter with psutil, which measures, imported), each
    import's USS increase and the final USS, in MiB.

    Raises:
        subprocess.CalledProcessError: as :func:`chain_uss`.
        statistics.StatisticsError: ``repeats`` < 1 (no process to take a median over).
    """
    runs = [chain_uss(modules) for _ in range(repeats)]
    mib = 2**20
    steps = [statistics.median((r[i + 1] - r[i]) / mib for r in runs) for i in range(len(modules))]
    return {
        "modules": modules,
        "repeats": repeats,
        "start_mib": statistics.median(r[0] / mib for r in runs),
        "step_mib": steps,
        "total_mib": statistics.median(r[-1] / mib for r in runs),
    }


def table(result: dict) -> str:
    """The Markdown table of :func:`measure`'s result: each import and the USS it added, then the total."""
    lines = [
        "| import | USS added |",
        "|---|---|",
        f"| (the interpreter, with psutil) | {result['start_mib']:.1f} MiB |",
    ]
    lines += [f"| `{m}` | {s:.1f} MiB |" for m, s in zip(result["modules"], result["step_mib"], strict=True)]
    lines.append(f"| all of them, one process | {result['total_mib']:.1f} MiB |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modules", default=",".join(ACTOR_CHAIN), help="comma-separated imports, in order")
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes to take the median over")
    parser.add_argument("--out", type=Path, help="write the result (with the command and commit) as JSON")
    parser.add_argument("--table", type=Path, help="print the table of a written result and exit")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: allowed values are integers >= 1")
    if args.table:
        print(table(json.loads(args.table.read_text())))
        return 0
    result = measure([m for m in args.modules.split(",") if m], args.repeats)
    print(table(result))
    if args.out:
        command = "python -m bench.import_memory " + " ".join(argv or sys.argv[1:])
        record = {"command": command, "commit": git_head(ROOT), **result}
        args.out.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
