"""The speed rows of the table, from a run's raw figures: cold start and `prefetchd start`,
throughput per recipe and decoder, the partial decode's gain, scaling against in-process loops,
the daemon's CPU, and --executor ray against local workers. Each: medians over repeats, the
ratio, the target and whether it holds."""

from __future__ import annotations

from prefetchd.bench import coldstart, ray_executor
from prefetchd.bench.common import OTHER, RECIPE_NAMES, RECIPES, SYSTEMS, Row, Settings, med


def cold_start_rows(cold_start: dict, s: Settings) -> list[Row]:
    """From nothing running to the images in hand, against DALI where it ran (DataLoader where it
    did not); and `prefetchd start`'s own time, with when each of its steps was done."""
    cold = coldstart.summary(cold_start)
    default, dl = cold[f"prefetchd_{s.decoder}"], cold["dataloader"]
    dali = cold.get("dali")
    shown = ("dataloader", f"prefetchd_{s.decoder}")
    peers = {sy: f"{m['cold_ratio']:.2f}x" for sy, m in cold.items() if sy not in shown}
    if dali is None:
        peers["dali"] = "not installed (--dali-path)"
        against, goal = "DataLoader", (1.0, 1.4)
        ratios = (default["cold_ratio"], default["ratio"])
    else:
        against, goal = "DALI", (1.25, 1.5)
        ratios = tuple(default[k] / dali[k] for k in ("cold_images_per_s", "images_per_s"))
    steps = {k.removesuffix("_s"): v for k, v in default.items() if k.startswith("daemon ")}
    imports = {"imports, each alone in a fresh interpreter": cold_start["start_breakdown_s"]}
    return [
        Row(
            "cold_start",
            f"cold start, {coldstart.describe(cold_start)}: end to end [from the first batch on] "
            f"(img/s), ratio to {against}; every system's end-to-end ratio to DataLoader: "
            + ", ".join(f"{sy} {r}" for sy, r in peers.items()),
            f"{default['cold_images_per_s']:.0f} [{default['images_per_s']:.0f}]",
            f"{dl['cold_images_per_s']:.0f} [{dl['images_per_s']:.0f}]",
            f"{ratios[0]:.2f}x [{ratios[1]:.2f}x] {against}",
            f">= {goal[0]}x [>= {goal[1]}x] {against}",
            ratios[0] >= goal[0] and ratios[1] >= goal[1],
            cold,
        ),
        Row(
            "start",
            "`prefetchd start` returning, and the first batch in hand, from the clock's start (s); "
            "when each of the start's steps was done (median s): "
            + ", ".join(f"{k} {v:.2f}" for k, v in steps.items()),
            f"start {default['start_s']:.2f} s, first batch {default['first_batch_s']:.2f} s",
            f"first batch {dl['first_batch_s']:.2f} s",
            "",
            "start <= 0.5 s, first batch <= 0.3 s",
            default["start_s"] <= 0.5 and default["first_batch_s"] <= 0.3,
            {
                "start_s": default["start_s"],
                "first_batch_s": default["first_batch_s"],
                "start_to_first_batch_s": default["start_to_first_batch_s"],
                "steps_s": steps,
                **imports,
            },
        ),
    ]


def throughput_medians(throughput: dict) -> dict[str, dict[str, float]]:
    """Images/s per recipe and system, the median over repeats: what the speed rows compare."""
    return {rc: {sy: med(x["images_per_s"] for x in v) for sy, v in throughput[rc].items()} for rc in RECIPES}


def _best_dataloader(tp: dict) -> dict[str, float]:
    return {rc: max(tp[rc]["dataloader_persistent"], tp[rc]["dataloader_fresh"]) for rc in RECIPES}


def throughput_rows(tp: dict, s: Settings) -> list[Row]:
    """The default decoder on both recipes; then each other decoder against the same DataLoader."""
    dl_best = _best_dataloader(tp)
    rows = []
    for recipe, goal in (("rrc", 1.4), ("classic", 2.0)):
        t = tp[recipe]
        ratio = t["prefetchd"] / dl_best[recipe]
        rows.append(
            Row(
                f"throughput_{recipe}",
                f"throughput, {RECIPE_NAMES[recipe]}, decoder {s.decoder} (what `auto` picks here) (img/s)",
                f"{t['prefetchd']:.0f}",
                f"persistent {t['dataloader_persistent']:.0f} / not {t['dataloader_fresh']:.0f}",
                f"{ratio:.2f}x",
                f">= {goal}x",
                ratio >= goal,
                {**t, "ratio": ratio},
            )
        )
    for decoder, goal in (("pillow", 1.0), ("simplejpeg", None)):
        system = "prefetchd" if decoder == s.decoder else OTHER + decoder
        if system not in tp["rrc"]:
            missing = Row(
                f"throughput_{decoder}", f"throughput, decoder {decoder}", "not installed", "-", "", "", None, {}
            )
            rows.append(missing)
            continue
        ratios = {rc: tp[rc][system] / dl_best[rc] for rc in RECIPES}
        rows.append(
            Row(
                f"throughput_{decoder}",
                f"throughput, decoder {decoder} vs DataLoader: rrc / classic (img/s)",
                f"{tp['rrc'][system]:.0f} / {tp['classic'][system]:.0f}",
                f"best {dl_best['rrc']:.0f} / {dl_best['classic']:.0f}",
                f"{ratios['rrc']:.2f}x / {ratios['classic']:.2f}x",
                "" if goal is None else f"rrc >= {goal}x",
                None if goal is None else ratios["rrc"] >= goal,
                {"images_per_s": {rc: tp[rc][system] for rc in RECIPES}, "ratio": ratios},
            )
        )
    return rows


def partial_decode_row(tp: dict, decoder_loops: dict, s: Settings) -> Row:
    """The region-of-interest decode's own gain: the same libjpeg-turbo, the same DCT scaling, the
    same resample; only the rows and columns outside the crop are skipped."""
    loops = {rc: {d: med(v) for d, v in decoder_loops[rc].items()} for rc in RECIPES}
    systems = {d: "prefetchd" if d == s.decoder else OTHER + d for d in ("turbojpeg", "simplejpeg")}
    if not all(sy in tp["rrc"] for sy in systems.values()):
        why = "turbojpeg or simplejpeg not installed"
        return Row("partial_decode", "partial decode", why, "-", "", "> 1x", None, {})
    roi, whole = systems["turbojpeg"], systems["simplejpeg"]
    gain = {rc: tp[rc][roi] / tp[rc][whole] for rc in RECIPES}
    loop_gain = {rc: loops[rc]["turbojpeg"] / loops[rc]["simplejpeg"] for rc in RECIPES}
    return Row(
        "partial_decode",
        "partial decode: turbojpeg (the crop's region) vs simplejpeg (whole image), rrc / classic: "
        "daemon img/s [one in-process loop]",
        f"{tp['rrc'][roi]:.0f} / {tp['classic'][roi]:.0f} "
        f"[{loops['rrc']['turbojpeg']:.0f} / {loops['classic']['turbojpeg']:.0f}]",
        f"whole {tp['rrc'][whole]:.0f} / {tp['classic'][whole]:.0f} "
        f"[{loops['rrc']['simplejpeg']:.0f} / {loops['classic']['simplejpeg']:.0f}]",
        f"{gain['rrc']:.2f}x / {gain['classic']:.2f}x [{loop_gain['rrc']:.2f}x / {loop_gain['classic']:.2f}x]",
        "> 1x",
        min(gain.values()) > 1,
        {"daemon": gain, "loop": loop_gain, "loops_images_per_s": loops},
    )


def scaling_rows(tp: dict, inprocess: dict, s: Settings) -> list[Row]:
    """Images/s over N x one in-process loop; in brackets, over N such loops run at once."""
    rows = []
    for recipe in RECIPES:
        one = med(x["images_per_s"] for x in inprocess[recipe])
        many = med(x["parallel_images_per_s"] for x in inprocess[recipe])
        t = tp[recipe]
        best_dl = _best_dataloader(tp)[recipe]
        scaling, dl = t["prefetchd"] / (s.workers * one), best_dl / (s.workers * one)
        rows.append(
            Row(
                f"scaling_{recipe}",
                f"scaling, {recipe}: img/s / ({s.workers} x {one:.0f} of one in-process loop) "
                f"[{s.workers} bare loops at once: {many / (s.workers * one):.2f}]",
                f"{scaling:.2f} [{t['prefetchd'] / many:.2f} of the bare loops]",
                f"{dl:.2f} [{best_dl / many:.2f}]",
                "",
                ">= 0.97",
                scaling >= 0.97,
                {
                    "inprocess_images_per_s": one,
                    "parallel_loops_images_per_s": many,
                    "machine": many / (s.workers * one),
                    "prefetchd": scaling,
                    "dataloader_best": dl,
                    "prefetchd_of_parallel_loops": t["prefetchd"] / many,
                    "dataloader_best_of_parallel_loops": best_dl / many,
                },
            )
        )
    return rows


def daemon_cost_row(results: dict) -> Row:
    """CPU of the daemon's master per 1,000 batches and of its workers per image, per recipe."""
    dc = {}
    for recipe in RECIPES:
        runs = results["throughput"][recipe]
        dc[recipe] = {
            "master_cpu_s_per_1000_batches": med(x["master_cpu_s_per_1000_batches"] for x in runs["prefetchd"]),
            "worker_cpu_ms_per_image": med(x["worker_cpu_ms_per_image"] for x in runs["prefetchd"]),
            "dataloader_worker_cpu_ms_per_image": med(
                x["worker_cpu_ms_per_image"] for x in runs["dataloader_persistent"]
            ),
            "inprocess_ms_per_image": 1000 / med(x["images_per_s"] for x in results["inprocess"][recipe]),
            "consumer_cpu_ms_per_batch": {
                sy: 1000 * med(x["consumer_cpu_s_per_batch"] for x in runs[sy]) for sy in SYSTEMS
            },
        }
    d = dc["rrc"]
    return Row(
        "daemon_cost",
        "daemon cost (rrc): master CPU per 1,000 batches; worker CPU per image",
        f"{d['master_cpu_s_per_1000_batches']:.2f} s; {d['worker_cpu_ms_per_image']:.2f} ms",
        f"worker {d['dataloader_worker_cpu_ms_per_image']:.2f} ms "
        f"(in-process loop {d['inprocess_ms_per_image']:.2f} ms)",
        "",
        "",
        None,
        dc,
    )


def ray_row(ray_runs: dict, s: Settings) -> Row:
    if "why" in ray_runs:
        why = f"not run: {ray_runs['why']}"
        return Row("ray", "--executor ray vs local workers", why, "-", "", ">= 0.90x", None, ray_runs)
    r = ray_executor.summary(ray_runs)
    return Row(
        "ray",
        f"--executor ray ({s.workers} Ray CPUs, no local workers) vs {s.workers} local workers, rrc: img/s "
        "[start to first batch]",
        f"{r['ray']['images_per_s']:.0f} [{r['ray']['first_batch_s']:.2f} s]",
        f"local {r['local']['images_per_s']:.0f} [{r['local']['first_batch_s']:.2f} s]",
        f"{r['ratio']:.2f}x",
        ">= 0.90x",
        r["ratio"] >= 0.90,
        r,
    )


def packed_rows(packed: dict, s: Settings) -> list[Row]:
    """`pack --max-short-side N --quality 90` against the raw folder, rrc 224 + flip, one row per
    folder: images/s (in brackets, one in-process loop), the ratio, and the crops' PSNR."""
    rows = []
    for name, f in packed["folders"].items():
        tp = {v: med(x["images_per_s"] for x in runs) for v, runs in f["throughput"].items()}
        loop = {v: med(runs) for v, runs in f["loops"].items()}
        ratio = {v: tp[v] / tp["raw"] for v in tp}
        loop_ratio = {v: loop[v] / loop["raw"] for v in loop}
        cpu = {v: med(x["worker_cpu_ms_per_image"] for x in runs) for v, runs in f["throughput"].items()}
        sides = [f"side_{n}" for n in packed["sides"]]
        first = sides[0]
        psnr = f["psnr"]
        w, h = f["size"]
        rows.append(
            Row(
                f"packed_{name}",
                f"packed, {w}x{h} folder (~{f['mean_kb']:.0f} KB): `pack --max-short-side N --quality "
                f"{packed['quality']}` vs the raw folder, rrc 224 + flip: img/s [one in-process loop]; "
                f"crop PSNR median (p5); as stored, no resize: {tp['as_is']:.0f} img/s",
                "; ".join(
                    f"{v.removeprefix('side_')}: {tp[v]:.0f} [{loop[v]:.0f}], "
                    f"{psnr[v]['median_db']:.1f} dB ({psnr[v]['p5_db']:.1f})"
                    for v in sides
                ),
                f"raw folder {tp['raw']:.0f} [{loop['raw']:.0f}]",
                " / ".join(f"{ratio[v]:.2f}x [{loop_ratio[v]:.2f}x]" for v in sides),
                f"{first.removeprefix('side_')}: >= 2x, median >= 35 dB",
                ratio[first] >= 2.0 and psnr[first]["median_db"] >= 35.0,
                {
                    "images_per_s": tp,
                    "loop_images_per_s": loop,
                    "ratio": ratio,
                    "loop_ratio": loop_ratio,
                    "worker_cpu_ms_per_image": cpu,
                    "mean_kb": f["mean_kb"],
                    "jpeg_kb": f["jpeg_kb"],
                    "psnr": psnr,
                },
            )
        )
    return rows
