"""`prefetchd` and `python -m prefetchd`. The CLI is imported here, not by the console script,
so that Ctrl-C while it loads (a few hundred ms) ends it as Ctrl-C ends a command, with exit
code 130 and no traceback. `start` takes stop signals first thing: from then on a stop is the
start's to act on (stopsignals), never an exception that an import might swallow. Then it
forks its daemon process (cli.daemonlaunch, standard library only), before the CLI's own
imports: the daemon's imports run beside them, not after, and it needs no interpreter of its own."""

import os
import sys


def main() -> None:
    try:
        _stdio_open()
        early_daemon = None
        if sys.argv[1:2] == ["start"]:
            from prefetchd import stopsignals

            stopsignals.take()
            if not {"--foreground", "--help"} & set(sys.argv[2:]):  # those run no daemon of their own
                from prefetchd.cli.daemonlaunch import DaemonLaunch

                early_daemon = DaemonLaunch(fork=True)  # a stop signal cancels it (app.main, once it runs)
    except KeyboardInterrupt:  # Ctrl-C before `start` takes stop signals: nothing was started yet
        sys.exit(130)
    except OSError:  # the fork refused (`ulimit -u`): `start` tries again once it has its job, and says why
        early_daemon = None
    try:
        from prefetchd.cli.app import main as run_command
    except BaseException:  # Ctrl-C (not `start`: it records signals), or a broken install
        if early_daemon is not None:
            early_daemon.cancel()
        if isinstance(sys.exc_info()[1], KeyboardInterrupt):
            sys.exit(130)
        raise
    run_command(early_daemon)


def _stdio_open() -> None:
    """/dev/null in place of a closed stdin, stdout or stderr (`prefetchd start <&- >&-`): else
    the first pipe the command opens takes descriptor 0 or 1 (the daemon's ready pipe became its
    stdout, and start waited for a line that went to the job's log), and a print fails."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            os.open(os.devnull, os.O_RDWR)  # the lowest free descriptor: this one
    for name, fd in (("stdin", 0), ("stdout", 1), ("stderr", 2)):
        if getattr(sys, name) is None:  # the interpreter found it closed at its start
            setattr(sys, name, open(fd, "r" if fd == 0 else "w", closefd=False))


if __name__ == "__main__":
    main()
