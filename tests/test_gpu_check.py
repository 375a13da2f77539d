"""The GPU check's steps that need no GPU: the carried distributions, cutting and packing the payload
into calls, joining it again, the environment it installs into and the argument handling (the whole
chain ran here as ``bench.gpu_check run --dry-run``: docs/running.md)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import zipfile
from pathlib import Path

import pytest

from bench import gpu_check
from bench.gpu_check import BLOCK, carried_distributions, join_pieces, moved_bytes, pack, piece_name, pieces_of

ROOT = Path(__file__).resolve().parents[1]


def test_the_carried_distributions_are_closed_and_leave_the_image_its_own():
    import importlib.metadata as md
    import re

    carried = carried_distributions()
    assert {"flwr", "ray", "grpcio", "protobuf", "flwr-datasets"} <= set(carried)
    assert carried["flwr"] == md.version("flwr")  # this checkout's version
    assert not {"torch", "torchvision", "numpy"} & set(carried)
    assert not [n for n in carried if n.startswith(("nvidia-", "cuda-"))]
    provided = set(gpu_check.DEVICE_PROVIDES)
    for name in carried:  # every requirement of a carried one is carried or the image's
        for requirement in md.distribution(name).requires or []:
            if "extra ==" in requirement or ";" in requirement:
                continue
            needed = gpu_check.normalized(re.match(r"[A-Za-z0-9_.\-]+", requirement).group(0))
            assert needed in carried or needed in provided or needed.startswith(("nvidia-", "cuda-")), (name, needed)


def test_files_cut_into_pieces_pack_into_calls_and_join_back(tmp_path):
    # in blocks: 7.5 (cut 3 + 3 + 1.5), 2.2 and 0.1 count as 3 + 3 + 2, 3 and 1 whole blocks
    sizes = {
        "wheels/ray.whl": 15 * BLOCK // 2,
        "data/train.parquet": 11 * BLOCK // 5,
        "wheels/flwr.whl": 400,
        "empty": 0,
    }
    files = {}
    for name, size in sizes.items():
        path = tmp_path / "src" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(bytes((i * 7 + size) % 251 for i in range(size)))
        files[name] = path
    room = 3 * BLOCK
    assert pieces_of(2500, 1000) == [(0, 1000), (1000, 1000), (2000, 500)] and pieces_of(0, room) == [(0, 0)]
    assert moved_bytes(0) == 0 and moved_bytes(1) == moved_bytes(BLOCK) == BLOCK and moved_bytes(BLOCK + 1) == 2 * BLOCK
    parts = pack(files, room + BLOCK - 1)  # a room of 3.99 blocks holds 3
    assert all(sum(moved_bytes(p[3]) for p in part) <= room for part in parts)
    assert len(parts) == 4  # 12 whole blocks in calls of 3 (9.8 blocks of bytes)
    staged = tmp_path / "staged"
    staged.mkdir()
    for part in parts:
        for name, index, offset, length in part:
            (staged / piece_name(name, index)).write_bytes(files[name].read_bytes()[offset : offset + length])
    for name, path in files.items():
        sha = hashlib.sha256(path.read_bytes()).hexdigest()
        joined = join_pieces(name, len(pieces_of(path.stat().st_size, room)), sha, staged, tmp_path / "tree" / name)
        assert joined.read_bytes() == path.read_bytes()
    with pytest.raises(RuntimeError, match="joined SHA-256"):
        join_pieces("wheels/ray.whl", 3, "0" * 64, staged, tmp_path / "again")
    (staged / piece_name("wheels/ray.whl", 1)).unlink()
    with pytest.raises(RuntimeError, match=r"ray.whl.1 missing.*run the calls again from the first"):
        join_pieces("wheels/ray.whl", 3, "0" * 64, staged, tmp_path / "again")
    with pytest.raises(RuntimeError, match="the working tree alone fills a call"):
        pack(files, 0)


def fake_wheel(folder: Path) -> Path:
    """A wheel of module ``gpucheckfake`` with a console script ``gpucheckfake``."""
    wheel = folder / "gpucheckfake-1.0-py3-none-any.whl"
    info = "gpucheckfake-1.0.dist-info"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("gpucheckfake.py", "def main():\n    print('fake ran')\n")
        z.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: gpucheckfake\nVersion: 1.0\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/entry_points.txt", "[console_scripts]\ngpucheckfake = gpucheckfake:main\n")
        z.writestr(f"{info}/RECORD", "")
    return wheel


def test_the_environment_installs_from_the_files_alone_and_sees_the_image(tmp_path):
    """Installed with the interpreter that has pip (the image's, there): the module lives in the new
    environment, its console script beside that environment's Python, and the image's packages (here
    pip itself) are seen after the environment's own."""
    try:
        image = gpu_check.pip_python()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    code = (
        "import sys; from pathlib import Path; from bench.gpu_check import make_environment; "
        f"print(make_environment(Path({str(tmp_path / 'venv')!r}), [Path({str(fake_wheel(tmp_path))!r})]))"
    )
    python = Path(
        subprocess.run([image, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    )
    assert (python.parent / "gpucheckfake").is_file()
    assert subprocess.run([str(python.parent / "gpucheckfake")], capture_output=True, text=True).stdout == "fake ran\n"
    where = "import gpucheckfake, pip; print(gpucheckfake.__file__); print(pip.__file__)"
    fake, pip = subprocess.run([str(python), "-c", where], capture_output=True, text=True, check=True).stdout.split()
    assert fake.startswith(str(tmp_path / "venv")) and not pip.startswith(str(tmp_path))


def test_stage_and_run_refuse_a_part_that_is_not_there_or_incomplete(tmp_path, monkeypatch, capsys):
    with pytest.raises(SystemExit) as exit_info:
        gpu_check.main(["stage", str(tmp_path / "absent")])
    assert exit_info.value.code == 2 and "no such folder (carry it with this call)" in capsys.readouterr().err
    monkeypatch.setattr(gpu_check, "STAGE", tmp_path / "stage")
    last = tmp_path / "4"
    last.mkdir()
    plan = {"files": {"wheels/ray.whl": {"pieces": 2, "sha256": "0" * 64}}, "htfllib": False, "parts": 4}
    (last / "plan.json").write_text(json.dumps(plan))
    assert gpu_check.main(["run", str(last), "--out", str(tmp_path / "out")]) == 1
    assert "ray.whl.0, wheels__ray.whl.1 missing" in capsys.readouterr().out


def test_a_dry_run_measure_refuses_a_data_folder_without_cifar10(tmp_path, capsys):
    from bench import gpu_measure

    with pytest.raises(SystemExit):
        gpu_measure.main(["--data-dir", str(tmp_path), "--out", str(tmp_path / "out")])
    assert "no cifar10/ folder in it" in capsys.readouterr().err


def test_run_passes_what_follows_the_separator_to_the_measure(tmp_path, monkeypatch, capsys):
    seen = {}
    monkeypatch.setattr(gpu_check, "run", lambda part, out, dry_run, measure: seen.update(measure=measure) or 0)
    (tmp_path / "4").mkdir()
    argv = ["run", str(tmp_path / "4"), "--out", str(tmp_path), "--", "--steps", "simulation", "--minutes", "4"]
    assert gpu_check.main(argv) == 0
    assert seen["measure"] == ("--steps", "simulation", "--minutes", "4")
    assert gpu_check.main(["run", str(tmp_path / "4")]) == 0 and seen["measure"] == ()
    with pytest.raises(SystemExit):
        gpu_check.main(["stage", str(tmp_path / "4"), "--", "--steps", "simulation"])
    assert "are for run only" in capsys.readouterr().err
