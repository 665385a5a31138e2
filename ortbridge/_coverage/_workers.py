"""Many cases in forked worker processes: a case that kills its process costs that case only."""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import wait

from ._cases import ERROR, CaseResult, NodeCase


def _worker(conn, cases: Sequence[NodeCase], samples: int, quiet: bool, backend: str) -> None:
    import gc

    import torch

    # The package's run_case, looked up here: a caller (the tests) may replace
    # it there before the fork.
    from .. import _coverage

    # What the fork inherited (the parent's onnxruntime sessions among it) is
    # never collected here: destroying an inherited session can kill the worker.
    gc.freeze()

    torch.set_num_threads(1)
    if quiet:  # onnxruntime logs its load failures on stderr, which the result records
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        faulthandler.disable()  # a crash is reported by its exit code
    while True:
        index = conn.recv()
        if index is None:
            return
        conn.send(_coverage.run_case(cases[index], samples=samples, backend=backend).as_dict())


def run_isolated(
    cases: Sequence[NodeCase],
    *,
    workers: int = 2,
    samples: int = 16,
    timeout: float = 300.0,
    quiet: bool = False,
    progress: Callable[[int, int, CaseResult], None] | None = None,
    backend: str = "onnxruntime",
) -> list[CaseResult]:
    """Check ``cases`` in forked worker processes; a crash or a hang costs one case.

    Results come back in the order of ``cases``. ``progress(done, total,
    result)`` is called after each case; ``quiet`` silences the workers' stderr.
    """
    _check_forkable()
    context = multiprocessing.get_context("fork")
    results: list[CaseResult | None] = [None] * len(cases)
    todo = list(range(len(cases)))[::-1]
    running: dict = {}  # connection -> [process, case index, start time]
    done = 0

    def start():
        parent, child = context.Pipe()
        process = context.Process(
            target=_worker, args=(child, cases, samples, quiet, backend), daemon=True
        )
        process.start()
        child.close()
        return parent, process

    def finish(index, result):
        nonlocal done
        results[index] = result
        done += 1
        if progress is not None:
            progress(done, len(cases), result)

    idle = [start() for _ in range(max(1, min(workers, len(cases))))]
    while todo or running:
        while idle and todo:
            conn, process = idle.pop()
            index = todo.pop()
            conn.send(index)
            running[conn] = [process, index, time.monotonic()]
        ready = wait(list(running) + [p.sentinel for p, _, _ in running.values()], timeout=1.0)
        for conn in list(running):
            process, index, began = running[conn]
            if conn in ready:
                try:
                    payload = conn.recv()
                except (EOFError, OSError):
                    payload = None
                if payload is not None:
                    del running[conn]
                    finish(index, CaseResult(**payload))
                    idle.append((conn, process))
                    continue
            crashed = not process.is_alive() or (conn in ready)
            late = time.monotonic() - began > timeout
            if crashed or late:
                del running[conn]
                if process.is_alive():
                    process.kill()
                process.join()
                conn.close()
                case = cases[index]
                if late and not crashed:
                    detail = f"timed out after {timeout:.0f} s"
                else:
                    detail = f"the process died (exit code {process.exitcode})"
                finish(
                    index,
                    CaseResult(
                        case.name,
                        case.op_key,
                        case.expanded,
                        ERROR,
                        detail=detail,
                        seconds=round(time.monotonic() - began, 2),
                    ),
                )
                if todo:
                    idle.append(start())
    for conn, process in idle:
        conn.send(None)
        process.join(timeout=10)
        if process.is_alive():
            process.kill()
    return results  # type: ignore[return-value]


def _check_forkable() -> None:
    """torch's autograd cannot run in a child forked after its parent ran CUDA
    work (its device threads): every case would fail there with torch's
    "Autograd-and-Fork" error. Refused up front in plain words instead."""
    import torch

    from ..exceptions import OrtBridgeError

    if torch.cuda.is_initialized():
        raise OrtBridgeError(
            "the op-coverage harness checks cases in forked processes, and torch's autograd "
            "cannot run in a process forked after CUDA was used: run it in a fresh process"
        )
