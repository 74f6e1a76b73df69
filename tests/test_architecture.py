"""The package's import structure (issue 26, docs/architecture.md): the import-linter
contracts of ``.importlinter`` hold, there is no import cycle, and the custom contracts
of ``tools/lint`` catch what they are for."""

from __future__ import annotations

import configparser
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytest.importorskip("importlinter")
sys.path.insert(0, ROOT)  # tools.lint, as lint-imports finds it from the repository root
from tools.lint.private_names import (cycles, function_level_imports, import_graph, module_names,  # noqa: E402
                                      private_name_uses, root_imports)


def _lint_imports(cwd: str, config: str = ".importlinter") -> subprocess.CompletedProcess:
    exe = shutil.which("lint-imports", path=os.path.dirname(sys.executable)) or shutil.which("lint-imports")
    assert exe, "import-linter is installed (pyproject's test extra) but lint-imports is not on PATH"
    env = dict(os.environ, PYTHONPATH=cwd + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([exe, "--config", config, "--no-cache"], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)


def test_import_contracts_hold() -> None:
    """Every contract of .importlinter is kept (layers, independence, private names,
    module-level imports, root imports)."""
    r = _lint_imports(ROOT)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert "BROKEN" not in r.stdout and "broken" not in r.stdout.split("Contracts:")[-1].split("\n")[0].replace(
        "0 broken", "")


def _layers_contracts(config: str) -> dict[str, tuple[str, set[str]]]:
    """container -> (contract section, the names its layers list) of every layers contract of ``config``."""
    parser = configparser.ConfigParser(interpolation=None)
    parser.read(config)
    out: dict[str, tuple[str, set[str]]] = {}
    for section in parser.sections():
        if parser.get(section, "type", fallback="") != "layers":
            continue
        names: set[str] = set()
        for line in parser.get(section, "layers").splitlines():
            line = line.split("#", 1)[0].strip()
            names.update(n.strip().strip("()") for n in re.split(r"[|:]", line) if n.strip())
        for container in parser.get(section, "containers", fallback="").split():
            out[container] = (section, names)
    return out


def unlayered_modules(packages: list[str], config: str) -> list[str]:
    """Why each module of ``packages`` that no layers contract of ``config`` names is
    unconstrained, and where to add it. A module is named when it is listed in the
    layers of the contract whose container is its package (the packages' own
    ``__init__`` modules are the containers)."""
    contracts = _layers_contracts(config)
    problems = []
    for name in module_names(packages):
        if name in packages:
            continue
        parent, _, leaf = name.rpartition(".")
        if parent not in contracts:
            problems.append(
                f"{name}: its package {parent} has no layers contract in {os.path.basename(config)}; add a "
                f"[importlinter:contract:...] section with type = layers, containers = {parent} and a layers list "
                f"naming {leaf!r} and every other module of {parent}")
        elif leaf not in contracts[parent][1]:
            section = contracts[parent][0]
            problems.append(
                f"{name} is in no layer: add {leaf!r} to the layers of [{section}] in {os.path.basename(config)} "
                f"(container {parent}), in the line below every module that imports it and above every module it "
                "imports (docs/architecture.md lists the layers)")
    return problems


def test_layers_contracts_name_every_module() -> None:
    """The layers contracts are exhaustive: every module of fastpersist/ and integrations/
    (formats/, formats/safetensors/, dcp/, bench/ included) is named by the layers contract
    of its package, so a new module cannot escape the layering."""
    found = unlayered_modules(["fastpersist", "integrations"], os.path.join(ROOT, ".importlinter"))
    assert found == [], "modules outside every layers contract:\n" + "\n".join(found)


def test_unlayered_module_is_reported(tmp_path, monkeypatch) -> None:
    """A module that no layers contract names, and a package without a contract, are
    reported with where to add them."""
    root = _package(tmp_path, {
        "lay/__init__.py": "",
        "lay/top.py": "",
        "lay/bottom.py": "",
        "lay/new.py": "",
        "lay/sub/__init__.py": "",
        "lay/sub/leaf.py": "",
        "contracts.ini": """
            [importlinter]
            root_packages =
                lay
            [importlinter:contract:lay]
            name = lay
            type = layers
            containers =
                lay
            layers =
                top | sub
                bottom
        """,
    })
    monkeypatch.syspath_prepend(root)
    found = unlayered_modules(["lay"], os.path.join(root, "contracts.ini"))
    assert len(found) == 2, found
    assert found[0].startswith("lay.new is in no layer: add 'new' to the layers of [importlinter:contract:lay]")
    assert found[1].startswith("lay.sub.leaf: its package lay.sub has no layers contract")


def test_no_import_cycles() -> None:
    """No strongly connected component of more than one module in the import graph of
    fastpersist and integrations (every import counts, function-level ones too)."""
    graph = import_graph(["fastpersist", "integrations"])
    assert len(graph) > 60 and sum(map(len, graph.values())) > 200  # the real package was read
    assert cycles(graph) == []


def test_cycle_finder_finds_a_cycle(tmp_path, monkeypatch) -> None:
    root = _package(tmp_path, {
        "cyc/__init__.py": "",
        "cyc/a.py": "from cyc import b\n",
        "cyc/b.py": "def f():\n    from cyc import c\n",
        "cyc/c.py": "import cyc.a\n",
        "cyc/d.py": "from cyc import a\n",
    })
    monkeypatch.syspath_prepend(root)
    graph = import_graph(["cyc"])
    assert cycles(graph) == [["cyc.a", "cyc.b", "cyc.c"]]


def _package(tmp_path, files: dict[str, str]) -> str:
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))
    return str(tmp_path)


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """A package ``toypkg`` on sys.path with one violation of each custom rule."""
    root = _package(tmp_path, {
        "toypkg/__init__.py": "from toypkg import high\n",
        "toypkg/low.py": """
            def _helper():
                return 1
            def public():
                return 2
        """,
        "toypkg/high.py": """
            from toypkg import low
            from toypkg.low import _helper
            def f():
                from toypkg import low as again
                return low._helper() + again.public()
        """,
        "toypkg/lower.py": """
            import toypkg
            def g():
                return toypkg.high
        """,
    })
    monkeypatch.syspath_prepend(root)
    yield root
    for m in [m for m in sys.modules if m == "toypkg" or m.startswith("toypkg.")]:
        del sys.modules[m]


def test_private_names_contract_catches_both_forms(toy) -> None:
    found = private_name_uses(["toypkg"])
    assert any("from toypkg.low import _helper" in f for f in found), found
    assert any("low._helper" in f for f in found), found
    assert not any("public" in f for f in found), found


def test_module_level_imports_contract_catches_function_imports(toy) -> None:
    found = function_level_imports(["toypkg"], set())
    assert found == ["toypkg.high:5: from toypkg import low as again"], found
    assert function_level_imports(["toypkg"], {"toypkg.high"}) == []


def _guarded_package(tmp_path, monkeypatch, name: str) -> None:
    """A package ``name`` on sys.path whose ``b.f`` imports ``name.a`` inside an ImportError guard."""
    root = _package(tmp_path, {
        f"{name}/__init__.py": "",
        f"{name}/a.py": "x = 1\n",
        f"{name}/b.py": f"""
            def f():
                try:
                    from {name} import a
                except ImportError:
                    return None
                return a.x
        """,
    })
    monkeypatch.syspath_prepend(root)


def test_module_level_imports_allows_import_error_guards(tmp_path, monkeypatch) -> None:
    _guarded_package(tmp_path, monkeypatch, "guarded")
    assert function_level_imports(["guarded"], set()) == []


def test_module_level_imports_guards_only_for_optional_modules(tmp_path, monkeypatch) -> None:
    """With a list of optional modules, a guard around any other module's import is reported."""
    _guarded_package(tmp_path, monkeypatch, "guarded2")
    assert function_level_imports(["guarded2"], set(), set()) == ["guarded2.b:4: from guarded2 import a"]
    assert function_level_imports(["guarded2"], set(), {"guarded2.a"}) == []


def test_root_imports_contract(toy) -> None:
    found = root_imports(["toypkg"], set())
    assert found == ["toypkg.lower:2: import toypkg"], found
    assert root_imports(["toypkg"], {"toypkg.low*"}) == []


def test_layers_contract_fails_on_an_upward_import(tmp_path) -> None:
    """import-linter with a layers contract like ours reports an import from a lower
    layer up (so the contract in .importlinter is not vacuous)."""
    root = _package(tmp_path, {
        "layered/__init__.py": "",
        "layered/top.py": "from layered import bottom\n",
        "layered/bottom.py": "def f():\n    from layered import top\n    return top\n",
        "contracts.ini": """
            [importlinter]
            root_packages =
                layered
            [importlinter:contract:layers]
            name = layers
            type = layers
            containers =
                layered
            layers =
                top
                bottom
        """,
    })
    r = _lint_imports(root, "contracts.ini")
    assert r.returncode != 0 and "layered.bottom is not allowed to import layered.top" in r.stdout, r.stdout
