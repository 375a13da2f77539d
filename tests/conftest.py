"""Shared fixtures: run configs on the real offline data, an in-process federation."""

from __future__ import annotations

import os

# Never reach for the Hub from tests: an offline lookup must fail at once, not hang.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# Under pytest-xdist (README: `pytest -n 2`) each worker is one process per core: torch's default
# of a thread per core in every worker (and the processes a test starts) would oversubscribe the cores
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

import fakegrid  # noqa: E402,F401  (sets Flower's task identity, needed to build Messages in tests)
from tools.runconfig import app_defaults  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DATA_DIR = ROOT.parent / "shared" / "data"


def data_spec(**kw):
    """A ``common.data.DataSpec``: CIFAR-10 from the offline data, pathological over 10 partitions,
    seed 7; ``kw`` overriding any field."""
    from common.data import DataSpec

    base = dict(
        dataset="cifar10",
        data_dir=str(DATA_DIR),
        data_pool="train",
        partitioner="pathological",
        num_partitions=10,
        dirichlet_alpha=0.5,
        dirichlet_min_size=2,
        dirichlet_self_balancing=False,
        classes_per_client=2,
        test_fraction=0.2,
        max_examples_per_client=0,
        seed=7,
    )
    return DataSpec(**{**base, **kw})


def make_run_config(**overrides) -> dict:
    """pyproject defaults + small, fast settings + ``overrides`` (keys with '-' or '_')."""
    rc = app_defaults()
    # round-timeout: the fake grid answers at once, so only a silent node waits for it.
    # device: on the CPU also where a GPU is visible ('auto' would take it), since the tests compare
    # exact numbers (CPU kernels are deterministic, cuDNN's need not be) and feed CPU tensors to the
    # clients' models; tests/test_gpu.py checks the GPU path with CUDA faked.
    rc.update(
        {
            "device": "cpu",
            "data-dir": str(DATA_DIR),
            "num-clients": 4,
            "num-server-rounds": 2,
            "max-examples-per-client": 200,
            "batch-size": 32,
            "round-timeout": 0.5,
        }
    )
    rc.update({k.replace("_", "-"): v for k, v in overrides.items()})
    return rc


@pytest.fixture
def run_config(tmp_path):
    """Factory: a run-config dict writing results under the test's tmp folder."""

    def factory(**overrides):
        return make_run_config(**{"output-dir": str(tmp_path / "outputs"), **overrides})

    return factory


def federation(rc: dict, tamper=None):
    """(strategy, grid) for ``rc`` over a FakeGrid with the real ClientApp."""
    from client_app.app import app as client_app
    from common.config import RunConfig
    from fakegrid import FakeGrid
    from methods.registry import build_run

    cfg = RunConfig.from_dict(rc)
    return build_run(cfg), FakeGrid(client_app, rc, cfg.num_clients, tamper)


def client_runtime(rc: dict, partition_id: int = 0):
    """A ClientRuntime of partition ``partition_id`` for run config ``rc``, with empty state."""
    from flwr.app import Context, RecordDict

    from common.runtime import ClientRuntime

    ctx = Context(
        run_id=1,
        node_id=1,
        node_config={"partition-id": partition_id, "num-partitions": rc["num-clients"]},
        state=RecordDict(),
        run_config=rc,
    )
    return ClientRuntime(ctx)


def train_config(rc: dict, server_round: int = 1, **kw) -> dict:
    """The config of a train instruction for run config ``rc`` (``engine.contract.train_config``),
    ``kw`` overriding (keys with '-')."""
    from common.config import RunConfig
    from common.protocol import train_config as base_train_config

    return {**base_train_config(RunConfig.from_dict(rc), server_round), **kw}


def plain_sgd_config(rc: dict, **kw) -> dict:
    """:func:`train_config` with plain SGD: no momentum, weight decay or clipping (PFLlib's recipe,
    FedProto's and FedTGP's)."""
    return train_config(rc, **{"momentum": 0.0, "weight-decay": 0.0, "clip-norm": 0.0, **kw})


def captured_federation(rc: dict):
    """(strategy, grid, replies): :func:`federation` for ``rc`` recording every reply the server receives."""
    replies = []
    strategy, grid = federation(rc, tamper=lambda node, reply: replies.append(reply) or reply)
    return strategy, grid, replies


def chance(rc: dict, n: int) -> float:
    """Mean over clients of the majority-class share of the local test split."""
    import numpy as np

    from common.data import class_counts

    return np.mean([class_counts(y, 10).max() / len(y) for y in (client_runtime(rc, p).data.test_y for p in range(n))])


def shapes_of(message) -> dict:
    """Payload array name -> shape of a message."""
    from common.protocol import PAYLOAD

    return {k: tuple(v.shape) for k, v in message.content.array_records[PAYLOAD].items()}


def run_method(run_config, method, **kw):
    """(rc, strategy, grid, train replies) of a 5-round run of ``method`` (2 local epochs, 400
    examples per client, the fixture's other settings), ``kw`` overriding."""
    rc = run_config(method=method, **{"num-server-rounds": 5, "local-epochs": 2, "max-examples-per-client": 400, **kw})
    strategy, grid, replies = captured_federation(rc)
    strategy.start(grid)
    return rc, strategy, grid, [r for r in replies if r.metadata.message_type == "train"]


def assert_learns(rc: dict, strategy) -> None:
    """The last round beats the majority-class share by 5 points and the train loss fell."""
    rows = strategy.rows
    assert rows[-1]["accuracy_mean"] > chance(rc, rc["num-clients"]) + 0.05, rows[-1]["accuracy_mean"]
    assert rows[-1]["train_loss"] < rows[0]["train_loss"]


#: CIFAR-10's official test split, the real images of the privacy controls
CIFAR_TEST_SPLIT = DATA_DIR / "cifar10" / "test.parquet"


def cifar_test_images():
    """(uint8 images ``[1000, 3, 32, 32]``, int64 labels ``[1000]``): 100 images per class of
    :data:`CIFAR_TEST_SPLIT`, interleaved (image k has class k mod 10; the split is stored class by
    class, 1,000 each)."""
    import pyarrow.parquet as pq
    import torch
    from torchvision.io import ImageReadMode, decode_image

    table = pq.ParquetFile(CIFAR_TEST_SPLIT).read_row_group(0, columns=["img", "label"])
    table = table.take([(k % 10) * 1000 + k // 10 for k in range(1000)])
    raw = [torch.frombuffer(bytearray(d["bytes"]), dtype=torch.uint8) for d in table.column("img").to_pylist()]
    images = torch.stack([decode_image(b, ImageReadMode.RGB) for b in raw])
    labels = torch.tensor(table.column("label").to_pylist())
    assert labels[:10].tolist() == list(range(10))
    return images, labels


@pytest.fixture
def one_thread():
    """One intra-op thread for the test (a module's ``autouse`` fixture can ask for it): on a loaded
    2-core machine a second one costs more than it gives."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def reference_dp_sgd(model, data, config, plan, generator, secrets, objective=None):
    """DP-SGD from materialised per-example gradients, as ``common.training.private_training`` was before ghost
    clipping and ``dp.adaptive-clip``: Opacus's ``GradSampleModule`` and ``DPOptimizer`` at ``dp.clip-norm``,
    Poisson batches, per-example augmentation, the loss ``objective(x, representations, logits, labels)``
    (default cross-entropy); ``secrets`` gives the generators the code draws from the operating system's
    entropy, in the code's order."""
    import torch
    import torch.nn.functional as F
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer
    from opacus.utils.uniform_sampler import UniformWithReplacementSampler

    import common.training
    from common.data import augment, normalize

    n = len(data.train_y)
    opt = common.training.make_sgd(model.parameters(), config)
    sampled = GradSampleModule(model)
    private = DPOptimizer(
        opt,
        noise_multiplier=plan.noise_multiplier,
        max_grad_norm=plan.options.clip_norm,
        expected_batch_size=min(plan.batch_size, n),
        generator=secrets(),
    )
    epochs = int(config["local-epochs"])
    sampler = UniformWithReplacementSampler(
        num_samples=n, sample_rate=plan.sample_rate, generator=secrets(), steps=plan.steps_per_training // epochs
    )
    for _ in range(epochs):
        for idx in sampler:
            idx = torch.as_tensor(idx, dtype=torch.int64)
            x = augment(normalize(data.train_x[idx], data.info), data.info, generator)
            features = model.extractor(x)
            logits = model.head(features)
            y = data.train_y[idx]
            if len(idx) == 0:
                loss = logits.sum()
            else:
                loss = F.cross_entropy(logits, y) if objective is None else objective(x, features, logits, y)
            private.zero_grad(set_to_none=True)
            loss.backward()
            private.step()
    sampled._close()
    return model
