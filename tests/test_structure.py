"""The shape of the code, checked on the source: no import cycle, small modules, and the layers.

The import graph is read with ``ast`` from every ``import`` in prefetchd/ and
client/prefetchd_client/ — module level, inside functions and under ``TYPE_CHECKING`` alike, since
each is a dependency a reader must follow — with relative imports resolved. An edge goes to the
longest project module that the imported name starts with (``from prefetchd import plan`` is an
edge to ``prefetchd.plan``; ``from prefetchd_client import PrefetchLoader`` one to the package).
``scripts/import_graph.py`` prints the same graph and the line counts, from the functions here.

The layer rules:

- The client (``prefetchd_client``) never imports ``prefetchd``: it is installed alone on GPU nodes.
- The worker side (WORKER_SIDE) never reaches the master side (MASTER_SIDE), directly or through
  another module: a spawned worker must not load the master's machinery.
- A pure module (PURE: plans, decisions, tables, error types, message types; no processes, files
  or sockets) imports, directly, only other pure modules and the client's format modules
  (CLIENT_FORMAT: ``prefetchd_client.batchfile`` and ``prefetchd_client.layout``, which define the
  batch format and the job directory's names that the plan and the messages speak of,
  ``prefetchd_client.ranks`` and ``prefetchd_client.text``, pure text functions; the
  client's own tests cover their I/O). A pure module that needs a file, a process or a socket
  takes it as an argument from the module that owns that edge.

Module sizes count physical lines of every module of both packages but the ``__init__`` and
``__main__`` shims, whose few lines would pull the median down without saying anything.
"""

from __future__ import annotations

import ast
import statistics
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def package_dirs(repo: Path) -> dict[str, Path]:
    return {"prefetchd": repo / "prefetchd", "prefetchd_client": repo / "client" / "prefetchd_client"}


PACKAGE_DIRS = package_dirs(REPO)

MAX_MODULE_LINES = 500
MAX_MASTER_LINES = 300
MAX_MEDIAN_LINES = 160  # the goal is a median of about 150

WORKER_SIDE = {f"prefetchd.{m}" for m in ("worker", "producer", "transforms", "sources", "messages")}
WORKER_SIDE |= {f"prefetchd.{m}" for m in ("fastdecode", "roidecode", "tjlib")}  # the native decoders
WORKER_SIDE |= {f"prefetchd.{m}" for m in ("raybridge", "raycluster", "raytask")}  # --executor ray's side
MASTER_SIDE = {f"prefetchd.{m}" for m in ("master", "pool", "buffer", "intake", "job", "daemon", "cli", "status")}
PURE = {f"prefetchd.{m}" for m in ("plan", "scheduler", "policy", "settings", "errors", "sizes", "messages", "stalls")}
CLIENT_FORMAT = {f"prefetchd_client.{m}" for m in ("batchfile", "layout", "ranks", "text")}
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


def test_the_graph_sees_every_kind_of_import(tmp_path):
    """The other tests stand on the parser: on a package written here, every form of import is an
    edge to the right module, names outside the project are none, and a cycle through a
    TYPE_CHECKING import is found."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    sources = {
        "__init__.py": "from .a import thing\n",
        "a.py": "import os\nimport pkg.b as b\nfrom pkg import c, missing_name\n",
        "b.py": "def late():\n    from . import c\n    from .sub.d import x\n",
        "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import thing\n",
        "sub/__init__.py": "from .. import b\n",
        "sub/d.py": "from ..c import y\nfrom . import e\n",
        "sub/e.py": "",
    }
    for name, text in sources.items():
        (package / name).write_text(text)
    graph = import_graph({"pkg": package})
    assert graph == {
        "pkg": {"pkg.a"},
        "pkg.a": {"pkg.b", "pkg.c", "pkg"},
        "pkg.b": {"pkg.c", "pkg.sub.d"},
        "pkg.c": {"pkg.a"},
        "pkg.sub": {"pkg.b"},
        "pkg.sub.d": {"pkg.c", "pkg.sub.e"},
        "pkg.sub.e": set(),
    }
    assert import_cycles(graph) == [["pkg", "pkg.a", "pkg.b", "pkg.c", "pkg.sub.d"]]
    assert import_path(graph, "pkg.sub", {"pkg.sub.e"}) == ["pkg.sub", "pkg.b", "pkg.sub.d", "pkg.sub.e"]


def test_the_layer_rules_name_real_modules():
    graph = import_graph()
    missing = sorted((PURE | WORKER_SIDE | MASTER_SIDE | CLIENT_FORMAT) - set(graph))
    assert missing == [], f"the layer rules name modules that do not exist: {missing}"


def test_no_import_cycle():
    graph = import_graph()
    cycles = import_cycles(graph)
    assert cycles == [], "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles) + "\n" + format_graph(graph)


def test_no_module_over_the_size_limits():
    counts = line_counts()
    too_long = {m: n for m, n in counts.items() if n > MAX_MODULE_LINES}
    assert too_long == {}, f"modules over {MAX_MODULE_LINES} lines: {too_long}; split them by role"
    assert counts["prefetchd.master"] <= MAX_MASTER_LINES, (
        f"prefetchd/master.py has {counts['prefetchd.master']} lines: the event loop only wires and dispatches "
        f"(at most {MAX_MASTER_LINES}); move a concern into its own module"
    )


def test_the_median_module_is_small():
    counts = line_counts()
    median = statistics.median(counts.values())
    largest = sorted(counts.items(), key=lambda item: -item[1])[:8]
    assert median <= MAX_MEDIAN_LINES, f"median module size {median} lines > {MAX_MEDIAN_LINES}; largest: {largest}"


def test_the_client_never_imports_the_daemon():
    graph = import_graph()
    offenders = {m: sorted(t for t in targets if t.split(".")[0] == "prefetchd") for m, targets in graph.items()}
    offenders = {m: t for m, t in offenders.items() if m.split(".")[0] == "prefetchd_client" and t}
    assert offenders == {}, f"the client imports the daemon: {offenders}"


def test_the_worker_side_never_reaches_the_master_side():
    graph = import_graph()
    chains = {m: import_path(graph, m, MASTER_SIDE) for m in sorted(WORKER_SIDE)}
    chains = {m: " -> ".join(chain) for m, chain in chains.items() if chain}
    assert chains == {}, f"worker-side modules that load the master side: {chains}"


def test_pure_modules_import_only_pure_modules():
    graph = import_graph()
    allowed = PURE | CLIENT_FORMAT
    offenders = {m: sorted(graph[m] - allowed) for m in sorted(PURE)}
    offenders = {m: t for m, t in offenders.items() if t}
    assert offenders == {}, (
        f"pure modules that import modules with I/O: {offenders}; pass the file, process or socket in from "
        "the module that owns it"
    )
