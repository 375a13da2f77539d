"""Errors every layer raises (kept apart so that the registries and the config parser can both use
them without importing each other)."""


class ConfigError(ValueError):
    """A run-config value is missing, of the wrong type or outside its allowed values."""


class RunFailed(RuntimeError):
    """A run that cannot produce a result: e.g. no client trained for run config key
    ``max-untrained-rounds`` rounds in a row. ``client_errors``: the clients' distinct errors."""

    def __init__(self, message: str, client_errors: list[str] | None = None) -> None:
        super().__init__(message)
        self.client_errors = list(client_errors or [])
