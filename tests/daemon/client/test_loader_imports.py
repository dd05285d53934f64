"""What a trainer's process loads for the loader: numpy arrays (as_tensors=False) need no torch,
whether its rank is given or read from $RANK / $WORLD_SIZE. torch costs ~2 s of CPU to import;
a loader that looked for torch.distributed by importing it made every such trainer pay that."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, write_config

_TRAINER = """
import json, sys
from prefetchd_client import PrefetchLoader
kwargs = json.loads(sys.argv[1])
loader = PrefetchLoader("job", as_tensors=False, timeout=30, **kwargs)
batch = next(iter(loader))
print(json.dumps({"rank": loader.rank, "world": loader.world_size, "shape": list(batch["image"].shape),
                  "torch": "torch" in sys.modules}))
loader.close()
"""


@pytest.mark.parametrize("given", [{"rank": 1, "world_size": 2}, {}], ids=["rank-given", "rank-from-env"])
def test_a_loader_of_numpy_arrays_never_imports_torch(given, tmp_path, jpeg_folder, serve):
    serve(write_config(tmp_path, jpeg_folder, world_size=2))
    env = {**os.environ, "RANK": "1", "WORLD_SIZE": "2"}
    command = [sys.executable, "-c", _TRAINER, json.dumps(given)]
    out = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"rank": 1, "world": 2, "shape": [4, 32, 32, 3], "torch": False}
