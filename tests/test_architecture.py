"""The package's import structure (issue 26, docs/architecture.md): the import-linter
contracts of ``.importlinter`` hold, there is no import cycle, and the custom contracts
of ``tools/lint`` catch what they are for."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytest.importorskip("importlinter")
sys.path.insert(0, ROOT)  # tools.lint, as lint-imports finds it from the repository root
from tools.lint.private_names import (cycles, function_level_imports, import_graph, private_name_uses,  # noqa: E402
                                      root_imports)


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


def test_module_level_imports_allows_import_error_guards(tmp_path, monkeypatch) -> None:
    root = _package(tmp_path, {
        "guarded/__init__.py": "",
        "guarded/a.py": "x = 1\n",
        "guarded/b.py": """
            def f():
                try:
                    from guarded import a
                except ImportError:
                    return None
                return a.x
        """,
    })
    monkeypatch.syspath_prepend(root)
    assert function_level_imports(["guarded"], set()) == []


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
