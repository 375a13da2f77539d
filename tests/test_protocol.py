"""Every message key is defined once, in ``common/protocol.py``: the message types, record names, config keys
and the reply metric keys the server reads structurally. Checked on the source (ast), so no module needs
importing: a module-level constant elsewhere that reuses a protocol name or a protocol key's value fails."""

import ast
from pathlib import Path

from test_layout import PACKAGES

ROOT = Path(__file__).resolve().parents[1]
PROTOCOL = ROOT / "common" / "protocol.py"


def constants(path: Path) -> dict[str, object]:
    """Module-level UPPER_CASE names of ``path`` bound to a str or a tuple of str literal (also in a
    tuple assignment such as ``A, B = "a", "b"``)."""
    found: dict[str, object] = {}
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        targets, value = [], None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        for target in targets:
            pairs = []
            if isinstance(target, ast.Name):
                pairs = [(target, value)]
            elif isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) and len(target.elts) == len(value.elts):
                pairs = list(zip(target.elts, value.elts, strict=True))
            for name, v in pairs:
                if not (isinstance(name, ast.Name) and name.id.isupper()):
                    continue
                try:
                    literal = ast.literal_eval(v)
                except ValueError:
                    continue
                strings = isinstance(literal, tuple) and all(isinstance(x, str) for x in literal)
                if isinstance(literal, str) or strings:
                    found[name.id] = literal
    return found


def offenders(keys: dict[str, object], files: list[Path], root: Path = ROOT) -> list[str]:
    """``file: NAME = value`` of each constant in ``files`` that reuses a protocol name or a protocol value."""
    values = {v for v in keys.values() if isinstance(v, str)}
    values |= {x for v in keys.values() if isinstance(v, tuple) for x in v}
    out = []
    for path in files:
        for name, value in constants(path).items():
            if name in keys or (isinstance(value, str) and value in values):
                out.append(f"{path.relative_to(root)}: {name} = {value!r}")
    return out


def test_no_other_module_defines_a_message_key():
    keys = constants(PROTOCOL)
    assert {"PAYLOAD", "PARTITION_ID", "EVAL_PREFIX", "TRAIN_GLOBAL", "TRAIN_HEAD", "DEVICE_KEYS"} <= set(keys)
    files = [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py")) if p != PROTOCOL]
    assert offenders(keys, files) == []


def test_the_check_finds_a_planted_key(tmp_path):
    planted = tmp_path / "method.py"
    planted.write_text('TRAIN_HEAD = "train.head"\nOTHER, KEY = 1, "partition-id"\nFINE = "fedgh"\n')
    found = offenders(constants(PROTOCOL), [planted], tmp_path)
    assert [f.split(": ", 1)[1] for f in found] == ["TRAIN_HEAD = 'train.head'", "KEY = 'partition-id'"]
