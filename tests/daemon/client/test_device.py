"""device= and normalize=: the same values as the plain batches, made where the trainer runs.

The CPU path runs everywhere; the CUDA path (pinned staging, side stream) runs only where a
GPU is present.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from prefetchd_client import PrefetchLoader
from prefetchd_client.device import DeviceFeeder
from tests.conftest import cli, start_job, write_config

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def reference(image: np.ndarray) -> np.ndarray:
    x = image.transpose(0, 3, 1, 2).astype(np.float32) / 255
    return (x - np.array(MEAN, np.float32)[:, None, None]) / np.array(STD, np.float32)[:, None, None]


def sample_arrays(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "image": rng.integers(0, 256, (4, 8, 6, 3), dtype=np.uint8),
        "label": rng.integers(0, 10, 4),
        "index": np.arange(4),
    }


def test_normalize_makes_nchw_floats_equal_to_the_reference():
    feeder = DeviceFeeder(torch, "cpu", (MEAN, STD))
    arrays = sample_arrays(0)
    out = feeder(arrays)
    assert out["image"].dtype == torch.float32 and tuple(out["image"].shape) == (4, 3, 8, 6)
    np.testing.assert_allclose(out["image"].numpy(), reference(arrays["image"]), rtol=1e-6, atol=1e-6)
    assert torch.equal(out["label"], torch.from_numpy(arrays["label"]))


def test_without_normalize_uint8_is_delivered_unchanged():
    arrays = sample_arrays(1)
    out = DeviceFeeder(torch, "cpu")(arrays)
    assert out["image"].dtype == torch.uint8 and np.array_equal(out["image"].numpy(), arrays["image"])


@pytest.mark.parametrize(
    "normalize, message",
    [(((0.5, 0.5), (0.2, 0.2, 0.2)), "equal-length"), (((0.5,) * 3, (0.2, 0.0, 0.2)), "std > 0")],
)
def test_bad_normalize_is_refused(normalize, message):
    with pytest.raises(ValueError, match=message):
        DeviceFeeder(torch, "cpu", normalize)


def test_the_loader_delivers_normalised_batches_on_the_device(tmp_path, jpeg_folder, job_root):
    config = write_config(tmp_path, jpeg_folder, seed=9)
    start_job(config, "--name", "plain")
    start_job(config, "--name", "dev")
    plain = PrefetchLoader("plain", as_tensors=False)
    on_device = PrefetchLoader("dev", device="cpu", normalize=(MEAN, STD))
    n = 0
    for a, b in zip(plain, on_device):
        assert b["image"].device.type == "cpu" and b["image"].dtype == torch.float32
        np.testing.assert_allclose(b["image"].numpy(), reference(a["image"]), rtol=1e-6, atol=1e-6)
        assert np.array_equal(b["label"].numpy(), a["label"])
        n += 1
    assert n == 12
    plain.close()
    on_device.close()
    with pytest.raises(ValueError, match="pass device= too"):
        PrefetchLoader("plain", normalize=(MEAN, STD))
    for job in ("plain", "dev"):
        assert cli("stop", job).returncode == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_path_matches_the_cpu_path():
    cpu, gpu = DeviceFeeder(torch, "cpu", (MEAN, STD)), DeviceFeeder(torch, "cuda", (MEAN, STD))
    for seed in range(5):  # more batches than staging slots: reuse is exercised
        arrays = sample_arrays(seed)
        expected = cpu(arrays)
        got = gpu(arrays)
        assert got["image"].is_cuda
        torch.testing.assert_close(got["image"].cpu(), expected["image"])
        assert torch.equal(got["label"].cpu(), expected["label"])
