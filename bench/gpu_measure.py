"""What the GPU check measures, run on the lent machine by ``bench.gpu_check run`` in the environment it
installed (Flower and Ray beside the image's PyTorch).

Usage (there; here it runs on CPU with ``--device cpu`` for a dry run)::

    python -m bench.gpu_measure --data-dir .gpu/c/data --out $OUT [--htfllib .gpu/c/htfllib]
        [--rounds 3] [--examples 0] [--minutes 2.5] [--device cuda] [--gpus-per-client 0.25,0.5]

Steps, each recorded in ``<out>/gpu_check.json`` as it ends (a failed step records its error and
the next one runs):

- ``environment``: PyTorch, Flower and Ray versions, the GPU's name and memory;
- ``throughput``: :mod:`bench.throughput` on the device for every architecture of the ``htfe2``
  and ``hetero-cnn5`` model groups (images per second, ours and the plain loop);
- ``simulation-gpus-<g>``: the 20-client FedTGP ``htfe2`` preset (``presets/fedtgp-cifar10-htfe2.toml``)
  for ``--rounds`` rounds through :func:`bench.simulation.run_one` with ``--gpus-per-client`` g
  (``--gpus-per-client``: 0.25 and 0.5): seconds per round, wall seconds, peak memory, each client's GPU peak (row key
  ``gpu_per_client``) and the GPU's peak memory in use (``nvidia-smi``, sampled every 0.5 s);
- ``htfllib``: with ``--htfllib``, HtFLlib's FedTGP on the same partitions and rounds, seed 0
  (:func:`bench.htfllib.run_reference`, which runs on the GPU when PyTorch sees one): wall seconds
  and the GPU's peak memory in use.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRESET = ROOT / "presets" / "fedtgp-cifar10-htfe2.toml"
#: the model groups whose architectures the throughput step times
GROUPS = ("htfe2", "hetero-cnn5")
GPUS_PER_CLIENT = (0.25, 0.5)


class GpuMemorySampler:
    """The peak of the GPU's memory in use (MiB, all processes, ``nvidia-smi``) while it runs; None
    without ``nvidia-smi``."""

    def __init__(self, interval: float = 0.5) -> None:
        self.interval, self.peak_mib = interval, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            try:
                used = subprocess.run(
                    ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                    capture_output=True,
                    text=True,
                    timeout=5,
                ).stdout.split()
            except (OSError, subprocess.TimeoutExpired):
                return
            if used:
                self.peak_mib = max(self.peak_mib or 0, int(used[0]))
            self._stop.wait(self.interval)

    def __enter__(self) -> GpuMemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def environment() -> dict:
    """Versions and the device PyTorch sees."""
    import flwr
    import ray
    import torch

    out = {"torch": torch.__version__, "flwr": flwr.__version__, "ray": ray.__version__, "python": sys.version}
    out["flwr_from"] = flwr.__file__  # the installed environment's, not another copy on the path
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        out.update(gpu=props.name, gpu_memory_gib=props.total_memory / 2**30)
    return out


def throughput(data_dir: Path, out: Path, device: str) -> list[dict]:
    """:mod:`bench.throughput` for every architecture of :data:`GROUPS` on ``device``, batch 10 and 32."""
    from bench import throughput as bench_throughput
    from models.groups import MODEL_GROUPS

    archs = list(dict.fromkeys(a for g in GROUPS for a in MODEL_GROUPS[g].architectures))
    target = out / "throughput.json"
    argv = ["--archs", ",".join(archs), "--batches", "10,32", "--device", device, "--data-dir", str(data_dir)]
    if bench_throughput.main([*argv, "--json", str(target)]) != 0:
        raise RuntimeError("bench.throughput failed")
    return json.loads(target.read_text())


def overrides(data_dir: Path, rounds: int, examples: int) -> list[str]:
    """The ``-c`` items on top of the preset: ``rounds`` rounds, no early stop, the carried data and,
    with ``examples`` > 0, at most that many examples per client."""
    item = f"num-server-rounds={rounds} stop-patience=0 data-dir={json.dumps(str(data_dir.resolve()))}"
    return [item + (f" max-examples-per-client={examples}" if examples > 0 else "")]


def simulation(data_dir: Path, rounds: int, examples: int, gpus: float | None, minutes: float) -> dict:
    """The FedTGP ``htfe2`` preset (:func:`overrides`) with ``gpus`` GPUs per client."""
    from bench.simulation import run_one
    from common.files import read_rows

    items = overrides(data_dir, rounds, examples)
    with GpuMemorySampler() as gpu:
        totals = run_one(items, 1, gpus, minutes, str(PRESET))
    if totals is None:
        raise RuntimeError("the simulation failed (its log's tail is in the output above)")
    rows = read_rows(Path(totals["run_dir"]))
    per_client = [used for r in rows for used in r.get("gpu_per_client", {}).values()]
    return {**totals, "gpu_peak_mib": gpu.peak_mib, "gpu_per_client": per_client[-20:]}


def htfllib(reference: Path, data_dir: Path, rounds: int, examples: int, out: Path) -> dict:
    """HtFLlib's FedTGP on our partitions of the preset (:func:`overrides`), seed 0
    (:func:`bench.htfllib.run_reference`)."""
    from bench.htfllib import run_reference
    from bench.pfllib import write_partitions
    from tools.runconfig import read_config

    config, _ = read_config(PRESET, overrides(data_dir, rounds, examples))
    partitions = out / "partitions"
    write_partitions(config, partitions)
    with GpuMemorySampler() as gpu:
        result = run_reference(reference, config, "fedtgp", 0, partitions, out / "htfllib")
    return {k: result[k] for k in ("curve", "wall_seconds", "cpu_seconds", "command")} | {"gpu_peak_mib": gpu.peak_mib}


def record(report: dict, path: Path, name: str, step: Callable[[], object]) -> None:
    """Run ``step``, keep its result (or its error) under ``name`` with its seconds, write the report."""
    start = time.perf_counter()
    try:
        report[name] = {"result": step()}
    except Exception as exc:  # a step that fails is recorded; the next one still runs
        traceback.print_exc()
        report[name] = {"error": f"{type(exc).__name__}: {exc}"}
    report[name]["seconds"] = time.perf_counter() - start
    path.write_text(json.dumps(report, indent=1, default=str))
    print(f"gpu check: {name} done in {report[name]['seconds']:.1f} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, required=True, help="folder with cifar10/")
    parser.add_argument("--out", type=Path, required=True, help="gpu_check.json and throughput.json go here")
    parser.add_argument("--htfllib", type=Path, default=None, help="a folder with HtFLlib's system/")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--examples", type=int, default=0, help="most examples per client (0: the preset's, all)")
    parser.add_argument("--minutes", type=float, default=2.5, help="wall-time budget of each simulation")
    parser.add_argument("--device", default="cuda", help="cuda (the check) or cpu (a dry run here)")
    parser.add_argument("--steps", default="environment,throughput,simulation,htfllib")
    parser.add_argument(
        "--gpus-per-client",
        default=",".join(map(str, GPUS_PER_CLIENT)),
        help="the simulation step's GPU shares, comma-separated",
    )
    args = parser.parse_args(argv)
    if not (args.data_dir / "cifar10").is_dir():
        parser.error(f"--data-dir {args.data_dir}: no cifar10/ folder in it")
    steps = set(args.steps.split(","))
    args.out.mkdir(parents=True, exist_ok=True)
    path, report = args.out / "gpu_check.json", {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if "environment" in steps:
        record(report, path, "environment", environment)
    if "throughput" in steps:
        record(report, path, "throughput", lambda: throughput(args.data_dir, args.out, args.device))
    if "simulation" in steps:
        for gpus in [float(g) for g in args.gpus_per_client.split(",")] if args.device == "cuda" else (None,):
            name = f"simulation-gpus-{gpus}"
            sized = (args.data_dir, args.rounds, args.examples)
            record(report, path, name, lambda g=gpus, sized=sized: simulation(*sized, g, args.minutes))
    if "htfllib" in steps and args.htfllib is not None:
        sized = (args.data_dir, args.rounds, args.examples)
        record(report, path, "htfllib", lambda: htfllib(args.htfllib, *sized, args.out))
    failed = [name for name, step in report.items() if isinstance(step, dict) and "error" in step]
    print(f"gpu check: {path}" + (f"; failed: {', '.join(failed)}" if failed else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
