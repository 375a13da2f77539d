"""Client training throughput: our training loop against a plain PyTorch loop on the same work.

Usage (from the repository root):

    uv run --frozen python -m bench.throughput [--archs cnn1,fedavgcnn,resnet18] [--batches 10,32]
        [--examples 320] [--threads 1] [--device cpu|cuda] [--data-dir ../shared/data] [--json FILE]

For each architecture and batch size, one epoch over the same CIFAR-10 partition (uint8 tensors
from :func:`common.data.load_client_data`), the same model built from the same seed, the
same normalisation and augmentation (:func:`common.data.augment`) and SGD(lr 0.01, momentum
0.9), on ``--threads`` intra-op threads (1: a ClientApp in simulation gets one core), timed as:

- ``ours``: :func:`common.training.train_supervised` (what every method's client runs);
- ``plain``: the textbook loop (forward, cross-entropy, ``zero_grad``, ``backward``, ``step``)
  with ``torch.optim.SGD``'s default implementation;
- ``plain-foreach`` / ``plain-fused``: the same with ``SGD(foreach=True)`` / ``SGD(fused=True)``.

Each is run twice and the faster epoch is kept (the first pays one-off costs; on CUDA both loops
are timed to a synchronised end). Prints images per second per variant and ours relative to
plain; ``--json`` also writes them (a list of rows: arch, batch, images per second per variant).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from common.config import RunConfig
from common.data import DataSpec, augment, batches, load_client_data, normalize
from common.datasets import DATASETS
from common.protocol import train_config
from common.training import train_supervised
from models.groups import ModelGroup
from tools.runconfig import app_defaults

ROOT = Path(__file__).resolve().parents[1]
DATA_DIR = ROOT.parent / "shared" / "data"
#: the training settings a client receives (common.protocol.train_config, at the run config's
#: defaults), with the plain loop's: no weight decay, no clipping, fp32, one epoch
CONFIG = {
    **train_config(RunConfig.from_dict(app_defaults()), 1),
    **{"lr": 0.01, "momentum": 0.9, "weight-decay": 0.0, "clip-norm": 0.0, "local-epochs": 1, "precision": "fp32"},
}


def plain_epoch(
    model, data, batch_size: int, generator: torch.Generator, optimizer: dict, device: torch.device
) -> float:
    """Seconds of one epoch of the plain loop with ``torch.optim.SGD(**optimizer)`` on ``device``
    (the partition moved there first, as ours does)."""
    model = model.to(device)
    x_all, y_all = data.train_x.to(device), data.train_y.to(device)
    synchronize(device)
    start = time.perf_counter()
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=CONFIG["lr"], momentum=CONFIG["momentum"], **optimizer)
    for idx in batches(len(y_all), batch_size, generator):
        if len(idx) < 2:  # as ours: BatchNorm cannot train on one sample
            continue
        idx = idx.to(device)
        x = augment(normalize(x_all[idx], data.info), data.info, generator)
        loss = F.cross_entropy(model.head(model.extractor(x)), y_all[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    synchronize(device)
    return time.perf_counter() - start


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously; a CPU needs no wait)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", default="cnn1,fedavgcnn,resnet18")
    parser.add_argument("--batches", default="10,32")
    parser.add_argument("--examples", type=int, default=320)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (the first GPU)")
    parser.add_argument("--data-dir", type=Path, default=DATA_DIR, help="folder with cifar10/ (default ../shared/data)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows to this file")
    args = parser.parse_args(argv)
    if args.device not in ("cpu", "cuda") or (args.device == "cuda" and not torch.cuda.is_available()):
        parser.error(f"--device {args.device!r}: allowed are 'cpu' and 'cuda' (when PyTorch sees a GPU)")
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    root = str(args.data_dir.resolve())
    spec = DataSpec("cifar10", root, "train", "iid", 10, 0.5, 2, False, 2, 0.2, args.examples, 0)
    data = load_client_data(spec, 0)
    info = DATASETS["cifar10"]
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{args.threads} thread(s)"
    print(f"CIFAR-10, {len(data.train_y)} training images, {where}, torch {torch.__version__}")
    print(
        f"{'arch':>10} {'batch':>5} {'ours':>8} {'plain':>8} {'foreach':>8} {'fused':>8} {'ours/plain':>10}  (images/s)"
    )
    variants = {"plain": {}, "plain-foreach": {"foreach": True}, "plain-fused": {"fused": True}}
    table = []
    for arch in args.archs.split(","):
        group = ModelGroup((arch,))
        for batch_size in (int(b) for b in args.batches.split(",")):

            def model(group=group):
                return group.build(0, info.num_classes, info.channels, info.image_size, seed=0)

            config = {**CONFIG, "batch-size": batch_size}
            ours = min(
                train_supervised(model().to(device), data, config, device, torch.Generator().manual_seed(0))[
                    "train-seconds"
                ]
                for _ in range(2)
            )
            plain = {
                name: min(
                    plain_epoch(model(), data, batch_size, torch.Generator().manual_seed(0), options, device)
                    for _ in range(2)
                )
                for name, options in variants.items()
            }
            n = len(data.train_y)
            rates = {"ours": n / ours, **{name: n / seconds for name, seconds in plain.items()}}
            table.append({"arch": arch, "batch": batch_size, "device": args.device, "images_per_second": rates})
            print(
                f"{arch:>10} {batch_size:>5} {n / ours:>8.1f} {n / plain['plain']:>8.1f} "
                f"{n / plain['plain-foreach']:>8.1f} {n / plain['plain-fused']:>8.1f} "
                f"{plain['plain'] / ours:>10.2f}",
                flush=True,
            )
    if args.json is not None:
        args.json.write_text(json.dumps(table, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
