"""`prefetchd` and `python -m prefetchd`. The CLI is imported here, not by the console script,
so that Ctrl-C while it loads (a few hundred ms) ends it as Ctrl-C ends a command, with exit
code 130 and no traceback. `start` takes stop signals first thing: from then on a stop is the
start's to act on (stopsignals), never an exception that an import might swallow."""

import sys


def main() -> None:
    if sys.argv[1:2] == ["start"]:
        from prefetchd import stopsignals

        stopsignals.take()
    try:
        from prefetchd.cli.app import main as run_command
    except KeyboardInterrupt:
        sys.exit(130)
    run_command()


if __name__ == "__main__":
    main()
