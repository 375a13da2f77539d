"""Check a simulation's partitions, and decode them into its clients' cache, before the simulation starts.

``tools.run`` runs :func:`cache_before_ray` in the process that has just checked its config
(:func:`tools.runconfig.validate_configs`' ``then``), which exits before Ray starts, so that the
launcher, which lives as long as the run, never imports torch, and torch is imported once for both
steps. With the full handshake it decodes every partition the cache folder of simulated clients
(:func:`common.runtime.default_cache_dir`) lacks, one worker process per core that exits when done
(:func:`common.data.cache_partitions`), and prints one line of what it did. The ClientApp actors then
memory-map the files instead of decoding in the processes that serve every client for the whole run
(docs/running.md, "Many methods, many clients, memory and the partition cache"). Otherwise it splits
every partition from its labels alone (:func:`common.data.partition_errors`). Either way a partition
the handshake would refuse (a data error, a partitioner that cannot split the pool, a partition too
small for a train and a test set) refuses the run before any node starts.
"""

from __future__ import annotations

import os
import time

#: partitions' errors quoted in a refusal (:func:`refusal`); the others are counted
ERRORS_SHOWN = 3


def refusal(errors: list[str], num_partitions: int) -> str:
    """One line for the partitions' ``errors`` (each a ``ConfigError`` message of
    :func:`common.data.partition_split`, naming its partition and what to change): how many of the
    ``num_partitions`` cannot serve the run and the first :data:`ERRORS_SHOWN` distinct errors (a data
    file that every partition reads is one error)."""
    distinct = list(dict.fromkeys(errors))
    more = len(distinct) - ERRORS_SHOWN
    return (
        f"{len(errors)} of {num_partitions} partitions cannot serve the run, refused before any node starts: "
        + "; ".join(distinct[:ERRORS_SHOWN])
        + (f"; and {more} more" if more > 0 else "")
    )


def cache_before_ray(config: dict, num_clients: int, *, num_supernodes: int | None = None, cache: bool = True) -> None:
    """Check every partition of the federation that ``config`` (checked, flat keys) and
    ``--num-supernodes`` ``num_supernodes`` make (:func:`tools.runconfig.federation_size`) as its
    client's handshake would. With ``cache`` and the full handshake (run config ``handshake = "all"``,
    which loads every partition before round 1 anyway), the partitions the cache lacks are decoded
    into it on the way; otherwise (the sampled handshake meets only the drawn clients' partitions,
    decoded as they are drawn; a Ray cluster's nodes keep caches of their own) only their labels are
    read and split (:func:`common.data.partition_errors`).

    Raises:
        ConfigError: a partition cannot serve the run (:func:`refusal`).
    """
    from common.config import RunConfig
    from common.data import DataSpec, cache_partitions, partition_errors
    from common.errors import ConfigError
    from common.runtime import default_cache_dir
    from tools.runconfig import federation_size

    try:
        partitions = num_clients or federation_size(num_supernodes, num_clients)
    except ConfigError:
        return  # the launcher raises the same error when it sizes the federation
    start = time.perf_counter()
    workers = os.cpu_count() or 1
    cfg = RunConfig.from_dict(config)  # its handshake as run: `auto` resolved
    spec = DataSpec.from_config(cfg, partitions)
    if not cache or cfg.handshake != "all":
        errors = partition_errors(spec, workers)
    else:
        cache_dir = default_cache_dir()
        try:
            decoded, cached, errors = cache_partitions(spec, str(cache_dir), workers)
        except Exception as exc:  # noqa: BLE001 - a failure here costs only the cache: the clients decode as before
            print(
                f"Partition cache {cache_dir} not filled ({type(exc).__name__}: {exc}); the clients decode their "
                "partitions",
                flush=True,
            )
            errors = partition_errors(spec, workers)
        else:
            print(
                f"Partition cache {cache_dir}: {decoded} partitions decoded in {time.perf_counter() - start:.1f} s "
                f"({workers} processes), {cached} were there",
                flush=True,
            )
    if errors:
        raise ConfigError(refusal(errors, partitions))
