"""The GPU check: what a lent GPU machine measures, prepared here and run there in a few calls.

The lent machine (one NVIDIA GPU; Python 3.12 with PyTorch and torchvision; no package registry;
64 MiB per call for the working tree and what the call carries; warm for 30 s after a call) has
neither Flower nor Ray, and Ray's wheel (about 70 MiB) alone is larger than one call can carry.
So, here, once (downloads from the package index; writes ``.gpu/``, which git ignores)::

    uv run --frozen --extra crosscheck python -m bench.gpu_check prepare [--htfllib ../refs/HtFLlib]

downloads the wheels of every distribution the simulation needs that the machine's image does not
provide (:data:`DEVICE_PROVIDES`), at this checkout's versions, for CPython 3.12 on manylinux
x86-64; adds CIFAR-10 from ``../shared/data`` and, with ``--htfllib``, HtFLlib's code; cuts files
larger than one call's room into pieces and packs everything into parts ``.gpu/1``, ``.gpu/2``, ...,
each of which fits one call beside the working tree; and prints the calls. There, one after
another (each within the 30 s the machine stays warm)::

    carry [".gpu/1"]:  python3 -m bench.gpu_check stage .gpu/1
    ...
    carry [".gpu/n"]:  python3 -m bench.gpu_check run .gpu/n --out $OUT [-- <bench.gpu_measure options>]

``stage`` keeps a carried part in :data:`STAGE`; ``run`` stages the last part, joins every file
from its pieces (each file's SHA-256 checked, ``plan.json``), makes a virtual environment that sees
the image's PyTorch, installs the wheels from the files alone and runs :mod:`bench.gpu_measure` in
it, which writes ``$OUT/gpu_check.json``.

This module uses the standard library only: it runs on the lent machine before anything is
installed there.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: what ``prepare`` writes (ignored by git: only the calls that name a part carry it)
PREPARED = ROOT / ".gpu"
#: where the lent machine keeps the staged parts between calls (gone when it is given back)
STAGE = Path("/tmp/gpu-check")
#: bytes one call may move: the working tree plus what it carries (the device tool's limit)
CALL_LIMIT = 64 * 2**20
#: the distributions the simulation imports, with everything they require (closed over here)
NEEDED = ("flwr", "ray", "flwr-datasets", "datasets", "opacus", "dp-accounting")
#: what HtFLlib imports beyond them (the ``crosscheck`` extra; with ``prepare --htfllib``)
HTFLLIB_NEEDS = ("calmsize", "scikit-learn", "h5py")
#: distributions the lent machine's image provides (large binaries; the device tool's KINDS.md),
#: left to it; every other one needed is carried at this checkout's version
DEVICE_PROVIDES = (
    "torch", "torchvision", "triton", "numpy", "scipy", "pandas", "pyarrow", "matplotlib", "pillow",
    "sympy", "mpmath", "networkx", "contourpy", "fonttools", "kiwisolver", "setuptools", "scikit-learn", "h5py",
    "joblib", "threadpoolctl",
    # flwr's runtime installer of a FAB's own dependencies, which the launcher never asks for
    "uv",
)  # fmt: skip
#: prefixes of the image's CUDA libraries
DEVICE_PREFIXES = ("nvidia-", "cuda-")
#: bytes kept free in the last part for plan.json
PLAN_ROOM = 2**20
#: the unit a file's size counts in against :data:`CALL_LIMIT`: the device tool refused a call of
#: 63.0 MiB in file sizes that took 65.4 MiB in 4-KiB blocks (its measure is not documented; whole
#: blocks are the larger of it and a tar archive's headers and padding)
BLOCK = 4096
#: the platform tags a wheel for the lent machine may carry (pip matches each exactly)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


def normalized(name: str) -> str:
    """A distribution name as PEP 503 compares it (``Flwr_Datasets`` -> ``flwr-datasets``)."""
    return "-".join(name.replace("_", "-").replace(".", "-").lower().split("-"))


def carried_distributions(needed: tuple[str, ...] = NEEDED) -> dict[str, str]:
    """Name -> installed version of every distribution ``needed`` requires here, transitively (not
    counting extras' requirements), less those the lent machine provides.

    Raises:
        RuntimeError: a needed distribution is not installed here (``uv sync`` first).
    """
    import importlib.metadata as md
    import re

    found: dict[str, str] = {}
    stack = list(needed)
    while stack:
        name = normalized(stack.pop())
        if name in found:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            if name in map(normalized, needed):
                extra = " --extra crosscheck" if name in HTFLLIB_NEEDS else ""
                raise RuntimeError(f"{name} is not installed here: run 'uv sync --frozen{extra}' first") from None
            continue  # a requirement for another Python or platform (its marker is false here)
        found[name] = dist.version
        for requirement in dist.requires or []:
            if "extra ==" not in requirement:
                stack.append(re.match(r"[A-Za-z0-9_.\-]+", requirement).group(0))
    return {n: v for n, v in sorted(found.items()) if n not in DEVICE_PROVIDES and not n.startswith(DEVICE_PREFIXES)}


def moved_bytes(size: int) -> int:
    """What a file of ``size`` bytes counts against :data:`CALL_LIMIT`: whole blocks (:data:`BLOCK`)."""
    return -(-size // BLOCK) * BLOCK


def working_tree_bytes(root: Path = ROOT) -> int:
    """Bytes of what every call moves besides its carry (:func:`moved_bytes` of each): tracked files
    and untracked ones git does not ignore."""
    cmd = ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"]
    files = [
        root / os.fsdecode(p)
        for p in subprocess.run(cmd, cwd=root, capture_output=True, check=True).stdout.split(b"\0")
    ]
    return sum(moved_bytes(f.stat().st_size) for f in files if f.is_file() and f != root)


def folder_bytes(folder: Path) -> int:
    """Bytes of the files under ``folder`` (:func:`moved_bytes` of each)."""
    return sum(moved_bytes(f.stat().st_size) for f in folder.rglob("*") if f.is_file())


def pieces_of(size: int, room: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of the pieces a file of ``size`` bytes is cut into to fit ``room`` bytes."""
    return [(offset, min(room, size - offset)) for offset in range(0, size, room)] or [(0, 0)]


def pack(files: dict[str, Path], room: int) -> list[list[tuple[str, int, int, int]]]:
    """Parts of at most ``room`` bytes each (:func:`moved_bytes` of every piece): lists of ``(name,
    piece index, offset, length)``, the pieces of every file of ``files`` (name -> path) packed
    first-fit, largest first; a piece is at most ``room`` rounded down to whole blocks (:data:`BLOCK`).

    Raises:
        RuntimeError: ``room`` is not positive (the working tree alone fills a call).
    """
    room -= room % BLOCK
    if room <= 0:
        raise RuntimeError(f"the working tree alone fills a call of {CALL_LIMIT / 2**20:.0f} MiB")
    pieces = [
        (name, i, offset, length)
        for name, path in files.items()
        for i, (offset, length) in enumerate(pieces_of(path.stat().st_size, room))
    ]
    parts: list[list[tuple[str, int, int, int]]] = []
    free: list[int] = []
    for piece in sorted(pieces, key=lambda p: -moved_bytes(p[3])):
        cost = moved_bytes(piece[3])
        slot = next((i for i, f in enumerate(free) if f >= cost), None)
        if slot is None:
            parts.append([])
            free.append(room)
            slot = len(parts) - 1
        parts[slot].append(piece)
        free[slot] -= cost
    return parts


def piece_name(name: str, index: int) -> str:
    """The staged file name of piece ``index`` of the file ``name`` (a path under the tree)."""
    return f"{name.replace('/', '__')}.{index}"


def join_pieces(name: str, count: int, sha256: str, staged: Path, target: Path) -> Path:
    """Concatenate the ``count`` staged pieces of ``name`` into ``target`` and check its SHA-256.

    Raises:
        RuntimeError: a piece is missing (the machine went back between calls: start again from the
            first call), or the joined file is not the one cut (``sha256`` differs).
    """
    parts = [staged / piece_name(name, i) for i in range(count)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise RuntimeError(
            f"staged piece(s) {', '.join(missing)} missing: the machine was given back between calls "
            "(or a part was not carried); run the calls again from the first"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    with open(target, "wb") as out:
        for part in parts:
            data = part.read_bytes()
            digest.update(data)
            out.write(data)
    if digest.hexdigest() != sha256:
        raise RuntimeError(f"{name}: joined SHA-256 {digest.hexdigest()} is not the cut file's {sha256}")
    return target


def pip_python() -> str:
    """An interpreter with pip: this one, or the one its virtual environment was made from (uv makes
    environments without pip).

    Raises:
        RuntimeError: neither has pip.
    """
    for python in dict.fromkeys((sys.executable, getattr(sys, "_base_executable", sys.executable))):
        if subprocess.run([python, "-m", "pip", "--version"], capture_output=True).returncode == 0:
            return python
    raise RuntimeError(f"no pip in {sys.executable} or the interpreter its environment was made from")


def download(distributions: dict[str, str], folder: Path, python_version: str) -> None:
    """``pip download`` each ``name==version`` (no dependencies: the list is already closed) as a
    wheel for CPython ``python_version`` on manylinux x86-64 into ``folder``; a distribution
    published as source only (e.g. calmsize) is built into a wheel here (``pip wheel``), which
    holds for pure-Python code alone.

    Raises:
        subprocess.CalledProcessError: a distribution that pip can neither download nor build.
    """
    python = pip_python()
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    binary = [python, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(folder)]
    binary += ["--python-version", python_version, "--implementation", "cp", *platforms]
    for name, version in distributions.items():
        pin = f"{name}=={version}"
        if subprocess.run([*binary, pin], capture_output=True).returncode != 0:
            subprocess.run([python, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(folder), pin], check=True)


#: HtFLlib's files the reference run needs (its system/ folder less the generative models' code)
HTFLLIB_FILES = ("system/main.py", "system/flcore", "system/utils")


def payload(work: Path, data_dir: Path, htfllib: Path | None) -> dict[str, Path]:
    """Name (a path under the tree ``run`` rebuilds) -> file: ``wheels/*``, ``data/cifar10/*`` and,
    with ``htfllib``, ``htfllib/`` + :data:`HTFLLIB_FILES`."""
    files = {f"wheels/{w.name}": w for w in sorted(work.glob("*.whl"))}
    files |= {
        f"data/cifar10/{f.relative_to(data_dir / 'cifar10')}": f for f in sorted((data_dir / "cifar10").rglob("*"))
    }
    for entry in HTFLLIB_FILES if htfllib is not None else ():
        root = htfllib / entry
        found = [root] if root.is_file() else sorted(root.rglob("*"))
        files |= {f"htfllib/{f.relative_to(htfllib)}": f for f in found if "__pycache__" not in f.parts}
    return {name: path for name, path in files.items() if path.is_file()}


def prepare(out: Path, data_dir: Path, htfllib: Path | None, python_version: str) -> dict:
    """Write the parts under ``out`` (``1``, ``2``, ...: pieces of the payload, the last also
    ``plan.json``); returns the plan (file -> piece count and SHA-256, the distributions, MiB per call).

    Raises:
        RuntimeError: the working tree alone fills a call, or a needed distribution is not installed.
        subprocess.CalledProcessError: a wheel that cannot be had.
    """
    if out.exists():
        shutil.rmtree(out)
    work = out / "download"
    work.mkdir(parents=True)
    distributions = carried_distributions(NEEDED + (HTFLLIB_NEEDS if htfllib is not None else ()))
    download(distributions, work, python_version)
    files = payload(work, data_dir, htfllib)
    tree = working_tree_bytes()
    room = CALL_LIMIT - tree - PLAN_ROOM
    room -= room % BLOCK  # as pack cuts
    parts = pack(files, room)
    plan = {"files": {}, "distributions": distributions, "htfllib": htfllib is not None, "parts": len(parts)}
    for number, part in enumerate(parts, 1):
        folder = out / str(number)
        folder.mkdir()
        for name, index, offset, length in part:
            with open(files[name], "rb") as f:
                f.seek(offset)
                (folder / piece_name(name, index)).write_bytes(f.read(length))
    for name, path in files.items():
        count = len(pieces_of(path.stat().st_size, room))
        plan["files"][name] = {"pieces": count, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    (out / str(len(parts)) / "plan.json").write_text(json.dumps(plan, indent=1))
    shutil.rmtree(work)
    plan["call_mib"] = [round((tree + folder_bytes(out / str(n))) / 2**20, 1) for n in range(1, len(parts) + 1)]
    return plan


def stage(part: Path) -> list[Path]:
    """Copy a carried part's files into :data:`STAGE` (kept while the machine stays warm)."""
    STAGE.mkdir(parents=True, exist_ok=True)
    return [Path(shutil.copy2(f, STAGE / f.name)) for f in sorted(part.iterdir()) if f.is_file()]


def make_environment(venv: Path, wheels: list[Path]) -> Path:
    """A virtual environment at ``venv`` with ``wheels`` installed from the files alone (no index, no
    dependency resolution), seeing this interpreter's packages (the image's PyTorch) after its
    own through a ``.pth`` file; returns its Python. Its console scripts (``flwr``,
    ``flower-superlink``) sit beside that Python, where ``tools.run`` looks for them.

    Raises:
        subprocess.CalledProcessError: the environment or an install failed.
    """
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    own = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    cmd = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-index", "--no-deps"]
    subprocess.run(cmd + ["--no-compile", "--no-cache-dir", *map(str, wheels)], check=True)
    # only now the image's packages: seen during the install, pip would skip a wheel the image has
    # at that version and remove one it has at another. An "import" line of a .pth file runs, and
    # addsitedir also reads the image's own .pth files.
    image = sysconfig.get_paths()["purelib"]
    (Path(own) / "device-image.pth").write_text(f"import site; site.addsitedir({image!r})\n")
    return python


#: what ``run --dry-run`` asks of :mod:`bench.gpu_measure` on a machine without a GPU
DRY_RUN = ("--device", "cpu", "--rounds", "1", "--examples", "40", "--minutes", "4")


def run(part: Path, out: Path, dry_run: bool = False, measure: tuple[str, ...] = ()) -> int:
    """Stage the last part, rebuild the tree from every staged piece under :data:`STAGE`, install the
    wheels into an environment there and run :mod:`bench.gpu_measure` in it (with ``dry_run``, on
    the CPU with :data:`DRY_RUN`'s small settings; ``measure`` after them, so a later option wins:
    ``--steps``, ``--gpus-per-client``, ``--minutes`` to fit the device time left); its exit status.

    Raises:
        RuntimeError: a piece is missing or a joined file is damaged (:func:`join_pieces`).
    """
    plan = json.loads((part / "plan.json").read_text())
    stage(part)
    tree = STAGE / "tree"
    for name, entry in plan["files"].items():
        join_pieces(name, entry["pieces"], entry["sha256"], STAGE, tree / name)
    python = make_environment(STAGE / "venv", sorted((tree / "wheels").glob("*.whl")))
    cmd = [str(python), "-m", "bench.gpu_measure", "--data-dir", str(tree / "data"), "--out", str(out)]
    if plan["htfllib"]:
        cmd += ["--htfllib", str(tree / "htfllib")]
    cmd += (list(DRY_RUN) if dry_run else []) + list(measure)
    env = {**os.environ, "PATH": f"{python.parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    return subprocess.run(cmd, cwd=ROOT, env=env).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    steps = parser.add_subparsers(dest="step", required=True)
    p = steps.add_parser("prepare", help="here: wheels, data and the parts under .gpu/")
    p.add_argument("--out", type=Path, default=PREPARED)
    p.add_argument("--data-dir", type=Path, default=ROOT.parent / "shared" / "data")
    p.add_argument("--htfllib", type=Path, default=None, help="a TsingZ0/HtFLlib checkout (its system/ is carried)")
    p.add_argument("--python-version", default="3.12", help="the lent machine's Python (default 3.12)")
    s = steps.add_parser("stage", help="there: keep a carried part (all but the last) for the last call")
    s.add_argument("part", type=Path)
    r = steps.add_parser("run", help="there: with the last part: rebuild, install and measure")
    r.add_argument("part", type=Path)
    r.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "outputs/gpu-check")))
    r.add_argument("--dry-run", action="store_true", help="on the CPU with small settings (a check without a GPU)")
    # what follows "--" goes to bench.gpu_measure as it stands (its own parser checks it there)
    argv = sys.argv[1:] if argv is None else list(argv)
    measure = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: len(argv) - len(measure) - 1] if "--" in argv else argv)
    if measure and args.step != "run":
        parser.error(f"arguments after -- ({' '.join(measure)}) are for run only")
    if args.step == "prepare":
        try:
            plan = prepare(args.out, args.data_dir, args.htfllib, args.python_version)
        except (RuntimeError, subprocess.CalledProcessError, FileNotFoundError) as exc:
            print(f"error: {exc}")
            return 1
        rel = args.out.resolve().relative_to(ROOT) if args.out.resolve().is_relative_to(ROOT) else args.out
        print(f"{len(plan['distributions'])} wheels, {len(plan['files'])} files; MiB per call: {plan['call_mib']}")
        for number in range(1, plan["parts"]):
            print(f'{number}. carry ["{rel}/{number}"]: python3 -m bench.gpu_check stage {rel}/{number}')
        last = plan["parts"]
        print(f'{last}. carry ["{rel}/{last}"]: python3 -m bench.gpu_check run {rel}/{last} --out $OUT')
        return 0
    if not args.part.is_dir():
        parser.error(f"{args.part}: no such folder (carry it with this call)")
    if args.step == "stage":
        print("staged: " + ", ".join(str(f) for f in stage(args.part)))
        return 0
    try:
        return run(args.part, args.out, args.dry_run, tuple(measure))
    except (RuntimeError, subprocess.CalledProcessError) as exc:
        print(f"error: {exc}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
