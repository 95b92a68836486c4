"""The package's structure in numbers: modules, floors, import arrows, cycles.

    python scripts/layers.py                 # the working tree
    python scripts/layers.py --rev 08f749e   # a git revision (read with `git archive`)
    python scripts/layers.py --json

An arrow is one rayeval module importing another (``from rayeval.x import y`` and relative
imports alike), counted once per pair; arrows written inside functions are counted apart, and
imports under ``if TYPE_CHECKING:`` (annotations only, never run) are not arrows, but are
counted in ``annotation_cycles`` (two modules naming each other's types). A string
that names a rayeval module ("rayeval.harness.task:Harness", a lazy registration) is an arrow
for the ladder (``upward_imports``), though not for the counts and cycles. A
"deferred" import is one inside a function that names a rayeval module but no heavy or optional
dependency comes with it that the caller could avoid: those are the ones the layering should
remove. Cycles are strongly connected components of the module graph, and of the graph of
packages (a module's package: its folder below rayeval/).
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def modules_of(root: str) -> dict[str, str]:
    """Dotted module name -> file, for every .py under root/rayeval."""
    out = {}
    base = os.path.join(root, "rayeval")
    for folder, _, files in os.walk(base):
        for name in files:
            if not name.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(folder, name), root)[:-3].split(os.sep)
            if rel[-1] == "__init__":
                rel = rel[:-1]
            out[".".join(rel)] = os.path.join(folder, name)
    return out


def _target(node: ast.ImportFrom, module: str, is_package: bool) -> str | None:
    if node.level == 0:
        return node.module
    parts = module.split(".")
    base = parts if is_package else parts[:-1]
    base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, path: str, known: set[str], annotations: bool = False
               ) -> list[tuple[str, int, bool]]:
    """(imported rayeval module, line, inside a function) for each import in the file;
    ``annotations``: those under ``if TYPE_CHECKING:`` too."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    is_package = path.endswith("__init__.py")
    found = []

    def resolve(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    def visit(node, in_function: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test) \
                    and not annotations:
                continue            # names for annotations only: never imported at run time
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                for alias in child.names:
                    if alias.name.split(".")[0] == "rayeval" and resolve(alias.name):
                        found.append((resolve(alias.name), child.lineno, in_function))
            elif isinstance(child, ast.ImportFrom):
                target = _target(child, module, is_package)
                if target and target.split(".")[0] == "rayeval":
                    for alias in child.names:       # `from pkg import module` names modules
                        sub = f"{target}.{alias.name}"
                        hit = sub if sub in known else resolve(target)
                        if hit:
                            found.append((hit, child.lineno, in_function))
            visit(child, inner)

    visit(tree, False)
    return [(t, line, f) for t, line, f in found if t != module]


def heavy(module: str, graph: dict[str, set[str]], heavy_roots: dict[str, set[str]]) -> bool:
    """Whether importing ``module`` pulls in torch, Ray or an optional package (transitively,
    through module-level imports)."""
    seen, todo = set(), [module]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        if heavy_roots.get(m):
            return True
        todo += graph.get(m, ())
    return False


HEAVY = {"torch", "ray", "pyarrow", "transformers", "tokenizers", "safetensors", "matplotlib", "mlflow",
         "wandb", "numpy", "lm_eval", "huggingface_hub", "moto", "jsonschema", "pandas"}


def third_party_of(path: str) -> set[str]:
    """The heavy or optional packages a file imports at module level."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    out = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out & HEAVY


def sccs(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on.add(start)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    advanced = True
                    break
                if child in on:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


# The floors, bottom first: a top-level package imports only those on its floor or below.
# ``rayeval`` is the package's own ``__init__`` (the curated API), ``__main__`` the entry.
LADDER = [
    {"errors", "compat", "config", "lazy"},  # base: errors, private hooks, schema, registries,
                                            # lazy imports
    {"io"},                                 # locations, layouts, loading, the result store
    {"core"},                               # tasks, backends, metrics, statistics, the pass
    {"harness", "lmms"},                    # lm-eval, lmms-eval: vertical slices above core
    {"ranking"},                            # what a board ranks: headline, aggregate, board
    {"plan"},                               # sweeps to cells, rendering, group aggregates
    {"execution"},                          # Ray lifecycle, driver, workers, callbacks
    {"reporting"},                          # boards, display, trackers, plots
    {"api"},                                # the public API
    {"integrations"},                       # watch, Ray Jobs, KubeRay, Ray Train
    {"rayeval"},                            # the curated names: api's, and by name (lazily)
                                            # integrations' validation_config
    {"ui", "__main__"},                     # the command line
]


def floor_of(top: str) -> int:
    for i, names in enumerate(LADDER):
        if top in names:
            return i
    raise KeyError(f"top-level package {top!r} has no floor in LADDER")


def top_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "rayeval"


# A module named in a string, "rayeval.x.y" or "rayeval.x.y:Name" (an f-string's leading part,
# "rayeval.x.y:{name}", too): a lazy registration (``Registry.add_lazy``) or an import by name.
# The arrow is as real as an import's, only later: the name works in a process only if the
# module can be imported there, so it must point down the ladder like any import.
REFERENCE = re.compile(r"(rayeval(?:\.[A-Za-z_]\w*)+)(?::[A-Za-z_{][\w.{}]*|:)?")


def references_of(path: str, known: set[str]) -> list[tuple[str, int]]:
    """(rayeval module, line) for each string in the file that names a rayeval module, alone or
    as the module of a "module:Name" reference (imports under ``if TYPE_CHECKING:`` aside)."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    found = []

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Constant) and isinstance(child.value, str):
                hit = REFERENCE.fullmatch(child.value)
                if hit and hit.group(1) in known:
                    found.append((hit.group(1), child.lineno))
            visit(child)

    visit(tree)
    return found


def upward_imports(root: str) -> list[str]:
    """Every import (module level or in a function; annotations-only aside) from a top-level
    package to one on a higher floor of LADDER, and every string naming such a module
    (``references_of``: "rayeval.harness.task:Harness" in core is an arrow up, by name)."""
    modules = modules_of(root)
    known = set(modules)
    out = []
    for m, path in sorted(modules.items()):
        where = os.path.relpath(path, root)
        for target, line, _ in imports_of(m, path, known):
            if floor_of(top_of(target)) > floor_of(top_of(m)):
                out.append(f"{where}:{line} -> {target}")
        for target, line in references_of(path, known):
            if floor_of(top_of(target)) > floor_of(top_of(m)):
                out.append(f"{where}:{line} -> {target} (by name)")
    return sorted(set(out))


def largest_modules(root: str, n: int = 5) -> list[str]:
    sizes = [(sum(1 for _ in open(p, encoding="utf-8")), os.path.relpath(p, root))
             for p in modules_of(root).values()]
    return [f"{lines} {path}" for lines, path in sorted(sizes, reverse=True)[:n]]


def package_of(module: str, modules: dict[str, str]) -> str:
    if modules[module].endswith("__init__.py"):
        return module
    return module.rpartition(".")[0]


def measure(root: str) -> dict:
    modules = modules_of(root)
    known = set(modules)
    top_level: dict[str, set[str]] = {m: set() for m in modules}
    arrows, deferred_arrows, deferred = set(), set(), []
    for m, path in modules.items():
        for target, line, in_function in imports_of(m, path, known):
            if in_function:
                deferred_arrows.add((m, target))
            else:
                arrows.add((m, target))
                top_level[m].add(target)
    roots = {m: third_party_of(p) for m, p in modules.items()}
    for m, path in modules.items():
        for target, line, in_function in set(imports_of(m, path, known)):
            if in_function and not heavy(target, top_level, roots):
                deferred.append(f"{os.path.relpath(path, root)}:{line} -> {target}")
    full = {m: set(top_level[m]) for m in modules}
    for a, b in deferred_arrows:
        full[a].add(b)
    packages = {package_of(m, modules) for m in modules}
    pkg_graph: dict[str, set[str]] = {p: set() for p in packages}
    for a, b in arrows | deferred_arrows:
        pa, pb = package_of(a, modules), package_of(b, modules)
        # a package's own __init__ and its modules are one node; parent -> child is not a cycle
        if pa != pb and not pb.startswith(pa + ".") and not pa.startswith(pb + "."):
            pkg_graph[pa].add(pb)
    files = [m for m in modules if not modules[m].endswith("__init__.py") or
             os.path.getsize(modules[m]) > 300]
    return {
        "modules": len(files),
        "packages": len(packages),
        "floors": 1 + max(len(p.split(".")) - 1 for p in packages),
        "largest_package": max(packages, key=lambda p: sum(package_of(m, modules) == p
                                                            for m in files)),
        "modules_in_largest_package": max(sum(package_of(m, modules) == p for m in files)
                                          for p in packages),
        "arrows_module_level": len(arrows),
        "arrows_in_functions": len(deferred_arrows - arrows),
        "imports_in_functions_without_heavy_dependency": sorted(deferred),
        "upward_imports": upward_imports(root),
        "largest_modules": largest_modules(root),
        "module_cycles": sccs(full),
        "package_cycles": sccs(pkg_graph),
        "annotation_cycles": annotation_cycles(modules, known),
    }


def annotation_cycles(modules: dict[str, str], known: set[str]) -> list[list[str]]:
    """Module cycles with the imports under ``if TYPE_CHECKING:`` counted: never run, so not
    arrows above, but two modules that name each other's types depend on each other all the
    same (a circle held only by an annotation import is one the layering hides)."""
    graph = {m: {t for t, _, _ in imports_of(m, path, known, annotations=True)}
             for m, path in modules.items()}
    return sccs(graph)


def checkout(rev: str) -> str:
    """The revision's rayeval/ in a temporary folder."""
    folder = tempfile.mkdtemp(prefix="rayeval-layers-")
    data = subprocess.run(["git", "archive", rev, "rayeval"], cwd=REPO, check=True,
                          capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(folder, filter="data")
    return folder


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rev", help="a git revision instead of the working tree")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    result = measure(checkout(args.rev) if args.rev else REPO)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    for key, value in result.items():
        if isinstance(value, list):
            print(f"{key}: {len(value)}")
            for item in value:
                print(f"  {item}")
        else:
            print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
