"""CPU seconds of one client round with and without differential privacy (run config ``dp.*``).

Usage: ``uv run --frozen python -m bench.dp_overhead [--preset presets/privacy-cifar10-cnn5.toml]
[--epsilon 8] [--partitions 0,1,2,3,4] [--repeats 3]``

For each partition (with the preset's model group: one architecture each) it times, interleaved and
``repeats`` times, a local training of the preset's recipe (``common.training.train_supervised``)
without and with DP-SGD, and the per-class payload without and with the Gaussian release
(``common.training.trained_class_means``), on one torch thread, and prints the medians and their
ratios. The σ is the client's calibrated one for ``--epsilon`` (``common.dp.make_plan``, FedGH's
events: one training and one release per round); its calibration is timed once.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from flwr.app import Context, RecordDict

from common.config import RunConfig
from common.dp import make_plan, noisy_class_means
from common.protocol import train_config
from common.runtime import ClientRuntime
from common.training import representations, train_supervised, trained_class_means
from models.groups import MODEL_GROUPS
from tools.runconfig import app_defaults, read_preset


def client(rc: dict, partition: int) -> ClientRuntime:
    context = Context(
        run_id=1,
        node_id=partition + 1,
        node_config={"partition-id": partition, "num-partitions": rc["num-clients"]},
        state=RecordDict(),
        run_config=rc,
    )
    return ClientRuntime(context)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="presets/privacy-cifar10-cnn5.toml")
    parser.add_argument("--epsilon", type=float, default=8.0)
    parser.add_argument("--partitions", default="0,1,2,3,4")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rc = {**app_defaults(), **read_preset(args.preset), "device": "cpu", "record-payloads": ""}
    private_rc = {**rc, "dp.epsilon": args.epsilon}
    config = train_config(RunConfig.from_dict(rc), 1)
    print(f"preset {args.preset}, dp.epsilon {args.epsilon}, 1 torch thread, median of {args.repeats}")
    print(
        f"{'partition':>9} {'model':>6} {'n':>5} {'sigma':>7} {'calib_s':>8} {'train_s':>8} {'dp_train_s':>10} "
        f"{'ratio':>6} {'means_s':>8} {'dp_means_s':>10}"
    )
    for partition in (int(p) for p in args.partitions.split(",")):
        plain, private = client(rc, partition), client(private_rc, partition)
        n = len(plain.data.train_y)
        start = time.perf_counter()
        private.dp = make_plan(private.cfg, n, private.spec.num_partitions, 1, 1)
        calibration = time.perf_counter() - start
        times: dict[str, list[float]] = {"train": [], "dp_train": [], "means": [], "dp_means": []}
        for _ in range(args.repeats):
            for name, runtime in (("", plain), ("dp_", private)):
                model = runtime.model
                start = time.perf_counter()
                train_supervised(model, runtime.data, config, runtime.device, runtime.generator(1), dp=runtime.dp)
                times[name + "train"].append(time.perf_counter() - start)
                stats = {"train-seconds": 0.0}
                start = time.perf_counter()
                if runtime.dp is None:
                    trained_class_means(runtime, stats)
                else:  # the release alone, without charging a ledger
                    rows = representations(model.extractor, runtime.data.train_x, runtime.info, runtime.device)
                    noisy_class_means(rows, runtime.data.train_y, 10, 1.0, runtime.dp.release_noise_multiplier)
                times[name + "means"].append(time.perf_counter() - start)
        med = {k: statistics.median(v) for k, v in times.items()}
        arch = MODEL_GROUPS[plain.cfg.model_group].architecture_for(partition)
        print(
            f"{partition:>9} {arch[:6]:>6} {n:>5} {private.dp.noise_multiplier:>7.3f} {calibration:>8.2f} "
            f"{med['train']:>8.2f} {med['dp_train']:>10.2f} {med['dp_train'] / med['train']:>6.1f} "
            f"{med['means']:>8.3f} {med['dp_means']:>10.3f}"
        )


if __name__ == "__main__":
    main()
