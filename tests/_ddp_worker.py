"""Worker for tests/test_ddp.py: one DistributedDataParallel replica (gloo, CPU)."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ortbridge import OnnxModule

STEPS = 20
BATCH = 16


def data(step: int):
    """The full batch of a step, the same in every process."""
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, 6, generator=gen), torch.randn(BATCH, 3, generator=gen)


def train(model: nn.Module, world_size: int = 1, rank: int = 0) -> list[float]:
    """SGD on this rank's share of each batch; mean-reduced MSE."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    share = BATCH // world_size
    losses = []
    for step in range(STEPS):
        x, y = data(step)
        x, y = x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def run(
    rank: int, world_size: int, port: int, model_path: str, out_dir: str, compiled: bool = False
) -> None:
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        model = DistributedDataParallel(OnnxModule(model_path))
        # Compiled, the layer is a torch operator in the graph DDP's buckets split.
        losses = train(
            torch.compile(model, backend="aot_eager") if compiled else model, world_size, rank
        )
        state = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
        torch.save({"state": state, "losses": losses}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
    # torch 2.13's gloo threads can abort the interpreter's teardown ("terminate called
    # without an active exception", about one run in five, plain nn.Linear replicas too):
    # the results are on disk, so leave without that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
