"""The release subset of the cluster tests (tests/cluster/conftest.py) names only real tests:
a renamed test must not drop out of what CI runs on every Slurm release unnoticed."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.cluster.conftest import RELEASE_SUBSET

CLUSTER = Path(__file__).parents[1] / "cluster"


def _tests_in(module: Path) -> set[str]:
    tree = ast.parse(module.read_text())
    return {
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
    }


def test_every_name_in_the_release_subset_is_a_cluster_test() -> None:
    missing = []
    for name in sorted(RELEASE_SUBSET):
        module, _, test = name.partition("::")
        path = CLUSTER / module
        if not path.exists() or (test and test not in _tests_in(path)):
            missing.append(name)
    assert not missing, missing


def test_the_subset_covers_what_every_release_must_pass() -> None:
    modules = {name.partition("::")[0] for name in RELEASE_SUBSET}
    needed = {
        "test_slurm_releases.py", "test_preemption.py", "test_nextflow_wire.py",
        "test_arrays_cluster.py", "test_engines.py", "test_local_cluster.py",
    }  # fmt: skip
    assert needed <= modules, needed - modules
