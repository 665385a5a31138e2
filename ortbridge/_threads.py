"""Keep onnxruntime's intra-op workers off the core of the thread calling it.

Between two onnxruntime calls of a training step torch runs, and its OpenMP
workers keep spinning for milliseconds after each parallel operation. Left
to Linux, onnxruntime's worker often wakes on the calling thread's own core,
where the two take turns and a parallel kernel runs slower than on one
thread; where it lands tends to stick to the thread, so each session drew a
lottery: on a 2-core machine the same MLP step took 2.2 or 2.7 ms depending
on the session (onnxruntime's calls 25% apart; ``bench_threads.py``). Allowing
the workers every core but the caller's removes the draw: onnxruntime pins
them so when the session is created, and they follow the caller when it
moves to another core.

Linux only (thread ids from ``/proc``, glibc's ``sched_getcpu``); elsewhere
nothing is pinned.
"""

from __future__ import annotations

import ctypes
import os
import time

_TASKS = "/proc/self/task"
_MASK_POLLS = 200  # of 1 ms


def _load_getcpu():
    try:
        getcpu = ctypes.CDLL(None).sched_getcpu
    except (AttributeError, OSError):
        return None
    getcpu.restype = ctypes.c_int
    getcpu.argtypes = []
    return getcpu


_getcpu = _load_getcpu()


def _affinity(tid: int) -> set[int] | None:
    try:
        return os.sched_getaffinity(tid)
    except OSError:  # a thread that has already ended
        return None


def thread_ids() -> set[int] | None:
    """Ids of this process's threads, or None where they cannot be listed."""
    if _getcpu is None or not hasattr(os, "sched_setaffinity"):
        return None
    try:
        return {int(t) for t in os.listdir(_TASKS)}
    except OSError:
        return None


class WorkerPinning:
    """Confines a session's worker threads to the cores its caller is not on."""

    def __init__(self, workers: list[int], allowed: set[int], cpu: int):
        self.workers = workers
        self.allowed = allowed
        self.cpu = cpu

    def follow(self) -> None:
        """Move the workers off the calling thread's core if it changed."""
        cpu = _getcpu()
        if cpu == self.cpu:
            return
        self.cpu = cpu
        cores = self.allowed - {cpu}  # never empty: allowed has two cores or more
        try:
            for tid in self.workers:
                os.sched_setaffinity(tid, cores)
        except OSError:
            # A worker is gone (the session was released, or a fork), or the
            # process's cores changed under us: stop pinning.
            self.workers = []


def start_pinned(create, options, n_workers: int):
    """``create(options)`` with its ``n_workers`` intra-op workers off this thread's core.

    onnxruntime pins the workers itself (``session.intra_op_thread_affinities``)
    to every allowed core but the one this thread runs on; they are then told
    from other threads started meanwhile by that mask. Returns the session
    and its :class:`WorkerPinning`, None where nothing could be pinned or the
    workers could not be found (they keep onnxruntime's pin, without
    following the caller).
    """
    before = thread_ids()
    allowed = os.sched_getaffinity(0) if before is not None else set()
    if n_workers < 1 or len(allowed) < 2:
        return create(options), None
    cpu = _getcpu()
    cores = allowed - {cpu}
    # onnxruntime numbers logical processors from 1.
    mask = ",".join(str(c + 1) for c in sorted(cores))
    options.add_session_config_entry(
        "session.intra_op_thread_affinities", ";".join([mask] * n_workers)
    )
    session = create(options)
    new = sorted((thread_ids() or set()) - before)
    # A worker applies its mask itself once started: give it a moment.
    for _ in range(_MASK_POLLS):
        workers = [tid for tid in new if _affinity(tid) == cores]
        if len(workers) >= n_workers:
            break
        time.sleep(0.001)
    if len(workers) != n_workers:
        return session, None
    return session, WorkerPinning(workers, allowed, cpu)
