"""Validation on a second prefetchd job, an evaluation job, as the LightningModule's
val_dataloader; DDP on CPU (2 ranks, gloo).

    prefetchd start configs/demo.toml --data FOLDER --world-size 2
    prefetchd start configs/demo_eval.toml --data VAL_FOLDER --world-size 2
    python examples/lightning_eval.py demo demo-val --epochs 2

An evaluation job (``[job] mode = "eval"``) reads every sample exactly once across the ranks,
in order and unaugmented; its last step is padded so every rank has as many steps, and each
batch's boolean ``valid`` field says which rows are samples. A metric summed over the valid
rows and reduced over the ranks is the metric over the dataset: counting the padding would
count the first samples twice.

Lightning's sanity check reads two validation batches before training; an evaluation loader
left mid-epoch starts its next iteration at the next epoch's start, so every validation
still reads a whole epoch (and every epoch of an evaluation job is the same).
"""

from __future__ import annotations

import argparse
import json

import lightning as L
import torch
from lightning_ddp import tiny_cnn
from torch import nn

from prefetchd_client import PrefetchLoader


def as_input(batch: dict) -> torch.Tensor:
    return batch["image"].permute(0, 3, 1, 2).float().div_(255)  # uint8 NHWC -> float NCHW


class EvalModule(L.LightningModule):
    def __init__(self, train_job: str, val_job: str, num_classes: int = 1000, timeout: float = 120.0, record=None):
        super().__init__()
        self.save_hyperparameters(ignore=["record"])
        self.net = tiny_cnn(num_classes)
        self.record_path = record

    def train_dataloader(self) -> PrefetchLoader:
        return PrefetchLoader(self.hparams.train_job, timeout=self.hparams.timeout)

    def val_dataloader(self) -> PrefetchLoader:
        # A job of its own: its batches wait in the buffer beside the training job's.
        return PrefetchLoader(self.hparams.val_job, timeout=self.hparams.timeout)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        return nn.functional.cross_entropy(self.net(as_input(batch)), batch["label"])

    def on_validation_epoch_start(self) -> None:
        self.sums = torch.zeros(4, dtype=torch.float64)  # correct, samples, loss sum, rows with padding
        self.ids: list[int] = []

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        valid = batch["valid"]
        logits = self.net(as_input(batch))
        loss = nn.functional.cross_entropy(logits, batch["label"], reduction="none")
        correct = logits.argmax(1) == batch["label"]
        self.sums += torch.stack(
            [(correct & valid).sum(), valid.sum(), loss[valid].sum(), torch.tensor(len(valid))]
        ).double()
        self.ids += batch["index"][valid].tolist()

    def on_validation_epoch_end(self) -> None:
        correct, samples, loss_sum, rows = self.trainer.strategy.reduce(self.sums, reduce_op="sum").tolist()
        self.log("val_acc", correct / samples, rank_zero_only=True)
        if self.record_path and not self.trainer.sanity_checking:
            line = {"epoch": self.current_epoch, "rank": self.global_rank, "ids": self.ids, "correct": correct,
                    "samples": samples, "loss": loss_sum / samples, "rows": rows}
            with open(self.record_path, "a") as f:  # every rank appends one line
                f.write(json.dumps(line) + "\n")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("train_job", help="the running training job (planned with --world-size DEVICES)")
    p.add_argument("val_job", help='the running evaluation job ([job] mode = "eval", same world size)')
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--num-classes", type=int, default=1000)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for one batch")
    p.add_argument("--record", help="append each validation's result and sample ids, one JSON line per rank")
    p.add_argument("--weights", help="save the final network's state_dict here (rank 0)")
    args = p.parse_args(argv)
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        max_epochs=args.epochs,
        use_distributed_sampler=False,  # each job's daemon gives every rank its own batches
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
    )
    model = EvalModule(args.train_job, args.val_job, args.num_classes, args.timeout, args.record)
    trainer.fit(model)
    if trainer.is_global_zero:
        if args.weights:
            torch.save(model.net.state_dict(), args.weights)
        print(f"done: val_acc={trainer.callback_metrics['val_acc'].item():.4f}")


if __name__ == "__main__":
    main()
