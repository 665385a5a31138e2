"""Keep onnxruntime's intra-op workers off the core of the thread calling it,
and torch's idle OpenMP workers off the cores while a long run goes.

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

The workers still share the other cores with torch's: libgomp's workers
spin for milliseconds (``GOMP_SPINCOUNT``) after each parallel operation,
and a parallel kernel of onnxruntime then waits for its worker's share of a
core. Before a run of a session whose last run took :data:`LONG_RUN_S` or
more, torch's idle OpenMP workers are told to stop
(``omp_pause_resource_all``, OpenMP 5.0: libgomp ends them, and its next
parallel region starts new ones, about 0.1 ms). A transformer layer's step
took 0.90x its time, a small CNN's 0.90x (2 cores); for shorter runs the
restart costs more than the spinning (an MLP's step 1.22x), so they leave
the workers be. Only sessions whose workers spin within a run do this
(the onnxruntime engine's): where they sleep, each parallel node wakes its
worker, and on a core torch's workers no longer keep busy that took longer
(the training agent's CNN step 1.19x).

Linux only (thread ids from ``/proc``, glibc's ``sched_getcpu``); elsewhere
nothing is pinned.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import time

_TASKS = "/proc/self/task"
_MAPS = "/proc/self/maps"
_MASK_POLLS = 200  # of 1 ms
#: Runs at least this long (the session's last one) first rest torch's OpenMP workers.
LONG_RUN_S = 1e-3
_OMP_PAUSE_SOFT = 1  # omp_pause_resource_t
_OPENMP_LIBS = ("libgomp", "libiomp5", "libomp")


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


_pause = None  # omp_pause_resource_all of torch's OpenMP runtime; False: none found


def _load_pause():
    # torch's own runtime (a wheel ships its libgomp), else any in the process.
    paths = []
    try:
        with open(_MAPS) as maps:
            for line in maps:
                path = line.split(maxsplit=5)[-1].strip()
                if os.path.basename(path).startswith(_OPENMP_LIBS) and path not in paths:
                    paths.append(path)
    except OSError:
        pass
    paths.sort(key=lambda p: "torch" not in p)
    for path in [*paths, None]:
        try:
            pause = ctypes.CDLL(path).omp_pause_resource_all
        except (AttributeError, OSError):
            continue
        pause.argtypes = [ctypes.c_int]
        pause.restype = ctypes.c_int
        return pause
    return False


def _forked_child() -> None:
    # The OpenMP pool a forked child inherits names threads the fork did not
    # copy: pausing it would wait for them forever.
    global _pause
    _pause = False


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked_child)


def rest_openmp() -> bool:
    """Stop torch's idle OpenMP workers now; False where its runtime cannot, and
    in a forked child."""
    global _pause
    if _pause is None:
        _pause = _load_pause()
    # Refused (-1) inside a parallel region, never the case between torch's ops.
    return bool(_pause) and _pause(_OMP_PAUSE_SOFT) == 0


#: The context of a run without pinning.
UNPINNED = contextlib.nullcontext()


class WorkerPinning:
    """Confines a session's worker threads to the cores its caller is not on.

    A context manager around each run: the workers follow the caller; with
    ``rests_openmp``, torch's OpenMP workers rest first where the last run
    was long (see the module).
    """

    def __init__(self, workers: list[int], allowed: set[int], cpu: int, rests_openmp=False):
        self.workers = workers
        self.allowed = allowed
        self.cpu = cpu
        self.rests_openmp = rests_openmp
        self.last_run = 0.0
        self._start = 0.0

    def __enter__(self):
        self.follow()
        if self.rests_openmp and self.last_run >= LONG_RUN_S:
            rest_openmp()
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.last_run = time.perf_counter() - self._start
        return False

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


def start_pinned(create, options, n_workers: int, rests_openmp: bool = False):
    """``create(options)`` with its ``n_workers`` intra-op workers off this thread's core.

    onnxruntime pins the workers itself (``session.intra_op_thread_affinities``)
    to every allowed core but the one this thread runs on; they are then told
    from other threads started meanwhile by that mask. Returns the session
    and its :class:`WorkerPinning`, None where nothing could be pinned or the
    workers could not be found (they keep onnxruntime's pin, without
    following the caller). ``rests_openmp``: for sessions whose workers spin
    within a run (see the module).
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
    return session, WorkerPinning(workers, allowed, cpu, rests_openmp)
