"""The packages' import structure: no cycles, few function-level imports, no private reach-ins.

These tests read the source with :mod:`ast`; they import nothing of the project.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("disttensor", "disttensor_nn")
MAX_INNER_IMPORTS = 10


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


MODULES = _modules()
TREES = {m: ast.parse(p.read_text(), str(p)) for m, p in MODULES.items()}


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    """The project's modules that an import statement inside ``module`` loads."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            pkg = module.split(".")
            if MODULES[module].name != "__init__.py":
                pkg = pkg[:-1]
            pkg = pkg[: len(pkg) - (node.level - 1)]
            base = ".".join(pkg + ([base] if base else []))
        names = [base] + [f"{base}.{a.name}" for a in node.names]
    out = set()
    for name in names:
        while name and name not in MODULES:
            name = name.rpartition(".")[0]
        if name and name != module:
            out.add(name)
    return out


def _imports(module: str) -> tuple[set[str], list[tuple[int, set[str]]]]:
    """Module-level import targets, and (line, targets) of imports inside functions."""
    top: set[str] = set()
    inner: list[tuple[int, set[str]]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                targets = _targets(module, child)
                if in_function:
                    if targets:
                        inner.append((child.lineno, targets))
                else:
                    top.update(targets)
            visit(child, in_function or isinstance(
                child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(TREES[module], False)
    return top, inner


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (iterative Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    counter = 0
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
    return found


def test_cycle_finder_finds_a_cycle():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(edges) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_among_module_level_imports():
    edges = {m: _imports(m)[0] for m in MODULES}
    assert _cycles(edges) == []


def test_no_import_cycle_counting_function_level_imports():
    edges = {}
    for m in MODULES:
        top, inner = _imports(m)
        edges[m] = top | {t for _, ts in inner for t in ts}
    assert _cycles(edges) == []


def test_disttensor_does_not_import_disttensor_nn():
    for m in MODULES:
        if m.split(".")[0] == "disttensor":
            top, inner = _imports(m)
            targets = top | {t for _, ts in inner for t in ts}
            assert not {t for t in targets if t.split(".")[0] == "disttensor_nn"}, m


def test_function_level_imports_are_few_and_explained():
    inner = []
    for m, path in MODULES.items():
        lines = path.read_text().splitlines()
        for lineno, targets in _imports(m)[1]:
            here, above = lines[lineno - 1], lines[lineno - 2] if lineno > 1 else ""
            explained = "#" in here or above.strip().startswith("#")
            inner.append((f"{path.relative_to(ROOT)}:{lineno}", sorted(targets), explained))
    assert len(inner) <= MAX_INNER_IMPORTS, inner
    assert [i for i in inner if not i[2]] == []


def _private_names_of_disttensor() -> set[str]:
    """Names with one leading underscore that disttensor defines or assigns."""
    names = set()
    for m, tree in TREES.items():
        if m.split(".")[0] != "disttensor":
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _private_uses(tree: ast.AST, private: set[str]) -> list:
    """Imports of disttensor's private names, and attributes named like its private members
    read from anything but ``self`` or ``cls`` (a class's own members may share a name)."""
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "disttensor":
            uses += [(node.lineno, a.name) for a in node.names if a.name.startswith("_")]
            if any(p.startswith("_") for p in (node.module or "").split(".")):
                uses.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            uses += [(node.lineno, a.name) for a in node.names
                     if a.name.split(".")[0] == "disttensor"
                     and any(p.startswith("_") for p in a.name.split("."))]
        elif isinstance(node, ast.Attribute) and node.attr in private and not (
                isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            uses.append((node.lineno, node.attr))
    return uses


def test_private_use_finder_finds_reach_ins():
    private = _private_names_of_disttensor()
    assert "_check_dist" in private or private  # disttensor has private helpers to guard
    code = ("from disttensor.array import _hidden\nimport disttensor._x\n"
            f"x.{sorted(private)[0]}\nself._mine = 1\nself._mine\nx._buffer\n")
    uses = _private_uses(ast.parse(code), private | {"_mine", "_buffer"})
    assert [u[0] for u in uses] == [1, 2, 3, 6]


DISTTENSOR_PRIVATE = _private_names_of_disttensor()


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("disttensor_nn")))
def test_disttensor_nn_uses_no_private_name_of_disttensor(module):
    assert _private_uses(TREES[module], DISTTENSOR_PRIVATE) == []
