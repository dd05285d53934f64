"""The shape of the code, read from the source with ``ast``: the import graph, its cycles, the
line counts, and the layers. tests/unit/test_structure.py checks them; run as a script, this prints
them: the before and after of a structure change.

    python scripts/import_graph.py                    # this checkout
    python scripts/import_graph.py --repo /tmp/orig   # another checkout, e.g. main before a change
    python scripts/import_graph.py --counts           # line counts only
    python scripts/import_graph.py --layers           # the layer table of docs/architecture.md

The graph is read from every ``import`` in prefetchd/ and client/prefetchd_client/ (module level,
inside functions and under ``TYPE_CHECKING`` alike, since each is a dependency a reader must
follow), relative imports resolved. An edge goes to the longest project module that the imported
name starts with (``from prefetchd import plan`` is an edge to ``prefetchd.plan``;
``from prefetchd_client import PrefetchLoader`` one to the package).

The layers are the folders. A module's layer is the folder of ``prefetchd/`` it sits in; the
modules at the top of the package are the shared vocabulary (plan, settings, config, errors,
messages, the control socket) that every layer may use. LAYERS says what each folder may import
besides itself, the vocabulary and the client; ALLOWED_EDGES names the few single imports that
cross otherwise, each with its reason. Moving a module to another folder moves it to another
layer, so the rule and the tree cannot disagree.
"""

from __future__ import annotations

import argparse
import ast
import signal
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VOCABULARY = "prefetchd"  # the modules at the top of the package
CLIENT = "prefetchd_client"
SCRIPTS = "scripts"  # tools for the checkout: they may import anything; nothing imports them
LAYERS: dict[str, set[str]] = {  # folder -> the folders it may import (besides itself, VOCABULARY, CLIENT)
    "prefetchd.sources": set(),  # where samples come from: indexes, a sample's bytes
    "prefetchd.workers": {"prefetchd.sources"},  # the processes that make batches
    "prefetchd.remote": {"prefetchd.workers", "prefetchd.sources"},  # batches made on a Ray cluster
    "prefetchd.ops": set(),  # what operators see: status, metrics, systemd
    "prefetchd.master": {"prefetchd.sources", "prefetchd.workers", "prefetchd.remote", "prefetchd.ops"},
    "prefetchd.cli": {"prefetchd.master", "prefetchd.workers", "prefetchd.sources"},  # the command
    # `prefetchd bench`: measured against DataLoader, run in a process of its own; nothing imports it
    "prefetchd.bench": {"prefetchd.cli", "prefetchd.master", "prefetchd.workers", "prefetchd.sources", "prefetchd.ops"},
}
ALLOWED_EDGES = {
    ("prefetchd.__main__", "prefetchd.cli.app"): "the entry point runs the command",
    ("prefetchd.__main__", "prefetchd.cli.daemonlaunch"): "`start` launches its daemon before the CLI's imports",
    ("prefetchd.config", "prefetchd.workers.transformspec"): "a config's [[transform]] is checked by the ops' keys",
    ("prefetchd.config", "prefetchd.workers.decoders"): "a config's decoder is checked installed",
    ("prefetchd.config", "prefetchd.sources.kinds"): "a config's [[source]] is checked against its kind's row",
}
# The worker side is started as fresh processes: none of it may load the master's machinery,
# directly or through another module.
WORKER_SIDE = ("prefetchd.sources", "prefetchd.workers", "prefetchd.remote")
MASTER_SIDE = ("prefetchd.master", "prefetchd.ops", "prefetchd.cli")
# Pure modules (plans, decisions, tables, error and message types; no processes, files or
# sockets) import, directly, only other pure modules and the client's pure modules: the batch
# format and the job folder's names the plan and messages speak of, and pure text functions.
PURE = {f"prefetchd.{m}" for m in ("plan", "settings", "errors", "sizes", "messages")}
PURE |= {"prefetchd.master.scheduler", "prefetchd.master.policy", "prefetchd.ops.stalls"}
CLIENT_PURE = {f"prefetchd_client.{m}" for m in ("batchfile", "layout", "ranks", "text")}


def package_dirs(repo: Path) -> dict[str, Path]:
    """Where the project's modules are: both packages, and scripts/ (run as files: a script
    imports its siblings by their bare names, which the graph resolves to ``scripts.<name>``)."""
    return {
        "prefetchd": repo / "prefetchd",
        "prefetchd_client": repo / "client" / "prefetchd_client",
        SCRIPTS: repo / "scripts",
    }


PACKAGE_DIRS = package_dirs(REPO)

MAX_MODULE_LINES = 500
MAX_MASTER_LINES = 300
MAX_MEDIAN_LINES = 160

SHIMS = {"__init__", "__main__"}


def module_files(package_dirs: dict[str, Path] = PACKAGE_DIRS) -> dict[str, Path]:
    """Every module of the packages, by dotted name (a package by its own name)."""
    files = {}
    for package, folder in package_dirs.items():
        for path in sorted(folder.rglob("*.py")):
            parts = [package, *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join(parts)] = path
    return files


def _imported_names(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The dotted names an import statement may load, relative ones made absolute."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        # A package's own __init__ is its base; a module's base is the package that holds it.
        base = module.split(".")
        base = base if is_package else base[:-1]
        base = base[: len(base) - (node.level - 1)]
        stem = ".".join(base + ([node.module] if node.module else []))
    else:
        stem = node.module or ""
    return [f"{stem}.{alias.name}" for alias in node.names if alias.name != "*"] + [stem]


def _project_module(name: str, modules: set[str]) -> str | None:
    """The longest project module that ``name`` starts with, or None outside the project."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def import_graph(package_dirs: dict[str, Path] = PACKAGE_DIRS) -> dict[str, set[str]]:
    """module -> the project modules it imports anywhere in its source."""
    files = module_files(package_dirs)
    modules = set(files)
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        is_package = path.name == "__init__.py"
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            names = _imported_names(node, module, is_package)
            if module.split(".")[0] == SCRIPTS:  # a sibling script by its bare name
                names = [f"{SCRIPTS}.{n}" if f"{SCRIPTS}.{n.split('.')[0]}" in modules else n for n in names]
            if isinstance(node, ast.ImportFrom):
                # `from pkg import name`: an edge to pkg.name when that is a module, else to pkg
                # (the name is then defined by pkg itself); a star import needs pkg.
                *members, stem = names
                found = {n if n in modules else _project_module(stem, modules) for n in members}
                if not members:
                    found = {_project_module(stem, modules)}
            else:
                found = {_project_module(n, modules) for n in names}
            targets |= found - {None, module}
        graph[module] = targets
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(cycles)


def import_path(graph: dict[str, set[str]], source: str, targets: set[str]) -> list[str] | None:
    """The shortest chain of imports from ``source`` to any of ``targets``, or None."""
    parents: dict[str, str | None] = {source: None}
    frontier = [source]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(graph.get(node, ())):
                if target in parents:
                    continue
                parents[target] = node
                if target in targets:
                    chain = [target]
                    while parents[chain[-1]] is not None:
                        chain.append(parents[chain[-1]])
                    return chain[::-1]
                following.append(target)
        frontier = following
    return None


def line_counts(package_dirs: dict[str, Path] = PACKAGE_DIRS) -> dict[str, int]:
    """Physical lines of every module but the package shims."""
    return {
        module: len(path.read_text().splitlines())
        for module, path in module_files(package_dirs).items()
        if path.stem not in SHIMS
    }


def format_graph(graph: dict[str, set[str]]) -> str:
    return "\n".join(f"{module} -> {', '.join(sorted(graph[module])) or '-'}" for module in sorted(graph))


def layer_of(module: str) -> str:
    """The layer a module belongs to: its folder under prefetchd/, VOCABULARY at the top, CLIENT."""
    if module.split(".")[0] in (CLIENT, SCRIPTS):
        return module.split(".")[0]
    parts = module.split(".")
    folder = ".".join(parts[:2])
    return folder if folder in LAYERS else VOCABULARY


def layer_breaches(graph: dict[str, set[str]]) -> list[str]:
    """Every import that crosses the layers other than LAYERS and ALLOWED_EDGES allow."""
    breaches = []
    for module in sorted(graph):
        mine = layer_of(module)
        if mine == CLIENT:
            continue  # the client's own rule: never prefetchd (test_the_client_never_imports_the_daemon)
        allowed = {mine, VOCABULARY, CLIENT} | LAYERS.get(mine, set())
        if mine == SCRIPTS:
            allowed |= {VOCABULARY, *LAYERS}
        for target in sorted(graph[module]):
            if layer_of(target) not in allowed and (module, target) not in ALLOWED_EDGES:
                breaches.append(f"{module} -> {target} ({mine} may not import {layer_of(target)})")
    return breaches


def layer_table(package_dirs: dict[str, Path] = PACKAGE_DIRS) -> list[str]:
    """The layer table of docs/architecture.md, made from the folders and LAYERS."""

    def names(layer: str) -> str:
        prefix = "" if layer == VOCABULARY else layer.removeprefix("prefetchd.") + "/"
        found = sorted(m.rsplit(".", 1)[1] for m in modules if layer_of(m) == layer and m != layer)
        return f"`{prefix}` " + ", ".join(found) if prefix else ", ".join(found)

    modules = [m for m in module_files(package_dirs) if m.split(".")[0] == "prefetchd" and "__" not in m]
    rows = ["| layer | modules | may import, besides itself, the top and the client |", "|---|---|---|"]
    rows.append(f"| the shared vocabulary | {names(VOCABULARY)} | the client; {_edges_from(VOCABULARY)} |")
    for layer, may in LAYERS.items():
        also = ", ".join(f"`{m.removeprefix('prefetchd.')}/`" for m in sorted(may)) or "nothing else"
        crossing = _edges_from(layer)
        rows.append(
            f"| {layer.removeprefix('prefetchd.')} | {names(layer)} | {also}{'; ' + crossing if crossing else ''} |"
        )
    return rows


def _edges_from(layer: str) -> str:
    return "; ".join(
        f"`{a.removeprefix('prefetchd.')}` → `{b.removeprefix('prefetchd.')}` ({why})"
        for (a, b), why in ALLOWED_EDGES.items()
        if layer_of(a) == layer and not a.endswith("__main__")
    )


LARGEST_CLASSES = 8


def class_sizes(packages: dict[str, Path]) -> dict[str, int]:
    """Lines of every class (decorators and docstring included), by dotted name."""
    sizes = {}
    for module, path in module_files(packages).items():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ClassDef):
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                sizes[f"{module}.{node.name}"] = node.end_lineno - first + 1
    return sizes


def report(packages: dict[str, Path], counts_only: bool) -> list[str]:
    lines = []
    if not counts_only:
        graph = import_graph(packages)
        cycles = import_cycles(graph)
        lines += ["# import graph (module -> project imports, from every import statement)", format_graph(graph)]
        lines += ["", "# import cycles", "\n".join(" <-> ".join(cycle) for cycle in cycles) or "none"]
    counts = line_counts(packages)
    median = statistics.median(counts.values())
    lines += ["", f"# lines per module ({len(counts)} modules, median {median:g}, total {sum(counts.values())})"]
    lines += [f"{n:6d}  {module}" for module, n in sorted(counts.items(), key=lambda item: (-item[1], item[0]))]
    lines += ["", f"# the {LARGEST_CLASSES} largest classes (lines)"]
    largest = sorted(class_sizes(packages).items(), key=lambda item: -item[1])[:LARGEST_CLASSES]
    lines += [f"{n:6d}  {name}" for name, n in largest]
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", type=Path, default=REPO, help="the checkout to read (default: this one)")
    parser.add_argument("--counts", action="store_true", help="print only the line counts")
    parser.add_argument("--layers", action="store_true", help="print the layer table of docs/architecture.md")
    args = parser.parse_args()
    packages = package_dirs(args.repo.resolve())
    missing = [str(folder) for folder in packages.values() if not folder.is_dir()]
    if missing:
        print(f"error: --repo {args.repo} is not a prefetchd checkout: no {', '.join(missing)}", file=sys.stderr)
        return 2
    # Piped into `head`, stop quietly like any other command-line tool.
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    print("\n".join(layer_table(packages) if args.layers else report(packages, args.counts)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
