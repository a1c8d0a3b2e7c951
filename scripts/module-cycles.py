#!/usr/bin/env python3
"""Import cycles among the modules of the workspace's crates (#37, #53: imports only point down).

Reads every .rs file of each crate (server/, loadtest/src/, nccl-sys/src/), resolves each path it
names (`crate::a::b`, `super::a`, `self::a`, a child module declared in the file (`mod a;` then
`a::b`), another crate of the workspace (`epserve::a`), and one level of `{...}` groups) to the
module it lands in, cut to `--depth` names, and makes an edge from the file's module to it. Edges
between a module and its own parent or child count like any other (a parent that calls into its
child while the child imports from the parent is a cycle). Comments are removed by a small lexer
that knows string and char literals, so a `//` inside a string cuts nothing.
Prints each cycle (a strongly connected component of two or more modules, with the edges inside it
and the files that make each edge). Exit 1 if there is any, at any of the depths asked.
  usage: python3 scripts/module-cycles.py [--depth 1 2]
"""
import argparse
import os
import re
import sys
from collections import defaultdict

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
# crate name as other crates write it -> its source root.
CRATES = {"epserve": "server", "epserve_loadtest": "loadtest/src", "nccl_sys": "nccl-sys/src"}
ROOTS = ("lib", "main")
IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
# `crate::a::b`, `super::super::a`, `self::a`, `other_crate::a`, and `{...}` groups after each.
PATH = re.compile(
    r"(?<![A-Za-z0-9_:])(crate|self|(?:super::)*super|" + "|".join(CRATES) + r"|" + IDENT + r")"
    r"::((?:" + IDENT + r")(?:::" + IDENT + r")*)?(::)?(\{[^{}]*\})?"
)
NAME = re.compile(r"^\s*(" + IDENT + r"(?:::" + IDENT + r")*)")
CHILD = re.compile(r"^\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+(" + IDENT + r")\s*;", re.M)


def strip_comments(src):
    """The source without comments; string, raw-string and char literals are kept whole."""
    out, i, n = [], 0, len(src)
    while i < n:
        c = src[i]
        if src.startswith("//", i):
            j = src.find("\n", i)
            i = n if j < 0 else j
        elif src.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if src.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif src.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    i += 1
        elif (m := re.match(r'b?r(#*)"', src[i:i + 260])) and (i == 0 or not (src[i - 1].isalnum() or src[i - 1] == "_")):
            end = '"' + m.group(1)
            j = src.find(end, i + m.end())
            j = n if j < 0 else j + len(end)
            out.append(" ")  # a literal names no module
            i = j
        elif c == '"':
            j = i + 1
            while j < n and src[j] != '"':
                j += 2 if src[j] == "\\" else 1
            out.append(" ")
            i = j + 1
        elif c == "'" and (m := re.match(r"'(\\.[^']*|[^\\'])'", src[i:i + 12])):
            out.append(" ")
            i += m.end()
        else:
            out.append(c)
            i += 1
    return "".join(out)


def full_path(root, path):
    rel = os.path.relpath(path, root)[: -len(".rs")].split(os.sep)
    if rel[-1] == "mod":
        rel = rel[:-1]
    return [] if rel in ([r] for r in ROOTS) or rel[:1] == ["bin"] else rel


def inline_mods(src):
    """(start, end, name, is_test) of each `mod name { ... }` written inline."""
    spans = []
    for m in re.finditer(r"(#\[cfg\(test\)\]\s*)?\bmod\s+(" + IDENT + r")\s*\{", src):
        depth, i = 1, m.end()
        while i < len(src) and depth:
            depth += {"{": 1, "}": -1}.get(src[i], 0)
            i += 1
        spans.append((m.start(), i, m.group(2), bool(m.group(1))))
    return spans


def paths_in(src, here, crate, children):
    """Every module path a file names, as (crate, [names]) with crate-absolute names."""
    spans = inline_mods(src)
    for m in PATH.finditer(src):
        root, head, sep, group = m.groups()
        if any(s < m.start() < e for s, e, _, test in spans if test):
            continue  # tests are no part of the structure
        # Inside an inline `mod a { ... }`, `super` is the file's own module.
        here_m = here + [name for s, e, name, _ in spans if s < m.start() < e]
        head = head.split("::") if head else []
        if root == "crate":
            base = (crate, [])
        elif root == "self":
            base = (crate, here_m)
        elif root.startswith("super"):
            base = (crate, here_m[: len(here_m) - root.count("super")])
        elif root in CRATES:
            base = (root, [])
        elif root in children:
            base, head = (crate, here_m), [root] + head
        else:
            continue  # a type, an enum variant or an outside crate
        tails = [[]]
        if group and (sep or not head):
            tails = [n.group(1).split("::") for part in group[1:-1].split(",") if (n := NAME.match(part))]
        for t in tails:
            yield base[0], base[1] + head + t


def target_of(crate, parts, depth, known):
    for n in range(min(depth, len(parts)), -1, -1):
        name = (crate, tuple(parts[:n]))
        if name in known:
            return name
    return None


def label(mod):
    crate, path = mod
    return "::".join((crate,) + path) if crate != "epserve" else ("::".join(path) or "epserve")


def check(depth, quiet):
    files = []  # (crate, root dir, file)
    for crate, rel in CRATES.items():
        root = os.path.normpath(os.path.join(HERE, rel))
        for d, _, names in os.walk(root):
            files += [(crate, root, os.path.join(d, n)) for n in names if n.endswith(".rs")]
    mod_of = {f: (c, tuple(full_path(r, f)[:depth])) for c, r, f in files}
    known = set(mod_of.values())
    # Every prefix of a known module is a module too (backend, for backend::cuda), and each crate.
    known |= {(c, p[:i]) for c, p in list(known) for i in range(0, len(p))}
    edges = defaultdict(set)  # (a, b) -> files
    for crate, root, f in files:
        a = mod_of[f]
        src = strip_comments(open(f).read())
        children = set(CHILD.findall(src))
        for c, path in paths_in(src, full_path(root, f), crate, children):
            b = target_of(c, path, depth, known)
            if b and b != a and b[1]:  # a crate's root (lib.rs) holds no policy to cycle through
                edges[(a, b)].add(os.path.relpath(f, HERE))
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
        for w in sorted(graph[v]):
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
        print(f"depth {depth}: cycle:", " ".join(sorted(map(label, c))))
        for (a, b), fs in sorted(edges.items()):
            if a in c and b in c:
                print(f"  {label(a)} -> {label(b)}: {', '.join(sorted(fs))}")
    if not quiet or cycles:
        print(f"depth {depth}: {len(known)} modules, {len(edges)} edges, {len(cycles)} cycles")
    return len(cycles)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--depth", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args()
    return 1 if sum(check(d, args.quiet) for d in args.depth) else 0


if __name__ == "__main__":
    sys.exit(main())
