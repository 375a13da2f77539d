"""The ClientApp: thin handlers that route each message to the method's client procedure.

Every message type any registered method uses (``train``, ``evaluate``, ``query``,
``train.<action>`` ...) gets a handler. The handler validates the incoming payload against
the method's schema, calls the procedure, stores nothing itself (procedures persist their
state through the runtime) and replies with the payload plus metrics (with ``partition-id``).
"""

from __future__ import annotations

from flwr.app import Context, Message, MetricRecord
from flwr.clientapp import ClientApp

from client_app.data import DATASETS
from client_app.runtime import ClientRuntime
from strategies.base import EVAL_PREFIX, PARTITION_ID, metric_values
from strategies.payload import read_payload
from strategies.registry import all_message_types, client_procedure

app = ClientApp()


def handle(msg: Message, context: Context) -> Message:
    """Run the method's handler for ``msg`` and build the reply.

    Raises:
        ConfigError, PayloadError: turned into an error reply by Flower; the server logs and
            drops it, the round goes on.
    """
    config = dict(msg.content.config_records["config"]) if "config" in msg.content.config_records else {}
    message_type = msg.metadata.message_type
    training_round = int(config["server-round"]) if message_type.startswith("train") and "server-round" in config \
        else None
    client = ClientRuntime(context, str(config.get("state-key", "in-memory")), training_round)
    procedure = client_procedure(client.cfg)
    down, up = procedure.schemas[message_type]
    payload = read_payload(msg.content)
    down.validate(payload, {"C": DATASETS[client.cfg.dataset].num_classes, "d": client.cfg.representation_dim})
    arrays, metrics = getattr(procedure, message_type.replace(".", "_"))(client, payload, config)
    if config.get("evaluate"):  # evaluate the just-trained personal model in the same reply
        metrics.update({EVAL_PREFIX + k: v for k, v in procedure.evaluate(client, {}, config)[1].items()})
    content = up.to_record(arrays)
    content["metrics"] = MetricRecord(metric_values({**metrics, PARTITION_ID: client.partition_id,
                                                     "state-restores": client.state_restores,
                                                     "state-rollbacks": client.state_rollbacks}))
    return Message(content, reply_to=msg)


for _message_type in all_message_types():
    _category, _, _action = _message_type.partition(".")
    getattr(app, _category)(_action or "default")(handle)
