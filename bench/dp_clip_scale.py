"""The scale ``dp.clip-norm`` and ``dp.payload-clip`` clip at: per-example norms of a preset's models on its data.

Usage: ``uv run --frozen python -m bench.dp_clip_scale [--preset presets/privacy-cifar10-cnn5.toml]
[--groups hetero-cnn5,fedavgcnn,mh-lenet] [--rounds 5] [--examples 256]``

For each model group (one without BatchNorm, so DP-SGD can train it) and each of its architectures
(partition k gets member k), on up to ``--examples`` of partition k's training examples of the preset: the
median L2 norm of one example's loss gradient over all parameters (what ``dp.clip-norm`` clips;
``torch.func``'s per-example gradients, eval mode), of its representation (the extractor's output, what
``dp.payload-clip`` clips for prototypes and LARs) and of its logits (FD's rows), at initialisation and after
``--rounds`` local trainings of the preset's recipe without DP (``common.training.train_supervised``, as a
client trains each round; no federation in between). Prints one line per architecture and moment, then the
median over the group's architectures.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

from bench.dp_overhead import client
from common.config import RunConfig
from common.data import normalize
from common.protocol import train_config
from common.runtime import ClientRuntime
from common.training import train_supervised
from models.groups import MODEL_GROUPS
from tools.runconfig import app_defaults, read_preset


@torch.no_grad()
def row_norms(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """float [n]: the L2 norm of ``module``'s output row of each example of ``x`` (normalised inputs)."""
    return module(x).flatten(1).norm(dim=1)


def gradient_norms(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """float [n]: the L2 norm over every parameter of each example's cross-entropy gradient."""
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = dict(model.named_buffers())

    def loss(p, xi, yi):
        return F.cross_entropy(functional_call(model, (p, buffers), (xi[None],)), yi[None])

    grads = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    return torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in grads.values()))


def medians(runtime: ClientRuntime, examples: int) -> tuple[float, float, float]:
    """(gradient, representation, logit) median norms of the runtime's model on its first ``examples``."""
    model, data = runtime.model, runtime.data
    was_training = model.training
    model.eval()
    x = normalize(data.train_x[:examples], data.info)
    y = data.train_y[:examples]
    out = (
        float(gradient_norms(model, x, y).median()),
        float(row_norms(model.extractor, x).median()),
        float(row_norms(model, x).median()),
    )
    model.train(was_training)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="presets/privacy-cifar10-cnn5.toml")
    parser.add_argument("--groups", default="hetero-cnn5,fedavgcnn,mh-lenet")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--examples", type=int, default=256)
    args = parser.parse_args()
    base = {**app_defaults(), **read_preset(args.preset), "device": "cpu", "record-payloads": ""}
    print(f"preset {args.preset}, median L2 norms over {args.examples} training examples, eval mode")
    print(f"{'group':>12} {'partition':>9} {'model':>12} {'rounds':>6} {'gradient':>9} {'repr':>8} {'logits':>8}")
    for group in args.groups.split(","):
        rc = {**base, "model-group": group}
        config = train_config(RunConfig.from_dict(rc), 1)
        members = len(MODEL_GROUPS[group].architectures)
        by_moment: dict[int, list[tuple[float, float, float]]] = {0: [], args.rounds: []}
        for partition in range(members):
            runtime = client(rc, partition)
            arch = MODEL_GROUPS[group].architecture_for(partition)
            for moment in (0, args.rounds):
                for r in range(1, moment + 1):
                    train_supervised(runtime.model, runtime.data, config, runtime.device, runtime.generator(r))
                values = medians(runtime, args.examples)
                by_moment[moment].append(values)
                print(f"{group:>12} {partition:>9} {arch:>12} {moment:>6} " + " ".join(f"{v:>8.3f}" for v in values))
        for moment, values in by_moment.items():
            median = [statistics.median(v[i] for v in values) for i in range(3)]
            print(f"{group:>12} {'median':>9} {'':>12} {moment:>6} " + " ".join(f"{v:>8.3f}" for v in median))


if __name__ == "__main__":
    main()
