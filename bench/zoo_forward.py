"""Forward-pass seconds and parameter counts of a model group's members on this machine.

Usage: ``uv run --frozen python -m bench.zoo_forward [--group htfe8] [--batch 64] [--repeats 5]``

Each member (extractor + linear head, K = 512, C = 10) runs a batch of random images of the
group's input size in eval mode without gradients; prints the median of ``repeats`` timed
passes after one warm-up, and the number of parameters.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from models.groups import MODEL_GROUPS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--group", default="htfe8", choices=sorted(MODEL_GROUPS))
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--channels", type=int, default=3)
    parser.add_argument("--size", type=int, default=32)
    args = parser.parse_args()
    group = MODEL_GROUPS[args.group]
    x = torch.randn(args.batch, args.channels, args.size, args.size)
    print(
        f"group {args.group}, batch {args.batch}x{args.channels}x{args.size}x{args.size}, "
        f"{torch.get_num_threads()} threads"
    )
    print(f"{'member':>14} {'params':>12} {'forward_s':>10}")
    for k, arch in enumerate(group.architectures):
        model = group.build(k, 10, args.channels, args.size, seed=0).eval()
        times = []
        with torch.no_grad():
            model(x)
            for _ in range(args.repeats):
                start = time.perf_counter()
                model(x)
                times.append(time.perf_counter() - start)
        params = sum(p.numel() for p in model.parameters())
        print(f"{arch:>14} {params:>12,} {statistics.median(times):>10.4f}")


if __name__ == "__main__":
    main()
