#!/usr/bin/env python3
"""Import cycles among the top-level modules of server/ (#37: imports only point down).

Reads every .rs file under server/, resolves each path it names (`crate::a::b`, `super::a`,
one level of `{...}` groups) to the module it lands in, cut to `--depth` names, and makes an edge
from the file's module to it; prints each cycle of that graph (its strongly connected components
of two or more modules, and the edges inside them) with the files that make each edge. Exit 1 if
there is any. Paths in comments are skipped; a module is never counted against its own parents.
  usage: python3 scripts/module-cycles.py [--depth 2]   (2: nested modules such as backend::cuda)
"""
import argparse
import os
import re
import sys
from collections import defaultdict

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "server")
# `crate::a::b`, `super::super::a`, and `{...}` groups after either (one level).
PATH = re.compile(r"\b(crate|(?:super::)*super)::((?:[a-z_][a-z0-9_]*)(?:::[a-z_][a-z0-9_]*)*)?(::)?(\{[^{}]*\})?")
NAME = re.compile(r"^\s*([a-z_][a-z0-9_]*(?:::[a-z_][a-z0-9_]*)*)")


def full_path(path):
    rel = os.path.relpath(path, ROOT)[: -len(".rs")].split(os.sep)
    if rel[-1] == "mod":
        rel = rel[:-1]
    return [] if rel in (["lib"], ["main"]) else rel


def module_of(path, depth):
    rel = full_path(path)
    return "::".join(rel[:depth]) if rel else None


def paths_in(src, here):
    """Every module path a file names: crate-absolute, as lists of names."""
    for m in PATH.finditer(src):
        root, head, sep, group = m.groups()
        base = [] if root == "crate" else here[: len(here) - root.count("super")]
        head = head.split("::") if head else []
        tails = [[]]
        if group and (sep or not head):
            tails = [n.group(1).split("::") for part in group[1:-1].split(",") if (n := NAME.match(part))]
        for t in tails:
            yield base + head + t


def strip_comments(src):
    src = re.sub(r"/\*.*?\*/", "", src, flags=re.S)
    return "\n".join(line.split("//")[0] for line in src.splitlines())


def target_of(path_in_crate, depth, known):
    parts = path_in_crate.split("::")
    for n in range(min(depth, len(parts)), 0, -1):
        name = "::".join(parts[:n])
        if name in known:
            return name
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--depth", type=int, default=1)
    args = ap.parse_args()
    files = []
    for d, _, names in os.walk(ROOT):
        files += [os.path.join(d, n) for n in names if n.endswith(".rs")]
    known = {m for f in files if (m := module_of(f, args.depth))}
    # Every prefix of a known module is a module too (backend, for backend::cuda).
    known |= {"::".join(m.split("::")[:i]) for m in known for i in range(1, m.count("::") + 1)}
    edges = defaultdict(set)  # (a, b) -> files
    for f in files:
        a = module_of(f, args.depth)
        if a is None:
            continue
        for path in paths_in(strip_comments(open(f).read()), full_path(f)):
            b = target_of("::".join(path), args.depth, known)
            if b and b != a and not a.startswith(b + "::") and not b.startswith(a + "::"):
                edges[(a, b)].add(os.path.relpath(f, os.path.join(ROOT, "..")))
    graph = defaultdict(set)
    for a, b in edges:
        graph[a].add(b)
    # Tarjan's strongly connected components.
    index, low, stack, on, comps, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            comps.append(comp)

    sys.setrecursionlimit(10000)
    for v in sorted(known):
        if v not in index:
            visit(v)
    cycles = [c for c in comps if len(c) > 1]
    for c in cycles:
        print("cycle:", " ".join(sorted(c)))
        for (a, b), fs in sorted(edges.items()):
            if a in c and b in c:
                print(f"  {a} -> {b}: {', '.join(sorted(fs))}")
    print(f"{len(known)} modules, {len(edges)} edges, {len(cycles)} cycles")
    return 1 if cycles else 0


if __name__ == "__main__":
    sys.exit(main())
