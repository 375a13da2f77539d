"""The run config as every entry point reads it: ``pyproject.toml``'s defaults, a preset TOML file and
``-c key=value`` overrides (:func:`read_config`), checked before anything starts (:func:`validate_configs`,
:func:`check_output_folders`), and written for ``flwr run --run-config`` (:func:`run_config_file`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
#: virtual SuperNodes when neither --num-supernodes nor num-clients sets them (the README's default job)
DEFAULT_SUPERNODES = 10


def app_defaults(root: Path = ROOT) -> dict:
    """``[tool.flwr.app.config]`` of ``pyproject.toml``, flattened to Flower's dotted keys."""
    with open(root / "pyproject.toml", "rb") as f:
        table = tomllib.load(f)["tool"]["flwr"]["app"]["config"]

    def flat(d: dict, prefix: str = "") -> dict:
        out = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
        return out

    return flat(table)


def toml_value(value) -> str:
    """A run-config value written as TOML (strings quoted, bools lower-case)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    return repr(value)


@contextlib.contextmanager
def run_config_file(config: dict[str, Any]):
    """``config`` (flat keys) as a TOML file for ``flwr run --run-config FILE``, removed on exit.

    Why a file: Flower 1.42's ``parse_config_args`` parses each ``--run-config KEY=VALUE`` item to a
    nested dict and merges the items with a shallow ``dict.update``, so of several items of one table
    (``--run-config fedgh.server-mode=... --run-config fedgh.server-lr=...``) only the last survives
    and the others silently take their defaults. A TOML file is read in one piece; its quoted dotted
    keys (``"fedgh.server-mode" = "minibatch"``) stay flat, as Flower's own flattened keys are.
    """
    with tempfile.NamedTemporaryFile("w", suffix=".toml", prefix="run-config-", delete=False, encoding="utf-8") as f:
        f.writelines(f"{json.dumps(key, ensure_ascii=False)} = {toml_value(value)}\n" for key, value in config.items())
    try:
        yield Path(f.name)
    finally:
        Path(f.name).unlink(missing_ok=True)


def config_mismatch(requested: dict[str, Any], used: dict[str, Any]) -> list[str]:
    """``key: requested -> used`` for every key of ``requested`` whose value the run did not use
    (``used``: the ``config`` of its ``summary.json``); empty when the run used what was asked. A key
    requested as ``auto`` (:data:`common.config.AUTO_KEYS`) matches the value the run chose for it."""
    from common.config import AUTO_KEYS

    def chosen(key: str, value: Any) -> bool:
        return value == "auto" and key in AUTO_KEYS and used.get(key) in AUTO_KEYS[key]

    return [f"{k}: {v!r} -> {used.get(k)!r}" for k, v in requested.items() if used.get(k) != v and not chosen(k, v)]


def add_config_arguments(parser: argparse.ArgumentParser, preset: bool = True) -> None:
    """``--preset FILE`` (unless the entry point takes it otherwise) and ``-c/--run-config``: the one
    way every entry point takes run config keys (:func:`read_config`)."""
    if preset:
        parser.add_argument(
            "--preset",
            default=None,
            help="a TOML file of run config keys (e.g. presets/fedgh-table3-cifar10.toml); "
            "--run-config overrides its values",
        )
    parser.add_argument(
        "--run-config",
        "-c",
        action="append",
        default=[],
        help="overrides, several key=value pairs each, e.g. \"method='local' num-server-rounds=5\" (repeatable)",
    )


def read_preset(path: str | os.PathLike) -> dict[str, Any]:
    """The run config keys of preset ``path``, a TOML file (whatever its name ends in), flattened to
    Flower's dotted keys as ``flwr run --run-config FILE`` flattens them.

    Raises:
        ConfigError: naming the file: it cannot be read (missing, a folder, no permission, not a
            regular file such as a FIFO or a device, over ``common.files.MAX_READ_BYTES``; see
            :func:`common.files.read_bounded`) or is not UTF-8 TOML of run config values (strings,
            numbers, booleans, tables of them).
    """
    from flwr.common.config import flatten_dict

    from common.errors import ConfigError
    from common.files import read_bounded
    from common.options import excerpt

    name = f"preset {excerpt(str(path))}"
    data = read_bounded(Path(path).expanduser(), name=name)
    try:
        return flatten_dict(tomllib.loads(data.decode("utf-8")))
    except ValueError as exc:  # TOMLDecodeError, UnicodeDecodeError, or a value Flower does not take (a list)
        raise ConfigError(f"{name} is not a TOML file of run config keys: {exc}") from None


#: the run config keys that hold paths (:func:`read_config` resolves them)
PATH_KEYS = ("data-dir", "output-dir", "resume-from", "state-dir")


#: the longest name of one file or folder (bytes): ext4, XFS, Btrfs, tmpfs and APFS all stop there
NAME_MAX = 255


def check_path_names(key: str, value: str) -> None:
    """Refuse path ``value`` of run config key ``key`` that no file system takes: longer than
    ``common.options.MAX_STRING`` characters, or with a name (between two ``/``) over :data:`NAME_MAX`
    bytes in UTF-8. Only the text is checked, nothing on disk.

    Raises:
        ConfigError: naming ``key``, quoting the start of the value (and of the long name).
    """
    from common.options import MAX_STRING, excerpt, invalid

    if len(value) > MAX_STRING:
        raise invalid(key, value, f"a path of at most {MAX_STRING} characters")
    for name in Path(value).parts:
        if len(os.fsencode(name)) > NAME_MAX:
            raise invalid(
                key,
                value,
                f"a path whose every name is at most {NAME_MAX} bytes (this one has a name of "
                f"{len(os.fsencode(name))} bytes: {excerpt(name, 40)})",
            )


def repeated_keys(item: str) -> list[str]:
    """The keys that ``key=value`` pairs of one ``-c`` item ``item`` set more than once (split as a shell
    splits words, quotes kept together); none when the item cannot be split."""
    import shlex

    try:
        keys = [word.partition("=")[0] for word in shlex.split(item) if "=" in word]
    except ValueError:  # an unclosed quote: Flower's own message says what is wrong
        return []
    return sorted({k for k in keys if keys.count(k) > 1})


def read_config(preset: str | os.PathLike | None, items: list[str], base: dict | None = None) -> tuple[dict, dict]:
    """``(config, overrides)``: the run config defaults (pyproject), then ``base`` (an entry point's
    own settings), then the preset (:func:`read_preset`), then each ``-c`` item, parsed by Flower's
    ``parse_config_args`` as ``flwr run --run-config`` does (several ``key=value`` pairs per item);
    ``data-dir``, ``output-dir``, ``resume-from`` and ``state-dir`` of ``config`` checked
    (:func:`check_path_names`) and resolved to absolute paths. ``overrides`` is everything but the
    defaults, as given.

    Raises:
        ConfigError: a preset that cannot be read or is not TOML (naming it), a key the app does not
            have (naming it), an item Flower cannot parse, or a path no file system takes.
    """
    import click
    from flwr.common.config import parse_config_args

    from common.errors import ConfigError
    from common.options import excerpt

    overrides = dict(base or {})
    overrides.update(read_preset(preset) if preset else {})
    try:
        # one item at a time: Flower merges the items' nested tables shallowly (run_config_file)
        for item in items:
            overrides.update(parse_config_args([item]))
    except (ValueError, tomllib.TOMLDecodeError, click.ClickException) as exc:
        message = exc.format_message() if isinstance(exc, click.ClickException) else str(exc)
        if twice := repeated_keys(item):  # TOML refuses a key set twice, and Flower's message does not name it
            message = f"key(s) {excerpt(twice)} given twice in one item: allowed is each key once per item"
        raise ConfigError(f"run config overrides {excerpt(items)} cannot be parsed: {message}") from None
    defaults = app_defaults()
    unknown = sorted(set(overrides) - set(defaults))
    if unknown:
        raise ConfigError(f"unknown run config key(s) {excerpt(unknown)}; see [tool.flwr.app.config] in pyproject.toml")
    config = {**defaults, **overrides}
    for key in PATH_KEYS:
        if config[key] and isinstance(config[key], str):  # another type is refused by check_config, named
            check_path_names(key, config[key])
            config[key] = str(Path(config[key]).expanduser().resolve())
    return config, overrides


def check_output_folders(config: dict[str, Any]) -> None:
    """Check that run config ``output-dir`` and (when set) ``state-dir`` of ``config`` (absolute paths,
    :func:`read_config`) are folders this user can write, or can be created as such (the nearest
    existing folder above is writable), before anything starts; nothing is created.

    Raises:
        ConfigError: naming the key: the path is a file, lies below a file, or cannot be written.
    """
    from common.errors import ConfigError
    from common.options import excerpt

    for key in ("output-dir", "state-dir"):
        if not config.get(key):
            continue
        path = Path(config[key])
        where = f"run config key '{key}' = {excerpt(config[key])}"
        try:
            existing = next(p for p in (path, *path.parents) if p.exists())
        except OSError as exc:
            raise ConfigError(f"{where} cannot be checked: {exc.strerror or exc}") from None
        if not existing.is_dir():
            what = "is a file" if existing == path else f"lies below {excerpt(str(existing))}, which is a file"
            raise ConfigError(f"{where} {what}: allowed values are folders (existing or to be created)")
        if not os.access(existing, os.W_OK | os.X_OK):
            raise ConfigError(f"{where}: {excerpt(str(existing))} is not writable by this user")


def validate_configs(configs: list[dict], then: Callable[[dict, int], None] | None = None) -> list[tuple[int, bool]]:
    """Check every run config of ``configs`` as the ServerApp would (:func:`check_config`), in one
    spawned child (torch and the methods stay out of the caller's memory), before anything starts.
    When all pass and ``then`` is given (a picklable function), the same child then calls
    ``then(config, num_clients)`` for each, so a step that needs the same imports pays for them
    once (``tools.run``: :func:`tools.partition_cache.cache_before_ray`).

    Returns:
        ``(num-clients, whether a GPU is visible)`` per config.

    Raises:
        ConfigError: the first invalid config's error, naming the key.
    """
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from common.errors import ConfigError

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        checked = list(pool.map(check_config, configs))
        for error, _, _ in checked:
            if error:
                raise ConfigError(error)
        if then is not None:  # one worker: the process that checked
            for config, (_, num_clients, _) in zip(configs, checked, strict=True):
                pool.submit(then, config, num_clients).result()
    return [(num_clients, gpu) for _, num_clients, gpu in checked]


def federation_size(num_supernodes: int | None, num_clients: int) -> int:
    """The simulated SuperNodes: ``--num-supernodes``, else run config ``num-clients``, else
    :data:`DEFAULT_SUPERNODES`.

    Raises:
        ConfigError: ``--num-supernodes`` below 1 or disagreeing with a non-zero ``num-clients``.
    """
    from common.errors import ConfigError

    if num_supernodes is not None and num_supernodes < 1:
        raise ConfigError(f"--num-supernodes {num_supernodes}: allowed values are integers >= 1")
    supernodes = num_supernodes or num_clients or DEFAULT_SUPERNODES
    if num_clients and supernodes != num_clients:
        raise ConfigError(
            f"--num-supernodes {supernodes} disagrees with run config key 'num-clients' = "
            f"{num_clients}; drop one of them (num-clients=0 follows the federation)"
        )
    return supernodes


def check_config(config: dict) -> tuple[str | None, int, bool]:
    """(error message or None, run config ``num-clients``, whether a GPU is visible) of ``config``:
    everything the ServerApp would reject that needs neither data nor the federation's size, method
    options and a ``resume-from`` run of another config (its ``summary.json``) included. Runs in a child process
    (:func:`_validate_and_run`), so that torch and the methods are not kept in this launcher's
    memory for the whole run."""
    from common.config import RunConfig
    from common.run_folder import tensorboard_class
    from methods.registry import build_run

    try:
        cfg = RunConfig.from_dict(config)
        run = build_run(cfg)  # fail fast on any bad value, method options too
        run.checkpoints.check_summary()  # a resume of a run with another config
        tensorboard_class(cfg.logger)
    except ValueError as exc:
        return str(exc), 0, False
    import torch

    return None, cfg.num_clients, torch.cuda.is_available()
