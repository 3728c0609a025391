"""The layers of CONTRIBUTING.md, checked on the source: who may import what.

Read with ``ast`` (no import runs): every ``import``/``from ... import`` of every module
under parts/, including imports inside functions (a lazy import is still a dependency).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PARTS = Path(__file__).resolve().parents[1] / "parts"
BASE_LAYER = {"base", "comm", "_compat", "csrc"}
PARTS_ABOVE = {"partition", "offload", "optim", "checkpoint", "parallel", "observe", "io"}
SIDEWAYS_ALLOWED = {("optim", "partition"), ("partition", "offload")}
ABOVE_THE_PARTS = {"integrations", "plan"}  # may import any part; no part imports them
DISTRIBUTED_ALLOWED = {"comm", "_compat"}


def package_of(path: Path) -> str:
    """The top-level package (or module) under parts/ that ``path`` belongs to."""
    return path.relative_to(PARTS).parts[0].removesuffix(".py")


def imported_modules(path: Path) -> set[str]:
    """Every absolute module name ``path`` imports (relative imports resolved to parts.*)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: the package this file sits in
                package = ".".join(("parts", *path.relative_to(PARTS).parent.parts))
                names.add(package if not node.module else f"{package}.{node.module}")
            else:
                names.add(node.module)
    return names


def modules() -> list[Path]:
    return sorted(PARTS.rglob("*.py"))


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(PARTS)))
def test_imports_follow_the_layers(path: Path) -> None:
    """Base imports no part; parts import no sibling but optim->partition, partition->offload,
    nor integrations and plan, which sit above them; only comm and _compat import torch.distributed."""
    own = package_of(path)
    for name in imported_modules(path):
        if name.startswith("torch.distributed") or name == "torch.distributed":
            assert own in DISTRIBUTED_ALLOWED, f"{path}: imports {name}"
        if not name.startswith("parts."):
            continue
        target = name.split(".")[1]
        if target in ABOVE_THE_PARTS:
            assert own in ABOVE_THE_PARTS, f"{path}: {own} imports {name}, which sits above the parts"
        elif own in ABOVE_THE_PARTS:
            continue
        elif own in BASE_LAYER:
            assert target in BASE_LAYER, f"{path}: the base layer imports the part {name}"
        elif target in PARTS_ABOVE and target != own:
            assert (own, target) in SIDEWAYS_ALLOWED, f"{path}: part {own} imports part {name}"


def test_importing_checkpoint_loads_no_other_part() -> None:
    """``import parts.checkpoint`` loads only the base layer (not partition, not observe)."""
    code = ("import sys, parts.checkpoint; "
            "print(sorted({m.split('.')[1] for m in sys.modules if m.startswith('parts.')}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PARTS.parent).stdout
    loaded = set(ast.literal_eval(out.strip().splitlines()[-1]))
    assert loaded <= BASE_LAYER | {"checkpoint"}, loaded


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(PARTS)))
def test_no_module_is_over_400_lines(path: Path) -> None:
    """CONTRIBUTING's limit: one concept per module, none over 400 lines."""
    assert len(path.read_text().splitlines()) <= 400, path
