"""import-linter contract types for rules its built-in contracts cannot express.

``private_names``: no module uses another module's underscore names, whether imported
(``from fastpersist.api import _handle``) or reached through a module
(``api._handle(...)``). A module's own names, dunder names and private *modules*
(``fastpersist._compat``, ``fastpersist._native``: importing those is what they are for)
are allowed.

``module_level_imports``: the packages' modules import each other at module level only.
An import of one of the packages' modules inside a function is a violation, except in the
modules listed in ``allowed`` (the start-up hook, which must stay import-light).
An import inside a ``try`` whose handler catches ``ImportError`` is an optional
dependency's guard, allowed for the modules listed in ``optional`` only (``fastpersist.dcp``
needs a torch with ``torch.distributed.checkpoint``): a guard around a module that always
imports is no excuse for a function-level import. Function-level imports of other packages
(optional dependencies: torch.distributed, CUDA, the frameworks, matplotlib) are not this
contract's business.

Both read the source files of the packages named in ``packages`` (found on ``sys.path``,
as import-linter finds them) with :mod:`ast`; the import graph is not needed.
"""

from __future__ import annotations

import ast
import fnmatch
import importlib.util
import os
from typing import Any, Iterator, Optional

from importlinter import Contract, ContractCheck, fields, output


def _package_files(package: str) -> Iterator[tuple[str, str]]:
    """(module name, file path) of every ``.py`` file of ``package``."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"package {package!r} not found on sys.path")
    seen = set()
    # the locations holding the package's __init__.py: an editable install also lists its
    # build folder (extension modules only) and the repository root
    roots = [r for r in spec.submodule_search_locations if os.path.isfile(os.path.join(r, "__init__.py"))]
    for root in roots:
        for dirpath, _, files in os.walk(root):
            for f in sorted(files):
                if not f.endswith(".py"):
                    continue
                rel = os.path.relpath(os.path.join(dirpath, f), root)[:-3].replace(os.sep, ".")
                name = (package if rel == "__init__" else f"{package}.{rel}").removesuffix(".__init__")
                if name not in seen:
                    seen.add(name)
                    yield name, os.path.join(dirpath, f)


def module_names(packages: list[str]) -> list[str]:
    """Every module of ``packages`` (one per ``.py`` file; a package by its ``__init__``), sorted."""
    return sorted(name for p in packages for name, _ in _package_files(p))


class _Index:
    """The modules of the packages, and how to resolve an import statement to them."""

    def __init__(self, packages: list[str]) -> None:
        self.files = dict(kv for p in packages for kv in _package_files(p))
        self.packages = packages
        self.is_pkg = {m: f.endswith("__init__.py") for m, f in self.files.items()}

    def internal(self, name: str) -> bool:
        return any(name == p or name.startswith(p + ".") for p in self.packages)

    def module(self, name: str) -> bool:
        """Whether ``name`` is a module of the packages (a file, or an extension module
        such as ``fastpersist._native`` whose name is private by design)."""
        if name in self.files:
            return True
        parent, _, leaf = name.rpartition(".")
        if not (self.is_pkg.get(parent) and _private(leaf)):
            return False
        try:
            return importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            return False

    def absolute(self, me: str, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        parts = me.split(".") if self.is_pkg[me] else me.split(".")[:-1]
        parts = parts[: len(parts) - (node.level - 1)]
        return ".".join(parts + ([node.module] if node.module else []))


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_name_uses(packages: list[str]) -> list[str]:
    """Every use of another module's underscore name, as ``module:line: what``."""
    idx = _Index(packages)
    found = []
    for me, path in idx.files.items():
        tree = ast.parse(open(path, encoding="utf-8").read(), path)
        aliases: dict[str, str] = {}  # local name -> internal module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                src = idx.absolute(me, node)
                if not idx.internal(src):
                    continue
                for a in node.names:
                    full = f"{src}.{a.name}"
                    if idx.module(full):
                        aliases[a.asname or a.name] = full
                    elif _private(a.name) and src != me:
                        found.append(f"{me}:{node.lineno}: from {src} import {a.name}")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if idx.internal(a.name):
                        aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases):
                target = aliases[node.value.id]
                if target != me and not idx.module(f"{target}.{node.attr}"):
                    found.append(f"{me}:{node.lineno}: {node.value.id}.{node.attr} ({target})")
    return sorted(set(found))


def function_level_imports(packages: list[str], allowed: set[str], optional: Optional[set[str]] = None) -> list[str]:
    """Every import of the packages' own modules made inside a function, as ``module:line: what``.

    Imports inside an ``ImportError`` guard are allowed when every module of the packages
    the guard imports is in ``optional`` (or a submodule of one); ``optional=None``: any guard."""
    idx = _Index(packages)

    def excused(node: ast.AST, me: str) -> bool:
        if not _guards_import(node):
            return False
        if optional is None:
            return True
        for child in ast.walk(node):
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names if idx.internal(a.name)]
            elif isinstance(child, ast.ImportFrom):
                src = idx.absolute(me, child)
                names = [f"{src}.{a.name}" if idx.module(f"{src}.{a.name}") else src for a in child.names
                         if idx.internal(src)]
            else:
                continue
            if not all(any(n == o or n.startswith(o + ".") for o in optional) for n in names):
                return False
        return True

    found = []
    for me, path in idx.files.items():
        if me in allowed:
            continue
        tree = ast.parse(open(path, encoding="utf-8").read(), path)

        def visit(node: ast.AST, in_function: bool) -> None:
            if excused(node, me):
                return
            for child in ast.iter_child_nodes(node):
                inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                if in_function and isinstance(child, ast.Import):
                    names = [a.name for a in child.names if idx.internal(a.name)]
                elif in_function and isinstance(child, ast.ImportFrom):
                    src = idx.absolute(me, child)
                    names = [src] if idx.internal(src) else []
                else:
                    names = []
                if names:
                    found.append(f"{me}:{child.lineno}: {ast.unparse(child)}")
                visit(child, inner)

        visit(tree, False)
    return found


def _guards_import(node: ast.AST) -> bool:
    """Whether ``node`` is a ``try`` whose handlers catch ImportError (its body: optional imports)."""
    if not isinstance(node, ast.Try):
        return False
    caught = " ".join(ast.unparse(h.type) for h in node.handlers if h.type is not None)
    return "ImportError" in caught or "ModuleNotFoundError" in caught


class _AstContract(Contract):
    packages = fields.ListField(subfield=fields.StringField())

    def problems(self) -> list[str]:  # pragma: no cover - abstract
        raise NotImplementedError

    def check(self, graph: Any, verbose: bool) -> ContractCheck:
        found = self.problems()
        return ContractCheck(kept=not found, metadata={"problems": found})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for line in check.metadata["problems"]:
            output.print_error(line, bold=False)
        output.new_line()


class PrivateNamesContract(_AstContract):
    """No module imports or reaches another module's underscore names."""

    def problems(self) -> list[str]:
        return private_name_uses([str(p) for p in self.packages])


class ModuleLevelImportsContract(_AstContract):
    """The packages' modules import each other at module level only (``allowed``: exceptions)."""

    allowed = fields.ListField(subfield=fields.StringField(), required=False, default=[])
    optional = fields.ListField(subfield=fields.StringField(), required=False, default=[])

    def problems(self) -> list[str]:
        return function_level_imports([str(p) for p in self.packages], {str(a) for a in self.allowed},
                                      {str(o) for o in self.optional})


def root_imports(packages: list[str], allowed: set[str]) -> list[str]:
    """Every import of a package's root itself (``import fastpersist``,
    ``from fastpersist import save``) outside the modules in ``allowed``. Submodules
    (``from fastpersist import api``) and extension modules (``fastpersist._native``,
    which the import graph cannot see and would map to the root) are not the root."""
    idx = _Index(packages)
    found = []
    for me, path in idx.files.items():
        if me in packages or any(fnmatch.fnmatchcase(me, pattern) for pattern in allowed):
            continue
        tree = ast.parse(open(path, encoding="utf-8").read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                bad = [a.name for a in node.names if a.name in packages]
            elif isinstance(node, ast.ImportFrom):
                src = idx.absolute(me, node)
                bad = [f"{src}.{a.name}" for a in node.names if src in packages and not idx.module(f"{src}.{a.name}")]
            else:
                continue
            if bad:
                found.append(f"{me}:{node.lineno}: {ast.unparse(node)}")
    return found


class RootImportsContract(_AstContract):
    """Only the modules in ``allowed`` import the package's root (its public facade);
    the layers below import the modules they need. (The layers contract ignores imports
    of the root, because the import graph maps ``fastpersist._native``, an extension
    module, to it: this contract is what forbids the real ones.)"""

    allowed = fields.ListField(subfield=fields.StringField(), required=False, default=[])

    def problems(self) -> list[str]:
        return root_imports([str(p) for p in self.packages], {str(a) for a in self.allowed})


def import_graph(packages: list[str]) -> dict[str, set[str]]:
    """Module -> the packages' modules it imports (anywhere in the file, functions
    included). Extension modules such as ``fastpersist._native`` are nodes of their own
    (an import graph built from ``.py`` files alone would map them to the root package
    and report a false cycle through it)."""
    idx = _Index(packages)
    graph: dict[str, set[str]] = {m: set() for m in idx.files}

    def target(name: str) -> str:
        while name and name not in idx.files and not idx.module(name) and "." in name:
            name = name.rsplit(".", 1)[0]
        return name

    for me, path in idx.files.items():
        tree = ast.parse(open(path, encoding="utf-8").read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                src = idx.absolute(me, node)
                names = [f"{src}.{a.name}" if idx.module(f"{src}.{a.name}") else src for a in node.names]
            else:
                continue
            for n in names:
                if idx.internal(n):
                    t = target(n)
                    if t != me:
                        graph[me].add(t)
                        graph.setdefault(t, set())
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out
