"""DistributedDataParallel over OnnxModule: two gloo processes on one machine."""

from __future__ import annotations

import socket

import _ddp_worker
import onnx
import pytest
import torch
import torch.multiprocessing as mp
from conftest import export
from torch import nn

from ortbridge import OnnxModule


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_ddp_two_replicas_match_single_process_training(tmp_path, compiled):
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    model_path = tmp_path / "mlp.onnx"
    onnx.save(export(mlp, (torch.randn(4, 6),)), str(model_path))

    mp.spawn(
        _ddp_worker.run,
        args=(2, free_port(), str(model_path), str(tmp_path), compiled),
        nprocs=2,
        join=True,
    )
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]

    single = OnnxModule(str(model_path))
    single_losses = _ddp_worker.train(single)
    initial = OnnxModule(str(model_path)).state_dict()
    reference = single.state_dict()

    first, second = (r["state"] for r in results)
    assert sorted(first) == sorted(reference) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    for name, value in reference.items():
        # Replicas hold identical weights, those of full-batch training.
        torch.testing.assert_close(second[name], first[name], rtol=0, atol=0)
        torch.testing.assert_close(first[name], value, rtol=1e-5, atol=1e-6)
        assert not torch.equal(value, initial[name]), name
    # Each rank's loss is on its half; their mean is the full-batch loss.
    for step, want in enumerate(single_losses):
        got = (results[0]["losses"][step] + results[1]["losses"][step]) / 2
        assert abs(got - want) <= 1e-5 * abs(want), (step, got, want)
