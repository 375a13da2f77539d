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
into HtFLlib's server's module the first time HtFLlib stores it.

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


def server_initial_state(config: dict) -> dict[str, torch.Tensor]:
    """What our server of the flat run config ``config`` (its ``method`` and ``seed``) starts from: its
    shared arrays before round 1 (``global_arrays`` of the method's strategy, e.g. FedGH's header
    ``head.weight`` [C, d] and ``head.bias`` [C], or a shared model's state dict), as float32 CPU
    tensors in that order; empty when the server holds none (Local, FedProto).

    Raises:
        ConfigError: as :func:`strategies.registry.build_strategy`.
    """
    from common.config import RunConfig
    from strategies.registry import build_strategy

    arrays = build_strategy(RunConfig.from_dict(config)).global_arrays()
    return {name: torch.from_numpy(array.copy()) for name, array in arrays.items()}


def save_initial_states(config: dict, path: Path, server: Path | None = None) -> str:
    """Write :func:`initial_states` of ``config`` to ``path`` (``torch.save`` of a list of state
    dicts, one per client, loadable with ``weights_only=True``) and, with ``server``, our server's
    :func:`server_initial_state` to that file; returns the :func:`states_digest` of the clients' states
    (then the server's).

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
    state = server_initial_state(config)
    torch.save(state, server)
    return states_digest([*shared, state])
