"""GPUs that share fairly: each ClientApp's CUDA allocator is limited to its share of the device, a
client over its share fails with a clear error instead of running its neighbours out of memory,
and every reply of a client that used a GPU reports its peak memory and the device's name.

Ray's fractional ``num_gpus`` (``tools.run --gpus-per-client``, the federation's
``client-resources-num-gpus``) only schedules: several ClientApps share one GPU, and nothing stops
one of them from allocating all of its memory. PyTorch's per-process memory fraction does
(``torch.cuda.set_per_process_memory_fraction``): an allocation beyond it raises
``torch.cuda.OutOfMemoryError`` in that process only.

The share is node config ``gpu-memory-fraction`` when set (a SuperNode's ``--node-config``, e.g.
two SuperNodes on one GPU with 0.5 each), else the GPU share Ray granted this ClientApp's actor
in a simulation, when below 1; otherwise nothing is capped.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from functools import cache
from typing import Any

import torch

from common.errors import ConfigError
from common.metrics import MAX_DEVICE_NAME
from common.protocol import GPU_PEAK

#: node config key: the share of its GPU's memory a SuperNode's ClientApps may allocate, in (0, 1]
NODE_KEY = "gpu-memory-fraction"


class GPUShareExceeded(RuntimeError):
    """A client needed more CUDA memory than its share of the GPU (the message fails; the server
    drops the reply and logs this message)."""


def gpu_share(node_config: Mapping[str, Any]) -> float | None:
    """The share of its GPU's memory this ClientApp may allocate, a fraction in (0, 1], or None (no cap).

    Node config ``gpu-memory-fraction`` wins; in a Ray simulation the GPU share Ray assigned to
    this actor counts when it is below 1 (a whole GPU needs no cap). Ray is only asked when this
    process already imported it (a simulation's actor), so a deployed ClientApp never imports it.

    Raises:
        ConfigError: naming node config ``gpu-memory-fraction`` when it is not a number in (0, 1].
    """
    if NODE_KEY in node_config:
        value = node_config[NODE_KEY]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
            raise ConfigError(
                f"node config key '{NODE_KEY}' = {value!r} is invalid: allowed values are numbers > 0 and <= 1"
            )
        return float(value)
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    granted = ray.get_runtime_context().get_assigned_resources().get("GPU", 0.0)
    return float(granted) if 0 < granted < 1 else None


@cache
def limit_memory(device: torch.device, share: float) -> None:
    """Cap this process's CUDA allocator on ``device`` at ``share`` of its memory (once per process:
    the cap is process-wide, and a simulation's actor serves many clients)."""
    # PyTorch takes an indexed device here only: plain "cuda" (what pick_device gives) raises ValueError
    index = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda.set_per_process_memory_fraction(share, index)


def begin_message(device: torch.device) -> None:
    """Start measuring the peak memory of one message on ``device`` (a CUDA device; no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def report(device: torch.device) -> tuple[dict[str, float], str | None]:
    """``({gpu-peak-mib: MiB}, device name)`` of the message measured since :func:`begin_message`;
    ``({}, None)`` on the CPU."""
    if device.type != "cuda":
        return {}, None
    peak = torch.cuda.max_memory_allocated(device) / 2**20
    return {GPU_PEAK: peak}, torch.cuda.get_device_name(device)[:MAX_DEVICE_NAME]


def share_exceeded(
    exc: torch.cuda.OutOfMemoryError, partition_id: int, device: torch.device, share: float | None
) -> GPUShareExceeded:
    """The error of a client that ran out of CUDA memory on ``device``, naming its share and what to change."""
    total = torch.cuda.get_device_properties(device).total_memory / 2**20 if device.type == "cuda" else 0.0
    limit = f"its share {share:g} of {total:.0f} MiB" if share is not None else f"all {total:.0f} MiB"
    return GPUShareExceeded(
        f"partition {partition_id} ran out of CUDA memory within {limit} on {device} ({exc}); lower "
        f"batch-size, or give each ClientApp a larger share (tools.run --gpus-per-client, node config '{NODE_KEY}')"
    )
