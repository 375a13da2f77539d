"""TsingZ0/HtFLlib as the cross-check's reference: how our run config and methods map onto its
``main.py`` (:data:`FAMILIES`, :data:`REFERENCE_METHODS`, :data:`REFERENCE_RECIPE`,
:func:`reference_command`; :func:`check_expressible` refuses what it cannot follow), the bootstrap that
seeds it and loads our initial models into its clients' and our server's module and batch order into
its server's (:data:`BOOTSTRAP`), and one run of it for a
training seed, read from its log (:func:`parse_reference_log`, :func:`run_reference`)."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.crosscheck_pairing import CLIENT_THREADS, save_initial_states
from bench.measure import git_head, run_measured
from bench.our_side import method_options
from bench.pfllib import PLACEHOLDER_SERVERS
from common.errors import ConfigError
from tools.runconfig import ROOT

#: our run config ``model-group`` -> HtFLlib's ``-m`` model family (same architectures in the same
#: order: client i gets architecture ``i % len(group)`` in both)
FAMILIES = {
    "htfe2": "HtFE-img-2",
    "htfe3": "HtFE-img-3",
    "htfe4": "HtFE-img-4",
    "htfe8": "HtFE-img-8",
    "htfe9": "HtFE-img-9",
    "htfe8-htc4": "HtFE-img-8-HtC-img-4",
    "res34-htc4": "Res34-HtC-img-4",
    "htcnn8": "HCNNs8",
}


#: families whose HtFLlib models compute otherwise than ours from the same weights. Ours loaded into
#: HtFLlib's models of every family (CIFAR-10, HCNNs8 on Fashion-MNIST) give the same logits bit for
#: bit but for these: HtFLlib's HtC4 ``Head`` puts a ReLU after its last Linear, on the logits
#: (``flcore/trainmodel/models.py``), ours (``linear``, ``mlp*``) does not
FAMILY_DEVIATIONS = {
    group: "HtFLlib's HtC4 heads (`Head`) end with a ReLU on the logits, ours do not: from the same "
    "weights the logits differ"
    for group in ("htfe8-htc4", "res34-htc4")
}


def restored_family(family: str, dataset: str) -> list[str] | None:
    """The model constructors (HtFLlib ``args.models`` strings) of a family HtFLlib has removed from
    ``system/main.py``, which :data:`BOOTSTRAP` puts back for the run; None for a family it still has.

    ``HCNNs8`` is FedTGP's HtCNN8 as FedTGP's own code defined it (HtFLlib commit 70cda56, "add our
    FedTGP algorithm"; removed in 3fb1596): eight of its ``CNN(num_cov, hidden_dims)`` in our
    ``htcnn1..8`` order, each of our HtCNN8 widths but the last (the 512-wide representation,
    ``feature_dim``) a hidden width. The input channels and side come from ``dataset``.
    """
    from common.datasets import DATASETS
    from models.zoo import HTCNN8

    if family != "HCNNs8":
        return None
    info = DATASETS[dataset]
    return [
        f"CNN(num_cov={convs}, hidden_dims={list(widths[:-1])}, in_features={info.channels}, "
        f"height={info.image_size}, num_classes=args.num_classes)"
        for convs, widths in HTCNN8.values()
    ]


@dataclass(frozen=True)
class ReferenceMethod:
    """How one of our methods maps onto HtFLlib.

    Every option our method declares is in exactly one of:

    - ``flags``: HtFLlib flag -> our option key (the value is passed);
    - ``tied``: our option key -> the run config key whose value HtFLlib uses for it (it has no
      flag of its own); a cross-check refuses values that differ;
    - ``unexpressed``: our options HtFLlib has no flag for; listed with their values in the report
      (the method page's deviations say what they change).

    ``as_code``: of the ``unexpressed`` options, the value of ours that does what HtFLlib's code
    hard-codes (read in its ``flcore`` client and server of the algorithm); the report lists an
    option run at that value as HtFLlib's, the others as not expressible there.

    ``reported``: where HtFLlib's printed accuracy is of another model than our default primary
    metric's, ``(our option, its value, our row key)``: with the option at that value, ours reports
    HtFLlib's model under that row key, and the cross-check compares it (:func:`compared_metric`).

    ``recipe``: run config values HtFLlib's client for this method hard-codes beyond
    :data:`REFERENCE_RECIPE` (FML and FedKD clip every model's gradient norm at 10, FedL2G at 100), or
    an option value only it can be compared at (FedL2G without warm-up rounds, which HtFLlib does not
    evaluate); ours is run with them, and the report lists them.

    ``server_items``: the names under which HtFLlib's server stores the modules our server starts from
    (``save_item(module, "Server", name, ...)``: ``head``, ``global_model``, FedTGP's ``TGP``, FedGen's
    ``head`` and ``generative_model``); the first time it stores each, :data:`BOOTSTRAP` loads ours into
    it (:func:`bench.crosscheck_pairing.server_initial_state`), or, where the architectures differ,
    leaves HtFLlib's own draw and says so; empty when our server starts from nothing.

    ``server_order``: the HtFLlib server module (``flcore.servers.<name>``) whose ``DataLoader`` over
    the round's uploads :data:`BOOTSTRAP` replaces with our server's mini-batch order
    (:class:`bench.crosscheck_pairing.ServerOrder`); "" when the server trains on no uploads.

    ``unpaired``: what starts from other random draws on the two sides although every client's
    personal model (and the server's modules of ``server_items``) is paired
    (:mod:`bench.crosscheck_pairing`): models and state HtFLlib builds beside them; "" when nothing.

    ``repository``: the reference's name in the report: ``HtFLlib``, or an HtFLlib fork that holds the method
    (FedSA's authors' ``lokinko/FedSA``), whose checkout is then the ``--reference``.

    ``resumable``: whether its server's round loop reads the iteration index only to print and
    evaluate it, so that a stopped run can go on from a checkpoint (:data:`BOOTSTRAP`); FedKD's
    (``serverkd.py``) also sets its energy schedule from it.
    """

    algorithm: str
    recipe: dict[str, Any] = field(default_factory=dict)
    flags: dict[str, str] = field(default_factory=dict)
    tied: dict[str, str] = field(default_factory=dict)
    unexpressed: tuple[str, ...] = ()
    as_code: dict[str, Any] = field(default_factory=dict)
    reported: tuple[str, Any, str] | None = None
    server_items: tuple[str, ...] = ()
    server_order: str = ""
    unpaired: str = ""
    resumable: bool = True
    repository: str = "HtFLlib"


#: what a paired cross-check pairs for every method
PAIRED = (
    "every client's initial personal model (ours, built by our client for the run config and seed, "
    "loaded into HtFLlib's client model right after HtFLlib builds it, tensor by tensor in order and shape)"
)
#: what a paired cross-check pairs for each of a method's ``server_items`` (:class:`ReferenceMethod`)
PAIRED_SERVER = (
    "the server's initial `{item}` (ours, built by our server for the run config and seed, loaded into "
    "the module HtFLlib's server stores as `Server_{item}` the first time it stores it)"
)
#: what a paired cross-check pairs for a method with a ``server_order`` (:class:`ReferenceMethod`)
PAIRED_ORDER = (
    "the server's mini-batch order over the round's uploads (HtFLlib's rows put in ours, by client and "
    "class, and each epoch's permutation drawn from our generator of `seed`, in place of its DataLoader's "
    "shuffle over its own client order)"
)


#: our method -> its HtFLlib algorithm (``-algo``) and option mapping (HtFLlib ``system/main.py`` and
#: the ``flcore`` server and client of each algorithm; the files the comments name are of HtFLlib e959261)
REFERENCE_METHODS = {
    "local": ReferenceMethod("Local"),
    # clientproto.py, clienttgp.py: nn.MSELoss() (the mean over elements) to the global prototypes
    "fedproto": ReferenceMethod(
        "FedProto", flags={"-lam": "lambda"}, unexpressed=("reg-form",), as_code={"reg-form": "mse-mean"}
    ),
    # servertgp.py: Trainable_Global_Prototypes (embedings, middle.0.0, fc) holds our generator's
    # layers in order and shape (hidden-dim is tied to feature-dim, HtFLlib's hidden width)
    "fedtgp": ReferenceMethod(
        "FedTGP",
        flags={"-lam": "lambda", "-mart": "tau", "-se": "server-epochs"},
        tied={"server-lr": "lr", "server-batch-size": "batch-size", "hidden-dim": "feature-dim"},
        unexpressed=("reg-form", "margin", "prototype-pass", "margin-freeze"),
        # servertgp.py: min(max_gap, tau) of the nearest-centre gaps, every round; clienttgp.py collects
        # the prototypes before it saves the model it has just trained (docs/methods/fedtgp.md item 15)
        as_code={
            "reg-form": "mse-mean",
            "margin": "nearest",
            "prototype-pass": "before-training",
            "margin-freeze": 0.0,
        },
        server_items=("TGP",),
        server_order="servertgp",
    ),
    # HtFLlib's FedGH and LG-FedAvg servers start from client 0's initial head (servergh.py, serverlg.py);
    # ours from a Linear(d, C) drawn from seed: paired, both start from ours
    "fedgh": ReferenceMethod(
        "FedGH",
        flags={"-slr": "server-lr", "-se": "server-epochs"},
        tied={"server-batch-size": "batch-size"},
        unexpressed=("server-mode", "server-clip-norm", "eval-global-head"),
        # servergh.py: shuffled mini-batches of the uploads, no gradient clipping
        as_code={"server-mode": "minibatch", "server-clip-norm": 0.0, "eval-global-head": True},
        # HtFLlib evaluates every client's extractor with the global head it has just been sent
        reported=("eval-global-head", True, "accuracy_weighted_global_head"),
        server_items=("head",),
        server_order="servergh",
    ),
    "lg-fedavg": ReferenceMethod(
        "LG-FedAvg",
        unexpressed=("eval-global-head",),
        as_code={"eval-global-head": True},
        reported=("eval-global-head", True, "accuracy_weighted_global_head"),
        server_items=("head",),
    ),
    # clientfd.py: the raw per-class mean logits as the target
    "fd": ReferenceMethod("FD", flags={"-lam": "lambda"}, unexpressed=("target",), as_code={"target": "logits"}),
    # clientfml.py and clientkd.py: clip_grad_norm_(..., 10) on each model ("prevent divergency"); their
    # shared model (serverfml.py, serverkd.py, servermrl.py) is client 0's: ours with shared-model (FedMRL:
    # small-model) = "group-first"
    # clientfml.py: nn.KLDivLoss() (KL / C) on targets it does not detach: ours with fml.kl-reduction = "mean"
    # and fml.detach-targets = false
    "fml": ReferenceMethod(
        "FML",
        {"clip-norm": 10.0},
        {"-al": "alpha", "-bt": "beta"},
        unexpressed=("shared-model", "kl-reduction", "detach-targets"),
        as_code={"shared-model": "group-first", "kl-reduction": "mean", "detach-targets": False},
        server_items=("global_model",),
    ),
    "fedkd": ReferenceMethod(
        "FedKD",
        {"clip-norm": 10.0},
        {"-Ts": "energy-start", "-Te": "energy-end"},
        unexpressed=("shared-model",),
        as_code={"shared-model": "group-first"},
        server_items=("global_model",),
        unpaired="each client's alignment map `W_h` (each side draws it from its seed)",
        resumable=False,
    ),
    "fedmrl": ReferenceMethod(
        "FedMRL",
        flags={"-sfd": "d1"},
        unexpressed=("small-model", "weight-global", "weight-private", "eval-protocol", "inference", "keep-projector"),
        # clientmrl.py never saves its trained projector (docs/methods/fedmrl.md P3)
        as_code={"small-model": "group-first", "eval-protocol": "deployment", "keep-projector": False},
        # HtFLlib evaluates every client with the server's aggregated small model (our protocol B)
        reported=("eval-protocol", "deployment", "accuracy_weighted"),
        server_items=("global_model",),
        unpaired="each client's projector (each side draws it from its seed)",
    ),
    # servergen.py: the server's first head is client 0's, its generator a draw of its own (both paired with
    # ours); its trained generator is never stored, so every client uses the initial one (ours: generator =
    # "initial"); HtFLlib evaluates every client's extractor with the head just broadcast
    "fedgen": ReferenceMethod(
        "FedGen",
        flags={"-nd": "noise-dim", "-hd": "hidden-dim", "-glr": "generator-lr", "-se": "server-epochs"},
        unexpressed=("generator", "eval-global-head"),
        as_code={"generator": "initial", "eval-global-head": True},
        reported=("eval-global-head", True, "accuracy_weighted_global_head"),
        server_items=("head", "generative_model"),
        unpaired="the labels and noise generated for every batch (HtFLlib from numpy's and torch's global "
        "generators, ours from the client's generator of `seed`); round 1's generated term (HtFLlib's clients train "
        "with it from round 1, its server having read every client's counts at start; ours from round 2, after the "
        "first counts are reported)",
    ),
    # clientl2g_feat.py / clientl2g_logit.py: clip_grad_norm_(model.parameters(), 100) in local training, the
    # study and quiz loaders shuffled by torch's global generator; serverl2g_*.py: the per-class mean of the
    # uploaded rows (zero for a class nobody sent), clip_grad_norm_ 100, SGD; G an nn.Embedding(C, D) stored as
    # 'guiding_vec'. Its loop evaluates no warm-up round and a cross-check compares every round: no warm-up
    # (its loop index also decides the warm-up, so a resumed run would redo it: not resumable)
    **{
        method: ReferenceMethod(
            algorithm,
            {"clip-norm": 100.0, f"{method}.warm-up-rounds": 0},
            {"-slr": "server-lr", "-wu": "warm-up-rounds", "-mdb": "study-batches", "-mqb": "quiz-batches"},
            unexpressed=("guide-weight", "server-clip-norm"),
            as_code={"guide-weight": 1.0, "server-clip-norm": 100.0},
            server_items=("guiding_vec",),
            unpaired="the study and quiz batches (each side shuffles its own: HtFLlib with torch's global "
            "generator, ours with the client's generator of `seed`)",
            resumable=False,
        )
        for method, algorithm in (("fedl2g-feat", "FedL2G-feat"), ("fedl2g-logit", "FedL2G-logit"))
    },
    # FedSA is not in HtFLlib: its authors' code (lokinko/FedSA 75bf106) is an HtFLlib fork with main.py's
    # interface, run through the same bootstrap with its checkout as --reference (its mmcv import stubbed:
    # BOOTSTRAP). clientsa.py: -lam (FedProto's flag, default 1; the scripts pass 10), -mcl, -cc; serversa.py
    # hard-codes the EMA's 0.0001. Its anchors need no loading: the server draws them from torch's generator just
    # reseeded by the last client's constructor (the seed, under the bootstrap), in our order (initial_anchors)
    "fedsa": ReferenceMethod(
        "FedSA",
        flags={"-lam": "lambda", "-mcl": "mcl", "-cc": "cc"},
        unexpressed=("ema",),
        as_code={"ema": 0.0001},
        repository="lokinko/FedSA",
    ),
}


#: our methods HtFLlib does not have, cross-checked against their authors' code by a tool of their own (a
#: method in neither this nor :data:`REFERENCE_METHODS` has no reference: the "add a method" checklist's
#: [crosscheck] step, docs/architecture.md)
AUTHORS_REFERENCES = {
    "fedre": "bench.fedre_authors",
    "mh-pfedhn": "bench.mhpfedhn_authors",
    "mh-pfedhngd": "bench.mhpfedhn_authors",
}

#: run config values HtFLlib's recipe has built in (plain SGD, no augmentation, its training loader's
#: fixed batch order without the last partial batch, every client evaluated every round): a
#: cross-check refuses other values, since the reference cannot follow them
REFERENCE_RECIPE = {
    "batch-order": "fixed",
    "momentum": 0.0,
    "weight-decay": 0.0,
    "clip-norm": 0.0,
    "augment": "none",
    "eval-every": 1,
    "eval-clients": "all",
}


#: HtFLlib's ``-lr`` for FedKD's mentee is a flag of its own; ours trains both with ``lr``
FEDKD_MENTEE_LR = "-mlr"

ROUND_LINE = re.compile(r"Round number: (\d+)")
#: (lokinko/FedSA's fork of it prints "Accurancy")
ACCURACY_LINE = re.compile(r"Averaged Test Accuran?cy: ([0-9.]+)")
REPETITION_LINE = re.compile(r"Running time: (\d+)th")
#: the dataset flag of a reference command (its name is the output folder's)
DATA_FLAG = re.compile(r"-data \S+")
#: the initial models' files of a reference command (in the output folder)
INITIAL_FLAG = re.compile(r"CROSSCHECK_(SERVER_)?INITIAL=\S+")
#: HtFLlib's evaluation (scikit-learn's AUC) on NaN or infinite model outputs
DIVERGED_LINE = re.compile(r"ValueError: Input contains (NaN|infinity)")
#: a printed non-finite loss (FedTGP's ``Server loss: nan``): HtFLlib goes on, evaluating NaN state
NONFINITE_LOSS_LINE = re.compile(r"loss: [-+]?(nan|inf)\b", re.IGNORECASE)
#: FedTGP's server (``servertgp.py``, ``update_Gen``) prints the largest class-wise minimum distance of
#: the round's uploads; its margin is min(max_gap, tau)
MAX_GAP_LINE = re.compile(r"^max_gap tensor\(([-+0-9.eEinfa]+)", re.M)
#: the time of one iteration of a server's round loop, as HtFLlib's servers print it at its end
#: (``print('-'*50, self.Budget[-1])``: seconds, its evaluation and training included)
ITERATION_SECONDS_LINE = re.compile(r"^-{50} ([0-9.]+)$", re.M)

#: the environment variable that gives :data:`BOOTSTRAP` the training seed
SEED_VARIABLE = "CROSSCHECK_SEED"
#: the environment variable that gives :data:`BOOTSTRAP` a removed family (:func:`restored_family`)
#: as JSON ``[name, [constructor, ...]]``
FAMILY_VARIABLE = "CROSSCHECK_FAMILY"
#: the environment variable that gives :data:`BOOTSTRAP` PyTorch's thread count
THREADS_VARIABLE = "CROSSCHECK_THREADS"
#: the environment variable that gives :data:`BOOTSTRAP` our clients' initial models (a file of
#: :func:`bench.crosscheck_pairing.save_initial_states`)
INITIAL_VARIABLE = "CROSSCHECK_INITIAL"
#: the environment variable that gives :data:`BOOTSTRAP` this repository (for :mod:`bench.crosscheck_pairing`)
ROOT_VARIABLE = "CROSSCHECK_ROOT"
#: the environment variable that gives :data:`BOOTSTRAP` the folder of a resumable run's checkpoint
CHECKPOINT_VARIABLE = "CROSSCHECK_CHECKPOINT"
#: the environment variable that gives :data:`BOOTSTRAP` the least seconds between two checkpoints
CHECKPOINT_SECONDS_VARIABLE = "CROSSCHECK_CHECKPOINT_SECONDS"
#: seconds between a resumable reference run's checkpoints: a full-data round (Fashion-MNIST HtCNN8,
#: FedTGP: 65-93 s) checkpoints every round, and a capped cross-check (a few seconds a round) does not
#: pay a copy of its model store each round in the wall time it is compared by
CHECKPOINT_SECONDS = 60.0
#: what :func:`run_reference` writes into the log where a run goes on from its checkpoint
RESUMED_LINE = re.compile(r"^crosscheck: resumed at iteration (\d+)")
#: what :data:`BOOTSTRAP` prints for each client model it loaded ours into
PAIRED_LINE = re.compile(r"^crosscheck: client (\d+) paired", re.M)
#: what :data:`BOOTSTRAP` prints for each of the server's modules of ``server_items``: paired, or why not
SERVER_PAIRED_LINE = re.compile(r"^crosscheck: server (\S+) (paired|not paired: (.*))$", re.M)
#: the environment variables that give :data:`BOOTSTRAP` the server's items (comma-separated) and the file
#: of our server's initial state for each (``{item: state dict}``)
SERVER_ITEMS_VARIABLE = "CROSSCHECK_SERVER_ITEMS"
SERVER_INITIAL_VARIABLE = "CROSSCHECK_SERVER_INITIAL"
#: the environment variable that gives :data:`BOOTSTRAP` a method's ``server_order`` (in the command as
#: recorded: a kept run of HtFLlib's own order is not reused for a paired one)
SERVER_ORDER_VARIABLE = "CROSSCHECK_SERVER_ORDER"
#: what :data:`BOOTSTRAP` prints the first time the server of ``server_order`` builds its loader
SERVER_ORDER_LINE = re.compile(r"^crosscheck: server batch order paired", re.M)

#: runs HtFLlib's ``main.py`` (argv[1:]) in its ``system/`` folder. HtFLlib seeds torch with
#: ``torch.manual_seed(0)`` at start and again in every client's constructor, but leaves numpy's and
#: Python's global generators unseeded, and draws from them each round's client order
#: (``serverbase.select_clients``, a permutation even when every client joins; ``receive_ids``). That
#: order is the order of the server's uploads, which FedTGP's and FedGH's server training shuffles
#: with torch's generator, so an unseeded rerun of those differs from round 1 on (FedTGP,
#: Fashion-MNIST HtCNN8, 120 examples per client: 21.82 against 17.63 % pooled after round 1).
#: Here torch's seed 0 becomes the training seed (``$CROSSCHECK_SEED``; seed 0 is HtFLlib's own),
#: which varies the initial weights as our ``seed`` does (HtFLlib's clients read their data in a
#: fixed order), and numpy and ``random`` are seeded with it, so a rerun repeats its curve.
#: A server module of an algorithm other than the one run whose imports fail here (FedKTL needs
#: StyleGAN; FedL2G ``higher`` without the crosscheck extra) is replaced by a placeholder that raises that
#: import error if used.
#: A removed family (``$CROSSCHECK_FAMILY``) becomes one more branch of ``main.py``'s family chain,
#: just before its final ``raise NotImplementedError``.
#: Paired (:mod:`bench.crosscheck_pairing`): PyTorch runs ``$CROSSCHECK_THREADS`` threads, and every
#: client's model, right after HtFLlib's ``Client.__init__`` has built and stored it, is loaded with
#: our initial model of that client (``$CROSSCHECK_INITIAL``) and stored again; a client model whose
#: tensors do not match ours in order and shape stops the run with the first mismatch. With
#: ``$CROSSCHECK_SERVER_ITEMS`` (a method's ``server_items``), the first module the server stores under
#: each of those names (``clientbase.save_item``, which HtFLlib's servers import after this patch) is
#: loaded with our server's (``$CROSSCHECK_SERVER_INITIAL``, by name) before it is stored; where the two
#: differ in order or shape it stays HtFLlib's draw, and the log says why (:data:`SERVER_PAIRED_LINE`). With
#: ``$CROSSCHECK_SERVER_ORDER`` (a method's ``server_order``), that server module's ``DataLoader``
#: becomes :meth:`bench.crosscheck_pairing.ServerOrder.loader` (our rows' order and our generator of the
#: training seed), which learns each row's client from the ``protos`` item the server loads of it
#: (``clientbase.load_item``, patched before the servers import it); its first use prints
#: :data:`SERVER_ORDER_LINE`, and a row of no client's ``protos`` stops the run.
#: Resumable (``$CROSSCHECK_CHECKPOINT``, a folder; :func:`run_reference`): at the start of an
#: iteration of the server's round loop (its ``select_clients`` call, the first thing each iteration
#: does, before it draws) that begins ``$CROSSCHECK_CHECKPOINT_SECONDS`` or more after the last
#: checkpoint (or the process's start), the server's state is written to that folder, replacing the last one
#: (written beside it, then renamed): HtFLlib's on-disk store of models and prototypes
#: (``save_folder_name``), the server object's attributes (its clients, accuracy lists, generator),
#: torch's, numpy's and Python's generator states, and ``progress.json`` (iterations done, the log's
#: size then, launches, wall and CPU seconds so far). A process started with that folder present
#: restores it into the server it has just built and runs the iterations left (``global_rounds``
#: lowered by those done; its loop prints its iterations from 0 again, :func:`continued_log`), so a
#: stopped run loses at most the iterations since the last checkpoint and goes on as if never stopped.
BOOTSTRAP = (
    r"""
import time
launched = time.time()
import json, os, random, re, sys, types
import numpy, torch
seed = int(os.environ["CROSSCHECK_SEED"])
manual_seed = torch.manual_seed
torch.manual_seed = lambda s: manual_seed(seed if s == 0 else s)
numpy.random.seed(seed)
random.seed(seed)
torch.set_num_threads(int(os.environ["CROSSCHECK_THREADS"]))
sys.argv = sys.argv[1:]
sys.path.insert(0, ".")
sys.path.append(os.environ["CROSSCHECK_ROOT"])
from bench.crosscheck_pairing import paired_state
from flcore.clients import clientbase
states = torch.load(os.environ["CROSSCHECK_INITIAL"], weights_only=True)
built = clientbase.Client.__init__
def paired_init(self, *args, **kwargs):
    built(self, *args, **kwargs)
    if self.id >= len(states):
        sys.exit(f"crosscheck: client {self.id} has no initial model of ours ({len(states)} exported)")
    model = clientbase.load_item(self.role, "model", self.save_folder_name)
    model.load_state_dict(paired_state(states[self.id], model.state_dict(), f"client {self.id}"))
    clientbase.save_item(model, self.role, "model", self.save_folder_name)
    print(f"crosscheck: client {self.id} paired ({len(states[self.id])} tensors of ours)", flush=True)
clientbase.Client.__init__ = paired_init
if os.environ.get("CROSSCHECK_SERVER_ITEMS"):
    server_states = torch.load(os.environ["CROSSCHECK_SERVER_INITIAL"], weights_only=True)
    stored = clientbase.save_item
    def paired_save(item, role, item_name, *args, **kwargs):
        if role == "Server" and item_name in server_states:
            try:
                state = server_states.pop(item_name)
                item.load_state_dict(paired_state(state, item.state_dict(), f"the server's {item_name}"))
                print(f"crosscheck: server {item_name} paired", flush=True)
            except ValueError as exc:
                print(f"crosscheck: server {item_name} not paired: {exc}", flush=True)
        stored(item, role, item_name, *args, **kwargs)
    clientbase.save_item = paired_save
server_order = os.environ.get("CROSSCHECK_SERVER_ORDER")
if server_order:
    import importlib
    from bench.crosscheck_pairing import ServerOrder
    upload_order = ServerOrder(seed)
    loaded = clientbase.load_item
    def recorded_load(role, item_name, *args, **kwargs):
        item = loaded(role, item_name, *args, **kwargs)
        if item_name == "protos" and role.startswith("Client_") and item is not None:
            upload_order.record(int(role[len("Client_"):]), item)
        return item
    clientbase.load_item = recorded_load
    def paired_loader(*args, **kwargs):
        if upload_order.last is None:
            print(f"crosscheck: server batch order paired ({server_order}.DataLoader)", flush=True)
        return upload_order.loader(*args, **kwargs)
    importlib.import_module(f"flcore.servers.{server_order}").DataLoader = paired_loader
checkpoint = os.environ.get("CROSSCHECK_CHECKPOINT")
if checkpoint:
    import shutil
    from flcore.servers import serverbase
    progress_file = os.path.join(checkpoint, "progress.json")
    prior = json.load(open(progress_file)) if os.path.exists(progress_file) else {}
    def save_checkpoint(server):
        sys.stdout.flush(); sys.stderr.flush()
        tmp, old = checkpoint + ".tmp", checkpoint + ".old"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(server.save_folder_name, os.path.join(tmp, "store"))
        state = {k: v for k, v in server.__dict__.items() if k != "train"}
        rng = (torch.get_rng_state(), numpy.random.get_state(), random.getstate())
        if server_order:
            rng += (upload_order.generator.get_state(),)
        torch.save({"server": state, "rng": rng}, os.path.join(tmp, "state.pt"))
        progress = {
            "iterations": server.crosscheck_iterations,
            "log_offset": os.fstat(1).st_size,
            "launches": prior.get("launches", 0) + 1,
            "wall_seconds": prior.get("wall_seconds", 0.0) + time.time() - launched,
            "cpu_seconds": prior.get("cpu_seconds", 0.0) + time.process_time(),
        }
        with open(os.path.join(tmp, "progress.json"), "w") as f:
            json.dump(progress, f)
        if os.path.exists(checkpoint):
            os.rename(checkpoint, old)
        os.rename(tmp, checkpoint)
        shutil.rmtree(old, ignore_errors=True)
    select = serverbase.Server.select_clients
    every, last_checkpoint = float(os.environ["CROSSCHECK_CHECKPOINT_SECONDS"]), [launched]
    def checkpointed_select(self):
        if time.time() - last_checkpoint[0] >= every:
            save_checkpoint(self)
            last_checkpoint[0] = time.time()
        self.crosscheck_iterations += 1
        return select(self)
    server_init = serverbase.Server.__init__
    def resumable_init(self, *args, **kwargs):
        server_init(self, *args, **kwargs)
        self.crosscheck_iterations = 0
        train = self.train
        def resumed_train():
            if prior:
                fresh = self.save_folder_name
                saved = torch.load(os.path.join(checkpoint, "state.pt"), weights_only=False)
                self.__dict__.update(saved["server"])
                for folder in {fresh, self.save_folder_name}:
                    shutil.rmtree(folder, ignore_errors=True)
                shutil.copytree(os.path.join(checkpoint, "store"), self.save_folder_name)
                torch.set_rng_state(saved["rng"][0])
                numpy.random.set_state(saved["rng"][1])
                random.setstate(saved["rng"][2])
                if server_order:
                    upload_order.generator.set_state(saved["rng"][3])
                self.global_rounds = self.args.global_rounds - self.crosscheck_iterations
            return train()
        self.train = resumed_train
    serverbase.Server.select_clients = checkpointed_select
    serverbase.Server.__init__ = resumable_init
import importlib.util
if importlib.util.find_spec("mmcv") is None:
    # lokinko/FedSA's serversa.py imports mmcv for build_norm_layer alone (its anchor MLP's "SyncBN": torch's
    # SyncBatchNorm, a plain batch norm without a process group); mmcv does not install here
    mmcv, mmcv_cnn = types.ModuleType("mmcv"), types.ModuleType("mmcv.cnn")
    norms = {"SyncBN": torch.nn.SyncBatchNorm, "BN1d": torch.nn.BatchNorm1d}
    mmcv_cnn.build_norm_layer = lambda cfg, features: ("bn", norms[cfg["type"]](features))
    mmcv_cnn.ConvModule = None
    mmcv.cnn = mmcv_cnn
    sys.modules.update({"mmcv": mmcv, "mmcv.cnn": mmcv_cnn})
"""
    + PLACEHOLDER_SERVERS
    + r"""source = open("main.py").read()
def declares(flag):
    return re.search(r"add_argument\(\s*['\"]" + flag + r"['\"]", source) is not None
if declares("-nb") and not declares("-ncl"):  # an older HtFLlib (lokinko/FedSA's fork) names the classes -nb
    sys.argv = ["-nb" if arg == "-ncl" else arg for arg in sys.argv]
def has_family(name):
    return re.search(r"model_family == ['\"]" + re.escape(name) + r"['\"]", source) is not None
if "-m" in sys.argv[:-1]:  # an older HtFLlib names the image families without "-img-" ("HtFE2" for "HtFE-img-2")
    at = sys.argv.index("-m") + 1
    older = sys.argv[at].replace("-img-", "")
    if not has_family(sys.argv[at]) and has_family(older):
        sys.argv[at] = older
if os.environ.get("CROSSCHECK_FAMILY"):
    name, models = json.loads(os.environ["CROSSCHECK_FAMILY"])
    anchor = "\n        else:\n            raise NotImplementedError"
    if anchor not in source:
        sys.exit("crosscheck: main.py has no model family chain ending in NotImplementedError")
    branch = f"\n        elif args.model_family == {name!r}:\n            args.models = {models!r}"
    source = source.replace(anchor, branch + anchor, 1)
exec(compile(source, "main.py", "exec"), {"__name__": "__main__", "__file__": "main.py"})
"""
)


def pairing(method: str, refs: list[dict]) -> tuple[str, str]:
    """What the paired cross-check of ``method`` paired and what it did not, as the report says them,
    from its reference runs ``refs`` (:func:`run_reference`): :data:`PAIRED`, and each of the server's
    modules of ``server_items`` (:data:`PAIRED_SERVER`) that every run took ours of, else, among the
    unpaired, why the first run did not (e.g. a shared model of another architecture than HtFLlib's);
    then, with a ``server_order``, :data:`PAIRED_ORDER` (a run that did not pair it is refused)."""
    ref = REFERENCE_METHODS[method]
    paired, unpaired = [PAIRED], [ref.unpaired] if ref.unpaired else []
    for item in reversed(ref.server_items):
        refused = next((r["server_pairing"][item] for r in refs if r["server_pairing"][item] != "paired"), None)
        if refused is None:
            paired.insert(1, PAIRED_SERVER.format(item=item))
        else:
            unpaired.insert(0, f"the server's initial `{item}`, each side's own draw ({refused})")
    if ref.server_order:
        paired.append(PAIRED_ORDER)
    return "; ".join(paired), "; ".join(unpaired)


def compared_metric(config: dict, method: str) -> str:
    """Our row key compared with HtFLlib's printed accuracy: the method's ``reported`` row key when
    its option has that value in ``config``, else ``accuracy_weighted`` (every client's personal
    model, pooled over their test examples)."""
    reported = REFERENCE_METHODS[method].reported
    if reported is not None and method_options(config, method)[reported[0]] == reported[1]:
        return reported[2]
    return "accuracy_weighted"


def evaluates_as_reference(config: dict, method: str) -> bool:
    """Whether ours evaluates the model HtFLlib's printed accuracy is of (``reported`` option set)."""
    reported = REFERENCE_METHODS[method].reported
    return reported is None or method_options(config, method)[reported[0]] == reported[1]


def check_expressible(config: dict, method: str) -> None:
    """Refuse a run config the reference cannot follow for ``method``.

    Raises:
        ConfigError: the method has no HtFLlib counterpart, the model group no HtFLlib family, a
            recipe key differs from :data:`REFERENCE_RECIPE`, or a tied option differs from the
            run config key HtFLlib uses for it; the message lists every such key.
    """
    if method not in REFERENCE_METHODS:
        tool = AUTHORS_REFERENCES.get(method)
        elsewhere = f" (its authors' code: python -m {tool})" if tool else ""
        raise ConfigError(
            f"method {method!r} has no HtFLlib counterpart{elsewhere}; allowed: {', '.join(REFERENCE_METHODS)}"
        )
    if config["model-group"] not in FAMILIES:
        raise ConfigError(
            f"run config key 'model-group' = {config['model-group']!r} has no HtFLlib model family; "
            f"allowed: {', '.join(FAMILIES)}"
        )
    recipe = {**REFERENCE_RECIPE, **REFERENCE_METHODS[method].recipe}
    problems = [f"{k} = {config[k]!r} (HtFLlib: {v!r})" for k, v in recipe.items() if config.get(k, v) != v]
    options = method_options(config, method)
    problems += [
        f"{method}.{ours} = {options[ours]!r} (HtFLlib uses {key} = {config[key]!r})"
        for ours, key in REFERENCE_METHODS[method].tied.items()
        if options[ours] != config[key]
    ]
    if problems:
        raise ConfigError("the reference cannot follow: " + "; ".join(problems))


def reference_command(config: dict, method: str, dataset_name: str) -> list[str]:
    """HtFLlib's ``main.py`` flags for ``config`` and ``method``: one repetition, its models kept in
    HtFLlib's default store (``system/temp/<dataset>/<algorithm>/<time>/``, removed at the end)."""
    from common.datasets import DATASETS

    ref = REFERENCE_METHODS[method]
    options = method_options(config, method)
    cmd = [
        "main.py",
        *("-data", dataset_name, "-ncl", str(DATASETS[config["dataset"]].num_classes)),
        *("-m", FAMILIES[config["model-group"]], "-fd", str(config["feature-dim"])),
        *("-algo", ref.algorithm, "-gr", str(config["num-server-rounds"]), "-nc", str(config["num-clients"])),
        *("-jr", str(config["fraction-train"]), "-lbs", str(config["batch-size"]), "-lr", str(config["lr"])),
        *("-ls", str(config["local-epochs"]), "-eg", "1", "-t", "1"),
    ]
    for flag, key in ref.flags.items():
        cmd += [flag, str(options[key])]
    if method == "fedkd":
        cmd += [FEDKD_MENTEE_LR, str(config["lr"])]
    return cmd


def parse_reference_log(text: str) -> list[dict[int, float]]:
    """Per repetition (``Running time: <i>th``), HtFLlib's pooled test accuracy (a fraction) by
    round number (0 = the initial models), from its stdout; a repetition cut off keeps the rounds it
    printed. A repetition that printed a non-finite loss in round r keeps the rounds up to r: HtFLlib
    does not stop there, and what it evaluates from round r + 1 on holds NaN (FedTGP's server
    prints ``Server loss: nan``, its global prototypes turn NaN, and its clients, which classify by
    distance to them, print chance accuracy, 9.99 % on Fashion-MNIST, not a failure)."""
    runs: list[dict[int, float]] = []
    current_round = None
    poisoned = False
    for line in text.splitlines():
        if REPETITION_LINE.search(line):
            runs.append({})
            poisoned = False
        elif m := ROUND_LINE.search(line):
            current_round = int(m.group(1))
        elif NONFINITE_LOSS_LINE.search(line):
            poisoned = True
        elif (m := ACCURACY_LINE.search(line)) and runs and current_round is not None and not poisoned:
            runs[-1][current_round] = float(m.group(1))
    return runs


def continued_log(text: str) -> str:
    """A reference run's log as one launch would have printed it, from the log of a run stopped and
    resumed from its checkpoint (:data:`BOOTSTRAP`): after each :data:`RESUMED_LINE` (written where
    the log was cut back to the checkpoint's size), the repetition line that the new launch's
    ``main.py`` prints again is left out and its round numbers, counted from 0 again, are shifted by
    the iterations done. A log without that line is returned as it is."""
    lines, offset, restarted = [], 0, False
    for line in text.splitlines():
        if m := RESUMED_LINE.match(line):
            offset, restarted = int(m.group(1)), True
        elif restarted and REPETITION_LINE.search(line):
            restarted = False
            continue
        elif offset and (m := ROUND_LINE.search(line)):
            line = line.replace(m.group(0), f"Round number: {int(m.group(1)) + offset}", 1)
        lines.append(line)
    return "\n".join(lines) + "\n"


def resume_point(checkpoint: Path, identity: dict, log: Path) -> dict | None:
    """Where a stopped reference run goes on: the ``progress.json`` of its checkpoint folder
    (:data:`BOOTSTRAP`) when the checkpoint was written by a run of ``identity`` (command, reference
    commit, partition and initial models' digests, as ``<checkpoint>.json`` records) and ``log``
    still holds what that run printed up to it; then the log is cut back to that point and
    :data:`RESUMED_LINE` appended. Otherwise None, after removing any checkpoint and recording
    ``identity`` for the run about to start. A run stopped between the two renames of a checkpoint's
    replacement keeps the previous one (``<checkpoint>.old``)."""
    meta, old = Path(f"{checkpoint}.json"), Path(f"{checkpoint}.old")
    shutil.rmtree(f"{checkpoint}.tmp", ignore_errors=True)
    if old.exists() and not checkpoint.exists():
        old.rename(checkpoint)
    progress_file = checkpoint / "progress.json"
    if meta.exists() and json.loads(meta.read_text()) == identity and progress_file.exists() and log.exists():
        progress = json.loads(progress_file.read_text())
        if log.stat().st_size >= progress["log_offset"]:
            with open(log, "r+b") as f:
                f.truncate(progress["log_offset"])
            resumed = f"crosscheck: resumed at iteration {progress['iterations']} (launch {progress['launches'] + 1})"
            with open(log, "a") as f:
                f.write(resumed + "\n")
            return progress
    discard_checkpoint(checkpoint)
    meta.write_text(json.dumps(identity))
    return None


def discard_checkpoint(checkpoint: Path) -> None:
    """Remove a reference run's checkpoint folder, the one a replacement may have left
    (``<checkpoint>.old``) and the identity it was recorded for (``<checkpoint>.json``)."""
    for folder in (checkpoint, Path(f"{checkpoint}.old")):
        shutil.rmtree(folder, ignore_errors=True)
    Path(f"{checkpoint}.json").unlink(missing_ok=True)


def parse_iteration_seconds(text: str) -> list[float]:
    """The seconds HtFLlib printed for each iteration of its round loop (:data:`ITERATION_SECONDS_LINE`)
    in the last repetition of a log (:func:`continued_log` for a resumed one): R + 1 for R rounds, the
    last iteration trains after the last evaluation; none for a server that prints none (Local)."""
    return [float(x) for x in ITERATION_SECONDS_LINE.findall(text.rsplit("Running time:", 1)[-1])]


def parse_max_gap(text: str, rounds: int) -> list[float | None]:
    """FedTGP's printed ``max_gap`` for our rounds 1..``rounds`` (its margin is min(max_gap, tau)), None
    where none was printed or it is not finite, from the last repetition of a log.

    Iteration ``i`` of ``servertgp.py``'s loop prints ``Round number: i`` and evaluates, then trains
    and updates the generator, printing ``max_gap``: the margin of the training that round ``i + 1``
    evaluates, which is our round ``i + 1`` (our row r is after r rounds of training).
    """
    text = text.rsplit("Running time:", 1)[-1]
    by_round: dict[int, float] = {}
    current = None
    for line in text.splitlines():
        if m := ROUND_LINE.search(line):
            current = int(m.group(1))
        elif (m := MAX_GAP_LINE.match(line)) and current is not None:
            value = float(m.group(1))
            if math.isfinite(value):
                by_round[current + 1] = value
    return [by_round.get(r) for r in range(1, rounds + 1)]


def stopped_by_divergence(text: str) -> bool:
    """Whether the error a reference run ended with is its evaluation's on NaN or infinite outputs
    (:data:`DIVERGED_LINE` in the last traceback, or in the last lines when it printed none): an
    earlier such line, or a non-finite loss followed by another error, is not."""
    last = text.rsplit("Traceback (most recent call last)", 1)
    tail = last[1] if len(last) == 2 else "\n".join(text.splitlines()[-5:])
    return DIVERGED_LINE.search(tail) is not None


def reference_launch(
    config: dict, method: str, seed: int, dataset_name: str, initial: Path, threads: int, server: Path | None = None
) -> tuple[list[str], dict, str]:
    """How :func:`run_reference` starts HtFLlib: ``main.py`` and its flags (:func:`reference_command`),
    the environment :data:`BOOTSTRAP` reads (the training seed, ``threads``, ``initial``: the file of our
    clients' initial models, ``server``: our server's initial state for each of the method's ``server_items``,
    the method's ``server_order``, this repository, and a family HtFLlib removed,
    :func:`restored_family`), and the command as recorded (those variables, then ``python main.py ...``)."""
    args = reference_command(config, method, dataset_name)
    env = {
        **os.environ,
        # HtFLlib pickles whole models into its own store and loads them back, written for torch < 2.6
        "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1",
        SEED_VARIABLE: str(seed),
        THREADS_VARIABLE: str(threads),
        # numpy's BLAS (OpenBLAS, read at import) ignores torch.set_num_threads: unpinned, FedKD's
        # np.linalg.svd (HtFLlib e959261, system/flcore/clients/clientkd.py) runs one thread per core,
        # which competes with any other busy process; ours runs with OMP_NUM_THREADS = the actor's CPUs (Ray)
        "OMP_NUM_THREADS": str(threads),
        INITIAL_VARIABLE: str(initial),
        ROOT_VARIABLE: str(ROOT),
    }
    command = (
        f"OMP_NUM_THREADS={threads} {THREADS_VARIABLE}={threads} {INITIAL_VARIABLE}={initial} "
        f"{SEED_VARIABLE}={seed} python " + " ".join(args)
    )
    if server is not None:
        items = ",".join(REFERENCE_METHODS[method].server_items)
        env |= {SERVER_ITEMS_VARIABLE: items, SERVER_INITIAL_VARIABLE: str(server)}
        command = f"{SERVER_ITEMS_VARIABLE}={items} {SERVER_INITIAL_VARIABLE}={server} {command}"
    if order := REFERENCE_METHODS[method].server_order:
        env[SERVER_ORDER_VARIABLE] = order
        command = f"{SERVER_ORDER_VARIABLE}={order} {command}"
    family = FAMILIES[config["model-group"]]
    if (models := restored_family(family, config["dataset"])) is not None:
        env[FAMILY_VARIABLE] = json.dumps([family, models])
        command = f"{FAMILY_VARIABLE}='{env[FAMILY_VARIABLE]}' {command}"
    return args, env, command


def unplaced(command: str) -> str:
    """A reference command as recorded, without what comes from where it ran: the dataset's name (the
    output folder's) and the initial models' file (in the output folder)."""
    return INITIAL_FLAG.sub(r"CROSSCHECK_\1INITIAL=<initial>", DATA_FLAG.sub("-data <partitions>", command))


def kept_reference_run(done: Path, command: str, content_digest: str, initial_digest: str, rounds: int) -> dict | None:
    """The finished run kept in ``done`` when it ran ``command`` (up to :func:`unplaced`) for ``rounds``
    rounds, on partitions of ``content_digest`` and from initial models of ``initial_digest``; else None."""
    if not done.exists():
        return None
    saved = json.loads(done.read_text())
    same = (
        unplaced(saved.get("command", "")) == unplaced(command)
        and saved.get("content_digest") == content_digest
        and saved.get("initial_digest") == initial_digest
        and len(saved["curve"]) == rounds
    )
    return saved if same else None


def link_dataset(reference: Path, name: str, partitions: Path) -> None:
    """``<reference>/dataset/<name>``, where HtFLlib's ``-data <name>`` reads: a symlink to ``partitions``
    (what was there under that name is replaced)."""
    link = reference / "dataset" / name
    link.parent.mkdir(exist_ok=True)
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(partitions.resolve(), target_is_directory=True)


def read_reference_run(
    text: str,
    code: int,
    seed: int,
    rounds: int,
    clients: int,
    log: Path,
    server_items: tuple[str, ...] = (),
    server_order: str = "",
) -> dict:
    """The accuracy a reference run of ``rounds`` rounds and ``clients`` clients printed (its log
    ``text``, exit code ``code``): ``{"curve", "initial", "diverged_round", "server_pairing"}`` as
    :func:`run_reference` returns them; a run whose models diverged is a result (see there).
    ``server_pairing``: with ``server_items``, for each item ``"paired"`` or why the server's module
    was not (the bootstrap's :data:`SERVER_PAIRED_LINE`), else None.

    Raises:
        RuntimeError: the run printed fewer rounds than asked for another reason, did not pair every
            client, never stored one of its ``server_items``, or, with a ``server_order``, never built its
            server's loader over the uploads through the bootstrap's (:data:`SERVER_ORDER_LINE`) (its
            log's tail, or ``log``, in the message).
    """
    runs = parse_reference_log(text)
    curve = [runs[-1].get(r) for r in range(1, rounds + 1)] if runs else [None]
    if code != 0:
        diverged = bool(runs) and None in curve and stopped_by_divergence(text)
    else:
        diverged = bool(runs) and None in curve and NONFINITE_LOSS_LINE.search(text) is not None
    if (code != 0 or None in curve) and not diverged:
        raise RuntimeError(
            f"the reference run (seed {seed}) ended with exit code {code} before {rounds} rounds:\n{text[-2000:]}"
        )
    paired = {int(i) for i in PAIRED_LINE.findall(text)}
    if paired != set(range(clients)):
        raise RuntimeError(
            f"the reference run (seed {seed}) paired the models of clients {sorted(paired)}, not of all "
            f"{clients}: its clients are not built by flcore.clients.clientbase.Client "
            f"(log {log})"
        )
    server_pairing = {} if server_items else None
    for item in server_items:
        lines = [m for m in SERVER_PAIRED_LINE.finditer(text) if m.group(1) == item]
        if not lines:
            raise RuntimeError(
                f"the reference run (seed {seed}) never stored its server's `{item}` through "
                f"flcore.clients.clientbase.save_item, so it was not paired with ours (log {log})"
            )
        server_pairing[item] = lines[-1].group(3) or "paired"
    if server_order and not SERVER_ORDER_LINE.search(text):
        raise RuntimeError(
            f"the reference run (seed {seed}) never built a DataLoader of flcore.servers.{server_order} "
            f"over its uploads, so its batch order was not paired with ours (log {log})"
        )
    return {
        "curve": curve,
        "initial": runs[-1].get(0),
        "diverged_round": curve.index(None) + 1 if diverged else None,
        "server_pairing": server_pairing,
    }


def run_reference(
    reference: Path, config: dict, method: str, seed: int, partitions: Path, out: Path, threads: int = CLIENT_THREADS
) -> dict:
    """Run HtFLlib for ``method`` with training seed ``seed`` (:data:`BOOTSTRAP`), paired with ours, or
    reuse its finished run: one with the same command (up to the dataset's name, which is the output
    folder's, and the initial models' file), on partitions of the same content (their
    ``content_digest``) and from the same initial models (``initial_digest``); any other is run
    again, so a changed preset, override or model never passes off an old curve as this config's.

    Paired: every client's model starts from ours for ``config`` and ``seed``
    (:func:`bench.crosscheck_pairing.save_initial_states`, written to
    ``out/initial-seed-<seed>.pt`` for the run and removed after it: ours rebuilds it from the
    config), and PyTorch runs ``threads`` threads, as each of our clients does. A run whose log does
    not show every client model paired is refused. With the method's ``server_items`` our server's
    initial modules go to ``out/initial-server-seed-<seed>.pt`` the same way, and are part of the
    ``initial_digest``; the result's ``server_pairing`` says whether HtFLlib's server took each. With its
    ``server_order`` the server's mini-batches over the uploads are ours (:data:`BOOTSTRAP`); a run
    whose log does not show it is refused.

    A run whose models diverged (HtFLlib's evaluation stops on NaN or infinite outputs:
    scikit-learn's "Input contains NaN" or "Input contains infinity" as the error it ended with; or it
    printed a non-finite loss and went on to its end, :func:`parse_reference_log`) is a result, not a
    failure: its curve holds None from the first round whose models had diverged, and
    ``diverged_round`` names it. Any other early end is a failure, and nothing is kept of it.

    Resumable (a method whose ``resumable`` is set, :class:`ReferenceMethod`): the run writes a
    checkpoint at the start of an iteration at least :data:`CHECKPOINT_SECONDS` after the last
    (``out/reference-seed-<seed>.checkpoint``, :data:`BOOTSTRAP`), and a call that finds one of the
    same command, reference commit, partitions and initial models goes on from it
    (:func:`resume_point`), so a stop (Ctrl-C, a session's end) loses at most a minute or the round
    under way; the checkpoint is removed once the run is kept. Its wall and CPU
    seconds are those of the launches up to the checkpoint each one resumed, plus the last launch's;
    the work a stop lost is not counted, and the peak memory is the last launch's.

    Returns:
        ``{"curve": [accuracy by round 1..R], "initial": round 0's accuracy, "diverged_round": None
        or the first round without accuracy, "server_pairing" (:func:`read_reference_run`), "command",
        "commit", "content_digest", "initial_digest",
        "threads", "wall_seconds", "cpu_seconds", "peak_pss_gib", "launches", "iteration_seconds"}``
        (:func:`parse_iteration_seconds`) and for FedTGP ``"max_gap"`` by round
        (:func:`parse_max_gap`) (also in ``reference-seed-<seed>.json``).

    Raises:
        RuntimeError: the reference printed fewer rounds than asked for another reason, did not
            pair every client, never stored one of its ``server_items`` or did not pair its ``server_order``
            (its log's tail in the message).
    """
    done = out / f"reference-seed-{seed}.json"
    rounds = config["num-server-rounds"]
    name = f"mheterofl-crosscheck-{partitions.resolve().parent.name}"
    initial = (out / f"initial-seed-{seed}.pt").resolve()
    server_items = REFERENCE_METHODS[method].server_items
    server = (out / f"initial-server-seed-{seed}.pt").resolve() if server_items else None
    args, env, command = reference_launch(config, method, seed, name, initial, threads, server)
    initial_digest = save_initial_states({**config, "method": method, "seed": seed}, initial, server, server_items)
    key = json.loads((partitions / "config.json").read_text())["content_digest"]
    checkpoint = out / f"reference-seed-{seed}.checkpoint"
    progress = None
    try:
        if (saved := kept_reference_run(done, command, key, initial_digest, rounds)) is not None:
            return saved
        commit = git_head(reference)
        out.mkdir(parents=True, exist_ok=True)
        link_dataset(reference, name, partitions)
        log = out / f"reference-seed-{seed}.log"
        if REFERENCE_METHODS[method].resumable:
            identity = {
                "command": unplaced(command),
                "commit": commit,
                "content_digest": key,
                "initial_digest": initial_digest,
            }
            progress = resume_point(checkpoint, identity, log)
            env[CHECKPOINT_VARIABLE] = str(checkpoint.resolve())
            env[CHECKPOINT_SECONDS_VARIABLE] = str(CHECKPOINT_SECONDS)
        code, wall, cpu, peak_pss, _ = run_measured(
            [sys.executable, "-c", BOOTSTRAP, *args], reference / "system", log, env, append=progress is not None
        )
    finally:
        initial.unlink(missing_ok=True)
        if server is not None:
            server.unlink(missing_ok=True)
    text = continued_log(log.read_text(errors="replace"))
    prior = progress or {}
    result = {
        **read_reference_run(
            text, code, seed, rounds, config["num-clients"], log, server_items, REFERENCE_METHODS[method].server_order
        ),
        **({"max_gap": parse_max_gap(text, rounds)} if method == "fedtgp" else {}),
        "command": command,
        "commit": commit,
        "content_digest": key,
        "initial_digest": initial_digest,
        "threads": threads,
        "wall_seconds": prior.get("wall_seconds", 0.0) + wall,
        "cpu_seconds": prior.get("cpu_seconds", 0.0) + cpu,
        "peak_pss_gib": peak_pss / 2**30,
        "launches": prior.get("launches", 0) + 1,
        "iteration_seconds": parse_iteration_seconds(text),
    }
    done.write_text(json.dumps(result, indent=1))
    discard_checkpoint(checkpoint)
    return result
