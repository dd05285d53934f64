"""The ``prefetchd`` command. Thin: each command parses flags, calls one function, and
turns a UserError into its message and exit code (never a traceback)."""

from __future__ import annotations

import inspect
import json
import os
import stat
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from prefetchd import control, openfiles, settings
from prefetchd.cli.quickexit import exit_now
from prefetchd.cli.summary import start_summary
from prefetchd.cli.terminal import bounded, err, literal, out, progress
from prefetchd.errors import DaemonStop, ExitCode, JobError, UserError, describe, error_from_json
from prefetchd_client.errors import AuthError, UnsafeFolder
from prefetchd_client.folders import OpenJob, open_job, open_private_dir
from prefetchd_client.layout import JobPaths, resolve_root
from prefetchd_client.locks import daemon_alive
from prefetchd_client.manifest import VersionMismatch, check_manifest, read_manifest, read_stopped

app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="Prefetch augmented training batches into a tmpfs buffer."
)


def _root_folder(value: Optional[str]) -> Optional[Path]:
    # An empty --root (`--root "$DIR"`, DIR unset) became Path("") = the current folder: the
    # batches went to the disk under it, not to the tmpfs.
    if value == "":
        raise typer.BadParameter(
            "is empty (an unset shell variable?): name a folder, or leave --root out for $PREFETCHD_ROOT "
            "or /dev/shm/prefetchd-<uid>"
        )
    return None if value is None else Path(value)


RootOpt = Annotated[
    Optional[str],
    typer.Option(
        "--root",
        callback=_root_folder,
        help="Folder of job directories [default: $PREFETCHD_ROOT or /dev/shm/prefetchd-<uid>]",
    ),
]


def _fail(exc: UserError) -> typer.Exit:
    # Its message may quote file names, a reader's words or a daemon's stop reason: data.
    err.print(f"[bold red]error:[/] {escape(bounded(str(exc)))}", highlight=False, soft_wrap=True)
    return typer.Exit(int(exc.exit_code))


def _job_paths(job: str, root: Optional[Path]) -> JobPaths:
    try:
        return JobPaths.of(job, root)
    except ValueError as exc:
        raise _fail(JobError(str(exc))) from None


_IPC_PATH_MAX_BYTES = 107  # a Unix socket's sun_path, less its terminating NUL
_BENCH_STOP_S = 60.0  # after Ctrl-C, for the benchmark to stop the daemons it started; then it is killed


def _check_ipc_path(paths: JobPaths) -> None:
    """The job's socket path must be one ZeroMQ can bind: UTF-8 text, short enough."""
    try:
        size = len(str(paths.socket).encode("utf-8"))
    except UnicodeEncodeError:
        raise JobError(
            f"the job root {paths.dir.parent!r} is not UTF-8 text, which the control socket's path must be; "
            "choose another --root"
        ) from None
    if size > _IPC_PATH_MAX_BYTES:
        raise JobError(
            f"the control socket {paths.socket} would be {size} bytes long, more than a Unix socket path may "
            f"be ({_IPC_PATH_MAX_BYTES}); choose a shorter --root or --name"
        )


def _open_job(paths: JobPaths) -> OpenJob:
    """The job's root and folder, checked (prefetchd_client.folders.open_job); a clear error
    and exit 4 when either is missing or is not this user's private folder."""
    try:
        return open_job(paths)
    except FileNotFoundError:
        raise _fail(
            JobError(f"no job {paths.name!r} under {paths.dir.parent}; start one with `prefetchd start CONFIG`")
        ) from None
    except UnsafeFolder as exc:
        raise _fail(JobError(str(exc))) from None


def _option_help(s: settings.Setting) -> str:
    default = s.shown_default()
    return s.help[0].upper() + s.help[1:] + (f" [default: {default}]" if default else "")


def _setting_options(command):
    """Give ``command`` a flag for every config key (prefetchd.settings), after its first
    parameter; the flags reach it in ``**flags``. Typer reads the parameters from
    ``inspect.signature``, which returns ``__signature__`` when a function has one."""
    own = [p for p in inspect.signature(command, eval_str=True).parameters.values() if p.kind is not p.VAR_KEYWORD]
    keys = [
        inspect.Parameter(
            s.option,
            inspect.Parameter.KEYWORD_ONLY,
            default=None,  # None: not given, the file's value (or the key's default) stands
            annotation=Annotated[
                Optional[s.types[0]],
                typer.Option(
                    s.flag_decls,
                    # escaped: "[[transform]]" and "[default: ...]" would be rich markup, and vanish
                    help=escape(_option_help(s)),
                    show_default=False,  # the default is in the help: typer would show None, the "not given"
                    metavar=s.metavar or None,
                ),
            ],
        )
        for s in settings.SETTINGS
    ]
    command.__signature__ = inspect.Signature([own[0], *keys, *own[1:]])
    return command


@app.command()
@_setting_options
def start(
    config: Annotated[Optional[Path], typer.Argument(help="TOML config (see configs/)")] = None,
    *,
    data: Annotated[Optional[str], typer.Option(help="Data folder (or file list) of the only source")] = None,
    root: RootOpt = None,
    foreground: Annotated[bool, typer.Option("--foreground", help="Stay attached (containers, systemd)")] = False,
    keep: Annotated[bool, typer.Option("--keep", help="Keep the job directory when the daemon stops")] = False,
    **flags,
) -> None:
    """Start a job's daemon; returns once it serves, printing its job dir and pid.

    Every config key is also a flag, and the flag wins over the file."""
    from prefetchd.cli.launch import start_detached

    overrides = {s.option: flags[s.option] for s in settings.SETTINGS} | {"data": data}
    try:
        openfiles.ensure()  # listing the data takes descriptors: the least a daemon needs, first
        from prefetchd.config import load_config  # numpy, Pillow: only `start` needs them

        cfg = load_config(config, overrides)
        openfiles.ensure(cfg)
        paths = _job_paths(cfg.name, root)
        if cfg.endpoint == "ipc":
            _check_ipc_path(paths)
        warning = control.endpoint_warning(cfg)
        if warning is not None:
            err.print(f"[bold yellow]warning:[/] {literal(warning)}", highlight=False)
        if foreground:
            _serve_in_foreground(cfg, paths, keep)
            return
        msg = start_detached(cfg, paths, keep=keep, launched=_take_early_daemon())
    except UserError as exc:
        raise _fail(exc) from None
    job_dir, pid = literal(msg["job_dir"]), literal(msg["pid"])  # the daemon's words
    out.print(f"job {literal(cfg.name)} serving\njob dir: {job_dir}\npid: {pid}", highlight=False)
    try:
        summary = start_summary(read_manifest(paths))  # its lines each made printable: a newline is no escape
        out.print("\n".join(literal(line) for line in summary.splitlines()), highlight=False)
    except (OSError, ValueError, KeyError, TypeError):  # stopped meanwhile, or another version's: status says
        pass


def _serve_in_foreground(cfg, paths: JobPaths, keep: bool) -> None:
    """Run the daemon in this process until it stops. A failure, at start-up or later, raises
    the daemon's own error (its message, its exit code, rebuilt from the report a detached
    start reads too): under systemd or in a container this is the only place where the
    reason shows."""
    from prefetchd.master.daemon import serve

    failures: list[UserError] = []

    def notify(msg: dict) -> None:
        if msg["ok"]:
            err.print(literal(f"job {cfg.name} serving at {paths.dir} (pid {msg['pid']}); Ctrl-C stops it"))
        else:
            failures.append(error_from_json(msg["error"]))

    def on_stop(stop: DaemonStop) -> None:
        failures.append(DaemonStop(f"the daemon stopped: {stop}", stop.exit_code))

    code = serve(cfg, paths, keep=keep, notify=notify, detach_output=False, on_stop=on_stop)
    if code:
        raise failures[0] if failures else DaemonStop(f"the daemon stopped with exit code {code}", ExitCode(code))


def _job_status(paths: JobPaths) -> dict:
    """Its daemon's status, asked only once the job's folders are proven this user's: a job in
    folders that are not is "refused" unread (its manifest could name anyone's endpoint)."""
    try:
        job = open_job(paths)
    except FileNotFoundError:
        return {"job": paths.name, "state": "not running", "job_dir": str(paths.dir)}
    except UnsafeFolder as exc:
        return {"job": paths.name, "state": "refused", "job_dir": str(paths.dir), "error": str(exc)}
    with job:
        if not daemon_alive(paths, dir_fd=job.dir_fd):
            stopped = read_stopped(paths, dir_fd=job.dir_fd)  # why, when it stopped on an error
            if stopped is None:
                return {"job": paths.name, "state": "not running", "job_dir": str(paths.dir)}
            return {
                "job": paths.name,
                "state": "stopped",
                "job_dir": str(paths.dir),
                "error": stopped["message"],
                "exit_code": stopped["exit_code"],
                "stopped_at": stopped["stopped_at"],
            }
        try:  # at the endpoint in its manifest: ipc, or TCP (with CURVE when the manifest has a server key)
            reply = control.request_job(paths, {"op": "status"}, timeout_s=3.0, dir_fd=job.dir_fd)
        except AuthError as exc:
            return {"job": paths.name, "state": "refused", "job_dir": str(paths.dir), "error": str(exc)}
    if reply is None:
        return {"job": paths.name, "state": "not responding", "job_dir": str(paths.dir)}
    return {"state": "serving", "job_dir": str(paths.dir), **reply}


@app.command()
def status(
    job: Annotated[Optional[str], typer.Argument(help="Job name [default: every job under the root]")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON")] = False,
    watch: Annotated[bool, typer.Option("--watch", help="A live view, refreshed every second; Ctrl-C quits")] = False,
    root: RootOpt = None,
) -> None:
    """Show the buffer, each rank's position and wait for data, and production and consumption rates."""
    from prefetchd.cli import statusview

    if as_json and watch:
        raise _fail(UserError("--json and --watch do not go together: --json prints once, for a program"))
    if job is not None:
        paths = _job_paths(job, root)
        _open_job(paths).close()  # a missing job, or one in folders not ours: its message, exit 4
    # Listed afresh at each refresh of --watch: jobs come and go.
    fetch = (
        (lambda: [_job_status(paths)])
        if job is not None
        else (lambda: list(map(_job_status, _jobs_under(resolve_root(root)))))
    )
    if watch:
        statusview.watch(fetch, out)
        return
    reports = fetch()
    if as_json:
        # The exact text, as printable ASCII: json.dumps escapes every other control character
        # (C1 and bidi ones as \uXXXX, for it writes ASCII), DEL only by our hand.
        print(json.dumps(reports[0] if job is not None else reports, indent=1).replace("\x7f", "\\u007f"))
        return
    if not reports:
        out.print(literal(f"no jobs under {resolve_root(root)}"))
    for s in reports:
        out.print(statusview.render(s), highlight=False)


def _jobs_under(base: Path) -> list[JobPaths]:
    """The job folders under the root ``base``, listed once the root is proven this user's
    (symlinks among them included: their status says why they are refused)."""
    try:
        root_fd = open_private_dir(base, "job root")
    except FileNotFoundError:
        return []
    except UnsafeFolder as exc:
        raise _fail(JobError(str(exc))) from None
    jobs = []
    try:
        for name in os.listdir(root_fd):
            try:
                mode = os.stat(name, dir_fd=root_fd, follow_symlinks=False).st_mode
            except FileNotFoundError:  # a job that stopped while it was listed
                continue
            if stat.S_ISDIR(mode) or stat.S_ISLNK(mode):
                jobs.append(JobPaths(base / name))
    finally:
        os.close(root_fd)
    return sorted(jobs, key=lambda paths: paths.name)


@app.command()
def stop(
    job: Annotated[str, typer.Argument(help="Job name")],
    keep: Annotated[bool, typer.Option("--keep", help="Keep the job directory")] = False,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for a graceful stop before killing")] = 15.0,
    root: RootOpt = None,
) -> None:
    """Stop a job's daemon and workers; removes its directory unless --keep."""
    from prefetchd.cli.launch import stop_job

    try:
        outcome = stop_job(_job_paths(job, root), keep=keep, timeout_s=timeout)
    except UserError as exc:
        raise _fail(exc) from None
    out.print(literal(f"job {job}: {outcome}"), highlight=False)


@app.command()
def verify(
    job: Annotated[str, typer.Argument(help="Job name")],
    epoch: Annotated[int, typer.Option(help="Epoch of the batch")],
    step: Annotated[int, typer.Option(help="Step of the batch")],
    rank: Annotated[int, typer.Option(help="Rank of the batch")] = 0,
    root: RootOpt = None,
) -> None:
    """Remake one batch in-process and compare it, byte for byte, with the published one."""
    from prefetchd.cli.verify import verify_batch

    paths = _job_paths(job, root)
    # Checked before anything is read: the job's producer.json names code that verify imports.
    with _open_job(paths) as folder:
        try:
            check_manifest(paths, read_manifest(paths, dir_fd=folder.dir_fd))
        except FileNotFoundError:
            raise _fail(JobError(f"no serving job {job!r} under {paths.dir.parent}; start it first")) from None
        except VersionMismatch as exc:  # its message says which versions, and the fix
            raise _fail(JobError(str(exc))) from None
        except ValueError as exc:
            raise _fail(JobError(f"{exc}; a daemon never writes that: restart the job")) from None
    try:
        result = verify_batch(paths, epoch, step, rank)
    except UserError as exc:
        raise _fail(exc) from None
    if not result["identical"]:
        err.print(
            "[bold red]differs:[/] "
            + literal(
                f"{result['batch']}: published {result['digest_kind']} {result['published_digest']}, "
                f"regenerated {result['regenerated_digest']}; "
                f"{result['reason'] + '; ' if result.get('reason') else ''}"
                f"fields {', '.join(result['differing_fields']) or '(hash only)'}"
            ),
            highlight=False,
        )
        raise typer.Exit(1)
    out.print(
        literal(f"identical: {result['batch']} {result['digest_kind']} {result['regenerated_digest']}"), highlight=False
    )


@app.command()
def pack(
    source: Annotated[str, typer.Argument(help="Image folder (<root>/<class>/<image>) or file list of 'path,label'")],
    out_dir: Annotated[
        Path, typer.Argument(help="Folder for the shards and pack.json: new, or empty and only yours to write")
    ],
    shard_size: Annotated[str, typer.Option(help="Largest shard, e.g. 1G, 512M")] = "1G",
    max_short_side: Annotated[
        Optional[int], typer.Option(help="Shrink images whose shorter side is longer to this many pixels")
    ] = None,
    quality: Annotated[int, typer.Option(help="JPEG quality of a resized JPEG")] = 90,
    workers: Annotated[Optional[int], typer.Option(help="Processes for the per-image work [default: cores]")] = None,
    mode: Annotated[
        str, typer.Option(help="Octal mode of the files (folders get x beside r): 644 lets all users read the pack")
    ] = "600",
) -> None:
    """Write the data as WebDataset tar shards (<key>.jpg + <key>.cls) in id order, with pack.json."""
    from prefetchd.cli import pack as packing

    try:
        opts = packing.check_options(
            shard_size,
            max_short_side,
            quality,
            workers if workers is not None else len(os.sched_getaffinity(0)),
            mode,
        )
        with progress(err, "packing") as report:
            manifest = packing.pack(source, out_dir, opts, progress=report)
    except UserError as exc:
        raise _fail(exc) from None
    except Exception as exc:  # noqa: BLE001 - a bug or the unforeseen: one line (pack removes what it wrote)
        raise _fail(DaemonStop(f"internal error while packing: {describe(exc)}", ExitCode.INTERNAL)) from None
    err.print(literal(packing.summary(manifest)), highlight=False)
    out.print(literal(f"pack: {out_dir}"), highlight=False)


@app.command()
def demo(
    images: Annotated[int, typer.Option(help="Images in the generated dataset")] = 640,
    epochs: Annotated[int, typer.Option()] = 2,
    workers: Annotated[Optional[int], typer.Option(help="Worker processes [default: cores - 1]")] = None,
    buffer: Annotated[str, typer.Option()] = "256M",
    root: RootOpt = None,
) -> None:
    """Generate a small JPEG dataset, serve it, train a tiny model on it, stop."""
    from prefetchd.cli.demo import run_demo

    try:
        run_demo(images=images, epochs=epochs, workers=workers, buffer=buffer, root=root, console=out)
    except UserError as exc:
        raise _fail(exc) from None


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def bench(
    ctx: typer.Context,
    quick: Annotated[bool, typer.Option("--quick", help="Tiny data, one repeat, every row: under a minute")] = False,
    images: Annotated[Optional[int], typer.Option(help="JPEGs to generate [1500]")] = None,
    workers: Annotated[Optional[int], typer.Option(help="Worker processes, both systems (default: cores - 1)")] = None,
    repeats: Annotated[Optional[int], typer.Option(help="Repeats per row; medians are reported [3]")] = None,
    batch_size: Annotated[Optional[int], typer.Option(help="Samples per batch [64]")] = None,
    out_dir: Annotated[Path, typer.Option("--out", help="Folder for bench.json and bench_timeline.png")] = Path(
        "bench-out"
    ),
) -> None:
    """Compare prefetchd with torch's DataLoader on generated JPEGs (runs `python -m prefetchd.bench`;
    more flags after these go to it, see `python -m prefetchd.bench --help`)."""
    import subprocess

    # The benchmark needs torch, which this process never imports: it runs in its own process,
    # which checks that torch imports and otherwise says in one line what to install.
    args = ["--quick"] if quick else []
    for flag, value in (("--images", images), ("--workers", workers), ("--repeats", repeats)):
        if value is not None:
            args += [flag, str(value)]
    if batch_size is not None:
        args += ["--batch-size", str(batch_size)]
    bench_process = subprocess.Popen([sys.executable, "-m", "prefetchd.bench", *args, "--out", str(out_dir), *ctx.args])
    try:
        code = bench_process.wait()  # minutes, by design: it measures
    except KeyboardInterrupt:  # it reached the benchmark too (one process group): it stops what it started
        try:
            code = bench_process.wait(timeout=_BENCH_STOP_S)
        except (KeyboardInterrupt, subprocess.TimeoutExpired):  # a second Ctrl-C, or it hangs: ended
            bench_process.kill()
            code = bench_process.wait()
    raise typer.Exit(code)


# `prefetchd start` without --foreground: prefetchd.__main__ launches the daemon process before this
# module imports typer and the rest (cli.daemonlaunch), and `start` hands it the job.
_early_daemon: list = []


def _take_early_daemon():
    return _early_daemon.pop() if _early_daemon else None


def main(early_daemon=None) -> None:
    """Run the command; ``early_daemon``, a DaemonLaunch that `start` hands its job (one it
    does not use is cancelled here)."""
    if early_daemon is not None:
        _early_daemon.append(early_daemon)
    try:
        app()
        code = 0
    except SystemExit as exc:
        code = exc.code
    except KeyboardInterrupt:  # Ctrl-C before typer's own handling begins (while it builds the command)
        code = 130
    finally:
        for unused in _early_daemon:  # a bad flag or config: `start` never got to hand it the job
            unused.cancel()
    if not isinstance(code, int):  # None, or a message (which SystemExit prints, with code 1)
        if code is not None:
            print(code, file=sys.stderr)
        code = 0 if code is None else 1
    exit_now(code)  # no teardown: output and logs are flushed, a foreground daemon has stopped its workers


if __name__ == "__main__":
    sys.exit(main())
