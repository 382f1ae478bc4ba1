"""The shape ARCHITECTURE.md promises: a few wings at the top of bridge/, small functions (in
bench/ too).

The import rules themselves (layers, walls, no circles) are import-linter's contracts in
pyproject.toml, which deploy/test.sh checks with `lint-imports`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from radon.complexity import cc_visit

ROOT = Path(__file__).parents[2]
BRIDGE = ROOT / "bridge"
#: Radon's cyclomatic complexity (which counts boolean operators, unlike ruff's mccabe check).
MAX_COMPLEXITY = 15


def test_the_top_of_bridge_shows_the_wings():
    names = sorted(
        p.name
        for p in BRIDGE.iterdir()
        if not p.name.startswith(("__", "."))
        and (p.suffix == ".py" or (p / "__init__.py").exists())
    )
    assert len(names) <= 12, names


@pytest.mark.parametrize("package", ["bridge", "bench"])
def test_every_function_is_at_most_complexity_15(package: str):
    too_complex = [
        f"{path.relative_to(ROOT)}:{block.lineno} {block.fullname} ({block.complexity})"
        for path in sorted((ROOT / package).rglob("*.py"))
        for block in cc_visit(path.read_text())
        if block.complexity > MAX_COMPLEXITY
    ]
    assert not too_complex, "\n".join(too_complex)
