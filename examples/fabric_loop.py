"""A Lightning Fabric training loop on a prefetchd job: DDP on CPU (2 ranks, gloo), exact resume.

    prefetchd start configs/demo.toml --data FOLDER --world-size 2
    python examples/fabric_loop.py demo --epochs 2 --max-steps 4 --ckpt /tmp/run.ckpt   # stops after 4 steps
    python examples/fabric_loop.py demo --epochs 2 --resume /tmp/run.ckpt               # goes on at step 5

The pattern:

- ``fabric.launch()`` first: it starts the other ranks and initialises torch.distributed, so a
  PrefetchLoader created afterwards takes its rank and world size from it.
- Iterate the PrefetchLoader directly. Do not pass it to ``fabric.setup_dataloaders`` (that
  accepts only a torch DataLoader, and there is no sampler to replace: the daemon already
  gives each rank its own disjoint batches). Move each batch to ``fabric.device`` yourself.
- ``fabric.save(path, {"model": model, "optimizer": opt, "loader": loader, ...})`` calls
  ``loader.state_dict()`` (rank 0 writes; the state is the same on every rank), and
  ``fabric.load(path, state)`` calls ``loader.load_state_dict`` on every rank.
"""

from __future__ import annotations

import argparse
import json

import torch
from lightning.fabric import Fabric
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


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("job", help="name of the running prefetchd job (planned with --world-size DEVICES)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=None, help="stop after N optimizer steps in total (a 'crash')")
    p.add_argument("--ckpt", help="save a checkpoint here at the stop point (max steps, or the end)")
    p.add_argument("--resume", help="resume from this checkpoint")
    p.add_argument("--record", help="append one JSON line per step and rank: epoch, step, rank, global_step, ids")
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for one batch")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    fabric = Fabric(accelerator="cpu", devices=args.devices, strategy="ddp" if args.devices > 1 else "auto")
    fabric.launch()  # the other ranks start here; torch.distributed is initialised
    fabric.seed_everything(0, verbose=False)
    model = tiny_cnn(args.num_classes)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    model, optimizer = fabric.setup(model, optimizer)
    loader = PrefetchLoader(args.job, timeout=args.timeout)  # NOT fabric.setup_dataloaders(loader)
    state = {"model": model, "optimizer": optimizer, "loader": loader, "global_step": 0}
    if args.resume:
        fabric.load(args.resume, state)  # calls loader.load_state_dict; fills in state["global_step"]
    global_step = state["global_step"]

    epoch = loader.position[0]  # where the checkpoint left off (the next epoch after a full one)
    record = open(args.record, "a") if args.record else None
    stop = False
    while epoch < args.epochs and not stop:
        loader.set_epoch(epoch)  # a no-op for the epoch being resumed: it keeps the mid-epoch position
        for step, batch in enumerate(loader, start=loader.position[1]):
            batch = fabric.to_device(batch)
            x = batch["image"].permute(0, 3, 1, 2).float().div_(255)  # uint8 NHWC -> float NCHW
            loss = nn.functional.cross_entropy(model(x), batch["label"])
            optimizer.zero_grad(set_to_none=True)
            fabric.backward(loss)
            optimizer.step()
            if record:
                line = {"epoch": epoch, "step": step, "rank": fabric.global_rank, "global_step": global_step}
                record.write(json.dumps({**line, "index": batch["index"].tolist()}) + "\n")
                record.flush()
            global_step += 1
            if args.max_steps is not None and global_step >= args.max_steps:
                stop = True  # every rank stops at the same step: all ranks get the same number of batches
                break
        epoch += 1
    if args.ckpt:
        state["global_step"] = global_step
        fabric.save(args.ckpt, state)  # on every rank; rank 0 writes loader.state_dict() and the rest
    if record:
        record.close()
    loader.close()
    if fabric.global_rank == 0:
        print(f"done: global_step={global_step} position={loader.position}")


if __name__ == "__main__":
    main()
