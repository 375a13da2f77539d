"""Errors every layer raises (kept apart so that the registries and the config parser can both use
them without importing each other)."""


class ConfigError(ValueError):
    """A run-config value is missing, of the wrong type or outside its allowed values."""
