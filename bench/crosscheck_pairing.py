"""Paired cross-checks: both implementations start from our initial weights, with one thread count.

An unpaired cross-check compares two random starts: for the same seed HtFLlib's ``BaseHeadSplit``
draws other initial weights than our model group (torchvision's ResNet-18 is built there with its
10-class layer, here with its 1000-class one, which shifts every later draw; FedAvgCNN differs in
its head), and PyTorch's thread count changes the order of float sums (ours trains each client on
one thread, HtFLlib on PyTorch's default). Both move the curve by more than the seed spread.

So :func:`save_initial_states` writes every client's initial model exactly as our client builds it
(:attr:`common.runtime.ClientRuntime.model` for the run config and seed), the cross-check's bootstrap
loads them into HtFLlib's client models right after HtFLlib builds them (:func:`paired_state`), and
both sides run :data:`CLIENT_THREADS` threads. A method whose server starts from a module of its own
(LG-FedAvg's and FedGH's head, the shared model of FML, FedKD and FedMRL) has it paired the same way
where the architectures agree: :func:`server_initial_state` is what our server starts from, loaded
into HtFLlib's server's module the first time HtFLlib stores it (FedTGP's trainable prototypes too:
their generator's weights, which our server's global arrays show only after round 1; FedGen's head and
its generator, two modules). FedTGP's and
FedGH's servers also train on the round's uploads in shuffled mini-batches: :class:`ServerOrder` gives
HtFLlib's server ours, the rows in our order and the batches of our generator and seed.

This module imports only torch at its top: the bootstrap imports it inside HtFLlib's process.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path

import torch

#: PyTorch intra-op threads of one client on both sides: ours runs each ClientApp in a Ray actor with
#: ``--cpus-per-client`` CPUs (tools.run, default 1), and Ray sets ``OMP_NUM_THREADS`` to an actor's
#: CPUs, which PyTorch and numpy's BLAS take as their thread count; HtFLlib's process gets
#: ``torch.set_num_threads`` and ``OMP_NUM_THREADS`` (numpy's BLAS: FedKD's SVD)
CLIENT_THREADS = 1


def paired_state(source: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor], what: str) -> dict:
    """``source``'s tensors under ``target``'s names, matched by order (state-dict order: parameters
    and buffers module by module, the same walk for both when the architectures are the same).

    Args:
        source: a state dict to export, e.g. our ``SplitModel``'s (``extractor.0.conv1.weight``, ...,
            ``head.bias``).
        target: the state dict of the model to load it into, e.g. HtFLlib's ``BaseHeadSplit``
            (``base.conv1.weight``, ..., ``head.bias``).
        what: names the model in an error (e.g. ``client 3``).

    Returns:
        ``{target name: source tensor}`` in ``target``'s order, for ``load_state_dict``.

    Raises:
        ValueError: the two hold different numbers of tensors, or a pair differs in shape, dtype or
            kind (the last part of the name: ``weight``, ``bias``, ``running_mean``, ...); the message
            names the first such pair.
    """
    if len(source) != len(target):
        raise ValueError(
            f"{what}: ours has {len(source)} tensors, the reference's model {len(target)}: not the same architecture"
        )
    paired = {}
    for i, ((ours, x), (theirs, y)) in enumerate(zip(source.items(), target.items(), strict=True)):
        if x.shape != y.shape or x.dtype != y.dtype or ours.rsplit(".", 1)[-1] != theirs.rsplit(".", 1)[-1]:
            raise ValueError(
                f"{what}: tensor {i} differs: ours {ours} {tuple(x.shape)} {x.dtype}, "
                f"the reference's {theirs} {tuple(y.shape)} {y.dtype}"
            )
        paired[theirs] = x
    return paired


def initial_states(config: dict) -> list[dict[str, torch.Tensor]]:
    """Every client's initial personal model as our client builds it for the flat run config
    ``config`` (model group, ``seed``, ``init``, ``feature-dim``, dataset): the state dict of
    ``ClientRuntime.model`` with an empty client state, on the CPU, in client order."""
    from flwr.app import Context, RecordDict

    from common.runtime import ClientRuntime

    # the device only moves the built model; no state-dir: nothing stored is restored
    run_config = {**config, "device": "cpu", "state-dir": ""}
    states = []
    for i in range(config["num-clients"]):
        context = Context(
            run_id=0,
            node_id=i,
            node_config={"partition-id": i, "num-partitions": config["num-clients"]},
            state=RecordDict(),
            run_config=run_config,
        )
        states.append({k: v.detach().clone() for k, v in ClientRuntime(context).model.state_dict().items()})
    return states


def states_digest(states: list[Mapping[str, torch.Tensor]]) -> str:
    """SHA-256 of every tensor's shape, dtype and value in ``states``, in order (not their names: a
    model paired with ours has ours' digest under its own names)."""
    digest = hashlib.sha256()
    for state in states:
        for tensor in state.values():
            digest.update(f"{tuple(tensor.shape)}{tensor.dtype}".encode())
            digest.update(tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


#: method -> {item: the attribute of its server half that holds the server module HtFLlib stores as that
#: ``server_items`` item}, where its ``global_arrays`` do not show exactly that module before round 1
#: (FedTGP's show only the prototypes it generates; FedGen's the generator and label counts beside the head)
SERVER_MODULES = {"fedtgp": {"TGP": "generator"}, "fedgen": {"head": "shared", "generative_model": "generator"}}
#: shared arrays of our servers that are one tensor of a module on HtFLlib's side, under the name its state dict
#: gives that tensor (whose last part :func:`paired_state` matches): FedL2G's guiding vectors G [C, D], an
#: ``nn.Embedding``'s weight there
AS_MODULE_TENSOR = {"guiding": "guiding.weight"}


def server_initial_state(config: dict, item: str) -> dict[str, torch.Tensor]:
    """What our server of the flat run config ``config`` (its ``method`` and ``seed``) starts from in the
    module HtFLlib's server stores as ``item``: the state dict of its module of :data:`SERVER_MODULES`
    (FedTGP's ``TGP``, our generator: ``embedding.weight`` [C, K], ``mlp.0.weight`` [H, K], ``mlp.0.bias``
    [H], ``mlp.2.weight`` [K, H], ``mlp.2.bias`` [K]; FedGen's ``head`` and ``generative_model``, its
    representation generator with its BatchNorm buffers), else its shared arrays before round 1
    (``global_arrays`` of the method's server half, e.g. FedGH's header ``head.weight`` [C, d] and
    ``head.bias`` [C], FedL2G's ``guiding.weight`` [C, D] (:data:`AS_MODULE_TENSOR`), or a shared
    model's state dict), as CPU tensors in that order; empty when the server holds none (Local, FedProto).

    Raises:
        ConfigError: as :func:`methods.registry.build_run`.
    """
    from common.config import RunConfig
    from methods.registry import build_run

    server = build_run(RunConfig.from_dict(config)).method
    if (module := SERVER_MODULES.get(config["method"], {}).get(item)) is not None:
        return {name: t.detach().clone() for name, t in getattr(server, module).state_dict().items()}
    return {AS_MODULE_TENSOR.get(n, n): torch.from_numpy(array.copy()) for n, array in server.global_arrays().items()}


class ServerOrder:
    """Our server's mini-batch order over a round's uploads, standing in for HtFLlib's
    ``DataLoader(rows, batch_size, drop_last=False, shuffle=True)`` over them (FedTGP's and FedGH's
    servers; :data:`bench.htfllib.BOOTSTRAP` replaces the name in their module).

    Ours (``methods/fedtgp.py::train_generator``, ``methods/fedgh.py::header_batches``) orders
    the rows by partition id, then by class, and draws each epoch's order as
    ``torch.randperm(M, generator=g)`` split into batches of ``batch_size``, the last one partial, from
    one generator ``g = torch.Generator().manual_seed(seed)`` kept across rounds. HtFLlib collects
    the rows client by client in its own draw of the client order (numpy's, Python's for FedGH), each
    client's classes in the order its data first showed them, and shuffles with torch's global
    generator. Here the rows are sorted into ours (client id = our partition id; HtFLlib's client i
    reads our partition i) and each iteration over a loader draws one permutation from :attr:`generator`
    as ours does, nothing from torch's global generator.

    HtFLlib's rows carry no client id, so :meth:`record` learns each row's client from the client's
    ``protos`` item as the server loads it (``{class: row [K]}``), keyed by the row's bytes and class:
    rows that are equal in both are interchangeable, so their relative order does not matter.

    Attributes:
        generator: the order's generator (CPU), seeded with ``seed``; a resumed run restores its state.
    """

    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.origin: dict[bytes, int] = {}  # row key -> the client that uploaded it
        self.last: tuple[list, list] | None = None  # (HtFLlib's rows, ours' order): FedTGP asks each epoch

    @staticmethod
    def key(row: torch.Tensor, label) -> bytes:
        """SHA-256 of a row's dtype, shape and bytes (on the CPU) and its class ``label`` (an int or a
        0-d tensor)."""
        row = row.detach().cpu().contiguous()
        digest = hashlib.sha256(f"{row.dtype}{tuple(row.shape)}{int(label)}".encode())
        digest.update(row.view(-1).view(torch.uint8).numpy().tobytes())
        return digest.digest()

    def record(self, client: int, protos: Mapping) -> None:
        """Remember that ``client`` uploaded the rows of ``protos`` (``{class: row [K]}``)."""
        for label, row in protos.items():
            self.origin[self.key(row, label)] = client

    def ordered(self, rows: list) -> list:
        """``rows`` (``(row [K], class)`` pairs) in our order: by client, then by class.

        Raises:
            ValueError: a row no recorded client uploaded.
        """
        if self.last is not None and self.last[0] is rows and len(self.last[1]) == len(rows):
            return self.last[1]
        keyed = []
        for row, label in rows:
            if (client := self.origin.get(self.key(row, label))) is None:
                raise ValueError(f"a row of class {int(label)} that no client's loaded `protos` holds")
            keyed.append(((client, int(label)), (row, label)))
        ours = [pair for _, pair in sorted(keyed, key=lambda k: k[0])]
        self.last = (rows, ours)  # holding HtFLlib's list keeps its id from being reused while cached
        return ours

    def loader(self, rows: list, batch_size: int, drop_last: bool = False, shuffle: bool = True) -> OrderedBatches:
        """:class:`OrderedBatches` of ``rows`` in our order (:meth:`ordered`), for ``DataLoader``'s call.

        Raises:
            ValueError: ``drop_last`` or not ``shuffle`` (not the loader ours stands in for), or a
                row of no recorded client.
        """
        if drop_last or not shuffle:
            raise ValueError(f"a server DataLoader with drop_last={drop_last}, shuffle={shuffle}: not ours")
        return OrderedBatches(self.ordered(rows), batch_size, self.generator)


class OrderedBatches:
    """An iterable as HtFLlib's server uses its ``DataLoader``: each iteration draws one permutation of
    ``rows`` from ``generator`` and yields its batches of ``batch_size`` (the last one partial),
    collated as the ``DataLoader`` collates them (rows stacked [b, K], classes as a tensor [b]); no
    rows: no batch and no draw, as our servers' step on no uploads."""

    def __init__(self, rows: list, batch_size: int, generator: torch.Generator) -> None:
        self.rows, self.batch_size, self.generator = rows, batch_size, generator

    def __iter__(self):
        from torch.utils.data import default_collate

        if not self.rows:
            return
        for idx in torch.split(torch.randperm(len(self.rows), generator=self.generator), self.batch_size):
            yield default_collate([self.rows[i] for i in idx])

    def __len__(self) -> int:
        return -(-len(self.rows) // self.batch_size)


def save_initial_states(config: dict, path: Path, server: Path | None = None, items: tuple[str, ...] = ()) -> str:
    """Write :func:`initial_states` of ``config`` to ``path`` (``torch.save`` of a list of state
    dicts, one per client, loadable with ``weights_only=True``) and, with ``server``, our server's
    :func:`server_initial_state` for each of ``items`` to that file (``{item: state dict}``); returns the
    :func:`states_digest` of the clients' states (then the server's, in ``items`` order).

    Clients with equal initial models (run config ``init = "identical"``: every client of one
    architecture) share one state dict object, which ``torch.save`` stores once: the file holds one
    model per architecture then, not one per client (20 HtFE8 clients' would be about 4.8 GB)."""
    states = initial_states(config)
    unique: dict[str, dict] = {}
    shared = [unique.setdefault(states_digest([state]), state) for state in states]
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(shared, path)
    if server is None:
        return states_digest(shared)
    server_states = {item: server_initial_state(config, item) for item in items}
    torch.save(server_states, server)
    return states_digest([*shared, *server_states.values()])
