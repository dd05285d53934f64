"""PrefetchLoader as the train_dataloader of a LightningModule, DDP on CPU (2 ranks, gloo).

    prefetchd start configs/demo.toml --data FOLDER --world-size 2
    python examples/lightning_ddp.py demo --epochs 2 --max-steps 4 --ckpt /tmp/run.ckpt   # stops after 4 steps
    python examples/lightning_ddp.py demo --epochs 2 --resume /tmp/run.ckpt               # goes on at step 5

How Lightning 2.x treats the loader (lightning/pytorch/loops/fit_loop.py):

- The loader is not a torch DataLoader, so Lightning leaves it alone: no DistributedSampler
  is injected (``use_distributed_sampler=False`` says so explicitly). PrefetchLoader keeps
  its own epoch: each ``iter()`` is the next epoch.
- It must be created in ``train_dataloader()``: that runs after DDP has initialised
  torch.distributed, so PrefetchLoader takes rank and world size from it.
- ``len(loader)`` is known, so Lightning fetches no batch ahead: the loader's state at a
  checkpoint saved in ``on_train_batch_end`` counts exactly the batches trained on.
- Because the loader has ``state_dict``/``load_state_dict``, ``trainer.save_checkpoint``
  stores rank 0's ``loader.state_dict()`` under ``loops.fit_loop.state_dict.combined_loader``,
  and ``trainer.fit(ckpt_path=...)`` calls ``load_state_dict`` with it on every rank before
  ``iter()``. Every rank gets rank 0's state, which is right: the state is global (epoch and
  samples consumed by all ranks), the same on every rank.

Known Lightning bug (Lightning#20550): if ``configure_optimizers`` reads
``self.trainer.estimated_stepping_batches`` (e.g. for OneCycleLR), the train dataloader is
set up before the checkpoint is restored, and the loader state is never loaded: the resumed
run starts the loader at epoch 0, step 0. Compute the total steps yourself instead
(``epochs * len(PrefetchLoader(job))``) until that is fixed.

Resuming from a checkpoint saved at the end of an epoch (ModelCheckpoint's default when there
is no validation, or ``trainer.save_checkpoint`` after ``fit``): Lightning does not consider
the run "restarting" then and drops the loader state. It does call ``sampler.set_epoch`` at
every epoch start, on anything with a ``sampler`` attribute; PrefetchLoader has one, so the
resumed run starts the right epoch (and a mid-epoch resume keeps its step: setting the
current epoch is a no-op).
"""

from __future__ import annotations

import argparse
import json

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
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


class PrefetchModule(L.LightningModule):
    def __init__(self, job: str, num_classes: int = 1000, lr: float = 0.05, timeout: float = 120.0, record=None):
        super().__init__()
        self.save_hyperparameters(ignore=["record"])
        self.net = tiny_cnn(num_classes)
        self.record_path = record
        self._record = None
        self.loader: PrefetchLoader | None = None

    def train_dataloader(self) -> PrefetchLoader:
        # Called after torch.distributed is initialised: rank and world size come from it.
        self.loader = PrefetchLoader(self.hparams.job, timeout=self.hparams.timeout)
        return self.loader

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        x = batch["image"].permute(0, 3, 1, 2).float().div_(255)  # uint8 NHWC -> float NCHW
        loss = nn.functional.cross_entropy(self.net(x), batch["label"])
        if self.record_path:
            if self._record is None:
                self._record = open(self.record_path, "a")  # every rank appends, one line per write
            line = {
                "epoch": self.current_epoch,
                "step": batch_idx,
                "rank": self.global_rank,
                "global_step": self.global_step,
                "index": batch["index"].tolist(),
            }
            self._record.write(json.dumps(line) + "\n")
            self._record.flush()
        return loss

    def configure_optimizers(self):
        # Do not use self.trainer.estimated_stepping_batches here: Lightning#20550 (see the docstring).
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)

    def on_train_end(self) -> None:
        if self._record is not None:
            self._record.close()
            self._record = None


class SaveAtStep(Callback):
    """``trainer.save_checkpoint(path)`` right after optimizer step ``step`` (on every rank: rank 0 writes)."""

    def __init__(self, path: str, step: int):
        self.path, self.step = path, step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("job", help="name of the running prefetchd job (planned with --world-size DEVICES)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=None, help="stop after N optimizer steps in total (a 'crash')")
    p.add_argument("--ckpt", help="save a checkpoint here at the stop point (max steps, or the end of fit)")
    p.add_argument("--ckpt-dir", help="also save with ModelCheckpoint into this folder: at each epoch's end ...")
    p.add_argument("--ckpt-every", type=int, default=None, help="... or every N steps (every_n_train_steps)")
    p.add_argument("--resume", help="resume from this checkpoint: trainer.fit(model, ckpt_path=...)")
    p.add_argument("--record", help="append one JSON line per step and rank: epoch, step, rank, global_step, ids")
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for one batch")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    L.seed_everything(0, verbose=False)
    callbacks = []
    if args.ckpt and args.max_steps is not None:
        callbacks.append(SaveAtStep(args.ckpt, args.max_steps))
    if args.ckpt_dir:  # files named epoch=E-step=S.ckpt
        callbacks.append(ModelCheckpoint(dirpath=args.ckpt_dir, every_n_train_steps=args.ckpt_every, save_top_k=-1))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        max_epochs=args.epochs,
        max_steps=-1 if args.max_steps is None else args.max_steps,
        use_distributed_sampler=False,  # the daemon already gives each rank its own disjoint batches
        callbacks=callbacks,
        enable_checkpointing=bool(args.ckpt_dir),
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
    )
    model = PrefetchModule(args.job, num_classes=args.num_classes, timeout=args.timeout, record=args.record)
    trainer.fit(model, ckpt_path=args.resume)
    if args.ckpt and args.max_steps is None:
        trainer.save_checkpoint(args.ckpt)  # on every rank; rank 0 writes
    if trainer.is_global_zero:
        print(f"done: global_step={trainer.global_step} epoch={trainer.current_epoch}")


if __name__ == "__main__":
    main()
