"""The two pictures in the docs, both from one real run on this machine.

    python scripts/docs_pictures.py [--out docs] [--duration 75] [--capture-at 38]

The run: a folder of generated JPEGs (prefetchd.cli.datagen, 4 classes x 60), a job with world size
2, batch size 8, one worker and an 8 MiB buffer under a private PREFETCHD_ROOT in /dev/shm,
started with `prefetchd start CONFIG --metrics 127.0.0.1:PORT`, and two trainer processes that
read it with PrefetchLoader (epoch after epoch, set_epoch each time):

  rank 0  a short step (5 ms per batch): it outruns the one worker and waits for data
  rank 1  a slow step (60 ms per batch) and a pause of 8 s (an 'evaluation') after every 20 s
          of training

While they run, /metrics is scraped every second and every sample kept. Then:

  OUT/status_watch.png  `prefetchd status JOB --watch` in a detached 140 x 34 tmux session
                        (a private tmux server), captured with its colours about --capture-at
                        seconds in, drawn as SVG by rich and turned into PNG by rsvg-convert
  OUT/dashboard.png     every panel of docker/grafana-dashboard.json, in its gridPos layout,
                        drawn with matplotlib from the scraped samples: what its PromQL would
                        show (rate and increase over a 10 s window, `sum by` the labels named,
                        gauges as they are); rank 1's pauses shaded grey (scripts/docs_dashboard.py)

It prints a few figures of the run (each rank's wait share, produced images/s, buffer peak).
Everything it starts (daemon, trainers, tmux server) is stopped and everything it writes
outside OUT is removed, also on an error or Ctrl-C.

Needs: tmux, rsvg-convert (the OS package librsvg2-bin: `apt-get install librsvg2-bin`),
matplotlib, rich, and prometheus_client (the `metrics` extra: pip install 'prefetchd[metrics]').
"""

from __future__ import annotations

import argparse
import io
import itertools
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import urllib.request
from pathlib import Path

# This script's folder is first on sys.path when it runs: its sibling draws the dashboard.
from docs_dashboard import Series, draw_dashboard

REPO = Path(__file__).resolve().parent.parent
JOB = "docs-demo"
WORLD_SIZE = 2
TMUX_COLS, TMUX_ROWS = 140, 34
DASHBOARD_TITLE = (
    "The panels of docker/grafana-dashboard.json, drawn from a real 2-rank run on this machine "
    f"(job {JOB}; not a Grafana screenshot)\n"
    "rank 0: 5 ms step, outruns the 1 worker; rank 1: 60 ms step, 8 s pause (grey) after every 20 s"
)

# The trainers: (step seconds, pause every N s of training, pause seconds).
TRAINERS = {0: (0.005, 0.0, 0.0), 1: (0.060, 20.0, 8.0)}


# ---------------------------------------------------------------- the trainer processes


def trainer_main(argv: list[str]) -> None:
    """One rank's trainer (run as a child process of this script)."""
    p = argparse.ArgumentParser()
    p.add_argument("--job", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--step", type=float, required=True)
    p.add_argument("--pause-every", type=float, default=0.0)
    p.add_argument("--pause", type=float, default=0.0)
    p.add_argument("--events", required=True)
    p.add_argument("--lifetime", type=float, required=True)  # a bound, should the parent vanish
    a = p.parse_args(argv)
    from prefetchd_client import PrefetchLoader

    end = time.monotonic() + a.lifetime
    loader = PrefetchLoader(a.job, rank=a.rank, world_size=WORLD_SIZE, as_tensors=False)
    trained_since_pause = time.monotonic()
    with open(a.events, "a", buffering=1) as events:
        for epoch in itertools.count():
            loader.set_epoch(epoch)
            for _batch in loader:
                time.sleep(a.step)  # the training step
                now = time.monotonic()
                if now > end:
                    return
                if a.pause_every and now - trained_since_pause >= a.pause_every:
                    events.write(json.dumps({"pause_start": time.time()}) + "\n")
                    time.sleep(a.pause)  # the evaluation: no batches read
                    events.write(json.dumps({"pause_end": time.time()}) + "\n")
                    trained_since_pause = time.monotonic()


# ---------------------------------------------------------------- the real run


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_config(folder: Path, data: Path) -> Path:
    path = folder / f"{JOB}.toml"
    path.write_text(
        textwrap.dedent(f"""\
        [job]
        name = "{JOB}"
        seed = 0
        world_size = {WORLD_SIZE}
        batch_size = 8

        [daemon]
        buffer = "8M"
        workers = 1

        [[source]]
        kind = "image_folder"
        root = "{data}"

        [[transform]]
        op = "random_resized_crop"
        size = 160

        [[transform]]
        op = "hflip"
        """)
    )
    return path


def scrape(url: str) -> list[tuple[str, dict, float]]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=3) as reply:
        text = reply.read().decode()
    return [(s.name, dict(s.labels), float(s.value)) for f in text_string_to_metric_families(text) for s in f.samples]


def real_run(duration: float, at: float | None = None, callback=None) -> dict:
    """The run both pictures come from. ``callback(root)`` runs in a thread ``at`` seconds after
    the trainers start (the scrapes go on meanwhile). Returns the scrapes, the trainers' start
    and rank 1's pauses, all in time.time() seconds."""
    root = Path(tempfile.mkdtemp(prefix="prefetchd-docs-root-", dir="/dev/shm"))
    work = Path(tempfile.mkdtemp(prefix="prefetchd-docs-data-"))
    env = {**os.environ, "PREFETCHD_ROOT": str(root)}
    trainers: list[subprocess.Popen] = []
    started = False
    stop_scraping = threading.Event()
    scrapes: list[dict] = []
    helper: threading.Thread | None = None
    try:
        from prefetchd.cli.datagen import make_image_folder

        data = make_image_folder(work / "data", classes=4, per_class=60, size=(200, 400))
        config = write_config(work, data)
        port = free_port()
        cmd = [sys.executable, "-m", "prefetchd", "start", str(config), "--metrics", f"127.0.0.1:{port}"]
        started = True  # from here on a daemon may exist: stop it whatever happens
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}/metrics"

        def scraper():
            while not stop_scraping.is_set():
                t = time.time()
                try:
                    scrapes.append({"t": t, "samples": scrape(url)})
                except OSError as exc:
                    print(f"scrape failed: {exc}", file=sys.stderr)
                stop_scraping.wait(max(0.0, 1.0 - (time.time() - t)))

        t0 = time.time()
        for rank, (step, every, pause) in TRAINERS.items():
            args = [sys.executable, __file__, "--trainer", "--job", JOB, "--rank", str(rank), "--step", str(step)]
            args += ["--pause-every", str(every), "--pause", str(pause)]
            args += ["--events", str(work / f"events-{rank}.jsonl"), "--lifetime", str(duration + 120)]
            # A session of their own: a Ctrl-C reaches this script only, which kills them.
            trainers.append(subprocess.Popen(args, env=env, start_new_session=True))
        scraping = threading.Thread(target=scraper, daemon=True)
        scraping.start()
        while time.time() - t0 < duration:
            if callback is not None and helper is None and time.time() - t0 >= at:
                helper = threading.Thread(target=callback, args=(root,), daemon=True)
                helper.start()
            for p in trainers:
                if p.poll() is not None:
                    raise RuntimeError(f"trainer pid {p.pid} exited early with {p.returncode}")
            time.sleep(0.2)
        if helper is not None:
            helper.join(timeout=60)
        stop_scraping.set()
        scraping.join(timeout=5)
        pauses, start = [], None
        events = work / "events-1.jsonl"
        for line in events.read_text().splitlines() if events.exists() else []:
            e = json.loads(line)
            if "pause_start" in e:
                start = e["pause_start"]
            elif start is not None:
                pauses.append((start, e["pause_end"]))
                start = None
        if start is not None:
            pauses.append((start, scrapes[-1]["t"]))
        return {"t0": t0, "scrapes": scrapes, "pauses": pauses}
    finally:
        stop_scraping.set()
        for p in trainers:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
            p.wait()
        if started:
            subprocess.run([sys.executable, "-m", "prefetchd", "stop", JOB], env=env, stdout=subprocess.DEVNULL)
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


# ---------------------------------------------------------------- picture 1: status --watch


class StatusCapture:
    """Captures `prefetchd status JOB --watch` in a detached tmux session of a private server."""

    def __init__(self, out: Path):
        self.out = out
        self.folder = Path(tempfile.mkdtemp(prefix="prefetchd-docs-tmux-"))  # the private server's socket
        self.session = "status"
        self.svg: Path | None = None
        self.error: BaseException | None = None

    def tmux(self, *args: str, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(["tmux", "-S", str(self.folder / "socket"), "-f", "/dev/null", *args], **kw)

    def pane(self, *flags: str) -> str:
        return self.tmux("capture-pane", *flags, "-p", "-t", self.session, capture_output=True, text=True).stdout

    def __call__(self, root: Path) -> None:
        try:
            self._capture(root)
        except BaseException as exc:  # reported by the main thread
            self.error = exc
        finally:
            self.close()

    def _capture(self, root: Path) -> None:
        cmd = f"PREFETCHD_ROOT={shlex.quote(str(root))} {shlex.quote(sys.executable)} -m prefetchd status {JOB} --watch"
        size = ["-x", str(TMUX_COLS), "-y", str(TMUX_ROWS)]
        self.tmux("new-session", "-d", "-s", self.session, *size, cmd, check=True)
        self.tmux("resize-window", "-t", self.session, *size, check=True)
        deadline = time.monotonic() + 30
        while "worker pid" not in self.pane():
            if time.monotonic() > deadline:
                raise RuntimeError("the status view did not show within 30 s")
            time.sleep(0.3)
        time.sleep(3)
        ansi = self.pane("-e")  # with its colours
        self.tmux("send-keys", "-t", self.session, "C-c")
        self.svg = self.out.with_suffix(".svg.tmp")
        ansi_to_svg(ansi, self.svg, title=f"prefetchd status {JOB} --watch")

    def close(self) -> None:
        self.tmux("kill-session", "-t", self.session, capture_output=True)
        self.tmux("kill-server", capture_output=True)
        shutil.rmtree(self.folder, ignore_errors=True)  # tmux leaves its socket file


def ansi_to_svg(ansi: str, path: Path, title: str) -> None:
    from rich.console import Console
    from rich.text import Text

    lines = ansi.rstrip("\n").split("\n")
    while lines and not Text.from_ansi(lines[-1]).plain.strip():
        lines.pop()  # the empty rows below the view
    console = Console(record=True, width=TMUX_COLS, file=io.StringIO(), force_terminal=True, color_system="truecolor")
    for line in lines:
        console.print(Text.from_ansi(line), no_wrap=True, overflow="crop")
    console.save_svg(str(path), title=title)


def svg_to_png(svg: Path, png: Path) -> None:
    subprocess.run(["rsvg-convert", "-o", str(png), str(svg)], check=True)


# ---------------------------------------------------------------- figures of the run


def summary(run: dict) -> list[str]:
    import numpy as np

    series = Series(run["scrapes"])
    t = series.t
    lines = [f"{len(t)} scrapes over {t[-1] - t[0]:.0f} s"]
    wait = series.by_name.get("prefetchd_trainer_wait_seconds_total", {})
    for key, v in sorted(wait.items()):
        ok = ~np.isnan(v)
        share = (v[ok][-1] - v[ok][0]) / (t[ok][-1] - t[ok][0])
        lines.append(f"rank {dict(key)['rank']} wait share over the run: {100 * share:.0f} %")
    for key, v in sorted(wait.items()):  # the counter's growth inside rank 1's pauses
        grown = spent = 0.0
        for a, b in run["pauses"]:
            inside = np.flatnonzero((t >= a) & (t <= b) & ~np.isnan(v))
            if len(inside) >= 2:
                grown += v[inside[-1]] - v[inside[0]]
                spent += t[inside[-1]] - t[inside[0]]
        if spent:
            rank = dict(key)["rank"]
            lines.append(f"rank {rank} wait share during rank 1's pauses: {100 * grown / spent:.0f} %")
    produced = series.by_name.get("prefetchd_produced_images_total", {})
    for v in produced.values():
        ok = ~np.isnan(v)
        lines.append(f"produced {(v[ok][-1] - v[ok][0]) / (t[ok][-1] - t[ok][0]):.0f} images/s on average")
    for v in series.by_name.get("prefetchd_buffer_peak_bytes", {}).values():
        lines.append(f"buffer peak {np.nanmax(v) / 2**20:.1f} MiB of 8 MiB")
    return lines


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main() -> int:
    if sys.argv[1:2] == ["--trainer"]:
        trainer_main(sys.argv[2:])
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=REPO / "docs", help="where the PNGs go [docs]")
    p.add_argument("--duration", type=float, default=75.0, help="seconds the trainers run [75]")
    p.add_argument("--capture-at", type=float, default=38.0, help="seconds in when the status capture starts [38]")
    a = p.parse_args()
    for tool in ("tmux", "rsvg-convert"):
        if shutil.which(tool) is None:
            hint = " (apt-get install librsvg2-bin)" if tool == "rsvg-convert" else ""
            sys.exit(f"needs {tool}{hint}")
    a.out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _interrupt)  # a kill cleans up as Ctrl-C does

    status_png, dashboard_png = a.out / "status_watch.png", a.out / "dashboard.png"
    capture = StatusCapture(status_png)
    began = time.monotonic()
    try:
        run = real_run(a.duration, a.capture_at, capture)
        if capture.error is not None:
            raise RuntimeError(f"the status capture failed: {capture.error!r}") from capture.error
        if capture.svg is None:
            raise RuntimeError("the status capture did not finish")
        svg_to_png(capture.svg, status_png)
        draw_dashboard(REPO / "docker" / "grafana-dashboard.json", run, dashboard_png, DASHBOARD_TITLE)
    finally:
        capture.close()
        if capture.svg is not None:
            capture.svg.unlink(missing_ok=True)
    print(f"run and pictures took {time.monotonic() - began:.0f} s")
    for line in summary(run):
        print(" ", line)
    for png in (status_png, dashboard_png):
        print(f"wrote {png} ({png.stat().st_size / 1024:.0f} KiB)")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit("interrupted; everything it started is stopped")
