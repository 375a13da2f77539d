"""Decode a simulation's partitions into its clients' cache before the simulation starts.

Run by ``tools.run`` (a process of its own, so that the launcher, which lives as long as the run,
never imports torch): ``python -m tools.partition_cache --workers N --num-partitions P`` with the
launcher's resolved run config as JSON on stdin. It decodes every partition the cache folder of
simulated clients (:func:`common.runtime.default_cache_dir`) lacks, in ``N`` worker processes that
exit when done (:func:`common.data.cache_partitions`), and prints one line of what it did. The
ClientApp actors then memory-map the files instead of decoding in the processes that serve every
client for the whole run (docs/running.md, "Many methods, many clients, memory and the partition
cache"). A data error is printed and left to the handshake, which fails the run with it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, required=True, help="decoding processes at once")
    parser.add_argument("--num-partitions", type=int, required=True, help="the federation's partitions")
    args = parser.parse_args(argv)
    from common.config import RunConfig
    from common.data import DataSpec, cache_partitions
    from common.runtime import default_cache_dir

    start = time.perf_counter()
    spec = DataSpec.from_config(RunConfig.from_dict(json.load(sys.stdin)), args.num_partitions)
    cache_dir = default_cache_dir()
    decoded, cached, errors = cache_partitions(spec, str(cache_dir), args.workers)
    print(
        f"Partition cache {cache_dir}: {decoded} partitions decoded in {time.perf_counter() - start:.1f} s "
        f"({args.workers} processes), {cached} were there"
        + (f"; {len(errors)} left to the handshake, which fails the run: {errors[0]}" if errors else ""),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
