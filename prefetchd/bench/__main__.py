"""``python -m prefetchd.bench``: the benchmark's entry point (prefetchd.bench.cli)."""

from prefetchd.bench.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
