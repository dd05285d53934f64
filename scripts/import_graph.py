"""Print the project's import graph (module -> the project modules it imports), any import
cycle, the line count of every module and the largest classes: the before/after of a
structure change.

    python scripts/import_graph.py                    # this checkout
    python scripts/import_graph.py --repo /tmp/orig   # another checkout, e.g. main before a change
    python scripts/import_graph.py --counts           # line counts only

The graph and the counts come from tests/test_structure.py, the one place that reads them, so
what this prints is what the structure tests check.
"""

from __future__ import annotations

import argparse
import ast
import signal
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.test_structure import (  # noqa: E402
    format_graph,
    import_cycles,
    import_graph,
    line_counts,
    module_files,
    package_dirs,
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
    args = parser.parse_args()
    packages = package_dirs(args.repo.resolve())
    missing = [str(folder) for folder in packages.values() if not folder.is_dir()]
    if missing:
        print(f"error: --repo {args.repo} is not a prefetchd checkout: no {', '.join(missing)}", file=sys.stderr)
        return 2
    # Piped into `head`, stop quietly like any other command-line tool.
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    print("\n".join(report(packages, args.counts)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
