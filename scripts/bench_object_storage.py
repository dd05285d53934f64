"""Shards read from an S3-compatible store against the same shards on the local disk.

The figures of issue 26 (docs/benchmarks.md, "Object storage"): one run alternating the two
sources, medians of --repeats. A folder of generated JPEGs (300-500 px, quality 90) is packed
with `prefetchd pack` (shards of --shard-size, each with its index object) and uploaded to a moto
S3 server; a proxy in front of it adds --delay-ms to every request, as a remote bucket's latency.
The server and the proxy run in a process of their own (``--serve``), so the trainer process
holds only the client; their CPU is reported apart (a real store's is not on the node).

Each run is a cold start inside the clock: `prefetchd start` (a process, as a user runs it),
then a PrefetchLoader reading --epochs epochs (random-resized-crop 224 + flip, batch 32), a fresh
index cache each time (the index objects are there, as pack leaves them). Reported per source:
images/s end to end, start → first batch in hand, and for the store: GET requests per sample
served and the bytes fetched against the bytes of the image members used (each with its
512-byte tar header).

    python scripts/bench_object_storage.py [--images 960] [--epochs 3] [--repeats 3] [--delay-ms 20] [--member-cache]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.objectstores: the servers the tests use

CONFIG = """\
[job]
name = "{name}"
seed = 0
world_size = 1
batch_size = 32

[daemon]
buffer = "256M"
workers = {workers}

[[source]]
kind = "webdataset"
urls = "{urls}"

[[transform]]
op = "random_resized_crop"
size = 224

[[transform]]
op = "hflip"
"""


def serve(folder: Path, delay_ms: float, server: str) -> None:
    """The store's process: every file of ``folder`` as bench/wds/<name> in an S3 bucket (moto),
    or on a static HTTP server with byte ranges, which answers the path-style GET and HEAD of
    the S3 API that reads use (RangeServer); a delaying proxy in front. Prints the proxy's
    endpoint, then answers "counts" / "reset" lines on stdin."""
    import contextlib
    import resource

    from tests.objectstores import DelayProxy, MotoS3, RangeServer

    with contextlib.ExitStack() as stack:
        if server == "moto":
            s3 = stack.enter_context(MotoS3("bench"))
            for path in sorted(folder.iterdir()):
                s3.put(f"wds/{path.name}", path.read_bytes())
            env = s3.env
        else:
            s3 = stack.enter_context(RangeServer({f"/bench/wds/{p.name}": p.read_bytes() for p in folder.iterdir()}))
            env = {**MotoS3("bench").env, "AWS_ENDPOINT_URL": s3.endpoint}
        s3.reset_counts()
        with DelayProxy(("127.0.0.1", s3.port), delay=delay_ms / 1000) as proxy:
            print(json.dumps({"endpoint": proxy.endpoint, "env": env}), flush=True)
            for line in sys.stdin:
                if line.strip() == "reset":
                    s3.reset_counts()
                    print("{}", flush=True)
                elif line.strip() == "counts":
                    usage = resource.getrusage(resource.RUSAGE_SELF)
                    tars = [r for r in s3.ranges if r[0].endswith(".tar")]
                    tar_bytes = sum(_range_bytes(r[1]) for r in tars)
                    print(
                        json.dumps(
                            {
                                "gets": s3.gets,
                                "tar_gets": len(tars),
                                "bytes_sent": s3.bytes_sent,
                                "tar_bytes": tar_bytes,
                                "cpu_s": usage.ru_utime + usage.ru_stime,
                            }
                        ),
                        flush=True,
                    )


def _range_bytes(header: str | None) -> int:
    """The bytes a "bytes=A-B" Range asks for (every read of a shard names its range)."""
    first, _, last = (header or "bytes=0--1").removeprefix("bytes=").partition("-")
    return int(last) - int(first) + 1


def run_once(name: str, config: Path, env: dict, epochs: int, counts=None) -> dict:
    """One cold run; ``counts()``: the store's counters, read with the daemon's (in the same moment)."""
    from prefetchd_client import PrefetchLoader

    began = time.perf_counter()
    started = subprocess.run(
        [sys.executable, "-m", "prefetchd", "start", str(config)], env=env, capture_output=True, text=True, timeout=300
    )
    if started.returncode:
        raise SystemExit(f"{name}: start failed: {started.stderr}")
    start_s = time.perf_counter() - began
    os.environ["PREFETCHD_ROOT"] = env["PREFETCHD_ROOT"]
    loader = PrefetchLoader(name, as_tensors=False, rank=0, world_size=1, timeout=120)
    first = None
    images = 0
    touched = 0
    for _ in range(epochs):
        for batch in loader:
            if first is None:
                first = time.perf_counter() - began
            touched += int(batch["image"][:, ::16, ::16].sum() & 1)  # the trainer touches its pixels
            images += len(batch["index"])
    total = time.perf_counter() - began
    loader.close()
    # The daemon made more than was read (the window ahead): requests and bytes are per sample made.
    shown = subprocess.run(
        [sys.executable, "-m", "prefetchd", "status", name, "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    state = json.loads(shown.stdout)
    produced = state["totals"]["produced_images"]
    cpu_s = _tree_cpu_s(state["pid"])
    store = counts() if counts is not None else None
    subprocess.run([sys.executable, "-m", "prefetchd", "stop", name], env=env, capture_output=True, timeout=120)
    result = {"images_per_s": images / total, "start_s": start_s, "first_batch_s": first, "produced": produced}
    result["daemon_cpu_ms_per_image"] = 1000 * cpu_s / produced
    return result if store is None else {**result, "store": store}


def _tree_cpu_s(pid: int) -> float:
    """CPU seconds the daemon and its workers (and their fork server) have used so far: with the
    pipeline on one CPU, what a sample costs there decides images/s, not the store's latency."""
    import psutil

    daemon = psutil.Process(pid)
    return sum(sum(p.cpu_times()[:2]) for p in [daemon, *daemon.children(recursive=True)])


def member_bytes(shards: list[Path]) -> float:
    """The mean bytes of an image member with its header, over the packed shards."""
    from prefetchd.sources import shards as wds

    index = wds.scan_webdataset({"urls": [str(p) for p in shards]}, "bench")
    return float(index.members[:, 1].mean() + 512)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=960)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--delay-ms", type=float, default=20.0)
    parser.add_argument("--shard-size", default="8M")
    parser.add_argument(
        "--server",
        choices=("moto", "static"),
        default="static",
        help="the store: moto (the whole S3 API; ~8 ms of CPU a ranged GET of an 8 MB shard, on these 2 cores) "
        "or a static HTTP server answering the S3 GET and HEAD that reads use",
    )
    parser.add_argument(
        "--store-cpus",
        type=int,
        default=1,
        help="CPUs given to the store's process alone (the last ones); the pipeline, both runs alike, gets the "
        "rest: on a node the store's CPU is elsewhere (0: everything shares every CPU)",
    )
    parser.add_argument(
        "--member-cache",
        action="store_true",
        help="the store's source with a local cache (cache, cache_size) emptied before each run: epoch 1 "
        "from the store, later ones from the cache",
    )
    parser.add_argument("--serve", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.delay_ms, args.server)
        return
    cpus = sorted(os.sched_getaffinity(0))
    store_cpus = set(cpus[len(cpus) - args.store_cpus :]) if 0 < args.store_cpus < len(cpus) else set(cpus)
    pipeline_cpus = set(cpus) - store_cpus or set(cpus)

    from prefetchd.cli.datagen import make_image_folder

    work = Path(tempfile.mkdtemp(prefix="prefetchd-bench-objects-"))
    root = Path(tempfile.mkdtemp(prefix="prefetchd-bench-", dir="/dev/shm"))
    server = None
    try:
        make_image_folder(work / "images", classes=8, per_class=args.images // 8, size=(300, 500), seed=3, quality=90)
        packed = subprocess.run(
            [sys.executable, "-m", "prefetchd", "pack", str(work / "images"), str(work / "shards"),
             "--shard-size", args.shard_size],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        if packed.returncode:
            raise SystemExit(packed.stderr)
        shards = sorted((work / "shards").glob("*.tar"))
        pattern = f"shard-{{000000..{len(shards) - 1:06d}}}.tar"
        store_files = work / "store"
        store_files.mkdir()
        for path in (work / "shards").iterdir():
            if path.suffix in (".tar", ".idx"):
                shutil.copy(path, store_files / path.name)
        server = subprocess.Popen(
            [sys.executable, __file__, "--serve", str(store_files), "--delay-ms", str(args.delay_ms),
             "--server", args.server],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            preexec_fn=lambda: os.sched_setaffinity(0, store_cpus),
        )  # fmt: skip
        os.sched_setaffinity(0, pipeline_cpus)  # the trainer, the command, the daemon and its workers inherit it
        hello = json.loads(server.stdout.readline())

        def ask(what: str) -> dict:
            server.stdin.write(what + "\n")
            server.stdin.flush()
            return json.loads(server.stdout.readline())

        env = {**os.environ, "PREFETCHD_ROOT": str(root)}
        store_env = {**env, **hello["env"], "AWS_ENDPOINT_URL": hello["endpoint"]}
        configs = {}
        for name, urls in (("local", str(work / "shards" / pattern)), ("s3", f"s3://bench/wds/{pattern}")):
            configs[name] = work / f"{name}.toml"
            configs[name].write_text(CONFIG.format(name=name, workers=args.workers, urls=urls))
            if name == "s3" and args.member_cache:  # a local copy of each read: later epochs make no request
                member_cache = work / "member-cache"  # on disk, as a node's NVMe would be
                source = f'urls = "{urls}"\n'
                configs[name].write_text(
                    configs[name].read_text().replace(source, source + f'cache = "{member_cache}"\ncache_size = "1G"\n')
                )
        results: dict[str, list[dict]] = {"local": [], "s3": []}
        for _ in range(args.repeats):
            for name in ("local", "s3"):
                cache = Path(tempfile.mkdtemp(prefix="prefetchd-bench-cache-", dir="/dev/shm"))
                shutil.rmtree(work / "member-cache", ignore_errors=True)  # each run starts cold
                run_env = {**(store_env if name == "s3" else env), "PREFETCHD_CACHE": str(cache)}
                before = ask("counts") if name == "s3" else None
                result = run_once(
                    name, configs[name], run_env, args.epochs, (lambda: ask("counts")) if before else None
                )
                if before:
                    after = result.pop("store")
                    result["requests_per_sample"] = (after["tar_gets"] - before["tar_gets"]) / result["produced"]
                    result["bytes_over_used"] = (after["tar_bytes"] - before["tar_bytes"]) / (
                        result["produced"] * member_bytes(shards)
                    )
                    result["server_cpu_s"] = after["cpu_s"] - before["cpu_s"]
                results[name].append(result)
                shutil.rmtree(cache, ignore_errors=True)
                print(name, json.dumps({k: round(v, 3) for k, v in result.items()}), flush=True)
        med = {name: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for name, runs in results.items()}
        ratios = [s["images_per_s"] / local["images_per_s"] for s, local in zip(results["s3"], results["local"])]
        print(
            json.dumps(
                {
                    "images": len(list((work / "images").rglob("*.jpg"))),
                    "shards": len(shards),
                    "epochs": args.epochs,
                    "workers": args.workers,
                    "delay_ms": args.delay_ms,
                    "server": args.server,
                    "pipeline_cpus": sorted(pipeline_cpus),
                    "store_cpus": sorted(store_cpus),
                    "median": med,
                    "s3_over_local_per_run": [round(r, 3) for r in ratios],
                    "s3_over_local_median": round(statistics.median(ratios), 3),
                    # local's daemon CPU a sample over the store's: the ratio the pipeline's one CPU allows
                    "cpu_ratio_per_run": [
                        round(local["daemon_cpu_ms_per_image"] / s["daemon_cpu_ms_per_image"], 3)
                        for s, local in zip(results["s3"], results["local"])
                    ],
                },
                indent=1,
            )
        )
    finally:
        if server is not None:
            server.stdin.close()
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
