"""The packages import only down the layers of docs/architecture.md (import-linter's
contract in pyproject.toml), and every package of `services` has its place in them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from tests.conftest import REPO

PACKAGES = ("services", "loraplane_kernels")


def contract() -> dict:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    (layers,) = config["contracts"]
    return layers


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """`lint-imports` on the packages under `root`, with the repository's contract."""
    command = Path(sys.executable).with_name("lint-imports")
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([str(command), "--no-cache", "--no-logo",
                           "--config", str(REPO / "pyproject.toml")],
                          cwd=root, env=env, capture_output=True, text=True, timeout=120)


def only_python(folder: str, names: list[str]) -> list[str]:
    return [n for n in names if not n.endswith(".py") and not Path(folder, n).is_dir()]


def test_no_package_imports_up_the_layers() -> None:
    result = lint_imports(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 kept, 0 broken" in result.stdout


def test_an_upward_import_breaks_the_contract(tmp_path: Path) -> None:
    """The check can fail: the catalog importing the release package (as it once did) is
    named, with its line."""
    for package in PACKAGES:
        shutil.copytree(REPO / package, tmp_path / package, ignore=only_python)
    rule = tmp_path / "services" / "catalog" / "gates.py"
    rule.write_text(rule.read_text() + "\nfrom services.release import deploy  # noqa\n")
    result = lint_imports(tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "services.catalog is not allowed to import services.release" in result.stdout
    assert "services.catalog.gates -> services.release.deploy" in result.stdout


def test_every_package_has_a_layer() -> None:
    """A new top-level package or module of `services` is placed in a layer, never left
    outside the contract (where it could import anything, and anything it)."""
    placed = {name.strip() for layer in contract()["layers"] for name in layer.split("|")}
    found = {f"services.{p.stem}" for p in (REPO / "services").iterdir()
             if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").exists()}
    assert found - placed == set()
    assert placed - found == {"loraplane_kernels"}
