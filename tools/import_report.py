"""Print the package's import cycles, layer violations and imports inside function bodies.

    python tools/import_report.py [--list]

Layers (LAYERS, bottom first) follow docs/ARCHITECTURE.md's picture: a module may import
modules of a lower layer, and of its own folder; anything else is a violation.

A cycle is a strongly connected set of moe_comm modules that import each other (at module
level or inside functions: both are real dependencies). An in-function import is any
``import`` statement nested in a ``def``; ``--list`` names each one. The modules of
moe_comm/deps are exempt: each exists to hold one optional dependency's lazy import.
"""
import argparse
import ast
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = "moe_comm"

# (layer, the top-level modules and folders of moe_comm in it), bottom first
LAYERS = [
    ("format and pure helpers", ["wire", "errors", "config", "quant", "logfmt", "layout",
                                 "event", "handle", "signature", "reference", "deps", "logs",
                                 "relay_map", "token_rounds"]),
    ("shared memory", ["shm"]),
    ("transport, kernel builds", ["transport", "jit"]),
    ("IBGDA host side", ["ibgda"]),
    ("backends", ["host", "cuda"]),
    ("API", ["backend", "validate", "buffer"]),
    ("expert placement", ["eplb"]),
    ("MoE layer", ["nn"]),
    ("test helpers", ["testing"]),
    ("package", ["", "deep_ep_alias"]),
    ("deep_ep, when opted in (a path entry, not a subpackage)", ["deep_ep_shim"]),
]


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def resolve(mod: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = mod.split(".")
    if not is_pkg:
        base = base[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def scan(modules: dict):
    """Returns (edges: {mod: set(mod)}, nested: [(mod, lineno, text)])."""
    edges, nested = {m: set() for m in modules}, []
    for mod, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        is_pkg = path.name == "__init__.py"
        func_lines = set()
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for sub in ast.walk(fn):
                    if isinstance(sub, (ast.Import, ast.ImportFrom)):
                        func_lines.add(id(sub))
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = resolve(mod, is_pkg, node)
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            if id(node) in func_lines and not mod.startswith(PKG + ".deps."):
                nested.append((mod, node.lineno, ast.unparse(node)))
            for t in targets:
                # the longest moe_comm module the name refers to
                while t and t not in modules:
                    t = t.rpartition(".")[0]
                if t and t != mod:
                    edges[mod].add(t)
    return edges, nested


def cycles(edges: dict):
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
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

    sys.setrecursionlimit(10000)
    for v in edges:
        if v not in index:
            visit(v)
    return out


def package_edges(edges: dict):
    """Edges between a package's own modules and its __init__ re-exports are not cycles of
    the design: drop X -> parent-package edges where X is inside that package."""
    return {m: {t for t in ts if not m.startswith(t + ".")} for m, ts in edges.items()}


def unit(mod: str) -> str:
    """The top-level module or folder of ``mod`` ('' for the package itself)."""
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else ""


def layer_of(mod: str) -> int:
    for i, (_, units) in enumerate(LAYERS):
        if unit(mod) in units:
            return i
    raise KeyError(f"{mod} is in no layer of LAYERS: add its folder there")


def is_folder(name: str) -> bool:
    return (ROOT / PKG / name).is_dir()


def violations(edges: dict):
    """(importer, imported) pairs that go up a layer, or across two folders of one layer
    (plain modules of one layer may use each other)."""
    out = []
    for mod, targets in sorted(edges.items()):
        for t in sorted(targets):
            a, b = unit(mod), unit(t)
            if a == b or t == PKG:
                continue
            if layer_of(t) > layer_of(mod) or (
                    layer_of(t) == layer_of(mod) and (is_folder(a) or is_folder(b))):
                out.append((mod, t))
    return out


def report():
    """(modules, cycles, layer violations, in-function imports) of the package."""
    modules = {module_name(p): p for p in sorted((ROOT / PKG).rglob("*.py"))}
    edges, nested = scan(modules)
    return modules, cycles(package_edges(edges)), violations(edges), nested


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--list", action="store_true", help="name every in-function import")
    args = ap.parse_args()
    modules, cyc, bad, nested = report()
    print(f"modules: {len(modules)}")
    print(f"import cycles: {len(cyc)}")
    for c in cyc:
        print("  " + " <-> ".join(c))
    print(f"layer violations: {len(bad)}")
    for mod, t in bad:
        print(f"  {mod} -> {t}")
    print(f"imports inside functions: {len(nested)}")
    if args.list:
        for mod, line, text in nested:
            print(f"  {mod}:{line}: {text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
