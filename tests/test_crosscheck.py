"""bench.crosscheck and its modules without HtFLlib: the option mapping covers every option, the partitions are
written in PFLlib's layout with exactly our clients' data, the reference's log is parsed, a recipe
the reference cannot follow is refused, and a stand-in ``system/main.py`` runs through the
bootstrap with its seed mapped."""

from __future__ import annotations

import dataclasses
import functools
import json
import random
import re
import shutil
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision
from torch import nn

from bench import crosscheck, crosscheck_report, htfllib, our_side, pfllib
from bench import crosscheck_pairing as pairing
from bench.measure import Measured
from common.config import RunConfig
from common.data import DataSpec, load_client_data, normalize
from common.datasets import DATASETS, with_recipe
from common.errors import ConfigError
from common.options import check_value, declared_fields, option_key
from common.payload import ClientReply
from methods import fedgh, fedtgp
from methods.registry import METHODS
from models.groups import MODEL_GROUPS
from models.zoo import HTCNN8
from tools.runconfig import read_config

DATA_DIR = Path(__file__).resolve().parents[2] / "shared" / "data"
PRESET = Path(__file__).resolve().parents[1] / "presets" / "fedtgp-cifar10-htfe2.toml"


def small_config(**overrides) -> dict:
    config, _ = read_config(PRESET, [])
    return {
        **config,
        "num-clients": 3,
        "max-examples-per-client": 40,
        "partition-seed": 0,
        "data-dir": str(DATA_DIR),
        **overrides,
    }


#: a stand-in for HtFLlib's ``flcore/clients/clientbase.py`` (no torchvision import: fast): ``Client``
#: builds a model with ``BaseHeadSplit``'s names (``base``, ``head``) and the shapes of our initial
#: models in ``$CROSSCHECK_INITIAL``, random values of its own (with ``WIDER_HEAD`` one more head row),
#: and stores it as HtFLlib does; ``build_clients`` builds ``-nc`` clients and prints each stored
#: model's digest, PyTorch's thread count and ``OMP_NUM_THREADS``, then stores client 0's head as the server's, as
#: HtFLlib's FedGH and LG-FedAvg servers do, and prints its digest
STAND_IN_CLIENTBASE = """
import argparse, os, torch
from torch import nn

WIDER_HEAD = {wider_head!r}

def save_item(item, role, name, path):
    os.makedirs(path, exist_ok=True)
    torch.save(item, os.path.join(path, role + "_" + name + ".pt"))

def load_item(role, name, path):
    return torch.load(os.path.join(path, role + "_" + name + ".pt"), weights_only=False)

def shaped(state):
    root = nn.Module()
    for name, tensor in state.items():
        *path, leaf = name.split(".")
        module = root
        for part in ["base" if path[0] == "extractor" else path[0], *path[1:]]:
            if part not in module._modules:
                module.add_module(part, nn.Module())
            module = module._modules[part]
        shape = list(tensor.shape)
        if WIDER_HEAD and name == "head.weight":
            shape[0] += 1
        value = torch.randn(shape) if tensor.is_floating_point() else torch.zeros_like(tensor)
        if leaf in ("weight", "bias"):
            module.register_parameter(leaf, nn.Parameter(value))
        else:
            module.register_buffer(leaf, value)
    return root

class Client:
    def __init__(self, args, id, **kwargs):
        torch.manual_seed(0)
        self.id, self.role, self.save_folder_name = id, "Client_" + str(id), args.folder
        ours = torch.load(os.environ["CROSSCHECK_INITIAL"], weights_only=True)[id]
        save_item(shaped(ours), self.role, "model", args.folder)

def build_clients():
    from bench.crosscheck_pairing import states_digest
    p = argparse.ArgumentParser()
    p.add_argument("-nc", type=int)
    args, _ = p.parse_known_args()
    args.folder = "temp"
    for c in [Client(args, id=i) for i in range(args.nc)]:
        state = load_item(c.role, "model", args.folder).state_dict()
        print("stand-in: client", c.id, states_digest([state]), "threads", torch.get_num_threads(),
              os.environ["OMP_NUM_THREADS"], flush=True)
    save_item(load_item("Client_0", "model", args.folder).head, "Server", "head", args.folder)
    state = load_item("Server", "head", args.folder).state_dict()
    print("stand-in: server head", states_digest([state]), flush=True)
"""


#: a stand-in for HtFLlib's ``flcore/servers/serverbase.py``: ``Server`` keeps its store in a folder of
#: its own (``temp/<time>/``, which the clients' models go to), ``select_clients`` draws their
#: order from numpy's generator, as HtFLlib's do, and ``train`` runs HtFLlib's round loop, printing each
#: round's number and an accuracy, then a stand-in's ``after_round`` step
STAND_IN_SERVERBASE = """
import time
import numpy as np

class Server:
    def __init__(self, args, times):
        self.args, self.global_rounds = args, args.global_rounds
        args.folder = self.save_folder_name = f"temp/{time.time()}/"
        self.clients, self.selected_clients = [], []

    def select_clients(self):
        return [self.clients[i] for i in np.random.permutation(len(self.clients))]

    def train(self):
        for r in range(self.global_rounds + 1):
            self.selected_clients = self.select_clients()
            print(f"Round number: {r}")
            print("Averaged Test Accuracy: 0.5")
            self.after_round(r)

    def after_round(self, r):
        pass
"""


#: a stand-in for HtFLlib's FedTGP and FedGH server modules (``servertgp.py``, ``servergh.py``), with
#: what the bootstrap pairs in them: ``store_server_item`` stores the server's module as HtFLlib's do
#: (FedTGP: a draw of its own with ``Trainable_Global_Prototypes``' names and shapes; FedGH: client 0's
#: head) and prints the digests of that draw and of what the store then holds; ``upload`` stores each
#: client's ``protos`` (``{class: row [4]}``, every entry 100 * client id + class, classes in descending
#: order); ``train_on_uploads`` collects them in the server's client order as HtFLlib's servers do and
#: goes over them in this module's ``DataLoader`` (one per epoch, as FedTGP's server), returning the
#: rows' and each batch's (client, class) pairs
STAND_IN_UPLOAD_SERVER = """
import torch
from torch import nn
from torch.utils.data import DataLoader
from bench.crosscheck_pairing import states_digest
from flcore.clients.clientbase import load_item, save_item

def store_server_item(server, args):
    if args.algo == "FedTGP":
        item, name = nn.Module(), "TGP"
        item.embedings = nn.Embedding(args.ncl, args.fd)
        item.middle = nn.Sequential(nn.Sequential(nn.Linear(args.fd, args.fd), nn.ReLU()))
        item.fc = nn.Linear(args.fd, args.fd)
    else:
        item, name = load_item("Client_0", "model", server.save_folder_name).head, "head"
    own = states_digest([item.state_dict()])
    save_item(item, "Server", name, server.save_folder_name)
    stored = states_digest([load_item("Server", name, server.save_folder_name).state_dict()])
    print("stand-in: server", name, own, stored, flush=True)

def upload(clients, classes):
    for c in clients:
        protos = {k: torch.full((4,), 100.0 * c.id + k) for k in sorted(classes(c.id), reverse=True)}
        save_item(protos, c.role, "protos", c.save_folder_name)

def train_on_uploads(server, epochs, batch_size):
    rows = []
    for c in server.selected_clients:
        protos = load_item(c.role, "protos", c.save_folder_name)
        rows += [(protos[k], k) for k in protos]
    batches = []
    for _ in range(epochs):
        for p, y in DataLoader(rows, batch_size, drop_last=False, shuffle=True):
            batches.append([divmod(int(v), 100) for v in p[:, 0]])
    return [divmod(int(p[0]), 100) for p, _ in rows], batches
"""


#: the end of HtFLlib's model family chain in ``main.py`` (never called here)
FAMILY_CHAIN = """
def families(args):
    for _ in range(1):
        if args.model_family == "HtFE-img-2":
            pass
        else:
            raise NotImplementedError
"""


def write_stand_in(system: Path, main: str, wider_head: bool = False, build: bool = True) -> None:
    """A stand-in HtFLlib in ``system`` (:data:`STAND_IN_SERVERBASE`, FedTGP's and FedGH's server modules
    :data:`STAND_IN_UPLOAD_SERVER`): ``main.py`` builds its clients first (:data:`STAND_IN_CLIENTBASE`;
    none without ``build``), then runs ``main``."""
    for package in ("clients", "servers"):
        (system / "flcore" / package).mkdir(parents=True, exist_ok=True)
        (system / "flcore" / package / "__init__.py").write_text("")
    (system / "flcore" / "__init__.py").write_text("")
    (system / "flcore" / "servers" / "serverbase.py").write_text(STAND_IN_SERVERBASE)
    for module in ("servertgp", "servergh"):
        (system / "flcore" / "servers" / f"{module}.py").write_text(STAND_IN_UPLOAD_SERVER)
    (system / "flcore" / "clients" / "clientbase.py").write_text(STAND_IN_CLIENTBASE.format(wider_head=wider_head))
    clients = "from flcore.clients.clientbase import build_clients\nbuild_clients()\n" if build else ""
    main = textwrap.dedent(main)
    if "raise NotImplementedError" not in main:  # HtFLlib's family chain, where a removed family goes
        main += FAMILY_CHAIN
    (system / "main.py").write_text(clients + main)


@pytest.mark.parametrize("method", list(htfllib.REFERENCE_METHODS))
def test_every_option_is_mapped_tied_or_listed_once(method):
    ref = htfllib.REFERENCE_METHODS[method]
    declared = sorted(option_key(f) for f in dataclasses.fields(METHODS[method].options))
    placed = [*ref.flags.values(), *ref.tied, *ref.unexpressed]
    assert sorted(placed) == declared  # none forgotten, none twice, none invented


@pytest.mark.parametrize("method", list(htfllib.REFERENCE_METHODS))
def test_what_htflib_hard_codes_is_a_value_our_option_allows(method):
    ref = htfllib.REFERENCE_METHODS[method]
    assert set(ref.as_code) <= set(ref.unexpressed)
    fields = {option_key(f): (f, kind) for f, kind in declared_fields(METHODS[method].options)}
    for key, value in ref.as_code.items():
        assert check_value(key, value, *fields[key]) == value


@pytest.mark.parametrize("method,width", [("fedl2g-feat", "feature-dim"), ("fedl2g-logit", None)])
def test_fedl2gs_guiding_vectors_load_into_htflibs_embedding(method, width):
    # serverl2g_*.py stores G as an nn.Embedding(C, D) ('guiding_vec'): ours goes in as its weight, unchanged
    config = {**small_config(), "method": method, "seed": 3}
    num_classes = DATASETS[config["dataset"]].num_classes
    ours = pairing.server_initial_state(config, "guiding_vec")
    embedding = nn.Embedding(num_classes, config[width] if width else num_classes)
    embedding.load_state_dict(pairing.paired_state(ours, embedding.state_dict(), "the server's guiding_vec"))
    assert list(ours) == ["guiding.weight"] and torch.equal(embedding.weight.detach(), ours["guiding.weight"])
    assert not torch.equal(
        ours["guiding.weight"], pairing.server_initial_state({**config, "seed": 4}, "guiding_vec")["guiding.weight"]
    )


def test_fedgens_head_and_generator_each_load_into_htflibs_module():
    # servergen.py stores the head (client 0's, a Linear(K, C)) as 'head' and its Generator as 'generative_model'
    # (fc1 = Linear(d_eps + C, H), BatchNorm1d(H), ReLU; fc = Linear(H, K)): ours goes into each, and the label
    # counts of our global arrays into neither
    config = {**small_config(), "method": "fedgen", "seed": 3, "fedgen.noise-dim": 4, "fedgen.hidden-dim": 6}
    k, c = RunConfig.from_dict(config).representation_dim, DATASETS[config["dataset"]].num_classes
    head = pairing.server_initial_state(config, "head")
    theirs = nn.Linear(k, c)
    theirs.load_state_dict(pairing.paired_state(head, theirs.state_dict(), "the server's head"))
    assert list(head) == ["head.weight", "head.bias"] and torch.equal(theirs.weight.detach(), head["head.weight"])
    generator = pairing.server_initial_state(config, "generative_model")
    htflib_generator = nn.Module()
    htflib_generator.fc1 = nn.Sequential(nn.Linear(4 + c, 6), nn.BatchNorm1d(6), nn.ReLU())
    htflib_generator.fc = nn.Linear(6, k)
    htflib_generator.load_state_dict(pairing.paired_state(generator, htflib_generator.state_dict(), "generator"))
    loaded = list(htflib_generator.state_dict().values())
    assert len(loaded) == len(generator) == 9
    assert all(torch.equal(a, b) for a, b in zip(loaded, generator.values(), strict=True))
    assert not torch.equal(
        htflib_generator.fc.weight.detach(),
        pairing.server_initial_state({**config, "seed": 4}, "generative_model")[list(generator)[-2]],
    )


def test_partitions_are_our_clients_data_in_pflib_layout(tmp_path):
    config = small_config()
    written = pfllib.write_partitions(config, tmp_path)
    cfg = RunConfig.from_dict(config)
    spec = DataSpec.from_config(cfg, 3)
    info = with_recipe(DATASETS["cifar10"], cfg.augment, cfg.normalize)
    for i in range(3):
        ours = load_client_data(spec, i)
        for split, x, y in (("train", ours.train_x, ours.train_y), ("test", ours.test_x, ours.test_y)):
            with open(tmp_path / split / f"{i}.npz", "rb") as f:  # as HtFLlib's read_data opens it
                data = np.load(f, allow_pickle=True)["data"].tolist()
            assert data["x"].dtype == np.float32 and data["y"].dtype == np.int64
            np.testing.assert_array_equal(data["x"], normalize(x, info).numpy())
            np.testing.assert_array_equal(data["y"], y.numpy())
        counts = dict(map(tuple, written["Size of samples for labels in clients"][i]))
        assert sum(counts.values()) == len(ours.train_y) + len(ours.test_y)
    assert written["num_clients"] == 3 and written["num_classes"] == 10
    before = (tmp_path / "train" / "0.npz").stat().st_mtime_ns
    pfllib.write_partitions(config, tmp_path)  # same partitions: kept
    assert (tmp_path / "train" / "0.npz").stat().st_mtime_ns == before


def test_reference_log_is_parsed_per_repetition_and_round():
    log = textwrap.dedent(
        """
        ============= Running time: 0th =============
        -------------Round number: 0-------------
        Averaged Test Accuracy: 0.1000
        Std Test Accuracy: 0.0100
        -------------Round number: 1-------------
        Averaged Test Accuracy: 0.2500
        ============= Running time: 1th =============
        -------------Round number: 0-------------
        Averaged Test Accuracy: 0.0900
        -------------Round number: 1-------------
        """
    )
    assert htfllib.parse_reference_log(log) == [{0: 0.1, 1: 0.25}, {0: 0.09}]


def test_a_recipe_the_reference_cannot_follow_is_refused():
    htfllib.check_expressible(small_config(), "fedtgp")
    with pytest.raises(ConfigError, match=r"momentum = 0\.9.*fedtgp\.server-lr = 0\.1 \(HtFLlib uses lr = 0\.01\)"):
        htfllib.check_expressible(small_config(**{"momentum": 0.9, "fedtgp.server-lr": 0.1}), "fedtgp")
    with pytest.raises(ConfigError, match="model-group"):
        htfllib.check_expressible(small_config(**{"model-group": "cnn1"}), "fedgh")
    with pytest.raises(ConfigError, match="no HtFLlib counterpart"):
        htfllib.check_expressible(small_config(), "fedre")
    # FML's client in HtFLlib clips each model's gradient norm at 10: that is its recipe, not ours
    with pytest.raises(ConfigError, match=r"clip-norm = 0\.0 \(HtFLlib: 10\.0\)"):
        htfllib.check_expressible(small_config(), "fml")
    htfllib.check_expressible(small_config(**{"clip-norm": 10.0}), "fml")
    with pytest.raises(ConfigError, match=r"clip-norm = 10\.0 \(HtFLlib: 0\.0\)"):
        htfllib.check_expressible(small_config(**{"clip-norm": 10.0}), "fedgh")


def test_the_reference_gets_our_option_values_as_the_run_config_has_them():
    config, _ = read_config(PRESET, ["fedtgp.lambda=1.0 fedtgp.server-epochs=7"])  # flat keys, as tools.run reads
    cmd = " ".join(htfllib.reference_command({**config, "num-server-rounds": 2}, "fedtgp", "d"))
    assert "-lam 1.0" in cmd and "-se 7" in cmd and "-mart 100.0" in cmd  # overrides, then the preset's value
    assert our_side.method_options(config, "fedgh")["server-epochs"] == 1  # another method's: its default


def test_compare_gives_spread_and_largest_gap():
    c = crosscheck_report.compare([[0.1, 0.5], [0.3, 0.3]], [[0.2, 0.2], [0.2, 0.2]])
    assert c["ours"]["final_mean"] == pytest.approx(0.4) and c["ours"]["final_std"] == pytest.approx(0.1)
    assert c["ours"]["best_mean"] == pytest.approx(0.4) and c["reference"]["best_std"] == 0
    assert c["largest_gap"] == pytest.approx(0.2) and c["largest_gap_round"] == 2
    assert c["ours"]["diverged"] == 0


def test_compare_leaves_a_diverged_seed_out_of_final_and_best_and_counts_it():
    c = crosscheck_report.compare([[0.5, 0.6], [0.5, 0.8]], [[0.2, None], [0.3, 0.4]])
    assert c["reference"]["diverged"] == 1
    assert c["reference"]["final_mean"] == pytest.approx(0.4) and c["reference"]["final_std"] == 0
    assert c["reference"]["best_mean"] == pytest.approx(0.4)
    # round 1: 0.5 - 0.25; round 2: 0.7 - 0.4 (the seed that reached it)
    assert c["largest_gap"] == pytest.approx(0.3) and c["largest_gap_round"] == 2
    every = crosscheck_report.compare([[0.5, 0.6]], [[None, None]])
    assert every["reference"]["final_mean"] is None and every["reference"]["diverged"] == 1


#: the run config of the stand-in reference runs: HtCNN8's small models on Fashion-MNIST (fast)
STAND_IN_CONFIG = {"dataset": "fashion-mnist", "model-group": "htcnn8", "max-examples-per-client": 20}


def stand_in_config(**overrides) -> dict:
    """3 rounds of :data:`STAND_IN_CONFIG` for 3 clients."""
    return small_config(**{"num-server-rounds": 3, **STAND_IN_CONFIG, **overrides})


@pytest.fixture(scope="module")
def stand_in_partitions(tmp_path_factory) -> Path:
    """:func:`stand_in_config`'s partitions, written once for this module's stand-in runs (read only)."""
    partitions = tmp_path_factory.mktemp("stand-in") / "cc" / "partitions"
    pfllib.write_partitions(stand_in_config(), partitions)
    return partitions


def run_stand_in_reference(tmp_path, partitions: Path, main: str, seed: int, method: str, **stand_in) -> dict:
    """``run_reference`` for :func:`stand_in_config` on ``partitions`` with a stand-in HtFLlib whose
    ``system/main.py`` is ``main`` (``stand_in``: :func:`write_stand_in`'s options)."""
    write_stand_in(tmp_path / "ref" / "system", main, **stand_in)
    return htfllib.run_reference(
        tmp_path / "ref", stand_in_config(), method, seed, partitions, tmp_path / "cc" / method
    )


#: a stand-in ``main.py`` that reads client 0's partition as HtFLlib does, seeds torch with 0 as HtFLlib
#: does, draws from numpy's and Python's generators unseeded as HtFLlib's client order does, imports an
#: optional server module whose own import fails, takes its models from HtFLlib's family chain, and
#: prints them and HtFLlib's log lines; each round goes over its FedGH server's loader (no uploads here)
BOOTSTRAPPED_MAIN = """
import argparse, json, random, numpy as np, torch
from flcore.servers import servergh
from flcore.servers.serverbroken import Broken
def run(args):
    data = np.load(f"../dataset/{args.data}/train/0.npz", allow_pickle=True)["data"].tolist()
    torch.manual_seed(0)
    draw = torch.rand(1).item() + np.random.rand() + random.random()
    for i in range(1):
        if args.model_family == "HtFE-img-2":
            args.models = ["FedAvgCNN()"]
        else:
            raise NotImplementedError
        print("models:", json.dumps(args.models))
        print("Running time: 0th")
        for r in range(args.gr + 1):
            print(f"Round number: {r}")
            print(f"Averaged Test Accuracy: {draw + r / 100 + len(data['y']) / 1e6:.6f}")
            list(servergh.DataLoader([], 10, drop_last=False, shuffle=True))  # FedGH's server step, on no uploads
p = argparse.ArgumentParser()
p.add_argument("-data"); p.add_argument("-m", dest="model_family"); p.add_argument("-gr", type=int)
run(p.parse_known_args()[0])
"""


@dataclasses.dataclass
class Bootstrapped:
    """:func:`bootstrapped`'s runs: ``runs[s]``, ``logs[s]`` and ``saved[s]`` (its
    ``reference-seed-<s>.json``) for seeds 0 and 1, read as they ended; ``left`` the ``*.pt`` files
    left in ``out``."""

    config: dict
    out: Path
    runs: list[dict]
    logs: list[str]
    saved: list[dict]
    left: list[Path]


@pytest.fixture(scope="module")
def bootstrapped(tmp_path_factory, stand_in_partitions) -> Bootstrapped:
    """The real bootstrap (:data:`bench.htfllib.BOOTSTRAP`) run twice, seeds 0 and 1, for FedGH on a
    stand-in HtFLlib that builds its clients (:data:`STAND_IN_CLIENTBASE`) then runs
    :data:`BOOTSTRAPPED_MAIN`: one pair of runs whose outputs the seeding, family and pairing tests
    assert on (each run starts PyTorch: seconds)."""
    tmp = tmp_path_factory.mktemp("bootstrapped")
    system = tmp / "ref" / "system"
    (system / "flcore" / "servers").mkdir(parents=True)
    (system / "flcore" / "servers" / "serverbroken.py").write_text("import not_installed_anywhere\n")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMP_NUM_THREADS", "3")  # what the reference must not inherit: it runs our clients' threads
        runs = [run_stand_in_reference(tmp, stand_in_partitions, BOOTSTRAPPED_MAIN, s, "fedgh") for s in (0, 1)]
    out = tmp / "cc" / "fedgh"
    return Bootstrapped(
        config=stand_in_config(),
        out=out,
        runs=runs,
        logs=[(out / f"reference-seed-{s}.log").read_text() for s in (0, 1)],
        saved=[json.loads((out / f"reference-seed-{s}.json").read_text()) for s in (0, 1)],
        left=list(out.glob("*.pt")),
    )


def fails_with_code_3(calls: list):
    """A ``run_measured`` standing in for a reference run that ends with exit code 3 (an empty log);
    each call's command is appended to ``calls``."""

    def run(cmd, cwd, log, env=None, append=False):
        calls.append(cmd)
        log.write_text("")
        return Measured(3, 0.0, 0.0, 0, {})

    return run


def test_a_stand_in_reference_runs_through_the_bootstrap_with_its_seed(
    bootstrapped, stand_in_partitions, tmp_path, monkeypatch
):
    """Through the bootstrap (:func:`bootstrapped`): seed 0 leaves torch's draw unchanged and seeds
    numpy's and Python's generators with 0, seed 1 changes the draw, a failing optional server import
    is replaced, and every run is kept; a kept run is reused for the same command and partition
    content (another folder, a copied data folder), and run again for another lr or other content
    (seen as ``run_measured`` called: here a run that ends with exit code 3)."""
    runs, out, config = bootstrapped.runs, bootstrapped.out, bootstrapped.config
    n = len(np.load(stand_in_partitions / "train" / "0.npz", allow_pickle=True)["data"].tolist()["y"])
    torch.manual_seed(0)
    unchanged = torch.rand(1).item() + np.random.RandomState(0).rand() + random.Random(0).random()
    assert runs[0]["curve"] == pytest.approx([unchanged + r / 100 + n / 1e6 for r in (1, 2, 3)], abs=1e-6)
    assert runs[1]["initial"] != pytest.approx(runs[0]["initial"])
    assert "-algo FedGH" in runs[0]["command"] and runs[0]["cpu_seconds"] > 0
    assert "placeholder" in bootstrapped.logs[0]
    saved = bootstrapped.saved[1]
    assert saved == runs[1]
    calls = []
    monkeypatch.setattr(htfllib, "run_measured", fails_with_code_3(calls))
    ref = tmp_path / "ref"
    ref.mkdir()
    assert htfllib.run_reference(ref, config, "fedgh", 1, stand_in_partitions, out) == saved
    elsewhere = tmp_path / "cc2" / "partitions"  # another output folder: another dataset name, same data
    shutil.copytree(stand_in_partitions, elsewhere)
    (tmp_path / "cc2" / "fedgh").mkdir()
    shutil.copy(out / "reference-seed-1.json", tmp_path / "cc2" / "fedgh")
    assert htfllib.run_reference(ref, config, "fedgh", 1, elsewhere, tmp_path / "cc2" / "fedgh") == saved
    key = json.loads((elsewhere / "config.json").read_text())["partition_key"]
    copied = {**config, "data-dir": str(tmp_path / "data")}  # the data folder copied: the same partitions written again
    shutil.copytree(DATA_DIR / "fashion-mnist", tmp_path / "data" / "fashion-mnist")
    pfllib.write_partitions(copied, elsewhere)
    assert json.loads((elsewhere / "config.json").read_text())["partition_key"] != key
    assert htfllib.run_reference(ref, copied, "fedgh", 1, elsewhere, tmp_path / "cc2" / "fedgh") == saved
    assert not calls
    with pytest.raises(RuntimeError, match="exit code 3"):  # another lr is another command: run again
        htfllib.run_reference(ref, {**config, "lr": 0.02}, "fedgh", 1, elsewhere, tmp_path / "cc2" / "fedgh")
    other = stand_in_config(**{"max-examples-per-client": 30})
    pfllib.write_partitions(other, elsewhere)  # other content: run again
    with pytest.raises(RuntimeError, match="exit code 3"):
        htfllib.run_reference(ref, other, "fedgh", 1, elsewhere, tmp_path / "cc2" / "fedgh")
    assert len(calls) == 2


def test_a_family_htflib_removed_is_put_back_for_the_run(bootstrapped, stand_in_partitions, tmp_path, monkeypatch):
    """HtCNN8 (FedTGP's ``HCNNs8``, gone from today's HtFLlib): the bootstrap adds its branch to a
    stand-in ``main.py``'s family chain (:func:`bootstrapped`), with our eight members' convs and
    widths and the dataset's channels and side; a family the chain has is left alone (the run gets no
    family to add)."""
    run = bootstrapped.runs[0]
    models = json.loads(bootstrapped.logs[0].split("models: ", 1)[1].splitlines()[0])
    assert len(models) == 8 and "-m HCNNs8" in run["command"] and "CROSSCHECK_FAMILY=" in run["command"]
    for constructor, (convs, widths) in zip(models, HTCNN8.values(), strict=True):
        assert f"num_cov={convs}, hidden_dims={list(widths[:-1])}, in_features=1, height=28," in constructor
    assert htfllib.restored_family("HtFE-img-2", "cifar10") is None
    envs = []

    def one_round(cmd, cwd, log, env=None, append=False):  # HtFLlib's log of one round, every client paired
        envs.append(env)
        paired = "".join(f"crosscheck: client {i} paired\n" for i in range(3))
        log.write_text(
            paired
            + "Running time: 0th\n"
            + "".join(f"Round number: {r}\nAveraged Test Accuracy: 0.5\n" for r in (0, 1))
        )
        return Measured(0, 0.0, 0.0, 0, {})

    monkeypatch.setattr(htfllib, "run_measured", one_round)
    (tmp_path / "ref").mkdir()
    cifar = htfllib.run_reference(
        tmp_path / "ref", small_config(**{"num-server-rounds": 1}), "local", 0, stand_in_partitions, tmp_path / "cc"
    )
    assert "CROSSCHECK_FAMILY" not in cifar["command"] and htfllib.FAMILY_VARIABLE not in envs[0]


def test_the_bootstrap_pairs_every_client_with_our_initial_models_and_threads(
    bootstrapped, stand_in_partitions, tmp_path
):
    """Through the bootstrap, every client model HtFLlib's ``Client`` stored is ours for the run config and
    seed (a stand-in ``Client`` draws its own), FedGH's server head is our server's (the stand-in stores
    client 0's, as HtFLlib's does), PyTorch runs our clients' thread count, the files of our models are
    gone after the run, and a client model of another shape or a run that builds no client through
    ``Client`` is refused and not kept."""
    for seed, run, log in zip((0, 1), bootstrapped.runs, bootstrapped.logs, strict=True):
        ours = pairing.initial_states({**bootstrapped.config, "seed": seed})
        lines = re.findall(r"stand-in: client (\d+) (\w+) threads (\d+) (\d+)", log)
        assert [(int(i), d) for i, d, _, _ in lines] == [(i, pairing.states_digest([s])) for i, s in enumerate(ours)]
        # torch's threads and those of numpy's BLAS (OMP_NUM_THREADS, read as numpy loads it)
        assert {(t, b) for _, _, t, b in lines} == {(str(pairing.CLIENT_THREADS),) * 2}
        server = pairing.server_initial_state({**bootstrapped.config, "method": "fedgh", "seed": seed}, "head")
        assert list(server) == ["head.weight", "head.bias"]
        assert re.findall(r"stand-in: server head (\w+)", log) == [pairing.states_digest([server])]
        client_head = {k: v for k, v in ours[0].items() if k.startswith("head.")}
        assert pairing.states_digest([server]) != pairing.states_digest([client_head])  # not what it stored
        assert run["server_pairing"] == {"head": "paired"}
        assert run["initial_digest"] == pairing.states_digest([*ours, server])
        assert run["threads"] == pairing.CLIENT_THREADS
        assert (
            "OMP_NUM_THREADS=1 CROSSCHECK_THREADS=1 " in run["command"]
            and "CROSSCHECK_SERVER_ITEMS=head " in run["command"]
        )
    assert htfllib.PAIRED_SERVER.format(item="head") in htfllib.pairing("fedgh", bootstrapped.runs)[0]
    assert not bootstrapped.left
    main = """
    print("Running time: 0th")
    for r in range(4):
        print(f"Round number: {r}")
        print("Averaged Test Accuracy: 0.3")
    """
    with pytest.raises(RuntimeError, match=r"client 0: tensor 4 differs: ours head\.weight \(10, 512\)"):
        run_stand_in_reference(tmp_path, stand_in_partitions, main, 6, "local", wider_head=True)
    with pytest.raises(RuntimeError, match=r"paired the models of clients \[\], not of all 3"):
        run_stand_in_reference(tmp_path, stand_in_partitions, main, 6, "local", build=False)
    assert not (tmp_path / "cc" / "local" / "reference-seed-6.json").exists()


def test_a_server_module_not_paired_is_reported_and_one_never_stored_is_refused(tmp_path):
    """The bootstrap's line for the server's module is read: paired, or not with its reason, which the
    report's unpaired list carries (the paired list then leaves the server out); a run that never
    stored one of its ``server_items`` is refused; each item is read on its own."""
    text = "crosscheck: client 0 paired (8 tensors of ours)\nRunning time: 0th\nRound number: 0\n"
    text += "Averaged Test Accuracy: 0.1\nRound number: 1\nAveraged Test Accuracy: 0.2\n"
    reason = "the server's global_model: tensor 0 differs: ours conv1.weight (16, 1, 5, 5) torch.float32, ..."
    refused = text + f"crosscheck: server global_model not paired: {reason}\n"
    took = text.replace("Running", "crosscheck: server global_model paired\nRunning")
    runs = [htfllib.read_reference_run(t, 0, 0, 1, 1, tmp_path, ("global_model",)) for t in (refused, took)]
    assert [r["server_pairing"] for r in runs] == [{"global_model": reason}, {"global_model": "paired"}]
    assert runs[0]["curve"] == [0.2]
    paired, unpaired = htfllib.pairing("fml", runs)
    assert paired == htfllib.PAIRED
    assert unpaired == f"the server's initial `global_model`, each side's own draw ({reason})"
    paired, unpaired = htfllib.pairing("fedkd", runs[1:])
    assert paired.endswith("`Server_global_model` the first time it stores it)")
    assert unpaired.startswith("each client's alignment map")
    assert htfllib.read_reference_run(text, 0, 0, 1, 1, tmp_path)["server_pairing"] is None
    with pytest.raises(RuntimeError, match=r"never stored its server's `head`"):
        htfllib.read_reference_run(refused, 0, 0, 1, 1, tmp_path, ("global_model", "head"))
    # FedGen's two modules: the generator paired, the head not (its reason in the unpaired list, first)
    lines = f"crosscheck: server generative_model paired\ncrosscheck: server head not paired: {reason}\n"
    two = htfllib.read_reference_run(
        text.replace("Running", lines + "Running"), 0, 0, 1, 1, tmp_path, ("head", "generative_model")
    )
    assert two["server_pairing"] == {"head": reason, "generative_model": "paired"}
    paired, unpaired = htfllib.pairing("fedgen", [two])
    assert paired == f"{htfllib.PAIRED}; {htfllib.PAIRED_SERVER.format(item='generative_model')}"
    assert unpaired.startswith(f"the server's initial `head`, each side's own draw ({reason}); the labels and noise")


#: a stand-in ``main.py`` whose server stores its module of the method (:data:`STAND_IN_UPLOAD_SERVER`)
#: and in each iteration r has every client i upload the classes k < 4 with (k + i + r) % 3 != 0, then
#: trains on them for ``-se`` epochs of batches of ``-lbs``, printing the rows in the order it collected
#: them and its batches
UPLOADS_MAIN = """
import argparse, importlib, json
from flcore.clients.clientbase import Client
from flcore.servers.serverbase import Server
p = argparse.ArgumentParser()
for flag in ("-nc", "-gr", "-ncl", "-fd", "-lbs", "-se"):
    p.add_argument(flag, type=int)
p.add_argument("-algo")
args, _ = p.parse_known_args()
args.global_rounds = args.gr
module = importlib.import_module("flcore.servers." + ("servertgp" if args.algo == "FedTGP" else "servergh"))

class StandIn(Server):
    def after_round(self, r):
        module.upload(self.clients, lambda i: [k for k in range(4) if (k + i + r) % 3])
        print("stand-in: round", json.dumps(module.train_on_uploads(self, args.se, args.lbs)), flush=True)

server = StandIn(args, 0)
server.clients = [Client(args, id=i) for i in range(args.nc)]
module.store_server_item(server, args)
print("Running time: 0th")
server.train()
"""


def our_server_batches(method: str, config: dict, seed: int, monkeypatch) -> list[list[list[int]]]:
    """Each mini-batch of our server's step (``methods.fedtgp.train_generator``,
    ``methods.fedgh.train_header`` in ``minibatch`` mode) over :data:`UPLOADS_MAIN`'s uploads of every
    iteration, as (client, class) pairs: the replies in partition order, each one's rows by class as
    our clients send them, and the server's generator of ``seed`` kept across rounds. The rows of a
    step are those FedTGP's ACL loss (patched to record them) or FedGH's header is called on."""
    options = our_side.method_options(config, method)
    epochs, size = options["server-epochs"], options["server-batch-size"]
    generator = torch.Generator().manual_seed(seed)  # FedTGPServer.batch_rng, FedGHServer.header_generator
    seen, batches = [], []
    loss = fedtgp.acl_loss
    monkeypatch.setattr(fedtgp, "acl_loss", lambda protos, *args: seen.append(protos.clone()) or loss(protos, *args))
    for r in range(config["num-server-rounds"] + 1):
        replies = []
        for i in range(config["num-clients"]):
            classes = [k for k in range(4) if (k + i + r) % 3]
            rows = np.array([[100.0 * i + k] * 4 for k in classes], dtype=np.float32)
            names = ("protos", "proto_labels") if method == "fedtgp" else ("lar", "lar_labels")
            labels = np.array(classes, dtype=np.int64 if method == "fedtgp" else np.int32)
            replies.append(ClientReply(1000 + i, i, {names[0]: rows, names[1]: labels}, {}))
        seen.clear()
        if method == "fedtgp":
            opts = fedtgp.FedTGPOptions(server_epochs=epochs, server_batch_size=size)
            fedtgp.train_generator(fedtgp.PrototypeGenerator(10, 4, 8), replies, opts, generator)
        else:
            opts = fedgh.FedGHOptions(server_mode="minibatch", server_epochs=epochs, server_batch_size=size)
            fedgh.train_header(RecordingLinear(seen), replies, opts, generator)
        # the first and the last call are the step's loss over all rows, before and after it
        batches += [[list(divmod(int(row[0]), 100)) for row in rows] for rows in seen[1:-1]]
    return batches


class RecordingLinear(nn.Linear):
    """FedGH's header Linear(4, 10) that appends each input it is called on to ``seen``."""

    def __init__(self, seen: list) -> None:
        super().__init__(4, 10)
        self.seen = seen

    def forward(self, x):
        self.seen.append(x.detach().clone())
        return super().forward(x)


@pytest.mark.parametrize("method", ["fedtgp", "fedgh"])
def test_the_bootstrap_pairs_the_servers_module_and_batch_order_over_the_uploads(
    method, stand_in_partitions, tmp_path, monkeypatch
):
    """Through the bootstrap, HtFLlib's server (a stand-in of FedTGP's or FedGH's) stores our server's
    initial module, not its own draw (FedTGP's trainable prototypes: our generator's weights), and its
    ``DataLoader`` over the uploads gives our server's batches round after round, although it collects
    the rows in another order (its client order, each client's classes in its own); with the order
    unpaired (the method without ``server_order``) the same stand-in's batches are not ours, and a run
    whose log does not show the order paired is refused for a method that pairs it."""
    config = stand_in_config(
        **{"batch-size": 3, f"{method}.server-batch-size": 3, f"{method}.server-epochs": 2, "method": method}
    )
    seed = 2
    (item,) = htfllib.REFERENCE_METHODS[method].server_items
    ours = our_server_batches(method, config, seed, monkeypatch)
    write_stand_in(tmp_path / "ref" / "system", UPLOADS_MAIN, build=False)

    def run(out):
        result = htfllib.run_reference(tmp_path / "ref", config, method, seed, stand_in_partitions, out)
        log = (out / f"reference-seed-{seed}.log").read_text()
        rounds = [json.loads(line) for line in re.findall(r"^stand-in: round (.*)$", log, re.M)]
        return result, log, rounds

    paired, log, rounds = run(tmp_path / "paired")
    server = pairing.server_initial_state({**config, "seed": seed}, item)
    own, stored = re.search(rf"^stand-in: server {item} (\w+) (\w+)$", log, re.M).groups()
    assert stored == pairing.states_digest([server]) != own and paired["server_pairing"] == {item: "paired"}
    assert [batch for _, batches in rounds for batch in batches] == ours
    assert any(uploads != sorted(uploads) for uploads, _ in rounds)  # HtFLlib's own row order, not ours
    assert f"CROSSCHECK_SERVER_ORDER=server{method[3:]} " in paired["command"]
    assert htfllib.pairing(method, [paired]) == (
        f"{htfllib.PAIRED}; {htfllib.PAIRED_SERVER.format(item=item)}; {htfllib.PAIRED_ORDER}",
        "",
    )
    ref = htfllib.REFERENCE_METHODS[method]
    monkeypatch.setitem(htfllib.REFERENCE_METHODS, method, dataclasses.replace(ref, server_order=""))
    _, log, rounds = run(tmp_path / "unpaired")
    assert [batch for _, batches in rounds for batch in batches] != ours
    with pytest.raises(RuntimeError, match=rf"never built a DataLoader of flcore.servers.{ref.server_order}"):
        htfllib.read_reference_run(log, 0, seed, 3, 3, tmp_path, (item,), ref.server_order)


#: a stand-in ``main.py`` whose server stores FedGen's two modules as HtFLlib's ``servergen.py`` does: a
#: ``Generator`` of its own draw (``fc1`` = Linear, BatchNorm1d, ReLU; ``fc`` = Linear) as ``generative_model``,
#: then client 0's head as ``head``; it prints the digest of each as stored
FEDGEN_MAIN = """
import argparse, torch
from torch import nn
from bench.crosscheck_pairing import states_digest
from flcore.clients.clientbase import Client, load_item, save_item
from flcore.servers.serverbase import Server
p = argparse.ArgumentParser()
for flag in ("-nc", "-gr", "-ncl", "-fd", "-nd", "-hd"):
    p.add_argument(flag, type=int)
args, _ = p.parse_known_args()
args.global_rounds = args.gr
server = Server(args, 0)
server.clients = [Client(args, id=i) for i in range(args.nc)]
generator = nn.Module()
generator.fc1 = nn.Sequential(nn.Linear(args.nd + args.ncl, args.hd), nn.BatchNorm1d(args.hd), nn.ReLU())
generator.fc = nn.Linear(args.hd, args.fd)
save_item(generator, "Server", "generative_model", server.save_folder_name)
save_item(load_item("Client_0", "model", server.save_folder_name).head, "Server", "head", server.save_folder_name)
for name in ("generative_model", "head"):
    stored = states_digest([load_item("Server", name, server.save_folder_name).state_dict()])
    print("stand-in: server", name, stored, flush=True)
print("Running time: 0th")
server.train()
"""


def test_fedgens_server_head_and_generator_are_both_ours_through_the_bootstrap(tmp_path, stand_in_partitions):
    """Through the bootstrap, HtFLlib's FedGen server (a stand-in) stores our server's initial head and
    our initial generator, each under its own name, and the report's paired list names both."""
    config = stand_in_config(**{"method": "fedgen", "fedgen.noise-dim": 4, "fedgen.hidden-dim": 6})
    write_stand_in(tmp_path / "ref" / "system", FEDGEN_MAIN, build=False)
    seed = 1
    run = htfllib.run_reference(tmp_path / "ref", config, "fedgen", seed, stand_in_partitions, tmp_path / "cc")
    log = (tmp_path / "cc" / f"reference-seed-{seed}.log").read_text()
    for item in ("generative_model", "head"):
        ours = pairing.server_initial_state({**config, "seed": seed}, item)
        assert re.findall(rf"^stand-in: server {item} (\w+)$", log, re.M) == [pairing.states_digest([ours])]
    assert run["server_pairing"] == {"head": "paired", "generative_model": "paired"}
    assert "CROSSCHECK_SERVER_ITEMS=head,generative_model " in run["command"]
    assert htfllib.pairing("fedgen", [run])[0] == "; ".join(
        [htfllib.PAIRED, *(htfllib.PAIRED_SERVER.format(item=i) for i in ("head", "generative_model"))]
    )


#: a stand-in ``main.py`` whose server runs HtFLlib's round loop: each iteration selects the clients
#: (numpy's order), prints its round number and an "accuracy" of every stored model and of its own
#: state, moves each selected client's stored model by torch's draws in that order, and prints a
#: draw of Python's generator as FedTGP's ``max_gap`` and the iteration's "seconds" as HtFLlib's servers
#: print them. Its server stores FedTGP's prototypes and trains on the clients' uploads
#: (:data:`STAND_IN_UPLOAD_SERVER`, 2 epochs of batches of 3), and the next round's "accuracy" also tells
#: that batch order; ``$STAND_IN_KILL_AT`` kills the process
#: (SIGKILL, nothing flushed or cleaned) in that iteration's training
RESUMABLE_MAIN = """
import argparse, os, random, signal, torch
from flcore.clients.clientbase import Client, load_item, save_item
from flcore.servers.serverbase import Server
from flcore.servers.servertgp import store_server_item, train_on_uploads, upload

class StandIn(Server):
    def __init__(self, args, times):
        super().__init__(args, times)
        self.clients = [Client(args, id=i) for i in range(args.nc)]
        store_server_item(self, args)
        self.orders, self.batch_order = [], 0.0

    def train(self):
        for i in range(self.global_rounds + 1):
            self.selected_clients = self.select_clients()
            print(f"\\n-------------Round number: {i}-------------")
            models = [load_item(c.role, "model", c.save_folder_name) for c in self.clients]
            total = sum(float(p.abs().sum()) for m in models for p in m.parameters())
            print(f"Averaged Test Accuracy: {total % 1 / 2 + len(self.orders) / 100 + self.batch_order:.6f}")
            for c in self.selected_clients:
                if os.environ.get("STAND_IN_KILL_AT") == str(i) and c is self.selected_clients[-1]:
                    os.kill(os.getpid(), signal.SIGKILL)
                model = load_item(c.role, "model", c.save_folder_name)
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(torch.randn_like(p))
                save_item(model, c.role, "model", c.save_folder_name)
            # the classes by the iterations done (the state), not by i, which a resumed launch counts from 0
            upload(self.clients, lambda c: [k for k in range(4) if (k + c + len(self.orders)) % 3])
            _, batches = train_on_uploads(self, 2, 3)
            rows = [100 * c + k for batch in batches for c, k in batch]
            self.batch_order = sum(j * row for j, row in enumerate(rows)) % 997 / 1e6
            self.orders.append([c.id for c in self.selected_clients])
            print(f"max_gap tensor({random.random():.6f})")
            print("-" * 50, 0.25 * len(self.orders))

p = argparse.ArgumentParser()
for flag in ("-nc", "-gr", "-ncl", "-fd"):
    p.add_argument(flag, type=int)
p.add_argument("-algo")
args, _ = p.parse_known_args()
args.global_rounds = args.gr
print("\\n============= Running time: 0th =============")
StandIn(args, 0).train()
"""


def test_a_stopped_reference_run_goes_on_from_its_checkpoint_as_if_never_stopped(
    tmp_path, stand_in_partitions, monkeypatch
):
    """Through the real bootstrap: a FedTGP run killed in iteration 2's training (SIGKILL: nothing
    flushed or cleaned up) fails, and the next call goes on from the checkpoint of iteration 2's start
    (the store, the server's state, every generator, the paired batch order's too) to the same curve and
    ``max_gap`` as a run never
    stopped, over two launches; the checkpoint is gone once the run is kept."""
    monkeypatch.setattr(htfllib, "CHECKPOINT_SECONDS", 0.0)  # every iteration
    run = functools.partial(
        run_stand_in_reference, partitions=stand_in_partitions, main=RESUMABLE_MAIN, seed=1, method="fedtgp"
    )
    whole = run(tmp_path / "whole", build=False)
    monkeypatch.setenv("STAND_IN_KILL_AT", "2")
    with pytest.raises(RuntimeError, match="exit code -9"):
        run(tmp_path / "stopped", build=False)
    out = tmp_path / "stopped" / "cc" / "fedtgp"
    progress = json.loads((out / "reference-seed-1.checkpoint" / "progress.json").read_text())
    assert progress["iterations"] == 2 and progress["launches"] == 1
    monkeypatch.delenv("STAND_IN_KILL_AT")
    resumed = run(tmp_path / "stopped", build=False)
    assert len(set(whole["curve"])) == 3 and None not in whole["max_gap"]
    assert resumed["curve"] == whole["curve"] and resumed["max_gap"] == whole["max_gap"]
    assert resumed["initial"] == whole["initial"] and resumed["launches"] == 2 and whole["launches"] == 1
    assert resumed["iteration_seconds"] == whole["iteration_seconds"] == [0.25, 0.5, 0.75, 1.0]
    assert "crosscheck: resumed at iteration 2 (launch 2)" in (out / "reference-seed-1.log").read_text()
    assert sorted(p.name for p in out.iterdir()) == ["reference-seed-1.json", "reference-seed-1.log"]


def test_a_checkpoint_of_another_run_is_not_resumed(tmp_path):
    """A checkpoint is resumed only for the identity its run recorded, and only while its log holds
    what that run printed; a stop between the renames of its replacement keeps the one before."""
    checkpoint, log = tmp_path / "reference-seed-0.checkpoint", tmp_path / "reference-seed-0.log"
    identity = {"command": "python main.py -lr 0.01", "commit": "c", "content_digest": "d", "initial_digest": "i"}
    assert htfllib.resume_point(checkpoint, identity, log) is None  # nothing yet: records the identity
    old = Path(f"{checkpoint}.old")
    old.mkdir()
    progress = {"iterations": 4, "log_offset": 6, "launches": 1, "wall_seconds": 9.0, "cpu_seconds": 8.0}
    (old / "progress.json").write_text(json.dumps(progress))
    log.write_text("round\nlost\n")
    assert htfllib.resume_point(checkpoint, identity, log) == progress
    assert log.read_text() == "round\ncrosscheck: resumed at iteration 4 (launch 2)\n"
    assert htfllib.resume_point(checkpoint, {**identity, "command": "python main.py -lr 0.02"}, log) is None
    assert not checkpoint.exists() and not old.exists()
    assert json.loads(Path(f"{checkpoint}.json").read_text())["command"].endswith("0.02")


def test_a_resumed_log_reads_as_one_launch():
    """The repetition line the new launch prints again is left out and its rounds are shifted."""
    text = "Running time: 0th\nRound number: 0\nRound number: 1\ncrosscheck: resumed at iteration 2 (launch 2)\n"
    text += "Running time: 0th\nRound number: 0\nAveraged Test Accuracy: 0.5\n"
    assert htfllib.continued_log(text).splitlines()[3:] == [
        "crosscheck: resumed at iteration 2 (launch 2)",
        "Round number: 2",
        "Averaged Test Accuracy: 0.5",
    ]
    assert htfllib.parse_reference_log(htfllib.continued_log(text)) == [{2: 0.5}]
    assert htfllib.continued_log("Round number: 3") == "Round number: 3\n"


#: a bootstrap without PyTorch for the tests of how a run's end is read: it prints the line
#: :data:`bench.htfllib.BOOTSTRAP` prints for each of the ``-nc`` clients it pairs, and those for the
#: server's item and batch order where the run has them, then runs
#: ``main.py`` as that one does (its pairing and seeding: the tests on :func:`bootstrapped`)
LIGHT_BOOTSTRAP = """
import os, sys
sys.argv = sys.argv[1:]
for i in range(int(sys.argv[sys.argv.index("-nc") + 1])):
    print(f"crosscheck: client {i} paired (stand-in)", flush=True)
for item in filter(None, os.environ.get("CROSSCHECK_SERVER_ITEMS", "").split(",")):
    print(f"crosscheck: server {item} paired", flush=True)
if os.environ.get("CROSSCHECK_SERVER_ORDER"):
    print("crosscheck: server batch order paired (stand-in)", flush=True)
exec(compile(open("main.py").read(), "main.py", "exec"), {"__name__": "__main__", "__file__": "main.py"})
"""


@pytest.fixture
def run_light(tmp_path, stand_in_partitions, monkeypatch):
    """:func:`run_stand_in_reference` through :data:`LIGHT_BOOTSTRAP` (a main.py that builds no client):
    ``run_light(main, seed, method)``, a fraction of a second each."""
    monkeypatch.setattr(htfllib, "BOOTSTRAP", LIGHT_BOOTSTRAP)
    return lambda main, seed, method: run_stand_in_reference(
        tmp_path, stand_in_partitions, main, seed, method, build=False
    )


def test_a_reference_whose_models_diverge_is_a_result_and_another_failure_is_not(run_light):
    """HtFLlib stops on NaN outputs (scikit-learn's "Input contains NaN" in its evaluation): the curve
    keeps the rounds printed, None after, and names the round; any other early exit raises."""
    main = """
    import sys
    print("Running time: 0th")
    for r in range(2):
        print(f"Round number: {r}")
        print("Averaged Test Accuracy: 0.3")
    print("Round number: 2")
    raise SystemExit("ValueError: Input contains NaN.")
    """
    run = run_light(main, 0, "fd")
    assert run["curve"] == [0.3, None, None] and run["diverged_round"] == 2
    infinite = "Input contains infinity or a value too large for dtype('float32')."
    assert run_light(main.replace("Input contains NaN.", infinite), 2, "fd")["diverged_round"] == 2
    with pytest.raises(RuntimeError, match="exit code 1"):
        run_light(main.replace("Input contains NaN.", "CUDA out of memory"), 1, "fd")


def test_a_reference_that_prints_a_nonfinite_loss_and_goes_on_has_diverged_from_the_next_round(run_light):
    """FedTGP's server prints ``Server loss: nan`` and HtFLlib goes on, printing chance accuracy of
    NaN models with exit code 0: the curve stops at the round that printed it."""
    main = """
    print("Running time: 0th")
    for r in range(4):
        print(f"Round number: {r}")
        print(f"Averaged Test Accuracy: {0.3 if r < 2 else 0.0999}")
        print(f"Server loss: {float('nan') if r >= 1 else 2.5}")
    """
    run = run_light(main, 0, "fedtgp")
    assert run["curve"] == [0.3, None, None] and run["diverged_round"] == 2
    assert run_light(main.replace("float('nan')", "float('inf')"), 1, "fedtgp")["diverged_round"] == 2
    run = run_light(main.replace("float('nan')", "7.25"), 2, "fedtgp")
    assert run["curve"] == [0.3, 0.0999, 0.0999] and run["diverged_round"] is None


def test_a_reference_that_ends_with_another_error_after_a_nonfinite_loss_is_refused(run_light, tmp_path):
    """A printed NaN loss before a crash of another cause (here out of memory) is no divergence result."""
    main = """
    print("Running time: 0th")
    for r in range(2):
        print(f"Round number: {r}")
        print("Averaged Test Accuracy: 0.3")
        print("Server loss: nan")
    raise MemoryError("out of memory")
    """
    with pytest.raises(RuntimeError, match="exit code 1"):
        run_light(main, 0, "fedtgp")
    assert not (tmp_path / "cc" / "fedtgp" / "reference-seed-0.json").exists()
    nan_then_crash = main.replace('raise MemoryError("out of memory")', 'raise ValueError("Input contains NaN.")')
    assert run_light(nan_then_crash, 0, "fedtgp")["diverged_round"] == 1


def test_fedgh_is_compared_on_the_model_htflib_evaluates_when_ours_reports_it():
    config = small_config(method="fedgh")
    assert htfllib.compared_metric(config, "fedgh") == "accuracy_weighted"  # our primary metric
    on = {**config, "fedgh.eval-global-head": True}
    assert htfllib.compared_metric(on, "fedgh") == "accuracy_weighted_global_head"
    assert htfllib.compared_metric(on, "fedproto") == "accuracy_weighted"
    assert not htfllib.evaluates_as_reference(config, "fedgh") and htfllib.evaluates_as_reference(on, "fedgh")
    mrl = {**config, "fedmrl.eval-protocol": "deployment"}  # a non-boolean option: compared by value
    assert not htfllib.evaluates_as_reference(config, "fedmrl") and htfllib.evaluates_as_reference(mrl, "fedmrl")
    assert htfllib.compared_metric(mrl, "fedmrl") == "accuracy_weighted"


def test_a_finished_run_is_reused_only_for_the_same_config(tmp_path, monkeypatch):
    """Ours: a completed seed is reused when the whole run config is the same, and run again when the
    preset's content, an override or the runner changed (a stale curve must not stand for another config)."""
    calls = []

    def fake_run(cmd, cwd, log, env=None):
        out = Path(json.loads(cmd[-1].split("output-dir=", 1)[1]))
        calls.append(cmd)
        run = out / f"run-{len(calls)}"
        run.mkdir(parents=True)
        (run / "summary.json").write_text(json.dumps({"status": "completed"}))
        rounds = int(re.search(r"num-server-rounds=(\d+)", " ".join(cmd)).group(1))
        rows = [
            {"round": r, "accuracy_weighted": 0.5, "accuracy_weighted_global_head": 0.25} for r in range(1, rounds + 1)
        ]
        (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        return Measured(0, 1.0, 1.0, 2**30, {})

    monkeypatch.setattr(our_side, "run_measured", fake_run)
    monkeypatch.setattr(our_side, "read_summary", lambda folder: json.loads((folder / "summary.json").read_text()))
    preset = tmp_path / "preset.toml"
    preset.write_text('method = "fedproto"\nbatch-order = "fixed"\n')
    out = tmp_path / "seed-0"
    first = our_side.run_ours(["num-server-rounds=1"], str(preset), 0, out)
    assert our_side.run_ours(["num-server-rounds=1"], str(preset), 0, out) == first and len(calls) == 1
    assert first["curve"] == [0.5] and first["metric"] == "accuracy_weighted"
    other = our_side.run_ours(["num-server-rounds=1"], str(preset), 0, out, "accuracy_weighted_global_head")
    assert other["curve"] == [0.25] and len(calls) == 1  # another row key of the same run: read, not run
    preset.write_text('method = "fedproto"\nbatch-order = "shuffle"\n')  # the preset changed
    assert our_side.run_ours(["num-server-rounds=1"], str(preset), 0, out)["config"]["batch-order"] == "shuffle"
    our_side.run_ours(["num-server-rounds=2"], str(preset), 0, out)  # an override changed
    assert len(calls) == 3
    # the same config through the in-process grid is another run: run, with no CPUs per client to give
    inprocess = our_side.run_ours(["num-server-rounds=2"], str(preset), 0, out, runner="tools.inprocess")
    assert len(calls) == 4 and inprocess["runner"] == "tools.inprocess"
    assert calls[-1][1:3] == ["-m", "tools.inprocess"] and "--cpus-per-client" not in calls[-1]
    assert our_side.run_ours(["num-server-rounds=2"], str(preset), 0, out, runner="tools.inprocess") == inprocess
    assert len(calls) == 4
    with pytest.raises(ValueError, match="runner 'flwr': allowed tools.run, tools.inprocess"):
        our_side.run_ours(["num-server-rounds=2"], str(preset), 0, out, runner="flwr")


class FedAvgCNNShaped(nn.Module):
    """HtFLlib's FedAvgCNN as its ``BaseHeadSplit`` holds it: ``conv1``, ``conv2``, ``fc1`` blocks, its
    classifier ``fc`` replaced by ``AdaptiveAvgPool1d(512)``; ``dim`` = the flattened conv output."""

    def __init__(self, channels: int, dim: int) -> None:
        super().__init__()
        self.conv1 = nn.Sequential(nn.Conv2d(channels, 32, 5), nn.ReLU(), nn.MaxPool2d(2))
        self.conv2 = nn.Sequential(nn.Conv2d(32, 64, 5), nn.ReLU(), nn.MaxPool2d(2))
        self.fc1 = nn.Sequential(nn.Linear(dim, 512), nn.ReLU())
        self.fc = nn.AdaptiveAvgPool1d(512)

    def forward(self, x):
        return self.fc(self.fc1(torch.flatten(self.conv2(self.conv1(x)), 1)))


class SplitShaped(nn.Module):
    """HtFLlib's ``BaseHeadSplit``: ``base`` then ``head`` = ``Linear(512, C)``."""

    def __init__(self, base: nn.Module, num_classes: int) -> None:
        super().__init__()
        self.base, self.head = base, nn.Linear(512, num_classes)

    def forward(self, x):
        return self.head(self.base(x))


def reference_shaped(arch: str, dim: int = 1600) -> nn.Module:
    """A reference-shaped CIFAR-10 client model of ``arch`` (torchvision's ResNet-18 with its 10-class
    layer replaced by the pooling, as ``BaseHeadSplit`` does)."""
    if arch == "fedavgcnn":
        return SplitShaped(FedAvgCNNShaped(3, dim), 10)
    base = torchvision.models.resnet18(num_classes=10)
    base.fc = nn.AdaptiveAvgPool1d(512)
    return SplitShaped(base, 10)


def test_our_initial_models_map_exactly_onto_reference_shaped_models(tmp_path):
    """Client i's initial model is our client's (the group's build for the seed and init); exported into
    a reference-shaped model of its architecture it computes the same logits bit for bit, and read back
    it is the same state; another architecture or input size fails naming the first mismatch."""
    config = small_config(seed=7)  # htfe2, init identical: FedAvgCNN, ResNet-18, FedAvgCNN
    states = pairing.initial_states(config)
    x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    for i, arch in enumerate(("fedavgcnn", "resnet18")):
        ours = MODEL_GROUPS["htfe2"].build(i, 10, 3, 32, 7, 512, identical=True).eval()
        assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), states[i].values(), strict=True))
        theirs = reference_shaped(arch).eval()
        assert not torch.equal(theirs(x), ours(x))  # its own draws
        theirs.load_state_dict(pairing.paired_state(states[i], theirs.state_dict(), f"client {i}"))
        with torch.no_grad():
            assert torch.equal(theirs(x), ours(x))
        back = pairing.paired_state(theirs.state_dict(), ours.state_dict(), "back")
        assert list(back) == list(states[i])
        assert all(torch.equal(back[k], v) for k, v in states[i].items())
    assert pairing.states_digest([states[0]]) == pairing.states_digest([states[2]])  # identical init
    pairing.save_initial_states(config, tmp_path / "initial.pt")
    saved = torch.load(tmp_path / "initial.pt", weights_only=True)
    assert pairing.states_digest(saved) == pairing.states_digest(states)
    assert saved[0]["head.weight"].data_ptr() == saved[2]["head.weight"].data_ptr()  # stored once
    independent = pairing.initial_states({**config, "init": "independent"})
    assert pairing.states_digest([independent[0]]) != pairing.states_digest([independent[2]])
    with pytest.raises(ValueError, match=r"client 0: tensor 4 differs: ours extractor\.0\.7\.weight \(512, 1600\)"):
        pairing.paired_state(states[0], reference_shaped("fedavgcnn", dim=1024).state_dict(), "client 0")  # 28x28
    with pytest.raises(ValueError, match="ours has 8 tensors, the reference's model 122"):
        pairing.paired_state(states[0], reference_shaped("resnet18").state_dict(), "client 0")


def fake_ours(rows_of, log_text: str = ""):
    """A ``run_measured`` for ``run_ours``: writes a run folder ``completed`` with ``rows_of(rounds)`` (None:
    no run folder; ``log_text`` in the log instead), exit code 0 (1 without a folder)."""
    calls = []

    def run(cmd, cwd, log, env=None):
        calls.append(env)
        out = Path(json.loads(cmd[-1].split("output-dir=", 1)[1]))
        rounds = int(re.search(r"num-server-rounds=(\d+)", " ".join(cmd)).group(1))
        log.write_text(log_text)
        rows = rows_of(rounds)
        if rows is None:
            return Measured(1, 1.0, 1.0, 2**30, {})
        folder = out / f"run-{len(list(out.glob('run-*'))) + 1}"
        folder.mkdir(parents=True)
        (folder / "summary.json").write_text(json.dumps({"status": "completed", "error": None}))
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return Measured(0, 1.0, 1.0, 2**30, {})

    return run, calls


def good_row(r: int) -> dict:
    return {"round": r, "num_clients": 2, "untrained": False, "dropped_clients": [], "accuracy_weighted": 0.5,
            "accuracy_per_client": {"0": 0.5, "1": 0.5}}  # fmt: skip


def test_a_crashed_run_of_ours_is_refused_and_not_kept(tmp_path, monkeypatch):
    """A simulation whose Ray node crashed ends ``completed`` with its last rounds untrained: refused with
    the clients' errors, never cached as a result (nor as diverged); a good run is kept; ours runs with
    our clients' thread count."""
    preset = tmp_path / "preset.toml"
    preset.write_text('method = "local"\nnum-clients = 2\n')
    monkeypatch.setattr(our_side, "read_summary", lambda folder: json.loads((folder / "summary.json").read_text()))
    crashed = lambda n: [  # noqa: E731
        *(good_row(r) for r in range(1, 5)),
        *({"round": r, "num_clients": 0, "untrained": True, "dropped_clients": [0, 1], "accuracy_weighted": None,
           "client_errors": ["RayActorError: the actor died unexpectedly"]} for r in range(5, n + 1)),
    ]  # fmt: skip
    run, calls = fake_ours(crashed)
    monkeypatch.setattr(our_side, "run_measured", run)
    out = tmp_path / "seed-0"
    with pytest.raises(RuntimeError, match=r"refused: round 5: no client trained \(RayActorError: the actor died"):
        our_side.run_ours(["num-server-rounds=6"], str(preset), 0, out)
    assert not (out / "ours.json").exists() and calls[0]["OMP_NUM_THREADS"] == str(pairing.CLIENT_THREADS)
    dropped = lambda n: [good_row(1), {**good_row(2), "dropped_clients": [1]}]  # noqa: E731
    monkeypatch.setattr(our_side, "run_measured", fake_ours(dropped)[0])
    with pytest.raises(RuntimeError, match=r"round 2: no valid reply from clients \[1\]"):
        our_side.run_ours(["num-server-rounds=2"], str(preset), 0, out)
    short = lambda n: [good_row(1), {**good_row(2), "accuracy_per_client": {"0": 0.5}}]  # noqa: E731
    monkeypatch.setattr(our_side, "run_measured", fake_ours(short)[0])
    with pytest.raises(RuntimeError, match="round 2: 1 of 2 clients evaluated"):
        our_side.run_ours(["num-server-rounds=2"], str(preset), 0, out)
    run, calls = fake_ours(lambda n: [good_row(r) for r in range(1, n + 1)])
    monkeypatch.setattr(our_side, "run_measured", run)
    assert our_side.run_ours(["num-server-rounds=2"], str(preset), 0, out)["curve"] == [0.5, 0.5]
    assert (out / "ours.json").exists() and len(calls) == 1
    kept = json.loads((out / "ours.json").read_text())
    rows = Path(kept["folder"]) / "metrics.jsonl"
    rows.write_text(rows.read_text().replace('"untrained": false', '"untrained": true'))  # a kept run gone bad
    our_side.run_ours(["num-server-rounds=2"], str(preset), 0, out)
    assert len(calls) == 2  # run again, not reused


def test_a_run_of_ours_without_a_run_folder_says_why_from_its_logs(tmp_path, monkeypatch):
    superlink = tmp_path / "superlink.log"
    superlink.write_text("INFO : starting\nERROR :     [Errno 98] Address already in use\n")
    log = f"error: flower-superlink exited with 1; see {superlink}\nthe SuperLink's log: {superlink}\n"
    monkeypatch.setattr(our_side, "run_measured", fake_ours(lambda n: None, log)[0])
    preset = tmp_path / "preset.toml"
    preset.write_text('method = "local"\n')
    with pytest.raises(RuntimeError) as caught:
        our_side.run_ours(["num-server-rounds=1"], str(preset), 0, tmp_path / "seed-0")
    message = str(caught.value)
    assert (
        "flower-superlink exited with 1" in message and "SuperLink: ERROR :     [Errno 98] Address already" in message
    )
    assert "None" not in message


def test_verdict_identical_within_spread_or_apart():
    v = crosscheck_report.verdict([[0.12345678, 0.5]], [[0.1235, 0.5]])  # HtFLlib's 4 decimals
    assert v["verdict"] == "identical"
    one = crosscheck_report.verdict([[0.1234, 0.5]], [[0.1236, 0.5]])  # one seed: any difference is apart
    assert one["verdict"] == "apart" and one["largest_paired_gap"] == pytest.approx(-0.0002) and one["round"] == 1
    spread = crosscheck_report.verdict([[0.4, 0.6], [0.6, 0.4]], [[0.45, 0.5], [0.55, 0.5]])
    assert spread["verdict"] == "within seed spread" and spread["seed_index"] == 0 and spread["round"] == 2
    apart = crosscheck_report.verdict([[0.4, 0.6], [0.6, 0.62]], [[0.45, 0.5], [0.55, 0.5]])
    assert apart["verdict"] == "apart" and apart["largest_paired_gap"] == pytest.approx(0.12)
    assert crosscheck_report.verdict([[0.3, None]], [[0.3, None]])["verdict"] == "identical"  # both diverged there
    assert crosscheck_report.verdict([[0.3, 0.3]], [[0.3, None]])["verdict"] == "apart"


def test_the_report_keeps_earlier_methods_and_says_the_settings_as_run(tmp_path, monkeypatch):
    """``--methods local`` then ``--methods fedgh`` into one folder: one report with both, the rounds and
    stop-patience run (not the preset's 1000 and 100), the pooled test set and one image in %, the
    threads, what the timing leaves out (our partition cache, filled first), a verdict per method and what
    is not paired; ``--in-process`` runs ours through ``tools.inprocess`` and the header says so."""
    runners = {}

    def reference(ref, config, method, seed, partitions, out, threads=1):
        curve = [0.1 * r for r in range(1, config["num-server-rounds"] + 1)]
        took = {item: "paired" for item in htfllib.REFERENCE_METHODS[method].server_items} or None
        return {"curve": curve, "initial": 0.1, "diverged_round": None, "server_pairing": took, "command": "main.py",
                "wall_seconds": 1, "cpu_seconds": 1}  # fmt: skip

    def ours(items, preset, seed, out, metric, runner):
        config, _ = read_config(preset, items)
        runners[config["method"]] = runner
        # our clients' partitions were decoded before ours is timed, as HtFLlib's files were written
        assert len([f for f in cache.rglob("*") if f.is_file()]) >= config["num-clients"]
        shift = 0.01 if config["method"] == "fedgh" else 0.0  # 1 and 2 points in rounds 2 and 3
        curve = [0.1 * r + shift * (r - 1) for r in range(1, config["num-server-rounds"] + 1)]
        return {"curve": curve, "metric": metric, "command": "tools.run", "wall_seconds": 1, "cpu_seconds": 1}

    cache = tmp_path / "xdg" / "mheterofl" / "partitions"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(crosscheck, "run_reference", reference)
    monkeypatch.setattr(crosscheck, "run_ours", ours)
    ref = tmp_path / "ref"
    (ref / "system").mkdir(parents=True)
    (ref / "system" / "main.py").write_text("")
    common = [
        "--reference",
        str(ref),
        "--preset",
        str(PRESET),
        "--seeds",
        "0",
        "--rounds",
        "3",
        "--out",
        str(tmp_path / "cc"),
    ]
    common += ["-c", f"num-clients=3 max-examples-per-client=40 data-dir={json.dumps(str(DATA_DIR))}"]
    common += ["-c", "fedgh.eval-global-head=true"]
    assert crosscheck.main([*common, "--methods", "local"]) == 0
    assert "each ClientApp's Ray actor has 1 CPU" in (tmp_path / "cc" / "report.md").read_text()
    assert crosscheck.main([*common, "--methods", "fedgh", "--in-process"]) == 0
    assert runners == {"local": "tools.run", "fedgh": "tools.inprocess"}
    report = (tmp_path / "cc" / "report.md").read_text()
    assert "(ours: `tools.inprocess`, one process running the clients one after another" in report
    assert "| local | identical |" in report and "| fedgh | apart: +2.00 (seed 0, round 3) |" in report
    assert "`num-server-rounds = 3`" in report and "`stop-patience = 0`" in report and "1000" not in report
    tests = sum(json.loads((tmp_path / "cc" / "partitions" / "config.json").read_text())["test_examples"])
    assert f"Test set: {tests} examples pooled" in report and f"one test image is {100 / tests:.4g} %" in report
    assert "Torch threads per client: 1 on both sides" in report
    assert f"Wall and CPU seconds: the runs alone, {crosscheck.CACHED_BEFORE_TIMING}." in report
    assert "Models: ours `htfe2` as HtFLlib's `HtFE-img-2`." in report
    assert "run by an earlier call" in report.split("## local")[1] and "## fedgh" in report
    assert "not paired: nothing" in report.split("## local")[1].split("##")[0]
    fedgh = report.split("## fedgh")[1]
    paired = fedgh.split("- paired:")[1].split("\n")[0]
    assert htfllib.PAIRED_SERVER.format(item="head") in paired and paired.endswith(htfllib.PAIRED_ORDER)
    assert "- not paired: nothing" in fedgh
    # options HtFLlib has no flag for: at its code's value listed as such, otherwise as not expressible
    as_code = fedgh.split("- set as HtFLlib's code does, which has no flag for them: ")[1].split("\n")[0]
    unexpressed = fedgh.split("- not expressible in HtFLlib (ours as run; see docs/methods): ")[1].split("\n")[0]
    assert as_code == "`eval-global-head` = True"
    assert unexpressed == "`server-mode` = 'per-lar', `server-clip-norm` = 50.0"


def test_fedtgp_max_gap_is_read_per_round_of_ours():
    """servertgp.py prints max_gap after iteration i's training: the margin of our round i + 1."""
    log = textwrap.dedent(
        """
        ============= Running time: 0th =============
        -------------Round number: 0-------------
        Averaged Test Accuracy: 0.1000
        max_gap tensor(0.3668)
        Server loss: 2.1
        -------------Round number: 1-------------
        Averaged Test Accuracy: 0.5000
        max_gap tensor(4.1700, device='cuda:0')
        -------------Round number: 2-------------
        max_gap tensor(nan)
        Server loss: nan
        """
    )
    assert htfllib.parse_max_gap(log, 4) == [0.3668, 4.17, None, None]


def test_reference_only_runs_htflib_alone_and_compares_nothing(tmp_path, monkeypatch, capsys):
    calls = []

    def reference(ref, config, method, seed, partitions, out, threads=1):
        calls.append((method, seed, config["num-server-rounds"]))
        return {"curve": [0.3, 0.5, None], "diverged_round": 3}

    def ours(*args, **kwargs):
        raise AssertionError("ours must not run")

    monkeypatch.setattr(crosscheck, "run_reference", reference)
    monkeypatch.setattr(crosscheck, "run_ours", ours)
    ref = tmp_path / "ref"
    (ref / "system").mkdir(parents=True)
    (ref / "system" / "main.py").write_text("")
    argv = ["--reference", str(ref), "--preset", str(PRESET), "--seeds", "1,2", "--rounds", "3", "--methods"]
    argv += ["fedtgp", "--out", str(tmp_path / "cc"), "--reference-only"]
    argv += ["-c", f"num-clients=3 max-examples-per-client=40 data-dir={json.dumps(str(DATA_DIR))}"]
    assert crosscheck.main(argv) == 0
    assert calls == [("fedtgp", 1, 3), ("fedtgp", 2, 3)]
    assert (
        "fedtgp, seed 2: HtFLlib best 50.00 % (round 2), round 2 50.00 %, diverged from round 3"
        in capsys.readouterr().out
    )
    assert not (tmp_path / "cc" / "report.md").exists()


#: a stand-in for an older HtFLlib fork (lokinko/FedSA's): the classes as ``-nb`` (no ``-ncl``), its image families
#: named without "-img-" ("HtFE2"), a server module whose client has a syntax error, ``mmcv``'s
#: ``build_norm_layer`` for a "SyncBN", and the fork's "Accurancy" in its log lines; each round prints the class
#: count / 100, plus 0.1 for the family it was given, plus the batch norm's output's absolute sum / 1000
FORK_MAIN = """
import argparse, torch
from flcore.servers.serversyntax import Broken
from mmcv.cnn import build_norm_layer
def family(args):
    for _ in range(1):
        if args.model_family == "HtFE2":
            return 0.1
        else:
            raise NotImplementedError
p = argparse.ArgumentParser()
p.add_argument("-nb", type=int); p.add_argument("-gr", type=int); p.add_argument("-m", dest="model_family")
args, rest = p.parse_known_args()
assert "-ncl" not in rest, rest
name, norm = build_norm_layer({"type": "SyncBN", "requires_grad": True}, 4)
out = norm.train()(torch.arange(8.0).reshape(2, 4))
print("Running time: 0th")
for r in range(args.gr + 1):
    print(f"Round number: {r}")
    print(f"Averaged Test Accurancy: {args.nb / 100 + family(args) + float(out.abs().sum()) / 1000:.4f}")
"""


def test_an_older_fork_runs_through_the_bootstrap(stand_in_partitions, tmp_path):
    system = tmp_path / "ref" / "system"
    write_stand_in(system, FORK_MAIN)
    (system / "flcore" / "servers" / "serversyntax.py").write_text("x = len(a _list)\n")
    config = stand_in_config(**{"model-group": "htfe2"})  # HtFLlib's HtFE-img-2
    run = htfllib.run_reference(tmp_path / "ref", config, "fd", 0, stand_in_partitions, tmp_path / "cc" / "fd")
    # 10 classes, the family's 0.1, a batch of 2 normalised per feature: every entry ±1, 8 of them
    assert run["curve"] == pytest.approx([0.208] * 3, abs=1e-4)
