"""A plain PyTorch training loop on a prefetchd job, with exact checkpoint/resume.

    prefetchd start configs/demo.toml --data FOLDER
    python examples/plain_pytorch.py demo --epochs 2 --max-steps 5 --ckpt /tmp/run.pt   # "crashes" after 5 steps
    python examples/plain_pytorch.py demo --epochs 2 --resume /tmp/run.pt                # goes on at step 6

The checkpoint is one ``torch.save`` of a dict: the model, the optimizer, the loader's
``state_dict()`` (a small JSON-able dict: format version, config hash, epoch, samples
consumed) and the global step. Resuming restores the three and the loader continues at the exact batch:
the daemon regenerates batches it had already deleted, with the same bytes.

Rank and world size come from ``RANK`` / ``WORLD_SIZE`` (else 0 / 1), as PrefetchLoader
reads them; this loop itself is single-process (see lightning_ddp.py and fabric_loop.py for
several ranks).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from torch import nn

from prefetchd_client import PrefetchLoader


def tiny_cnn(num_classes: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, num_classes),
    )


def to_float_nchw(images: torch.Tensor) -> torch.Tensor:
    """uint8 [B, H, W, 3] as the daemon writes it -> float [B, 3, H, W] in [0, 1]."""
    return images.permute(0, 3, 1, 2).float().div_(255)


def save_checkpoint(path: str, model: nn.Module, optimizer, loader: PrefetchLoader, global_step: int) -> None:
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "loader": loader.state_dict(),  # {"version": 1, "config_hash": ..., "epoch": 0, "samples_consumed": 20, ...}
        "global_step": global_step,
    }
    tmp = f"{path}.tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)  # a crash while saving never leaves a torn checkpoint


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("job", help="name of the running prefetchd job")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=None, help="stop after N optimizer steps in total (a 'crash')")
    p.add_argument("--ckpt", help="save a checkpoint here at the stop point (max steps, or the end)")
    p.add_argument("--resume", help="resume from this checkpoint")
    p.add_argument("--record", help="append one JSON line per step: epoch, step, rank, global_step, sample ids")
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for one batch")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.manual_seed(0)
    loader = PrefetchLoader(args.job, timeout=args.timeout)
    model = tiny_cnn(args.num_classes)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    global_step = 0
    if args.resume:
        ckpt = torch.load(args.resume, weights_only=True)  # the loader state is plain JSON values
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        loader.load_state_dict(ckpt["loader"])  # applies at the next iter(); the daemon is told at once
        global_step = ckpt["global_step"]

    epoch = loader.position[0]  # where the checkpoint left off (the next epoch after a full one)
    record = open(args.record, "a") if args.record else None
    stop = False
    while epoch < args.epochs and not stop:
        loader.set_epoch(epoch)  # a no-op for the epoch being resumed: it keeps the mid-epoch position
        first = loader.position[1]
        for step, batch in enumerate(loader, start=first):
            x, y = to_float_nchw(batch["image"]), batch["label"]
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if record:
                line = {"epoch": epoch, "step": step, "rank": loader.rank, "global_step": global_step}
                record.write(json.dumps({**line, "index": batch["index"].tolist()}) + "\n")
                record.flush()
            global_step += 1
            if args.max_steps is not None and global_step >= args.max_steps:
                stop = True
                break
        epoch += 1
    if args.ckpt:
        save_checkpoint(args.ckpt, model, optimizer, loader, global_step)
    if record:
        record.close()
    loader.close()
    print(f"done: global_step={global_step} position={loader.position}")


if __name__ == "__main__":
    main()
