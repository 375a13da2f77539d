"""Our gradient attacks against the ``breaching`` library's on the same cases: a well-kept implementation
as the control of ours.

Usage (from the repository root; ``breaching`` is an optional extra, not needed by anything else)::

    uv run --frozen --extra breaching python -m bench.breaching_crosscheck --data-dir ../shared/data \\
        [--images 4] [--steps 2000] [--idlg-steps 300] [--out results/privacy/breaching]

The case is the one of the privacy controls (``tests/test_privacy_controls.py``): CNN-1 at initialisation
(``torch.manual_seed(0)``, eval mode), CIFAR-10 test images 0, 1, ... (one of each class in turn), one
image at a time, the exact cross-entropy gradient of that image with its true label given to both
sides. Two attacks, each side at its own defaults except the budget, which is the same:

- *inverting gradients* (Geiping et al., NeurIPS 2020): ours :func:`privacy.gradients.invert_update`
  (one SGD step of lr 0.01, i.e. the gradient times -0.01; the cosine objective ignores the scale),
  breaching's ``attack=invertinggradients`` (its ``optim.max_iterations`` set to ``--steps``);
- *DLG/iDLG* (Zhu et al. 2019; Zhao et al. 2020, label given): ours :func:`privacy.gradients.idlg`,
  breaching's ``attack=deepleakage`` with the label given (so its ``attack_type=optimization``: its joint
  optimisation of image and label refuses a given label), ``--idlg-steps`` L-BFGS steps each.

Each reconstruction is scored against its own image with :func:`privacy.scores.own_image_scores` (PSNR
and SSIM, beside the mid-gray image's and the data set's mean image's on the same image). Writes
``rows.jsonl`` (one row per image, side and attack, with the CPU seconds of the attack) and
``report.md`` (the means) into ``--out``; prints the report. One torch thread.

Breaching's own settings are kept where ours differ (its start from Gaussian noise in normalised space
against our uniform pixels; its L2 DLG objective over the whole gradient); what differs is in the report.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from common.datasets import DATASETS
from models.cnn import build_cnn
from privacy import gradients
from privacy.scores import own_image_scores
from tools.privacy_calibration import test_split

INFO = DATASETS["cifar10"]
SHAPE = (3, 32, 32)
#: the learning rate of the one local step whose update ours inverts
LOCAL_LR = 0.01


def test_images(data_dir: str, count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(float images in [0, 1] ``[count, 3, 32, 32]``, int64 labels ``[count]``, the test split's mean
    image ``[3, 32, 32]``): image k is the (k // 10)-th test image of class k mod 10."""
    images, labels = test_split("cifar10", Path(data_dir))
    by_class = [torch.nonzero(labels == c).flatten().tolist() for c in range(INFO.num_classes)]
    rows = [by_class[k % INFO.num_classes][k // INFO.num_classes] for k in range(count)]
    return images[rows].float() / 255, labels[rows], (images.double().mean(0) / 255).float()


def model() -> torch.nn.Module:
    """CNN-1 at initialisation (seed 0), eval mode."""
    torch.manual_seed(0)
    return build_cnn("cnn1", INFO.num_classes).eval()


def gradient(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """The cross-entropy gradient of ``net`` on one normalised image, per parameter in order."""
    mean, std = torch.tensor(INFO.mean).view(1, 3, 1, 1), torch.tensor(INFO.std).view(1, 3, 1, 1)
    loss = F.cross_entropy(net((x - mean) / std), y)
    return list(torch.autograd.grad(loss, list(net.parameters())))


def ours(attack: str, x: torch.Tensor, y: torch.Tensor, steps: int) -> torch.Tensor:
    """Our reconstruction ``[1, 3, 32, 32]`` in [0, 1]."""
    net = model()
    grads = gradient(net, x, y)
    generator = torch.Generator().manual_seed(0)
    if attack == "idlg":
        per_parameter = dict(zip([n for n, _ in net.named_parameters()], grads, strict=True))
        _, rec = gradients.idlg(net, per_parameter, SHAPE, INFO.mean, INFO.std, steps=steps, generator=generator)
        return rec[None]
    start = {n: p.detach().clone() for n, p in net.named_parameters()}
    update = {n: -LOCAL_LR * g for (n, _), g in zip(net.named_parameters(), grads)}
    return gradients.invert_update(
        net, start, update, num_images=1, labels=y, local_steps=1, lr=LOCAL_LR, batch_size=1, image_shape=SHAPE,
        mean=INFO.mean, std=INFO.std, steps=steps, generator=generator,
    )  # fmt: skip


def theirs(attack: str, x: torch.Tensor, y: torch.Tensor, steps: int) -> torch.Tensor:
    """breaching's reconstruction ``[1, 3, 32, 32]`` in [0, 1] (its attack config, the budget set)."""
    import breaching
    from omegaconf import OmegaConf

    overrides = [f"optim.max_iterations={steps}", f"optim.callback={steps}"]  # its progress line: once
    if attack == "idlg":  # DLG with the label given is iDLG's image step: breaching's plain optimisation attack
        cfg = breaching.get_attack_config("deepleakage", overrides=[*overrides, "attack_type=optimization"])
    else:
        cfg = breaching.get_attack_config("invertinggradients", overrides=overrides)
    net = model()
    grads = gradient(net, x, y)
    torch.manual_seed(0)  # breaching draws its start from torch's global generator
    setup = {"dtype": torch.float, "device": torch.device("cpu")}
    attacker = breaching.attacks.prepare_attack(net, torch.nn.CrossEntropyLoss(), cfg, setup)
    metadata = OmegaConf.create(
        {"shape": list(SHAPE), "mean": list(INFO.mean), "std": list(INFO.std), "modality": "vision", "classes": 10}
    )
    payload = [{"parameters": [p.detach() for p in net.parameters()], "buffers": [], "metadata": metadata}]
    shared = [
        {
            "gradients": [g.detach() for g in grads],
            "buffers": None,
            "metadata": {"num_data_points": 1, "labels": y.clone(), "local_hyperparams": None},
        }
    ]
    rec, _ = attacker.reconstruct(payload, shared, {}, dryrun=False)
    mean, std = torch.tensor(INFO.mean).view(1, 3, 1, 1), torch.tensor(INFO.std).view(1, 3, 1, 1)
    return (rec["data"].detach() * std + mean).clamp(0, 1)


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every (image, attack, side) row; appended to ``rows.jsonl`` as it is made, kept across runs."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "rows.jsonl"
    done = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    budget = {"idlg": args.idlg_steps, "inverting-gradients": args.steps}
    images, labels, mean_image = test_images(args.data_dir, args.images)
    rows = [r for r in done if r["steps"] == budget[r["attack"]] and r["image"] < args.images]
    for i in range(args.images):
        x, y = images[i : i + 1], labels[i : i + 1]
        for attack, steps in budget.items():
            for side, fn in (("ours", ours), ("breaching", theirs)):
                if any(r["image"] == i and r["attack"] == attack and r["side"] == side for r in rows):
                    continue
                cpu = time.process_time()
                rec = fn(attack, x, y, steps)
                row = {"image": i, "label": int(y), "attack": attack, "side": side, "steps": steps}
                row["cpu_seconds"] = round(time.process_time() - cpu, 1)
                row.update({k: v[0] for k, v in own_image_scores(rec, x, mean_image).items()})
                rows.append(row)
                with path.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                print(json.dumps(row), flush=True)
    return rows


def report(rows: list[dict[str, Any]], command: str) -> str:
    """The mean over images of each attack and side: PSNR and SSIM to the own image, the floor
    (the higher of gray's and the mean image's PSNR to it), images above the floor, CPU seconds."""
    lines = [
        "# Our gradient attacks against breaching's, same case, same budget",
        "",
        f"Command: `{command}`. Case: CNN-1 at initialisation, CIFAR-10 test images (one of each class in turn),",
        "one image's exact cross-entropy gradient, the true label given (bench/breaching_crosscheck.py).",
        "PSNR in dB to the image itself; floor: the higher of a mid-gray image's and the data set's mean image's",
        "PSNR to it; above the floor: images whose reconstruction beats it by 1 dB; CPU seconds per image.",
        "",
        "| attack | side | steps | images | PSNR | SSIM | floor | PSNR − floor | above the floor | CPU s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for attack in ("inverting-gradients", "idlg"):
        for side in ("ours", "breaching"):
            sel = [r for r in rows if r["attack"] == attack and r["side"] == side]
            if not sel:
                continue
            floor = [max(r["gray_psnr_own"], r["mean_image_psnr_own"]) for r in sel]
            gain = [r["psnr_own"] - f for r, f in zip(sel, floor, strict=True)]
            psnr, ssim = (statistics.mean(r[k] for r in sel) for k in ("psnr_own", "ssim_own"))
            lines.append(
                f"| {attack} | {side} | {sel[0]['steps']} | {len(sel)} | {psnr:.2f} "
                f"| {ssim:.3f} | {statistics.mean(floor):.2f} "
                f"| {statistics.mean(gain):+.2f} | {sum(g > 1.0 for g in gain)}/{len(sel)} "
                f"| {statistics.mean(r['cpu_seconds'] for r in sel):.0f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.breaching_crosscheck", description=__doc__.split("\n")[0])
    parser.add_argument("--data-dir", required=True, help="folder holding cifar10/test.parquet")
    parser.add_argument("--images", type=int, default=4, help="test images attacked (default 4)")
    parser.add_argument("--steps", type=int, default=2000, help="inverting gradients' iterations, both sides")
    parser.add_argument("--idlg-steps", type=int, default=300, help="DLG/iDLG's L-BFGS steps, both sides")
    parser.add_argument("--out", default="outputs/breaching-crosscheck", help="folder of rows.jsonl and report.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = run(args)
    command = "python -m bench.breaching_crosscheck " + " ".join(argv if argv is not None else sys.argv[1:])
    text = report(rows, command)
    (Path(args.out) / "report.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
