"""The house plan (README, "Layout"): every distribution's folder holds the package it is named
after, with no remapping; each distribution imports only the first-party distributions it declares,
and those declarations form no circle; services import only the library; the library imports no
service, launcher, test helper or benchmark; no library or service reaches the launcher or the
benchmarks; no module imports itself back through others; the torch-free services declare no ml
dependency."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVICES = sorted(p.parent.name for p in (ROOT / "services").glob("*/pyproject.toml"))
DISTRIBUTIONS = sorted(p.parent for p in [*ROOT.glob("libs/*/pyproject.toml"), *ROOT.glob("services/*/pyproject.toml"),
                                           ROOT / "bench/pyproject.toml"])
LAUNCHER, BENCHMARKS = "brigade-cli", "brigade-bench"


def imported_packages(folder: Path) -> dict[str, set[str]]:
    """Top-level package of every import (lazy ones inside functions included) -> the files."""
    found: dict[str, set[str]] = {}
    for path in folder.rglob("*.py"):
        for name in imported_names(path):
            found.setdefault(name.split(".")[0], set()).add(str(path.relative_to(ROOT)))
    return found


def imported_names(path: Path) -> list[str]:
    """Every absolute import of a file, lazy ones and those under TYPE_CHECKING included: `import a.b`
    names a.b; `from a.b import c` names a.b and a.b.c (c may be a module)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
    return names


def project(folder: Path) -> dict:
    return tomllib.loads((folder / "pyproject.toml").read_text())["project"]


def package_of(folder: Path) -> str:
    """The package a distribution holds: its name with `_` for `-` (brigade-proxy holds brigade_proxy)."""
    return project(folder)["name"].replace("-", "_")


def first_party() -> dict[str, Path]:
    """Distribution name -> its folder."""
    return {project(folder)["name"]: folder for folder in DISTRIBUTIONS}


def declared(folder: Path) -> set[str]:
    """The first-party distributions `folder`'s pyproject depends on (extras of them included)."""
    names = {re.match(r"[A-Za-z0-9._-]+", req).group(0) for req in project(folder).get("dependencies", [])}
    return names & first_party().keys()


def modules() -> dict[str, Path]:
    """Every first-party module (dotted name) -> its file; protoc's generated code left out."""
    found = {}
    for folder in DISTRIBUTIONS:
        package = folder / package_of(folder)
        for path in package.rglob("*.py"):
            if "v1" in path.relative_to(package).parts:
                continue
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def module_graph() -> dict[str, set[str]]:
    """module -> the first-party modules it imports (each import resolved to the nearest module
    that exists: `from brigade.bucket import Bucket` is brigade.bucket)."""
    mods = modules()

    def resolve(name: str) -> str:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name

    return {m: {r for n in imported_names(path) if (r := resolve(n)) and r != m} for m, path in mods.items()}


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one node (iterative: no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def a_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One circle through a component's nodes, as a path that ends where it starts."""
    members = set(component)
    start = component[0]
    path, seen = [start], {start}
    while True:
        nxt = sorted(graph[path[-1]] & members)
        back = [n for n in nxt if n in seen]
        if start in nxt or back:
            end = start if start in nxt else back[0]
            return path[path.index(end):] + [end]
        step = next(n for n in nxt if n not in seen)
        path.append(step)
        seen.add(step)


def test_every_distribution_folder_holds_its_package_unmapped():
    assert len(DISTRIBUTIONS) >= 9 and SERVICES == ["aggregator", "evaluator", "janitor", "learner", "proxy", "rollout"]
    for folder in DISTRIBUTIONS:
        config = tomllib.loads((folder / "pyproject.toml").read_text())
        setuptools = config.get("tool", {}).get("setuptools", {})
        assert "package-dir" not in setuptools, f"{folder.name}: no package-dir remapping"
        (package,) = [i.rstrip("*") for i in setuptools["packages"]["find"]["include"]]
        assert (folder / package / "__init__.py").exists(), f"{folder} must hold the package {package}/"
        assert package == package_of(folder), f"{folder}: {project(folder)['name']} holds {package}"
        if folder.parent.name == "services":
            assert package == f"brigade_{folder.name}"


def test_every_distribution_imports_only_what_it_declares():
    """A distribution's imports (lazy ones included) of first-party packages are itself or the
    first-party distributions its pyproject depends on: installed alone, its imports resolve."""
    packages = {name.replace("-", "_"): name for name in first_party()}
    for folder in DISTRIBUTIONS:
        imports = imported_packages(folder / package_of(folder))
        used = {packages[p] for p in imports if p in packages} - {project(folder)["name"]}
        undeclared = used - declared(folder)
        where = [sorted(imports[n.replace("-", "_")]) for n in sorted(undeclared)]
        assert not undeclared, f"{project(folder)['name']} imports {sorted(undeclared)} undeclared, from {where}"


def test_declared_dependencies_form_no_circle_and_nothing_below_needs_the_launcher_or_the_benchmarks():
    graph = {name: declared(folder) for name, folder in first_party().items()}
    circles = [a_cycle(graph, c) for c in strongly_connected(graph)]
    assert not circles, f"distributions that depend on each other: {[' -> '.join(c) for c in circles]}"
    for name, folder in first_party().items():
        if folder.parent.name not in ("libs", "services") or name == LAUNCHER:
            continue
        imports = imported_packages(folder / package_of(folder))
        for top in (LAUNCHER, BENCHMARKS):
            assert top not in graph[name], f"{name} declares {top}: nothing below may depend on it"
            assert top.replace("-", "_") not in imports, (f"{name} imports {top.replace('-', '_')} from "
                                                           f"{sorted(imports[top.replace('-', '_')])}")
    launcher = imported_packages(first_party()[LAUNCHER] / package_of(first_party()[LAUNCHER]))
    assert BENCHMARKS not in graph[LAUNCHER] and "brigade_bench" not in launcher, (
        "the launcher finds `brigade bench` through its entry point, never by importing brigade_bench")


def test_no_module_imports_itself_back():
    """No circle of module imports (lazy ones included), inside a package or across them: each
    module can be read, and loaded, after the ones it imports."""
    graph = module_graph()
    assert len(graph) > 100
    circles = [a_cycle(graph, c) for c in strongly_connected(graph)]
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)


def test_the_cycle_finder_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e2"}, "e2": {"e"}}
    assert sorted(strongly_connected(graph)) == [["a", "b", "c"], ["e", "e2"]]
    assert a_cycle(graph, ["a", "b", "c"]) == ["a", "b", "c", "a"]


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


def test_imports_are_absolute():
    """One import style everywhere: a reader sees from the line itself where a name comes from."""
    relative = []
    for top in ("libs", "services", "bench"):
        for path in (ROOT / top).rglob("*.py"):
            if "/v1/" in str(path):
                continue  # generated by protoc
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ImportFrom) and node.level > 0:
                    relative.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not relative, f"relative imports: {relative}"


def test_brigade_names_a_service_that_is_not_installed():
    """An image holds only its own services: `brigade learner` there says what to install, and the
    installed commands keep working."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['brigade_learner'] = None\n"  # as if brigade-learner were not installed
            "from brigade_cli.main import app\n"
            "app(sys.argv[1:])")
    missing = subprocess.run([sys.executable, "-c", code, "learner", "--spec", "x.yaml"], capture_output=True,
                             text=True, timeout=60)
    assert missing.returncode == 2 and "pip install brigade-learner" in missing.stderr, missing.stderr
    other = subprocess.run([sys.executable, "-c", code, "janitor", "--help"], capture_output=True, text=True, timeout=60)
    assert other.returncode == 0 and "janitor" in other.stdout, other.stderr


def test_brigade_bench_comes_from_the_bench_distribution():
    """`brigade bench` is the bench distribution's entry point: mounted with its own help where bench
    is installed, and where it is not, `brigade bench` says how to install it."""
    import subprocess
    import sys

    installed = subprocess.run([sys.executable, "-m", "brigade_cli.main", "bench", "--help"],
                               capture_output=True, text=True, timeout=60)
    assert installed.returncode == 0 and "--repeat" in installed.stdout, installed.stderr
    code = ("import sys; sys.modules['brigade_bench'] = None\n"  # as if bench were not installed
            "from brigade_cli.main import app\n"
            "app(sys.argv[1:])")
    missing = subprocess.run([sys.executable, "-c", code, "bench", "fleet", "--quick"], capture_output=True,
                             text=True, timeout=60)
    assert missing.returncode == 2 and "pip install -e bench" in missing.stderr, missing.stderr
