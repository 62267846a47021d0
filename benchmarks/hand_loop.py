"""The hand-written loop of the start-up benchmark (`python -m benchmarks.overhead --startup`): what
a user writes with stock PyTorch for the runner's tiny smoke run, as one process.

It does the work of `python -m runner model=tiny data=synthetic trainer.max_epochs=1
trainer.limit_train_batches=T trainer.limit_val_batches=V` on the CPU: the same model (TinyCNN's
layers: three conv-BN-ReLU blocks, global pool, linear head), batches of the same shape from a
DataLoader with the same number of worker processes, SGD with the same settings and a cosine
schedule, T training steps, V validation batches with accuracy, and a checkpoint (model and
optimizer) written at the end. Images are random tensors of the synthetic data's shape (the
runner renders its synthetic images per item: a cost the runner's side carries).
It imports nothing of the runner, so its wall time is torch's own start-up plus the work.

    python benchmarks/hand_loop.py --train-batches 3 --val-batches 1 --out /tmp/hand.pt
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def conv_bn_relu(cin: int, cout: int, stride: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True),
    )


def tiny_cnn(num_classes: int, width: int = 16) -> nn.Sequential:
    return nn.Sequential(
        conv_bn_relu(3, width, 1),
        conv_bn_relu(width, 2 * width, 2),
        conv_bn_relu(2 * width, 4 * width, 2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4 * width, num_classes),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--train-batches", type=int, default=3)
    p.add_argument("--val-batches", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--num-classes", type=int, default=10)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--out", required=True, help="where the checkpoint is written")
    args = p.parse_args()
    started = time.perf_counter()
    torch.manual_seed(42)

    def loader(batches: int, shuffle: bool) -> DataLoader:
        n = batches * args.batch_size
        data = TensorDataset(
            torch.randn(n, 3, args.image_size, args.image_size),
            torch.randint(0, args.num_classes, (n,)),
        )
        return DataLoader(
            data,
            batch_size=args.batch_size,
            shuffle=shuffle,
            num_workers=args.num_workers,
            persistent_workers=args.num_workers > 0,
        )

    train, val = loader(args.train_batches, True), loader(args.val_batches, False)
    model = tiny_cnn(args.num_classes)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.train_batches)
    criterion = nn.CrossEntropyLoss()

    model.train()
    for x, y in train:
        loss = criterion(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for x, y in val:
            correct += (model(x).argmax(dim=1) == y).sum().item()
            total += y.numel()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, args.out)
    print(
        f"hand-written loop: train loss {loss.item():.4f}, val_acc {correct / total:.4f}, "
        f"{time.perf_counter() - started:.2f} s after the imports",
        flush=True,
    )


if __name__ == "__main__":
    main()
