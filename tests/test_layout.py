"""The package's shape: one import root, imports one way with no loop, short files,
the ledger of adaptations in step with the code, a README for users."""

import ast
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# Room -> the rooms it may import (docs/architecture.md); "models" is the root's own modules.
ROOMS = {
    "loaders": {"loaders"},
    "quant": {"quant", "loaders"},
    "models": {"models", "loaders", "quant"},
    "server": {"server", "models", "loaders", "quant"},
    "harness": {"harness", "server", "models", "loaders", "quant"},
    "benchmarks": {"benchmarks", "harness", "server", "models", "loaders", "quant"},
}


def package_dirs() -> dict[str, Path]:
    """Installed package -> its folder in the repository (pyproject's package-dir)."""
    mapping = PYPROJECT["tool"]["setuptools"]["package-dir"]
    dirs = {}
    for package in PYPROJECT["tool"]["setuptools"]["packages"]:
        parent = next((p for p in sorted(mapping, key=len, reverse=True)
                       if package == p or package.startswith(p + ".")), None)
        base = ROOT / mapping[parent] if parent else ROOT
        rest = package[len(parent) + 1:] if parent else package
        dirs[package] = base.joinpath(*rest.split(".")) if rest else base
    return dirs


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ROOMS else "models"


@pytest.fixture(scope="module")
def imports(tmp_path_factory) -> dict[str, set[str]]:
    """Module -> the package modules it imports (lazy imports too), read by grimp from the
    package laid out as the wheel installs it."""
    tree = tmp_path_factory.mktemp("installed")
    for package, directory in package_dirs().items():
        target = tree.joinpath(*package.split("."))
        target.mkdir(parents=True, exist_ok=True)
        for file in directory.glob("*.py"):
            shutil.copy(file, target / file.name)
    script = ("import grimp, json\n"
              "g = grimp.build_graph('tpu_models', cache_dir=None)\n"
              "print(json.dumps({m: sorted(g.find_modules_directly_imported_by(m)) "
              "for m in g.modules}))\n")
    run = subprocess.run([sys.executable, "-c", script], cwd=tree, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    import json
    return {m: set(deps) for m, deps in json.loads(run.stdout).items()}


def test_every_module_is_under_one_import_root(imports):
    assert set(PYPROJECT["tool"]["setuptools"]["packages"]) <= set(imports)
    assert all(m.split(".")[0] == "tpu_models" for m in imports)
    on_disk = {p.stem for d in package_dirs().values() for p in d.glob("*.py")}
    assert {m.rsplit(".", 1)[-1] for m in imports} >= on_disk - {"__init__"}


def test_every_package_is_listed_in_pyproject():
    # The wheel installs only the packages listed (docs/adding-an-architecture.md).
    roots = [ROOT / "tpu_models", *(ROOT / d for d in
                                    PYPROJECT["tool"]["setuptools"]["package-dir"].values())]
    found = {p.parent for r in roots for p in r.rglob("__init__.py")}
    missing = sorted(str(d.relative_to(ROOT)) for d in found - set(package_dirs().values()))
    assert not missing, f"not in pyproject.toml's packages: {missing}"


def test_no_import_loop(imports):
    import networkx as nx
    graph = nx.DiGraph([(m, d) for m, deps in imports.items() for d in deps])
    loops = [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]
    assert not loops, f"import loops: {loops}"


def test_rooms_import_one_way(imports):
    wrong = sorted(f"{m} -> {d}" for m, deps in imports.items() for d in deps
                   if room(d) not in ROOMS[room(m)])
    assert not wrong, "imports against docs/architecture.md's arrows:\n" + "\n".join(wrong)


# Rooms of tpu_models/ that import the seam, and why (docs/architecture.md lists them):
# each wires it, as an entry point does; none holds a feature the seam calls.
CORE_IMPORTING_THE_SEAM = {
    "tpu_models.plugin": "vLLM's entry point: installs the seam, then registers the models",
    "tpu_models.tunix": "installs the seam's Tunix adaptations, as the plugin does vLLM's",
}


def test_the_feature_rooms_import_no_patch(imports):
    # The seam (tpu_models.adapt) changes tpu-inference and vLLM and calls into the
    # feature rooms; they know nothing of it. The models reach what it adds through
    # runtime.SEAM, which the plugin fills in.
    core = [m for m in imports if room(m) == "models" and not m.startswith("tpu_models.adapt")
            and m not in CORE_IMPORTING_THE_SEAM]
    wrong = sorted(f"{m} -> {d}" for m in core for d in imports[m]
                   if d.startswith("tpu_models.adapt"))
    assert not wrong, wrong
    uses = {m for m in CORE_IMPORTING_THE_SEAM
            if any(d.startswith("tpu_models.adapt") for d in imports[m])}
    assert uses == set(CORE_IMPORTING_THE_SEAM), "no longer needed: " + str(
        set(CORE_IMPORTING_THE_SEAM) - uses)
    doc = (ROOT / "docs" / "architecture.md").read_text()
    assert all(f"`{m.split('.')[-1]}.py`" in doc for m in CORE_IMPORTING_THE_SEAM)


def test_the_seam_holds_no_device_program():
    # Device programs and numerics live in the feature rooms; the seam only wires.
    found = {}
    for path in sorted((ROOT / "tpu_models" / "adapt").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [f"{node.module}.{a.name}" for a in node.names]
                     if isinstance(node, ast.ImportFrom) and node.module else [])
            if any(n in ("jax.numpy", "jax.lax") or n.startswith(("jax.numpy.", "jax.lax."))
                   for n in names):
                found[path.name] = node.lineno
    assert not found, found


def test_the_architecture_names_every_room():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    package = ROOT / "tpu_models"
    rooms = {f"`{p.name}/`" for p in package.iterdir()
             if p.is_dir() and (p / "__init__.py").exists()}
    rooms |= {f"`{p.name}`" for p in package.glob("*.py") if p.stem != "__init__"}
    rooms |= {f"`{p.name}`" for p in (package / "adapt").glob("*.py")
              if p.stem not in ("__init__", "__main__")}
    missing = sorted(r for r in rooms if r not in doc)
    assert not missing, f"docs/architecture.md does not name {missing}"


def test_host_setup_imports_only_the_standard_library():
    # It runs before vLLM is imported; a third-party import could pick the platform early.
    source = (ROOT / "tpu_models" / "host.py").read_text()
    imported = set(re.findall(r"^\s*(?:import|from) (\w+)", source, re.M))
    assert imported <= set(sys.stdlib_module_names), imported - set(sys.stdlib_module_names)


def test_no_file_in_the_package_over_400_lines():
    long = {str(p.relative_to(ROOT)): n for d in package_dirs().values() for p in d.glob("*.py")
            if (n := len(p.read_text().splitlines())) > 400}
    assert not long, long


# Short functions (#70): each readable on one screen, top to bottom.
SHORT_FUNCTIONS_IN = ("tpu_models", "loaders", "quant", "server")


def test_no_function_over_60_lines():
    long = {}
    for folder in SHORT_FUNCTIONS_IN:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                        and (n := node.end_lineno - node.lineno + 1) > 60):
                    long[f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"] = n
    assert not long, long


def test_no_test_file_over_500_lines():
    long = {p.name: n for p in (ROOT / "tests").glob("*.py")
            if (n := len(p.read_text().splitlines())) > 500}
    assert not long, long


def test_the_ledger_of_adaptations_is_in_step_with_the_code():
    run = subprocess.run([sys.executable, "-m", "tpu_models.adapt"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    ledger = (ROOT / "docs" / "adaptations.md").read_text()
    assert ledger == run.stdout, "docs/adaptations.md is stale: python -m tpu_models.adapt " \
                                 "> docs/adaptations.md"


def test_each_adaptation_names_a_test_that_exists():
    import importlib

    from tpu_models import adapt
    on_import = [p for name in adapt.ON_IMPORT
                 for p in importlib.import_module(f"tpu_models.adapt.{name}").PATCHES]
    for patch in adapt.patches() + on_import:
        file, _, name = patch.test.partition("::")
        source = (ROOT / file).read_text()
        assert re.search(rf"^def {name}\(", source, re.M), f"{patch.name}: no {patch.test}"
        assert len(patch.why) < 120 and "\n" not in patch.why, patch.name


def test_the_readme_stays_short():
    # For users: what it does, the two commands, each capability once; details in docs/.
    assert len((ROOT / "README.md").read_text()) < 12_000
