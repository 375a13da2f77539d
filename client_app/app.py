"""The ClientApp: one handler for every message type any registered method uses (``train``, ``evaluate``,
``query``, ``train.<action>``: :data:`common.protocol.MESSAGE_TYPES`), which runs
:func:`client_app.handlers.handle`.

This module imports neither torch nor the methods: Flower's simulation loads the ClientApp in the
``flwr-simulation`` process, to test that it loads, before it starts Ray (``start_vce`` in
``flwr/server/superlink/fleet/vce/vce_api.py``, Flower 1.42), so what this module imports delays Ray's
start. The handlers come in at a process's first message, in the ClientApp actors and SuperNodes
that serve the messages; there they cost what they cost before (``app-start-seconds``).
"""

from __future__ import annotations

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from common.protocol import MESSAGE_TYPES

app = ClientApp()


def handle(msg: Message, context: Context) -> Message:
    """:func:`client_app.handlers.handle` (imported at the first message; raises what it raises)."""
    from client_app.handlers import handle as handle_message  # torch and the methods: see the module docstring

    return handle_message(msg, context)


for _message_type in MESSAGE_TYPES:
    _category, _, _action = _message_type.partition(".")
    getattr(app, _category)(_action or "default")(handle)
