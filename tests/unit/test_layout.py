"""The house plan (README, "Layout"): every distribution's folder holds the package it is named
after, with no remapping; services import only the library; the library imports no service,
launcher, test helper or benchmark; the torch-free services declare no ml dependency."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVICES = sorted(p.parent.name for p in (ROOT / "services").glob("*/pyproject.toml"))
DISTRIBUTIONS = sorted(p.parent for p in [*ROOT.glob("libs/*/pyproject.toml"), *ROOT.glob("services/*/pyproject.toml"),
                                           ROOT / "bench/pyproject.toml"])


def imported_packages(folder: Path) -> dict[str, set[str]]:
    """Top-level package of every import (lazy ones inside functions included) -> the files."""
    found: dict[str, set[str]] = {}
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            for name in names:
                found.setdefault(name.split(".")[0], set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_distribution_folder_holds_its_package_unmapped():
    assert len(DISTRIBUTIONS) >= 9 and SERVICES == ["evaluator", "janitor", "learner", "proxy", "rollout"]
    for folder in DISTRIBUTIONS:
        config = tomllib.loads((folder / "pyproject.toml").read_text())
        setuptools = config.get("tool", {}).get("setuptools", {})
        assert "package-dir" not in setuptools, f"{folder.name}: no package-dir remapping"
        (package,) = [i.rstrip("*") for i in setuptools["packages"]["find"]["include"]]
        assert (folder / package / "__init__.py").exists(), f"{folder} must hold the package {package}/"
        if folder.parent.name == "services":
            assert package == f"brigade_{folder.name}"


def test_services_import_only_the_library():
    for name in SERVICES:
        imports = imported_packages(ROOT / "services" / name)
        others = {p for p in imports if p.startswith("brigade_") and p != f"brigade_{name}"}
        assert not others, f"service {name} imports {sorted(others)} from {[imports[p] for p in others]}"


def test_the_library_imports_no_service_launcher_helper_or_benchmark():
    imports = imported_packages(ROOT / "libs/brigade/brigade")
    outside = {p for p in imports if p.startswith("brigade_")}
    assert not outside, f"libs/brigade imports {sorted(outside)} from {[imports[p] for p in outside]}"


def test_torch_free_services_declare_no_ml_dependency():
    for name in ("proxy", "janitor"):
        deps = tomllib.loads((ROOT / "services" / name / "pyproject.toml").read_text())["project"]["dependencies"]
        assert not [d for d in deps if "[ml" in d or "torch" in d or "transformers" in d], (name, deps)
