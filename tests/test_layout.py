"""The package's layout: no import circle among numguard's modules, imports inside functions
included (a circle hidden in a function still ties the two modules' designs together), and no
class over 400 lines."""
from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "numguard")


def _modules():
    mods = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                mods[dotted[:-len(".__init__")] if dotted.endswith(".__init__") else dotted] = path
    return mods


def _imported(mods, module, node):
    """numguard modules an import statement of `module` names."""
    package = module if mods[module].endswith("__init__.py") else module.rsplit(".", 1)[0]
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "numguard"]
    if node.level:
        parts = package.split(".")
        base = ".".join(parts[:len(parts) - node.level + 1])
        target = base + ("." + node.module if node.module else "")
    else:
        target = node.module or ""
    if target.split(".")[0] != "numguard":
        return []
    out = []
    for alias in node.names:
        if alias.name == "_C":  # the compiled extension: no Python module to follow
            continue
        candidate = f"{target}.{alias.name}"
        out.append(candidate if candidate in mods else target)
    return out


def import_graph():
    mods = _modules()
    graph = {m: set() for m in mods}
    for module, path in mods.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _imported(mods, module, node):
                    while target not in mods and "." in target:
                        target = target.rsplit(".", 1)[0]
                    if target in mods and target != module:
                        graph[module].add(target)
    return graph


def circles(graph):
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
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


def test_the_checker_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_among_numguard_modules():
    graph = import_graph()
    assert "numguard.inspector.core" in graph and graph["numguard.inspector.core"]
    found = circles(graph)
    detail = [" -> ".join(c) + ": " + "; ".join(f"{m} imports {sorted(graph[m] & set(c))}" for m in c)
              for c in found]
    assert found == [], "import circles:\n" + "\n".join(detail)


def test_no_class_over_400_lines():
    # A class past this size does several jobs: split it (numguard.inspector.features).
    big = []
    for module, path in sorted(_modules().items()):
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 400:
                big.append(f"{module}.{node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert big == []
