"""The DataLoader side of the benchmarks, written the usual way: a Dataset that opens each JPEG
with Pillow, decodes all of it, applies the recipe and a flip, and returns a uint8 HWC tensor.
Written out rather than torchvision's, which is not a dependency (and whose registry build
does not load against the CPU torch used here)."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset


def _random_resized_crop(img: Image.Image) -> Image.Image:
    """torchvision's RandomResizedCrop(224) algorithm on a fully decoded image. One
    resize(box=) instead of crop() then resize(): the same pixels, never slower."""
    w, h = img.size
    for _ in range(10):
        area = w * h * random.uniform(0.08, 1.0)
        aspect = math.exp(random.uniform(math.log(3 / 4), math.log(4 / 3)))
        cw, ch = round(math.sqrt(area * aspect)), round(math.sqrt(area / aspect))
        if 0 < cw <= w and 0 < ch <= h:
            x, y = random.randint(0, w - cw), random.randint(0, h - ch)
            break
    else:
        cw, ch, x, y = w, h, 0, 0
    return img.resize((224, 224), Image.Resampling.BILINEAR, box=(x, y, x + cw, y + ch))


def _resize_short_random_crop(img: Image.Image) -> Image.Image:
    """The classic scale augmentation: Resize(random 256..480) then RandomCrop(224)."""
    w, h = img.size
    short = random.randint(256, 480)
    nw, nh = (short, int(short * h / w)) if w <= h else (int(short * w / h), short)
    img = img.resize((nw, nh), Image.Resampling.BILINEAR)
    x, y = random.randint(0, nw - 224), random.randint(0, nh - 224)
    return img.crop((x, y, x + 224, y + 224))


DATALOADER_AUGMENT: dict[str, Callable[[Image.Image], Image.Image]] = {
    "rrc": _random_resized_crop,
    "classic": _resize_short_random_crop,
}


class JpegFolder(Dataset):
    """What a DataLoader user writes: PIL open + convert (full decode), the recipe, flip,
    a uint8 HWC tensor. Written out rather than torchvision's, which is not a dependency."""

    def __init__(self, files: list[tuple[str, int]], recipe: str):
        self.files, self.augment = files, DATALOADER_AUGMENT[recipe]

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> dict:
        path, label = self.files[i]
        with Image.open(path) as src:
            img = self.augment(src.convert("RGB"))
        if random.random() < 0.5:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return {"image": torch.from_numpy(np.array(img)), "label": label}
