"""Fail on any import circle among the modules under ``include/`` (``make lint`` runs it).

Run: ``PYTHONPATH=include python -m mailflow_dev.import_cycles [package ...]`` (default: ``mailflow``
and ``mailflow_dev``). The import graph comes from grimp (installed with import-linter), which reads
every ``import`` statement of every module, including lazy ones inside functions; imports under
``if TYPE_CHECKING:`` are left out, as in the import contracts, because they never run.

A circle is a strongly connected component of more than one module in the directed graph
"module -> module it imports" (a module importing itself counts too). Exit status 0 when there is
none; otherwise 1, with one shortest circle per component printed as ``a -> b -> ... -> a``.
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Iterable, Mapping, Sequence

import grimp

DEFAULT_PACKAGES = ("mailflow", "mailflow_dev")


def import_graph(packages: Sequence[str]) -> dict[str, set[str]]:
    """``{module: modules of ``packages`` it imports directly}`` for every module of ``packages``
    (dotted names; external packages left out, type-checking-only imports left out)."""
    graph = grimp.build_graph(*packages, exclude_type_checking_imports=True)
    return {m: set(graph.find_modules_directly_imported_by(m)) for m in sorted(graph.modules)}


def strongly_connected(edges: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components of ``edges`` (Tarjan's algorithm, iterative), each sorted,
    in a deterministic order; every node is in exactly one component."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work: list[tuple[str, Iterable[str]]] = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                out.append(sorted(component))
    return sorted(out)


def shortest_circle(edges: Mapping[str, Iterable[str]], component: Sequence[str]) -> list[str]:
    """One shortest circle through the first module of ``component`` (breadth-first within it),
    as ``[a, b, ..., a]``."""
    start, members = component[0], set(component)
    came_from: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for child in sorted(edges.get(node, ())):
            if child not in members:
                continue
            if child == start:
                path = [node]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return [*reversed(path), start]
            if child not in came_from:
                came_from[child] = node
                queue.append(child)
    return [start, start]


def find_circles(edges: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """One shortest circle per import circle of ``edges`` (components of 2+ modules, or a module
    importing itself); ``[]`` when the graph has none."""
    return [
        shortest_circle(edges, comp)
        for comp in strongly_connected(edges)
        if len(comp) > 1 or comp[0] in edges.get(comp[0], ())
    ]


def main(argv: Sequence[str] | None = None) -> int:
    """Print every import circle among ``argv`` packages (default both under ``include/``);
    return 1 if there is one, else 0."""
    packages = list(argv if argv is not None else sys.argv[1:]) or list(DEFAULT_PACKAGES)
    edges = import_graph(packages)
    circles = find_circles(edges)
    for circle in circles:
        print("import circle: " + " -> ".join(circle))
    print(f"{len(edges)} modules of {', '.join(packages)}: {len(circles)} import circle(s)")
    return 1 if circles else 0


if __name__ == "__main__":
    raise SystemExit(main())
