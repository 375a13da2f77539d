"""The attacks of the privacy evaluation (``tools.privacy``) on one run's recorded payloads, cell by cell.

One cell is one (round, client, attack); :func:`run_cell` runs it with an :class:`Attacker` and writes
its rows to ``<out>/cells/`` (:func:`cell_path`), so a stopped evaluation resumes. The attacks
(``ATTACKS``; :func:`applicable`: those that have something to attack in a run):

- ``inversion``: white-box inversion of every shared vector (:func:`privacy.inversion.invert_representation`)
  through the network that made it. Server: each upload through the victim's own recorded model, beside
  two reference inputs from the same model (not payloads of any method): one image's representation and
  the per-class mean representation (a prototype), FedRE's Q2 ladder. Client: the downloaded per-class
  vectors (global prototypes, global logits) through the curious client's own model, scored against the
  other clients' images of each class.
- ``decoder``: black-box inversion (:func:`privacy.inversion.train_decoder`). Server: a surrogate of a public
  architecture (the model group's first member) fitted on auxiliary images against the method's shared
  knowledge (:func:`privacy.inversion.fit_surrogate`), then a decoder trained through it. Auxiliary images
  are the official test split, which no client owns with ``data-pool = "train"``. Client: a decoder trained
  through the curious client's own model on its own images, applied to the downloaded per-class vectors.
- ``labels``: the victim's class set and class distribution from its upload (:mod:`privacy.labels`).
- ``update``: weight uploads (LG-FedAvg's head, FML/FedKD/FedMRL's shared model, MH-pFedHN's
  ``delta_theta``, GD's ``delta_w_g``) inverted with iDLG as if one step (:func:`privacy.gradients.idlg`)
  and with inverting gradients over the real number of local steps (:func:`privacy.gradients.invert_update`).
- ``membership``: which of the victim's training examples an upload gives away (:mod:`tools.privacy_membership`):
  per-class vectors by a likelihood-ratio and a distance test through the victim's model, weight uploads
  by the loss threshold on the model as uploaded; members are the victim's training examples,
  non-members its held-out test split of the same classes.

Scores (:mod:`privacy.scores`, :func:`scored`): PSNR, SSIM and MSE (0-255 scale) of each reconstruction
against the images it stands for (one class's images, all of a client's, or the one image), best match
and mean; a per-sample input's scores to its own image beside a gray and a mean image's (``psnr_own``,
``gray_psnr_own``), a class-mean payload's beside the exact class mean's (``ceiling_mean_psnr``);
label-set precision/recall, the class distribution's L1 error and the share of the victim's class
counts revealed; membership AUC and TPR at 1 % FPR. Each row carries its cell's CPU seconds.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.nn.utils import vector_to_parameters

from common.data import class_counts, normalize
from common.files import atomic_write
from common.protocol import TRAIN, TRAIN_GLOBAL, start_snapshot_name
from methods.registry import client_procedure
from models.mh import build_mh_model
from privacy import gradients, inversion, labels, scores
from tools import privacy_membership as membership
from tools.privacy_view import CLASS_COUNTS, RunView, class_ids, class_rows, expanded, global_rows, load_kept

ATTACKS = ("inversion", "decoder", "labels", "update", "membership")
#: the message types whose replies may carry a weight change (MH-pFedHNGD's global model: ``train.global``)
WEIGHT_MESSAGES = (TRAIN, TRAIN_GLOBAL)
#: MH-pFedHN's flat weight changes (``delta_theta``; GD's global model: ``delta_w_g``) and the flat weights
#: the server sent that they change
FLAT_WEIGHTS = {"delta_theta": "theta", "delta_w_g": "w_g"}
#: the name prefixes of the inputs the server's inversion adds beside an upload (no method sends them): one
#: image's vector and the victim's class mean vector (FedRE's Q2 ladder), and the class mean vector of public
#: non-members through the victim's model (the control of what a class-mean upload shows beyond its class)
REFERENCE_INPUTS = ("per-sample ", "class mean ", "non-member class mean ")
#: recognisers trained in this process (:meth:`Attacker.recogniser`), by (dataset, model group, seed, epochs)
_RECOGNISERS: dict[tuple, torch.nn.Module] = {}


@dataclass
class Settings:
    """The attacks' budget (command-line flags).

    White-box inversion: ``prior`` ``tv`` (total variation) or ``dip`` (deep image prior, FedRE's Q2
    attack, about 5x the CPU time for +0.5 dB), ``steps``, ``lr``, ``tv_weight``: the TV setting measured
    best on CIFAR-10 CNN representations (``privacy.inversion.invert_representation``). ``images``:
    reference images per class for the scores; ``samples``: per-sample inputs of the Q2 ladder;
    ``epochs``: of the surrogate and each decoder; ``update_images``, ``update_steps``,
    ``update_tv_weight``, ``update_restarts``: inverting gradients' images (0: the real local update, as
    many as the client trained on in its batches, :meth:`Attacker.inverting_gradients`; hours of CPU per
    cell at hundreds of images, a GPU's job), iterations, L1 TV weight and restarts (Geiping et al. 2020 on
    CIFAR-10: 24,000 iterations, TV 0.2; ``--update-steps 24000`` runs the paper's budget);
    ``idlg_steps``: iDLG's L-BFGS iterations (its authors' 300);
    ``membership_examples``: membership inference's candidates per side (members, non-members) and per
    class of a per-class payload, and its public reference images per class (drawn without replacement)."""

    prior: str = "tv"
    images: int = 32
    samples: int = 4
    steps: int = 1500
    lr: float = 0.1
    tv_weight: float = 0.1
    epochs: int = 5
    update_images: int = 4
    update_steps: int = 4000
    update_tv_weight: float = 0.2
    update_restarts: int = 1
    idlg_steps: int = 300
    membership_examples: int = 256
    seed: int = 0


@dataclass
class Inverted:
    """One payload's reconstructions and what they are scored against.

    ``images``: float32 ``[n, C, H, W]`` in [0, 1]; ``references``: one uint8 tensor ``[m_i, C, H, W]``
    per row (the images the row stands for); ``exact``: per row the index in its references of the one
    image it was made from (per-sample inputs), else None; ``mean_image``: float ``[C, H, W]``, the pixel
    mean of the victim's images (the floor a per-sample reconstruction is read against beside gray);
    ``ceilings``: per row of a class-mean payload the exact pixel mean of the images the row averages
    (the best any inversion of a mean can reach), empty for other payloads; ``classes``: per row the class
    its images are of (None: several), empty where the attack names none (iDLG's one image of all classes);
    ``held``: per row whether the victim holds the row's class, empty where it does for every row (a
    label leakage that names a class the victim lacks: the row is scored against all of the victim's
    images and counts as not recognised); ``cpu_seconds``: the attack's own CPU time where a cell runs
    several (iDLG and inverting gradients), else None (the cell's)."""

    payload: str
    threat: str
    knowledge: str
    images: torch.Tensor
    references: list[torch.Tensor]
    exact: list[int | None] = field(default_factory=list)
    mean_image: torch.Tensor | None = None
    ceilings: list[torch.Tensor] = field(default_factory=list)
    cpu_seconds: float | None = None
    classes: list[int | None] = field(default_factory=list)
    held: list[bool] = field(default_factory=list)


def sample(images: torch.Tensor, count: int, generator: torch.Generator) -> torch.Tensor:
    """At most ``count`` of ``images`` drawn without replacement (all of them, in order, when fewer)."""
    if len(images) <= count:
        return images
    return images[torch.randperm(len(images), generator=generator)[:count]]


def class_images(data, labels_: list[int | None], count: int, generator: torch.Generator) -> list[torch.Tensor]:
    """Per row the client's training images of that row's class (all its images for None), at most ``count``."""
    return [sample(data.train_x if c is None else data.train_x[data.train_y == c], count, generator) for c in labels_]


def class_means(images: torch.Tensor, labels_: torch.Tensor, row_classes: list[int | None]) -> list[torch.Tensor]:
    """Per row the pixel mean float ``[C, H, W]`` in [0, 1] of ``images`` (uint8 ``[n, C, H, W]``) of that
    row's class (of all of them for None): the exact mean a class-mean payload stands for."""
    return [(images if c is None else images[labels_ == c]).float().mean(0) / 255.0 for c in row_classes]


def network(model: torch.nn.Module, space: str) -> torch.nn.Module:
    """The part of a client model that maps images to vectors of ``space``: its extractor or the whole model."""
    return model.extractor if space == "representation" else model


def vectors_of(net: torch.nn.Module, images: torch.Tensor, info, batch_size: int = 256) -> torch.Tensor:
    """``net``'s vectors float32 ``[n, w]`` of uint8 images ``[n, C, H, W]`` (normalised as in training)."""
    with torch.no_grad():
        return torch.cat([net(normalize(images[i : i + batch_size], info)) for i in range(0, len(images), batch_size)])


class Attacker:
    """Runs the attacks of one run's cells with one budget (:class:`Settings`); caches the black-box
    surrogate and decoder per round (the shared knowledge is the same for every victim of a round)."""

    def __init__(self, view: RunView, settings: Settings) -> None:
        self.view, self.settings = view, settings
        self.shape = (view.info.channels, view.info.image_size, view.info.image_size)
        self._decoders: dict[int, tuple[torch.nn.Module, torch.nn.Module, str]] = {}

    @property
    def recogniser(self) -> torch.nn.Module:
        """A classifier of the public auxiliary images (the official test split, :attr:`RunView.auxiliary`):
        the model group's first architecture with fresh weights (the run's seed + 1, no client's), trained
        with cross-entropy (Adam, lr 1e-3, batch 64, ``epochs``; :func:`privacy.inversion.fit_surrogate`
        through the whole model). It reads a reconstruction's class without matching pixels, so a
        reconstruction of a class mean, which no pixel score can tell from a flat image, is recognised or
        not. Trained once per process and dataset, model group, seed and epochs."""
        view, s = self.view, self.settings
        key = (view.cfg.dataset, view.cfg.model_group, view.cfg.seed, s.epochs)
        if key not in _RECOGNISERS:
            fresh = view.model(0, seed=view.cfg.seed + 1)
            _RECOGNISERS[key] = self.fit_on_auxiliary(fresh, torch.nn.Identity(), None, self.generator(9))
        return _RECOGNISERS[key]

    def fit_on_auxiliary(
        self,
        extractor: torch.nn.Module,
        head: torch.nn.Module | None,
        prototypes: tuple[torch.Tensor, torch.Tensor] | None,
        generator: torch.Generator,
    ) -> torch.nn.Module:
        """:func:`privacy.inversion.fit_surrogate` of ``extractor`` on the public auxiliary images with the
        attacks' schedule (Adam, lr 1e-3, batch 64, ``epochs``)."""
        aux_x, aux_y = self.view.auxiliary
        info = self.view.info
        return inversion.fit_surrogate(
            extractor,
            head,
            prototypes,
            aux_x,
            aux_y,
            info.mean,
            info.std,
            epochs=self.settings.epochs,
            batch_size=64,
            lr=1e-3,
            generator=generator,
        )

    def recognise(self, images: torch.Tensor) -> torch.Tensor:
        """The :attr:`recogniser`'s class ids int64 ``[n]`` of images float32 ``[n, C, H, W]`` in [0, 1]."""
        pixels = (images.clamp(0, 1) * 255).round().to(torch.uint8)
        return vectors_of(self.recogniser, pixels, self.view.info).argmax(1)

    def generator(self, *salt: int) -> torch.Generator:
        """A CPU RNG for one cell and purpose: the same draws whatever ran before (resumable cells)."""
        seed = self.settings.seed
        for s in salt:
            seed = seed * 1_000_003 + s
        return torch.Generator().manual_seed(seed % 2**63)

    def invert(self, net: torch.nn.Module, vectors: torch.Tensor, *salt: int) -> torch.Tensor:
        """White-box inversion of ``vectors`` through ``net`` with the settings' budget."""
        s = self.settings
        return inversion.invert_representation(
            net,
            vectors,
            self.shape,
            self.view.info.mean,
            self.view.info.std,
            steps=s.steps,
            lr=s.lr,
            tv_weight=s.tv_weight,
            generator=self.generator(*salt),
            prior=s.prior,
        )

    # ------------------------------------------------------------------ vector inversion
    def inversion(self, r: int, p: int) -> list[Inverted]:
        """White-box: the server inverts ``p``'s upload through ``p``'s model (with the two reference
        inputs); ``p``, a curious client, inverts the per-class vectors it downloaded through its own model."""
        view, g = self.view, self.generator(r, p, 1)
        model, data = view.model(p, r), view.data(p)
        out = []
        found = class_rows(view.payload(r, p, "up"))
        if found is not None:
            out += self.invert_upload(r, p, found, model, data, g)
        found = global_rows(view.payload(r, p, "down"))
        if found is not None:
            name, vectors, row_classes, space = found
            images = self.invert(network(model, space), vectors, r, p, 5)
            inverted = Inverted(name, "client", "own model", images, *self.others(p, row_classes, g))
            out.append(replace(inverted, classes=row_classes))
        return out

    def invert_upload(
        self,
        r: int,
        p: int,
        found: tuple[str, torch.Tensor, list[int | None], str],
        model: torch.nn.Module,
        data,
        g: torch.Generator,
    ) -> list[Inverted]:
        """The server's white-box inversions of ``p``'s upload (``found``: :func:`class_rows`) through ``p``'s
        model; for a per-class upload, the same attack on the class mean vector of public non-members of each
        class through the same model, scored against the same images (what the attack shows of the class
        alone); then FedRE's Q2 ladder from the same model: one image's representation
        (:meth:`invert_samples`) and the per-class mean representation (:meth:`invert_prototypes`), both
        scored against one sample of the victim's images, the one the entangled ``z`` is scored against."""
        name, vectors, row_classes, space = found
        net = network(model, space)
        images = self.invert(net, vectors, r, p, 2)
        victim_refs = sample(data.train_x, self.settings.images, g)
        refs = [victim_refs if c is None else class_images(data, [c], self.settings.images, g)[0] for c in row_classes]
        ceilings = class_means(data.train_x, data.train_y, row_classes)
        out = [Inverted(name, "server", "white-box", images, refs, ceilings=ceilings, classes=row_classes)]
        if None not in row_classes:
            out.append(self.invert_nonmembers(r, p, net, space, data, row_classes, refs, ceilings))
        return out + [
            self.invert_samples(r, p, net, space, data, victim_refs, g),
            self.invert_prototypes(r, p, net, space, data, victim_refs),
        ]

    def invert_nonmembers(
        self,
        r: int,
        p: int,
        net: torch.nn.Module,
        space: str,
        data,
        row_classes: list[int],
        refs: list[torch.Tensor],
        ceilings: list[torch.Tensor],
    ) -> Inverted:
        """Per row's class the mean vector of ``space`` (through ``net``, the victim's model) of as many
        public auxiliary images of that class as the victim holds, inverted and scored against the victim's
        images ``refs``: a reconstruction this close to the victim's images comes from the class and the
        model, not from the victim's examples."""
        aux_x, aux_y = self.view.auxiliary
        g = self.generator(r, p, 10)
        means = []
        for c in row_classes:
            held = int((data.train_y == c).sum())
            means.append(vectors_of(net, sample(aux_x[aux_y == c], max(held, 1), g), self.view.info).mean(0))
        images = self.invert(net, torch.stack(means), r, p, 11)
        return Inverted(
            "non-member class mean " + space,
            "server",
            "white-box",
            images,
            refs,
            ceilings=ceilings,
            classes=row_classes,
        )

    def invert_samples(
        self, r: int, p: int, net: torch.nn.Module, space: str, data, victim_refs: torch.Tensor, g: torch.Generator
    ) -> Inverted:
        """The ``samples`` drawn training images' own vectors of ``space`` (per-sample representations)
        inverted through ``net``, each scored against its image (``exact``) and ``victim_refs``, beside the
        victim's mean image and its class's exact pixel mean on that image."""
        s = self.settings
        picks = sample(torch.arange(len(data.train_x)), s.samples, g)
        refs = [torch.cat([data.train_x[i : i + 1], victim_refs]) for i in picks]
        single = vectors_of(net, data.train_x[picks], self.view.info)
        images = self.invert(net, single, r, p, 3)
        mean_image = data.train_x.float().mean(0) / 255.0
        classes = [int(data.train_y[i]) for i in picks]
        ceilings = class_means(data.train_x, data.train_y, classes)
        return Inverted(
            "per-sample " + space,
            "server",
            "white-box",
            images,
            refs,
            [0] * len(picks),
            mean_image,
            ceilings,
            classes=classes,
        )

    def invert_prototypes(
        self, r: int, p: int, net: torch.nn.Module, space: str, data, victim_refs: torch.Tensor
    ) -> Inverted:
        """The mean vector of ``space`` of each class ``p`` holds (its prototype), computed by ``net`` and
        inverted through it, scored against ``victim_refs``, with each class's exact pixel mean as ceiling."""
        classes = sorted(int(c) for c in data.train_y.unique())
        means = torch.stack([vectors_of(net, data.train_x[data.train_y == c], self.view.info).mean(0) for c in classes])
        images = self.invert(net, means, r, p, 4)
        ceilings = class_means(data.train_x, data.train_y, classes)
        return Inverted(
            "class mean " + space,
            "server",
            "white-box",
            images,
            [victim_refs] * len(classes),
            ceilings=ceilings,
            classes=classes,
        )

    def others(
        self, p: int, row_classes: list[int], g: torch.Generator
    ) -> tuple[list[torch.Tensor], list[int | None], None, list[torch.Tensor]]:
        """(references, exact, mean image, ceilings) of :class:`Inverted` for a curious client's downloaded
        per-class vectors: per class a sample of the other clients' training images of it (what its
        reconstruction could reveal; empty for a class no other client holds) and their exact pixel mean."""
        pools = [self.view.data(q) for q in range(self.view.num_clients) if q != p]
        refs, ceilings = [], []
        for c in row_classes:
            held = torch.cat([d.train_x[d.train_y == c] for d in pools])
            refs.append(sample(held, self.settings.images, g))
            ceilings.append(held.float().mean(0) / 255.0 if len(held) else torch.zeros(self.shape))
        return refs, [], None, ceilings

    # ------------------------------------------------------------------ black-box decoder
    def decoder(self, r: int, p: int) -> list[Inverted]:
        """Black-box: the server decodes ``p``'s upload with a decoder trained on auxiliary images through a
        surrogate fitted to the round's shared knowledge; ``p``, a curious client, decodes the per-class
        vectors it downloaded with a decoder trained on its own images through its own model."""
        view, s, out = self.view, self.settings, []
        g = self.generator(r, p, 6)
        found = class_rows(view.payload(r, p, "up"))
        if found is not None:
            name, vectors, row_classes, space = found
            decoder, surrogate_space = self.surrogate_decoder(r, p, space)
            images = inversion.decode(decoder, vectors)
            data = view.data(p)
            out.append(
                Inverted(
                    name,
                    "server",
                    f"black-box ({surrogate_space})",
                    images,
                    class_images(data, row_classes, s.images, g),
                    ceilings=class_means(data.train_x, data.train_y, row_classes),
                    classes=row_classes,
                )
            )
        found = global_rows(view.payload(r, p, "down"))
        if found is not None:
            name, vectors, row_classes, space = found
            net, data = network(view.model(p, r), space), view.data(p)
            decoder = inversion.train_decoder(
                net, data.train_x, view.info.mean, view.info.std, epochs=s.epochs, batch_size=64, lr=1e-3, generator=g
            )
            images = inversion.decode(decoder, vectors)
            inverted = Inverted(name, "client", "own model + decoder", images, *self.others(p, row_classes, g))
            out.append(replace(inverted, classes=row_classes))
        return out

    def surrogate_decoder(self, r: int, p: int, space: str) -> tuple[torch.nn.Module, str]:
        """(decoder, how the surrogate was aligned) of round ``r``: a public architecture (the model group's
        first member, freshly initialised) fitted on the auxiliary images against the knowledge ``p`` was
        sent (:meth:`alignment`), then a decoder."""
        if r in self._decoders:
            return self._decoders[r][1], self._decoders[r][2]
        view, s = self.view, self.settings
        aux_x, _ = view.auxiliary
        g = self.generator(r, 7)
        how, extractor, head, prototypes = self.alignment(view.model(0), view.payload(r, p, "down"), space)
        fitted = self.fit_on_auxiliary(extractor, head, prototypes, g)
        decoder = inversion.train_decoder(
            fitted, aux_x, view.info.mean, view.info.std, epochs=s.epochs, batch_size=64, lr=1e-3, generator=g
        )
        self._decoders = {r: (fitted, decoder, how)}
        return decoder, how

    def alignment(
        self, surrogate: torch.nn.Module, down: dict, space: str
    ) -> tuple[str, torch.nn.Module, torch.nn.Module | None, tuple[torch.Tensor, torch.Tensor] | None]:
        """(how, the part of ``surrogate`` that maps images to ``space``, the head it is fitted through or
        None, the prototypes it is fitted to or None) for a round whose download is ``down``: a global head
        (held fixed), global prototypes (``[num_classes, w]`` and the mask of the classes they stand for),
        else plain cross-entropy on the auxiliary data (for logits through the whole model)."""
        if space == "logits":
            return "cross-entropy on auxiliary data", surrogate, torch.nn.Identity(), None
        if "head.weight" in down:
            head = torch.nn.Linear(*down["head.weight"].shape[::-1])
            head.load_state_dict(
                {"weight": torch.from_numpy(down["head.weight"]), "bias": torch.from_numpy(down["head.bias"])}
            )
            return "global head", surrogate.extractor, head, None
        found = global_rows(down)
        if found is not None:
            _, vectors, classes, _ = found
            full = torch.zeros(self.view.info.num_classes, vectors.shape[1])
            valid = torch.zeros(self.view.info.num_classes, dtype=torch.bool)
            full[classes], valid[classes] = vectors, True
            return "global prototypes", surrogate.extractor, None, (full, valid)
        return "cross-entropy on auxiliary data", surrogate.extractor, surrogate.head, None

    # ------------------------------------------------------------------ weight updates
    def weight_update(
        self, r: int, p: int, message_type: str = "train"
    ) -> tuple[torch.nn.Module, dict, dict[str, torch.Tensor]] | None:
        """(model, its parameters as the client received them, the change the client uploaded per
        parameter) of ``p``'s round-``r`` weight upload in a ``message_type`` reply, or None for an
        upload of vectors (or none).

        MH-pFedHN: the generated flat weights ``theta`` in the client's architecture (the server generates
        them, so it knows it), ``delta_theta`` their change; MH-pFedHNGD's ``train.global`` reply: ``w_g``
        in the public global architecture, ``delta_w_g``. Shared-model methods: the module every client
        trains a copy of (FedKD's SVD factors multiplied out), up minus down. LG-FedAvg: the head's change,
        on the victim's recorded extractor held fixed (white-box: the extractor never leaves the client)."""
        view = self.view
        up, down = view.payload(r, p, "up", message_type), view.payload(r, p, "down", message_type)
        if not up or class_rows(up) is not None or class_ids(up) is not None or "z" in up:
            return None
        if CLASS_COUNTS & set(up):  # FedGen: its head beside the counts, and beside the generator in the download
            up = {k: v for k, v in up.items() if k not in CLASS_COUNTS}
            down = {k: down[k] for k in up}
        name = next((k for k in FLAT_WEIGHTS if k in up), None)
        if name is not None:
            model, change = self.flat_update(p, name, up, down)
        else:
            model, change = self.module_update(r, p, up, down)
        start = {k: v.detach().clone() for k, v in model.named_parameters()}
        return model.eval(), start, change

    def flat_update(self, p: int, name: str, up: dict, down: dict) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
        """(model holding the flat weights the server sent, the change per parameter) of MH-pFedHN's flat
        weight upload ``name`` (:data:`FLAT_WEIGHTS`): ``delta_theta`` in ``p``'s architecture, ``delta_w_g``
        in the public global architecture."""
        view = self.view
        if name == "delta_theta":
            model = view.model(p)
        else:
            info = view.info
            model = build_mh_model(
                view.method.read_options(view.cfg).global_model, info.num_classes, info.channels, info.image_size
            )
        vector_to_parameters(torch.from_numpy(down[FLAT_WEIGHTS[name]]).clone(), model.parameters())
        return model, gradients.parameter_update(model, up[name])

    def module_update(self, r: int, p: int, up: dict, down: dict) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
        """(model holding the downloaded weights, the change per parameter: up minus down) of a shared
        module's upload: LG-FedAvg's head on ``p``'s round-``r`` extractor held fixed, else the module every
        client trains a copy of (:meth:`shared_module`; FedKD's SVD factors multiplied out)."""
        if set(up) == {"head.weight", "head.bias"}:
            model = FixedExtractor(self.view.model(p, r))
        else:
            model = self.shared_module()
        shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        up, down = expanded(up, shapes), expanded(down, shapes)
        model.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in down.items()}, strict=False)
        # the buffers the victim's training left, sent up with the weights (BatchNorm's running statistics of
        # this round), as the victim's model ran with them; the weights start from what the server sent
        trained = dict(model.named_parameters())
        buffers = {k: torch.from_numpy(np.asarray(v)) for k, v in up.items() if k not in trained and k in shapes}
        model.load_state_dict(buffers, strict=False)
        return model, gradients.parameter_update(model, {k: np.asarray(up[k]) - np.asarray(down[k]) for k in up})

    def shared_module(self) -> torch.nn.Module:
        """The module a shared-model method's clients train a copy of (its server half's ``build_shared``)."""
        server = self.view.method.server
        return server.build_shared(self.view.cfg, self.view.method.read_options(self.view.cfg))

    def update(self, r: int, p: int) -> list[Inverted]:
        """iDLG on ``p``'s round-``r`` weight change read as one gradient (-change / lr), and inverting
        gradients over the client's real number of local SGD steps (its lr, momentum, weight decay), the
        labels from the change's label leakage. MH-pFedHNGD's global model's change is attacked the same way
        (its appendix C.8 runs iDLG on it)."""
        out = []
        for message_type in WEIGHT_MESSAGES:
            found = self.weight_update(r, p, message_type)
            if found is not None:
                prefix = "" if message_type == "train" else "global model: "
                out += [replace(inv, payload=prefix + inv.payload) for inv in self.invert_weights(r, p, *found)]
        return out

    def invert_weights(
        self, r: int, p: int, model: torch.nn.Module, start: dict, change: dict[str, torch.Tensor]
    ) -> list[Inverted]:
        """iDLG (:meth:`idlg`) and inverting gradients (:meth:`inverting_gradients`) on one weight change
        of ``p`` in round ``r`` (see :meth:`update`)."""
        data, g = self.view.data(p), self.generator(r, p, 8)
        start_time = time.process_time()
        label, one_step = self.idlg(model, change, data, g)
        one_step.cpu_seconds, start_time = time.process_time() - start_time, time.process_time()
        inverted = self.inverting_gradients(r, p, model, start, change, data, label, g)
        inverted.cpu_seconds = time.process_time() - start_time
        return [one_step, inverted]

    def idlg(
        self, model: torch.nn.Module, change: dict[str, torch.Tensor], data, g: torch.Generator
    ) -> tuple[int, Inverted]:
        """(the label iDLG recovers, its one image scored against a sample of the client's images, beside the
        pixel mean of all of them: an image that shows no one example) of ``change`` read as one gradient
        (-change / lr)."""
        view, s = self.view, self.settings
        label, image = gradients.idlg(
            model,
            {k: -v / view.cfg.lr for k, v in change.items()},
            self.shape,
            view.info.mean,
            view.info.std,
            steps=s.idlg_steps,
            generator=g,
        )
        refs = [sample(data.train_x, s.images, g)]
        ceilings = class_means(data.train_x, data.train_y, [None])
        return label, Inverted(
            "update as one gradient (iDLG)", "server", "white-box", image[None], refs, ceilings=ceilings
        )

    def inverting_gradients(
        self,
        r: int,
        p: int,
        model: torch.nn.Module,
        start: dict,
        change: dict[str, torch.Tensor],
        data,
        label: int,
        g: torch.Generator,
    ) -> Inverted:
        """``update_images`` images inverted from ``change`` over the client's real number of local SGD
        steps (its lr, momentum, weight decay) of its own loss (:meth:`local_training`), labelled by the
        change's label leakage (iDLG's ``label`` without any), each scored against the images of its label,
        beside that class's exact pixel mean (what a reconstruction that shows the class and no one example
        scores) and recognised as that class or not. A label the leakage names wrongly, a class the victim
        holds no image of, still counts: its reconstructions are scored against all of the victim's images
        (beside their pixel mean) and count as not recognised (``Inverted.held``).

        ``update_images`` 0 simulates the real local update: as many images as the client trained on (the
        reply's ``num-examples`` tells the server), in batches of its ``batch-size``, their labels in the
        proportions the change's label leakage estimates (:func:`labels_in_proportion`). Not simulated even
        then: the client's batch order, its augmentation and BatchNorm's batch statistics (eval mode)."""
        view, s, cfg = self.view, self.settings, self.view.cfg
        steps = cfg.local_epochs * -(-len(data.train_x) // cfg.batch_size)
        leaked = self.update_labels(change)
        chosen = [int(c) for c in leaked.classes] if leaked is not None and len(leaked.classes) else [label]
        real = s.update_images == 0  # the real local update: as many images as the client trained on, its batches
        count = len(data.train_x) if real else s.update_images
        if real and leaked is not None and leaked.distribution is not None:
            batch_labels = labels_in_proportion(leaked.distribution, count, g)
        else:
            batch_labels = torch.tensor([chosen[i % len(chosen)] for i in range(count)])
        trained, start, change, loss, knowledge = self.local_training(r, p, model, start, change)
        images = gradients.invert_update(
            trained,
            start,
            change,
            num_images=count,
            labels=batch_labels,
            local_steps=steps,
            lr=cfg.lr,
            batch_size=cfg.batch_size if real else count,
            image_shape=self.shape,
            mean=view.info.mean,
            std=view.info.std,
            steps=s.update_steps,
            attack_lr=0.1,
            tv_weight=s.update_tv_weight,
            restarts=s.update_restarts,
            generator=g,
            momentum=cfg.momentum,
            weight_decay=cfg.weight_decay,
            loss=loss,
            matched=list(change),
        )
        rows = [int(c) for c in batch_labels]
        held = [bool((data.train_y == c).any()) for c in rows]
        scored_against = [c if h else None for c, h in zip(rows, held, strict=True)]
        refs = class_images(data, scored_against, s.images, g)
        ceilings = class_means(data.train_x, data.train_y, scored_against)
        name = f"update over {steps} steps (inverting gradients)"
        return Inverted(name, "server", knowledge, images, refs, ceilings=ceilings, classes=rows, held=held)

    def local_training(
        self, r: int, p: int, model: torch.nn.Module, start: dict, change: dict[str, torch.Tensor]
    ) -> tuple[torch.nn.Module, dict, dict[str, torch.Tensor], gradients.TrainingLoss, str]:
        """(the module ``p``'s local training optimised in round ``r``, its parameters at the start, ``change``
        named in it, the loss, what the attacker knows) that :func:`privacy.gradients.invert_update` simulates.

        A shared module that the method's client trains together with its private models (a client with
        ``local_training``: FML's meme model, FedKD's mentee with the alignment map, FedMRL's small model in
        the fused one) is simulated in that whole module under the method's own loss, from the private
        models as the victim kept them at the start of the round (:func:`common.protocol.start_snapshot_name`;
        knowledge ``white-box + private models``); the shared module holds what the server sent and the
        buffers of the victim's upload, as ``model``. Any other weight change (a shared module trained alone,
        LG-FedAvg's head, MH-pFedHN's generated weights): ``model`` itself under cross-entropy.

        Raises:
            ConfigError: the victim's start of the round was not kept (a run recorded before this version).
        """
        procedure = self.procedure
        own = getattr(procedure, "local_training", None)
        shared_names = {name for name, _ in model.named_parameters()}
        if own is None or isinstance(model, FixedExtractor) or set(change) != shared_names:
            return model, start, change, gradients.cross_entropy_loss, "white-box"
        private = self.view.model(p)  # the architecture; the start of the round is loaded below
        shared = copy.deepcopy(model)
        trained, supervised = own(StartOfTraining(private), shared)
        load_kept(trained, self.view.kept_state(p, start_snapshot_name(r)), p)
        shared.load_state_dict(model.state_dict())  # what the server sent, with the upload's buffers
        trained.eval()
        names = {id(w): name for name, w in trained.named_parameters()}
        change = {names[id(w)]: change[name] for name, w in shared.named_parameters()}
        start = {name: w.detach().clone() for name, w in trained.named_parameters()}
        return trained, start, change, gradients.training_loss(supervised), "white-box + private models"

    @cached_property
    def procedure(self):
        """The method's client procedure for the run's config (``methods.registry.client_procedure``)."""
        return client_procedure(self.view.cfg)

    # ------------------------------------------------------------------ labels
    def update_labels(self, change: dict[str, torch.Tensor]) -> labels.LabelInference | None:
        """The label leakage of a weight change (its last layer with C outputs), or None without one."""
        C = self.view.info.num_classes
        weights = [k for k, v in change.items() if v.dim() == 2 and v.shape[0] == C]
        if not weights:
            return None
        key = weights[-1]
        return labels.from_head_update(delta_bias=change.get(key.rsplit(".", 1)[0] + ".bias"), delta_weight=change[key])

    def labels(self, r: int, p: int) -> list[dict[str, Any]]:
        """Label-set precision/recall and the class distribution's L1 error of what ``p``'s upload reveals
        (:meth:`inferred_labels`)."""
        truth = class_counts(self.view.data(p).train_y, self.view.info.num_classes)
        return [label_row(payload, result, truth) for payload, result in self.inferred_labels(r, p)]

    def inferred_labels(self, r: int, p: int) -> list[tuple[str, labels.LabelInference]]:
        """(payload, the labels it reveals) of each part of ``p``'s round-``r`` upload that reveals some:
        per-class vectors' class ids (also of rows read for nothing else, :func:`tools.privacy_view.class_ids`),
        FedRE's entangled label ``y``, FedGen's per-class counts, a weight change's last layer (also of
        MH-pFedHNGD's global model)."""
        up = self.view.payload(r, p, "up")
        C = self.view.info.num_classes
        inferred = []
        found = class_rows(up)
        if found is not None and found[0] != "z":
            inferred.append((found[0] + " class ids", labels.from_class_ids(np.asarray(found[2]), C)))
        if (ids := class_ids(up)) is not None:
            inferred.append((ids[0] + " class ids", labels.from_class_ids(np.asarray(ids[1]), C)))
        if "y" in up:
            inferred.append(("entangled label y", labels.from_soft_label(up["y"][0])))
        for name in CLASS_COUNTS & set(up):
            inferred.append((name, labels.from_class_counts(up[name])))
        for message_type in WEIGHT_MESSAGES:
            weight = self.weight_update(r, p, message_type)
            leaked = None if weight is None else self.update_labels(weight[2])
            if leaked is not None:
                prefix = "" if message_type == "train" else "global model: "
                inferred.append((prefix + "weight change (last layer)", leaked))
        return inferred

    # ------------------------------------------------------------------ membership
    def membership(self, r: int, p: int) -> list[dict[str, Any]]:
        """Membership inference on ``p``'s round-``r`` upload: one row for its per-class vectors
        (:meth:`vector_membership`) and one per weight upload (:meth:`loss_membership`; MH-pFedHNGD's
        global model's too)."""
        view, g = self.view, self.generator(r, p, 9)
        data, rows = view.data(p), []
        up = view.payload(r, p, "up")
        found = class_rows(up)
        if found is not None:
            rows.append(self.vector_membership(r, p, found, up.get("y"), data, g))
        for message_type in WEIGHT_MESSAGES:
            weight = self.weight_update(r, p, message_type)
            if weight is not None:
                prefix = "" if message_type == "train" else "global model: "
                rows.append(self.loss_membership(weight[0], weight[2], data, prefix, g))
        return rows

    def candidates(self, images: torch.Tensor, labels_: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, ...]:
        """At most ``membership_examples`` of (uint8 images ``[n, C, H, W]``, int64 labels ``[n]``), the
        same draw from both."""
        picks = sample(torch.arange(len(images)), self.settings.membership_examples, g)
        return images[picks], labels_[picks]

    def vector_membership(
        self, r: int, p: int, found: tuple, soft_label: np.ndarray | None, data, g: torch.Generator
    ) -> dict[str, Any]:
        """The likelihood-ratio and distance tests (:mod:`tools.privacy_membership`) of ``p``'s uploaded
        per-class vectors (``found``: :func:`class_rows`) through ``p``'s round-``r`` model (white-box).

        Row of class c: members are ``p``'s training examples of c, non-members its test examples of c,
        the reference the mean vector of the auxiliary images of c (public, owned by no client). FedRE's
        z (class None, ``[1, w]``) stands for every class, weighted by its soft label ``y`` (``[1, C]``; z
        is Σ_c y_c times class c's mean vector, ``methods.fedre``), so members are all training
        examples, non-members all test examples, and the reference Σ_c y_c · (class c's auxiliary mean).
        Scores of every row are pooled into one ROC curve (one threshold for the whole upload). A row of a
        class the victim holds no training or test example of is left out (its scores are null when no
        row is left).

        Raises:
            ConfigError: the run has no public auxiliary images (``RunView.auxiliary``).
        """
        view, cap = self.view, self.settings.membership_examples
        name, vectors, row_classes, space = found
        net = network(view.model(p, r), space)
        aux_x, aux_y = view.auxiliary
        # every class's public mean vector: the non-member centre the likelihood ratio compares against
        classes = range(view.info.num_classes)
        centres = torch.stack([vectors_of(net, sample(aux_x[aux_y == c], cap, g), view.info).mean(0) for c in classes])
        scores_ = {"ratio": ([], []), "distance": ([], [])}
        for i, c in enumerate(row_classes):
            if c is None:
                weights = torch.from_numpy(np.asarray(soft_label[i], dtype=np.float32))
                reference = weights @ centres / weights.sum()
                train, test = data.train_x, data.test_x
            else:
                reference = centres[c]
                train, test = data.train_x[data.train_y == c], data.test_x[data.test_y == c]
            if len(train) == 0 or len(test) == 0:  # a DP release's noisy count can keep a class not held
                continue
            for side, images in enumerate((train, test)):
                f = vectors_of(net, sample(images, cap, g), view.info)
                scores_["ratio"][side].append(membership.likelihood_ratio_scores(f, vectors[i], reference))
                scores_["distance"][side].append(membership.distance_scores(f, vectors[i]))
        if scores_["ratio"][0]:
            ratio = membership.roc_summary(*(np.concatenate(s) for s in scores_["ratio"]))
            distance = membership.roc_summary(*(np.concatenate(s) for s in scores_["distance"]))
        else:  # no row of a class the victim holds: nothing to test (null scores)
            ratio = distance = {"auc": None, "tpr_at_1pct_fpr": None}
        return {
            "payload": name,
            "threat": "server",
            "knowledge": "white-box + public class means",
            "mia_auc": ratio["auc"],
            "mia_tpr_at_1pct_fpr": ratio["tpr_at_1pct_fpr"],
            "mia_distance_auc": distance["auc"],
            "mia_distance_tpr_at_1pct_fpr": distance["tpr_at_1pct_fpr"],
            "mia_members": sum(len(s) for s in scores_["ratio"][0]),
            "mia_nonmembers": sum(len(s) for s in scores_["ratio"][1]),
        }

    def loss_membership(
        self, model: torch.nn.Module, change: dict[str, torch.Tensor], data, prefix: str, g: torch.Generator
    ) -> dict[str, Any]:
        """Yeom et al.'s loss threshold (:func:`tools.privacy_membership.loss_scores`) on the model as the
        victim uploaded it: ``model`` (holding the weights it was sent, :meth:`weight_update`) plus
        ``change``. Members: the victim's training examples; non-members: its test split. LG-FedAvg's head
        runs on the victim's recorded extractor (white-box); the other uploads are whole models the
        server holds (MH-pFedHN's with the BatchNorm buffers of initialisation: they are not uploaded)."""
        with torch.no_grad():
            for key, param in model.named_parameters():
                param.add_(change[key])
        members = membership.loss_scores(model, *self.candidates(data.train_x, data.train_y, g), self.view.info)
        nonmembers = membership.loss_scores(model, *self.candidates(data.test_x, data.test_y, g), self.view.info)
        found = membership.roc_summary(members, nonmembers)
        head_only = isinstance(model, FixedExtractor)
        return {
            "payload": prefix + ("head as uploaded" if head_only else "model as uploaded"),
            "threat": "server",
            "knowledge": "white-box extractor + upload" if head_only else "upload (loss threshold)",
            "mia_auc": found["auc"],
            "mia_tpr_at_1pct_fpr": found["tpr_at_1pct_fpr"],
            "mia_members": len(members),
            "mia_nonmembers": len(nonmembers),
        }


def label_row(payload: str, result: labels.LabelInference, truth: np.ndarray) -> dict[str, Any]:
    """One table row of a payload's label leakage against the victim's class counts ``truth`` ``[C]``:
    label-set precision and recall, the class distribution's L1 error where the payload reveals one, and
    the share of the victim's class counts it reveals exactly or within ±10 % beside what the class set
    alone gives (``counts_exact``, ``counts_within_10pct``, ``set_only_within_10pct``, ``classes_held``:
    :func:`tools.privacy_membership.count_leakage`, with the victim's example count n, which the
    handshake discloses)."""
    precision, recall = labels.label_set_scores(result.classes, truth)
    row = {
        "payload": payload,
        "threat": "server",
        "knowledge": "payload only",
        "label_precision": precision,
        "label_recall": recall,
    }
    if result.distribution is not None:
        row["distribution_l1"] = labels.distribution_l1(result.distribution, truth)
    return row | membership.count_leakage(result.distribution, int(truth.sum()), truth)


class StartOfTraining:
    """What a client procedure's ``local_training`` reads of a client, for the attacker's simulation: the
    victim's personal model (``model``), the CPU, and no state record (``restore`` finds none: the victim's
    kept start of the round is loaded over the whole module afterwards, :meth:`Attacker.local_training`)."""

    device = torch.device("cpu")

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def restore(self, name: str, module: torch.nn.Module) -> bool:
        """Finds nothing (False): the module keeps its initialisation until the kept start is loaded."""
        return False


class FixedExtractor(torch.nn.Module):
    """A client model whose only parameters are its head's (``head.weight``, ``head.bias``): the extractor
    is applied but held fixed, as LG-FedAvg's payload covers the head alone."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.frozen = [model.extractor.eval()]  # a list: not registered, so its weights are no parameters
        self.head = model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, C]`` of images ``[B, C_in, H, W]``."""
        return self.head(self.frozen[0](x))


def scored(
    inverted: Inverted, recognise: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> tuple[dict[str, Any], list[tuple]]:
    """One table row of a payload's reconstructions and its figure pairs (shown original, reconstruction,
    caption).

    Per reconstruction: PSNR / SSIM / MSE against the best-matching image among those it stands for and
    the mean over them (:func:`privacy.scores.image_scores`), and ``gray_psnr`` / ``gray_mean_psnr``: what
    a uniform mid-gray image scores on the same images. A best match over many images is an order
    statistic that a flat image wins too, so it is no floor on its own (``results/privacy/calibration/``).
    The floors that can fire:

    - per-sample inputs (``exact``): ``psnr_own`` / ``ssim_own`` to the one image the input was made
      from, beside ``gray_psnr_own`` / ``gray_ssim_own`` and ``mean_image_psnr_own`` /
      ``mean_image_ssim_own`` of the gray image and of the victim's mean image on that image, and, with
      ``ceilings`` (its class's exact pixel mean), ``class_mean_psnr_own`` / ``class_mean_ssim_own``
      (:func:`privacy.scores.own_image_scores`);
    - class-mean payloads (``ceilings``): ``ceiling_psnr`` (best) and ``ceiling_mean_psnr`` (mean over the
      images) of the exact pixel mean of the row's images, the best a reconstruction of a mean can do,
      beside the reconstruction's ``best_psnr`` / ``mean_psnr`` and gray's.

    Recognisability, which needs no pixel match, where the rows have classes (``Inverted.classes``) and a
    classifier ``recognise`` (float images ``[n, C, H, W]`` in [0, 1] -> class ids ``[n]``;
    :meth:`Attacker.recognise`) is given: ``recognised``, the fraction of reconstructions it assigns their
    row's class (chance: one over the number of classes; a row whose class the victim lacks,
    ``Inverted.held``, counts as not recognised), and ``ceiling_recognised``, the same of the exact class
    means (over the rows of a class the victim holds).

    The row holds mean and std over reconstructions (all in dB but SSIM, MSE and the fractions), ``n``
    the reconstructions scored and ``<key>_n`` where a key counts fewer (``ceiling_recognised`` over the
    rows of a class the victim holds), and ``attack_cpu_seconds`` where the attack was timed on its own
    (``Inverted.cpu_seconds``)."""
    per: dict[str, list] = {}
    pairs = []
    for i, (image, refs) in enumerate(zip(inverted.images, inverted.references, strict=True)):
        if len(refs) == 0:  # a class no victim holds
            continue
        result = scores.image_scores(image[None], refs)
        gray = scores.image_scores(torch.full_like(image[None], 0.5), refs)
        found = {k: v for k, v in result.items() if k != "best_index"}
        found |= {"gray_psnr": gray["best_psnr"], "gray_mean_psnr": gray["mean_psnr"]}
        exact = inverted.exact[i] if inverted.exact else None
        if exact is not None:
            means = inverted.ceilings[i][None] if inverted.ceilings else None
            found |= scores.own_image_scores(image[None], refs[exact : exact + 1], inverted.mean_image, means)
        if inverted.ceilings:
            ceiling = scores.image_scores(inverted.ceilings[i][None], refs)
            found |= {"ceiling_psnr": ceiling["best_psnr"], "ceiling_mean_psnr": ceiling["mean_psnr"]}
        for k, v in found.items():
            per.setdefault(k, []).extend(v)
        shown = result["best_index"][0] if exact is None else exact
        psnr = scores.image_scores(image[None], refs[shown : shown + 1])["best_psnr"][0]
        pairs.append((refs[shown], image, f"{psnr:.1f} dB"))
    known = [i for i, c in enumerate(inverted.classes) if c is not None and len(inverted.references[i])]
    if recognise is not None and known:
        truth = torch.tensor([inverted.classes[i] for i in known])
        held = torch.tensor([inverted.held[i] if inverted.held else True for i in known])
        per["recognised"] = ((recognise(inverted.images[known]) == truth) & held).float().tolist()
        if inverted.ceilings and held.any():
            ceilings = torch.stack([inverted.ceilings[i] for i, h in zip(known, held, strict=True) if h])
            per["ceiling_recognised"] = (recognise(ceilings) == truth[held]).float().tolist()
    row: dict[str, Any] = {"payload": inverted.payload, "threat": inverted.threat, "knowledge": inverted.knowledge}
    if inverted.cpu_seconds is not None:
        row["attack_cpu_seconds"] = inverted.cpu_seconds
    for k, values in per.items():
        summary = scores.summarize(values)
        row[k], row[k + "_std"] = summary["mean"], summary["std"]
        if len(values) != len(pairs):
            row[k + "_n"] = len(values)
    if pairs:
        row["n"] = len(pairs)
    return row, pairs


def cell_path(out: Path, r: int, p: int, attack: str) -> Path:
    """The result file of one (round, client, attack) cell."""
    return out / "cells" / f"round-{r}-partition-{p}-{attack}.json"


def run_cell(attacker: Attacker, r: int, p: int, attack: str, out: Path) -> dict[str, Any]:
    """Run one cell, write its rows (and its reconstructions' first figure pair per payload, as uint8)
    atomically, and return them. Rows with ``recognised`` also carry ``recogniser_accuracy``: the
    recogniser's share of the victim's real training images it classifies right (its own calibration)."""
    start = time.process_time()
    if attack in ("labels", "membership"):
        rows, pairs = getattr(attacker, attack)(r, p), []
    else:
        rows, pairs = [], []
        for inverted in getattr(attacker, attack)(r, p):
            row, payload_pairs = scored(inverted, attacker.recognise)
            rows.append(row)
            if payload_pairs:
                original, image, caption = payload_pairs[0]
                pairs.append(
                    {
                        "payload": f"{inverted.payload}\n{inverted.threat}, {inverted.knowledge}",
                        "caption": caption,
                        "original": to_uint8(original).tolist(),
                        "reconstruction": to_uint8(image).tolist(),
                    }
                )
    seconds = time.process_time() - start
    if any("recognised" in row for row in rows):  # the recogniser's own accuracy on the victim's real images
        data = attacker.view.data(p)
        accuracy = float((attacker.recognise(data.train_x.float() / 255) == data.train_y).float().mean())
        for row in rows:
            row["recogniser_accuracy"] = accuracy
    for row in rows:
        row.update({"round": r, "partition": p, "attack": attack, "cpu_seconds": seconds})
    cell = {"rows": rows, "figure": pairs, "settings": asdict(attacker.settings)}
    path = cell_path(out, r, p, attack)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(cell, allow_nan=True).encode("utf-8")
    atomic_write(path, lambda f: f.write(text))
    return cell


def to_uint8(image: torch.Tensor) -> np.ndarray:
    """An image ``[C, H, W]`` (uint8, or float in [0, 1]) as uint8."""
    return image.numpy() if image.dtype == torch.uint8 else (image.clamp(0, 1) * 255).round().to(torch.uint8).numpy()


def labels_in_proportion(distribution: np.ndarray, count: int, g: torch.Generator) -> torch.Tensor:
    """int64 ``[count]``: class c ``round(count · distribution[c])`` times (largest remainders, so the counts
    sum to ``count``), in an order drawn from ``g`` (a client's batches mix its classes)."""
    exact = np.asarray(distribution, dtype=np.float64) * count
    counts = np.floor(exact).astype(np.int64)
    counts[np.argsort(counts - exact, kind="stable")[: count - int(counts.sum())]] += 1
    labels_ = torch.from_numpy(np.repeat(np.arange(len(counts)), counts))
    return labels_[torch.randperm(count, generator=g)]


def applicable(view: RunView) -> list[str]:
    """The attacks that have something to attack in this run's recorded uploads."""
    r = view.rounds()[0]
    up = view.payload(r, view.partitions(r)[0], "up")
    if not up:
        return []
    if class_ids(up) is not None:  # rows no attack here inverts or tests: their class ids only
        return ["labels"]
    vectors = class_rows(up) is not None
    return ["inversion", "decoder", "labels", "membership"] if vectors else ["labels", "update", "membership"]
