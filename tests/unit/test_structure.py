"""The shape of the code, checked on the source: no import cycle, small modules, and the layers.

The graph, the counts and the rules are read and declared in scripts/import_graph.py, which
prints them too. The rules:

- The client (``prefetchd_client``) never imports ``prefetchd``: it is installed alone on GPU nodes.
- A module's layer is its folder under ``prefetchd/``; the top of the package is the shared
  vocabulary. A layer imports itself, the vocabulary, the client and the folders LAYERS names;
  ALLOWED_EDGES lists, with a reason each, the few single imports that cross otherwise.
  docs/architecture.md's layer table is the one the rule prints.
- The worker side (``sources/``, ``workers/``, ``remote/``) never reaches the master side
  (``master/``, ``ops/``, ``cli/``), directly or through another module: a spawned worker must not
  load the master's machinery.
- A pure module (PURE: plans, decisions, tables, error and message types; no processes, files or
  sockets) imports, directly, only other pure modules and the client's pure ones (CLIENT_PURE:
  the batch format, the job folder's names, rank sets, printable text). A pure module that needs
  a file, a process or a socket takes it as an argument from the module that owns that edge.

Module sizes count physical lines of every module of both packages but the ``__init__`` and
``__main__`` shims, whose few lines would pull the median down without saying anything.
"""

from __future__ import annotations

import statistics

from scripts.import_graph import (
    ALLOWED_EDGES,
    CLIENT_PURE,
    LAYERS,
    MASTER_SIDE,
    MAX_MASTER_LINES,
    MAX_MEDIAN_LINES,
    MAX_MODULE_LINES,
    PURE,
    REPO,
    SHIMS,
    WORKER_SIDE,
    format_graph,
    import_cycles,
    import_graph,
    import_path,
    layer_breaches,
    layer_of,
    layer_table,
    line_counts,
)

MAX_TOP_MODULES = 15


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


def test_the_layer_rules_name_real_modules_and_every_folder():
    graph = import_graph()
    named = (
        PURE | CLIENT_PURE | set(LAYERS) | set(WORKER_SIDE) | set(MASTER_SIDE) | {m for e in ALLOWED_EDGES for m in e}
    )
    missing = sorted(named - set(graph))
    assert missing == [], f"the layer rules name modules or folders that do not exist: {missing}"
    folders = {f"prefetchd.{p.parent.name}" for p in (REPO / "prefetchd").glob("*/__init__.py")}
    assert folders == set(LAYERS), (
        f"a folder of prefetchd/ without a layer rule, or a rule without a folder: {folders ^ set(LAYERS)}"
    )


def test_the_top_of_the_package_is_the_shared_vocabulary_only():
    top = sorted(p.stem for p in (REPO / "prefetchd").glob("*.py") if p.stem not in SHIMS)
    assert len(top) <= MAX_TOP_MODULES, (
        f"{len(top)} modules at the top of prefetchd/ (at most {MAX_TOP_MODULES}): {top}; a module that belongs to "
        "one layer goes in that layer's folder"
    )


def test_imports_cross_the_layers_only_as_the_rules_allow():
    breaches = layer_breaches(import_graph())
    assert breaches == [], (
        "imports across the layers that LAYERS (scripts/import_graph.py) does not allow:\n" + "\n".join(breaches)
    )


def test_the_architecture_docs_layer_table_is_the_rule():
    """docs/architecture.md shows the table `python scripts/import_graph.py --layers` prints."""
    doc = (REPO / "docs" / "architecture.md").read_text()
    table = "\n".join(layer_table())
    assert table in doc, (
        "docs/architecture.md's layer table is not the one the folders and LAYERS make; paste the output of "
        f"`python scripts/import_graph.py --layers`:\n{table}"
    )


def test_no_import_cycle():
    graph = import_graph()
    cycles = import_cycles(graph)
    assert cycles == [], "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles) + "\n" + format_graph(graph)


def test_no_module_over_the_size_limits():
    counts = line_counts()
    too_long = {m: n for m, n in counts.items() if n > MAX_MODULE_LINES}
    assert too_long == {}, f"modules over {MAX_MODULE_LINES} lines: {too_long}; split them by role"
    assert counts["prefetchd.master.loop"] <= MAX_MASTER_LINES, (
        f"prefetchd/master/loop.py has {counts['prefetchd.master.loop']} lines: the event loop only wires and "
        f"dispatches (at most {MAX_MASTER_LINES}); move a concern into its own module"
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
    worker_side = {m for m in graph if layer_of(m) in WORKER_SIDE}
    master_side = {m for m in graph if layer_of(m) in MASTER_SIDE}
    chains = {m: import_path(graph, m, master_side) for m in sorted(worker_side)}
    chains = {m: " -> ".join(chain) for m, chain in chains.items() if chain}
    assert chains == {}, f"worker-side modules that load the master side: {chains}"


def test_pure_modules_import_only_pure_modules():
    graph = import_graph()
    allowed = PURE | CLIENT_PURE
    offenders = {m: sorted(graph[m] - allowed) for m in sorted(PURE)}
    offenders = {m: t for m, t in offenders.items() if t}
    assert offenders == {}, (
        f"pure modules that import modules with I/O: {offenders}; pass the file, process or socket in from "
        "the module that owns it"
    )


def test_scripts_are_in_the_graph_by_their_bare_sibling_imports(tmp_path):
    """A script imports its siblings by bare name (its folder is first on sys.path when it runs):
    the graph resolves them, so a circle between two scripts is found like any other."""
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    (scripts / "one.py").write_text("import two\nimport json\n")
    (scripts / "two.py").write_text("from one import thing\n")
    graph = import_graph({"scripts": scripts})
    assert graph == {"scripts.one": {"scripts.two"}, "scripts.two": {"scripts.one"}}
    assert import_cycles(graph) == [["scripts.one", "scripts.two"]]
