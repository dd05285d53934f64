"""What `prefetchd start` says once its job serves, from the manifest: the data and plan the
daemon found, the pipeline, the buffer (kept apart from the status view's rich widgets, which
a start does not load)."""

from __future__ import annotations

from prefetchd.sizes import format_size


def start_summary(manifest: dict) -> str:
    """What `start` says once the job serves: the data and plan it found, the pipeline, the buffer."""
    ranks = len(manifest["ranks"])
    transforms = ", ".join(_transform_text(t) for t in manifest.get("transforms", [])) or "the [pipeline] callable"
    return (
        f"data: {manifest['num_samples']:,} samples, {manifest.get('classes', 0):,} classes; "
        f"{manifest['batches_per_epoch']:,} batches of {manifest['batch_size']} per epoch per rank "
        f"(world size {manifest['world_size']}, {ranks} rank(s) here)\n"
        f"pipeline: {transforms}; decoder {manifest.get('decoder', '?')}\n"
        f"buffer: {format_size(manifest['buffer_bytes'])} bound, {manifest['window_per_rank']} batches ahead "
        f"per rank ({format_size(manifest['batch_bytes'])} a batch)"
    )


def _transform_text(spec: dict) -> str:
    """``random_resized_crop 224``, ``hflip``, ``color_jitter brightness=0.4 ...``."""
    keys = {k: v for k, v in spec.items() if k != "op"}
    if set(keys) == {"size"}:
        return f"{spec['op']} {keys['size']}"
    return " ".join([str(spec.get("op")), *(f"{k}={v}" for k, v in keys.items())])
