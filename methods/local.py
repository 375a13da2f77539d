"""Local (standalone) training: each client trains its own model alone, nothing is exchanged.

The control every model-heterogeneous FL paper compares against ("Standalone" in FedGH
Tables 1 and 3). Train instructions and replies carry no arrays; the server only samples,
evaluates and records.
"""

from __future__ import annotations

from typing import Any

from common.payload import NO_PAYLOAD_SCHEMAS
from common.protocol import Arrays, Reply
from common.runtime import ClientRuntime
from common.training import train_personal_model
from engine.contract import ClientProcedure, Method, MethodServer


class LocalServer(MethodServer):
    """Server of the Local baseline: no server state, no server step."""

    checkpointed = ()

    def evaluates_after_training(self) -> bool:
        """Yes: nothing is sent, the personal model is what is evaluated."""
        return True


class LocalClient(ClientProcedure):
    """Client of the Local baseline: supervised training of the personal model."""

    def train(self, client: ClientRuntime, payload: Arrays, config: dict[str, Any]) -> Reply:
        """Train on the local split; reply with metrics only."""
        return {}, train_personal_model(client, config)


METHOD = Method("local", LocalServer, LocalClient, NO_PAYLOAD_SCHEMAS)
