"""Delivering batches on a device: uint8 travels, floats are made where they are used.

``PrefetchLoader(..., device="cuda", normalize=(mean, std))`` hands the trainer tensors that
are already on its GPU:

- each field is copied once from the mapped batch file into a page-locked (pinned) staging
  buffer, then to the device with ``non_blocking=True`` on a side stream, so the transfer of
  batch k+1 overlaps the compute of batch k on the trainer's stream (which waits for the side
  stream only when it uses the batch);
- two staging buffers per field alternate; before one is refilled, the event recorded after
  its last transfer is waited on, so a transfer still in flight is never overwritten;
- ``normalize``: the image (uint8, B x H x W x C) becomes float32 B x C x H x W,
  ``(x / 255 - mean) / std``, computed on the device: a quarter of the bytes cross the bus.

On ``device="cpu"`` the same call returns the same values without staging or streams (the
path the tests run on machines without a GPU).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_STAGING_SLOTS = 2


class DeviceFeeder:
    def __init__(self, torch, device, normalize: tuple[Sequence[float], Sequence[float]] | None = None):
        self.torch = torch
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._staging: dict[str, list] = {}  # field -> [(pinned tensor, event or None)] * _STAGING_SLOTS
        self._turn = 0
        self.mean = self.std = None
        if normalize is not None:
            mean, std = (torch.tensor([float(v) for v in s], dtype=torch.float32) for s in normalize)
            if mean.shape != std.shape or mean.ndim != 1 or not bool((std > 0).all()):
                raise ValueError(f"normalize must be (mean, std), equal-length sequences with std > 0, got {normalize}")
            self.mean = mean.to(self.device).view(1, -1, 1, 1)
            self.std = std.to(self.device).view(1, -1, 1, 1)

    def __call__(self, arrays: dict[str, np.ndarray]) -> dict:
        torch = self.torch
        slot, self._turn = self._turn, (self._turn + 1) % _STAGING_SLOTS
        if not self.cuda:
            out = {name: torch.from_numpy(a) for name, a in arrays.items()}
            if self.device.type != "cpu":
                out = {name: t.to(self.device) for name, t in out.items()}
        else:
            out = {}
            for name, a in arrays.items():
                pinned = self._stage(name, slot, a)
                with torch.cuda.stream(self.stream):
                    out[name] = pinned.to(self.device, non_blocking=True)
                    self._staging[name][slot][1].record(self.stream)
        if self.mean is not None and "image" in out:
            with _maybe_stream(torch, self.stream):
                out["image"] = self._normalise(out["image"])
        if self.cuda:
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(self.stream)
            for t in out.values():  # the caching allocator must not reuse them before the trainer is done
                t.record_stream(current)
        return out

    def _stage(self, name: str, slot: int, a: np.ndarray):
        torch = self.torch
        slots = self._staging.get(name)
        if slots is None or tuple(slots[0][0].shape) != a.shape:
            source = torch.from_numpy(a)
            slots = self._staging[name] = [
                (torch.empty_like(source).pin_memory(), torch.cuda.Event()) for _ in range(_STAGING_SLOTS)
            ]
        pinned, event = slots[slot]
        event.synchronize()  # its previous transfer has finished: safe to overwrite
        pinned.copy_(torch.from_numpy(a))
        return pinned

    def _normalise(self, image):
        if image.ndim != 4 or image.shape[-1] != self.mean.shape[1]:
            raise ValueError(
                f"normalize expects images of shape [B, H, W, {self.mean.shape[1]}], got {list(image.shape)}"
            )
        x = image.permute(0, 3, 1, 2).float().div_(255)
        return x.sub_(self.mean).div_(self.std).contiguous()


class _maybe_stream:
    """``torch.cuda.stream(s)`` when there is a side stream; nothing otherwise."""

    def __init__(self, torch, stream):
        self._ctx = torch.cuda.stream(stream) if stream is not None else None

    def __enter__(self):
        return self._ctx.__enter__() if self._ctx is not None else None

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc) if self._ctx is not None else False
