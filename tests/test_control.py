"""tools.control: the FAB built from the folders a FAB file can come from is the one ``flwr run`` builds;
the launcher's config check and partition cache share one child process."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
from flwr.cli.build import build_fab_from_disk

from common.errors import ConfigError
from conftest import ROOT
from tools import runconfig
from tools.control import app_files, build_fab


def app_tree(root: Path, gitignore: str) -> Path:
    """A Flower app (this repository's pyproject.toml and two modules) beside what no FAB may hold: a
    virtualenv, caches, Flower's folder, an ignored folder, a symlinked file and folder, a file that
    resolves outside the app."""
    (root / "app").mkdir(parents=True)
    shutil.copy(ROOT / "pyproject.toml", root / "app" / "pyproject.toml")
    (root / "app" / ".gitignore").write_text(gitignore)
    files = {
        "server_app/app.py": "app = 1\n",
        "client_app/app.py": "app = 2\n",
        "docs/page.md": "# page\n",
        ".venv/lib/site.py": "x = 1\n",
        "client_app/__pycache__/app.cpython-311.py": "cached\n",
        ".flwr/launches/a/config.toml": "a = 1\n",
        "outputs/run/rows.json": "{}\n",
        "outputs/keep.py": "kept only when re-included\n",
        "results/report.md": "excluded by fab-exclude\n",
    }
    for name, text in files.items():
        (root / "app" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "app" / name).write_text(text)
    (root / "outside.py").write_text("y = 1\n")
    os.symlink(root / "outside.py", root / "app" / "linked.py")
    os.symlink(root / "app" / "docs", root / "app" / "docs-link")
    return root / "app"


@pytest.mark.parametrize(
    "gitignore",
    [".venv/\n__pycache__/\n.flwr/\noutputs/\n", "outputs/\n!outputs/keep.py\n", ""],
    ids=["ignored folders", "a re-included file", "no gitignore rules"],
)
def test_the_fab_is_byte_for_byte_the_one_flwr_run_builds_without_entering_excluded_folders(tmp_path, gitignore):
    app = app_tree(tmp_path, gitignore)
    assert build_fab(app) == build_fab_from_disk(app)
    walked = app_files(app)
    assert "server_app/app.py" in walked and "docs/page.md" in walked
    assert not [f for f in walked if f.startswith((".venv/", ".flwr/")) or "__pycache__" in f]
    assert "linked.py" not in walked and not [f for f in walked if f.startswith("docs-link/")]
    if gitignore.startswith(".venv"):
        assert not [f for f in walked if f.startswith("outputs/")]  # an ignored folder is not entered
    if "!" in gitignore:
        assert "outputs/keep.py" in walked  # a re-included file is found: its folder is entered


def record_process(config: dict, num_clients: int) -> None:
    """A ``then`` step: writes its process id and whether torch was imported before it ran."""
    Path(config["output-dir"], "then.txt").write_text(f"{os.getpid()} {'torch' in sys.modules} {num_clients}")


def test_the_step_after_the_check_runs_in_the_process_that_checked(tmp_path):
    config = {**runconfig.app_defaults(), "num-clients": 3, "output-dir": str(tmp_path)}
    ((num_clients, _),) = runconfig.validate_configs([config], then=record_process)
    assert num_clients == 3
    pid, torch_imported, num_clients = (tmp_path / "then.txt").read_text().split()
    assert int(pid) != os.getpid() and torch_imported == "True" and num_clients == "3"
    (tmp_path / "then.txt").unlink()
    with pytest.raises(ConfigError, match="'lr'"):
        runconfig.validate_configs([{**config, "lr": -1.0}], then=record_process)
    assert not (tmp_path / "then.txt").exists()  # nothing runs after a failed check
