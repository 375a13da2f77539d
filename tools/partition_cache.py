"""Decode a simulation's partitions into its clients' cache before the simulation starts.

``tools.run`` runs :func:`cache_before_ray` in the process that has just checked its config
(:func:`tools.runconfig.validate_configs`' ``then``), which exits before Ray starts, so that the
launcher, which lives as long as the run, never imports torch, and torch is imported once for both
steps. It decodes every partition the cache folder of simulated clients
(:func:`common.runtime.default_cache_dir`) lacks, one worker process per core that exits when done
(:func:`common.data.cache_partitions`), and prints one line of what it did. The ClientApp actors then
memory-map the files instead of decoding in the processes that serve every client for the whole run
(docs/running.md, "Many methods, many clients, memory and the partition cache"). A data error is
printed and left to the handshake, which fails the run with it.
"""

from __future__ import annotations

import os
import time


def cache_before_ray(config: dict, num_clients: int, *, num_supernodes: int | None = None) -> None:
    """With the full handshake (run config ``handshake = "all"``, which loads every partition before
    round 1 anyway), decode the partitions of the federation that ``config`` (checked, flat keys) and
    ``--num-supernodes`` ``num_supernodes`` make (:func:`tools.runconfig.federation_size`) that the
    cache lacks. The sampled handshake meets only the drawn clients' partitions: they are decoded as
    they are drawn."""
    from common.config import RunConfig
    from common.data import DataSpec, cache_partitions
    from common.errors import ConfigError
    from common.runtime import default_cache_dir
    from tools.runconfig import federation_size

    if config.get("handshake", "all") != "all":
        return
    try:
        partitions = num_clients or federation_size(num_supernodes, num_clients)
    except ConfigError:
        return  # the launcher raises the same error when it sizes the federation
    start = time.perf_counter()
    workers = os.cpu_count() or 1
    cache_dir = default_cache_dir()
    try:
        spec = DataSpec.from_config(RunConfig.from_dict(config), partitions)
        decoded, cached, errors = cache_partitions(spec, str(cache_dir), workers)
    except Exception as exc:  # noqa: BLE001 - a failure here costs only the cache: the clients decode as before
        print(
            f"Partition cache {cache_dir} not filled ({type(exc).__name__}: {exc}); the clients decode their partitions"
        )
        return
    print(
        f"Partition cache {cache_dir}: {decoded} partitions decoded in {time.perf_counter() - start:.1f} s "
        f"({workers} processes), {cached} were there"
        + (f"; {len(errors)} left to the handshake, which fails the run: {errors[0]}" if errors else ""),
        flush=True,
    )
