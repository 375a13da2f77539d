"""PFLlib's side of a reference run, shared by the references built on TsingZ0/PFLlib (HtFLlib, the
FedRE authors' tree, PFLlib itself): our partitions written in its dataset layout
(:func:`write_partitions`), and the bootstrap piece that lets its ``main.py`` start where a server
module it imports cannot be imported here (:data:`PLACEHOLDER_SERVERS`)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from common.files import atomic_write

#: bootstrap code shared by the reference runners (run in a PFLlib-layout ``system/`` folder, with
#: ``re``, ``sys`` and ``types`` imported): every server module ``main.py`` imports whose own imports
#: fail here (HtFLlib's FedKTL needs StyleGAN, FedL2G ``higher``; PFLlib's FedPAC ``cvxpy``; lokinko/FedSA's
#: ``serverdistill`` imports a client with a syntax error) is replaced by a placeholder that raises that error
#: if used; a module already in ``sys.modules`` is kept
PLACEHOLDER_SERVERS = r"""
for module, name in re.findall(r"^from (flcore\.servers\.\w+) import (\w+)", open("main.py").read(), re.M):
    try:
        __import__(module)
    except (ImportError, SyntaxError) as exc:
        def unavailable(*args, _exc=exc, **kwargs):
            raise _exc
        stub = types.ModuleType(module)
        setattr(stub, name, unavailable)
        sys.modules[module] = stub
        print(f"{module} not importable here ({exc}); a placeholder stands in", flush=True)
"""


def write_partitions(config: dict, folder: Path) -> dict:
    """Write every client's train and test split of ``config`` (our partitioner, our 75/25 split,
    normalised as run config ``normalize`` says) in PFLlib's layout under ``folder``, once:
    ``train/<i>.npz`` and ``test/<i>.npz`` hold ``data = {"x": float32 [n, C, H, W], "y": int64 [n]}``,
    ``config.json`` PFLlib's keys plus ``partition_key`` (ours: it names the data files' sizes and
    modification times, so a copied data folder rewrites the partitions), ``content_digest`` (a
    SHA-256 of every array written, in client order: what a reference run is reused by, so that
    rewriting identical partitions keeps its runs) and ``test_examples`` (each client's test split
    size, in client order). A folder whose ``config.json`` has the same ``partition_key`` and
    ``test_examples`` is kept.

    Returns:
        ``config.json``'s content.
    """
    import torch

    from common.config import RunConfig
    from common.data import DataSpec, load_client_data, normalize, partition_key
    from common.datasets import DATASETS, with_recipe

    cfg = RunConfig.from_dict(config)
    spec = DataSpec.from_config(cfg, cfg.num_clients)
    key = "-".join(partition_key(spec, i) for i in range(cfg.num_clients))
    done = folder / "config.json"
    if done.exists() and json.loads(done.read_text()).get("partition_key") == key:
        kept = json.loads(done.read_text())
        if "test_examples" in kept:
            return kept
    info = with_recipe(DATASETS[cfg.dataset], cfg.augment, cfg.normalize)
    sizes, tests = [], []
    digest = hashlib.sha256()
    for split in ("train", "test"):
        (folder / split).mkdir(parents=True, exist_ok=True)
    for i in range(cfg.num_clients):
        data = load_client_data(spec, i)
        for split, x, y in (("train", data.train_x, data.train_y), ("test", data.test_x, data.test_y)):
            arrays = {"x": normalize(x, info).numpy(), "y": y.to(torch.int64).numpy()}
            digest.update(arrays["x"].tobytes() + arrays["y"].tobytes())
            atomic_write(folder / split / f"{i}.npz", lambda f, a=arrays: np.savez_compressed(f, data=a))
        tests.append(len(data.test_y))
        labels = torch.cat([data.train_y, data.test_y])
        sizes.append([[int(c), int((labels == c).sum())] for c in labels.unique()])
    written = {
        "num_clients": cfg.num_clients,
        "num_classes": info.num_classes,
        "non_iid": cfg.partitioner != "iid",
        "balance": False,
        "partition": cfg.partitioner,
        "Size of samples for labels in clients": sizes,
        "alpha": cfg.dirichlet_alpha,
        "batch_size": cfg.batch_size,
        "partition_key": key,
        "content_digest": digest.hexdigest(),
        "test_examples": tests,
    }
    done.write_text(json.dumps(written, indent=1))
    return written
