"""onnxruntime's intra-op workers are kept off the core of the thread calling them,
and torch's idle OpenMP workers rest before a long run."""

from __future__ import annotations

import os
import threading
import time

import onnxruntime
import pytest
import torch

from ortbridge import OnnxModule
from ortbridge._runtime import _ort, _threads
from ortbridge._runtime._threads import WorkerPinning, start_pinned, thread_ids
from ortbridge.examples import linear_model

pinnable = pytest.mark.skipif(
    thread_ids() is None or len(os.sched_getaffinity(0)) < 2 or torch.get_num_threads() < 2,
    reason="needs Linux thread ids, two cores or more and torch on two threads or more",
)


def _graphs(layer):
    return [*layer._bridge._gradient_graphs.values(), *layer._bridge._inference_graphs.values()]


#: Features of a linear layer whose products keep the onnxruntime engine's
#: sessions on torch's thread count (8 rows: 8M multiply-adds; a smaller
#: graph runs on one thread, nothing to pin).
WIDE = 1024


@pinnable
def test_workers_run_on_every_core_but_the_callers():
    layer = OnnxModule(linear_model(WIDE, WIDE))
    layer(torch.randn(8, WIDE)).sum().backward()
    with torch.no_grad():
        layer(torch.randn(8, WIDE))
    graphs = _graphs(layer)
    assert len(graphs) == 2  # the gradient graph and the inference graph
    allowed = os.sched_getaffinity(0)
    main = threading.get_native_id()
    for pinning in [p for graph in graphs for p in graph.pinnings]:
        assert pinning is not None
        # One worker per intra-op thread beside the caller's, none of them this thread.
        assert len(pinning.workers) == torch.get_num_threads() - 1
        assert main not in pinning.workers
        assert pinning.cpu in allowed
        for tid in pinning.workers:
            assert os.sched_getaffinity(tid) == allowed - {pinning.cpu}


@pinnable
def test_workers_follow_the_caller_to_another_core(monkeypatch):
    layer = OnnxModule(linear_model(WIDE, WIDE))
    layer(torch.randn(8, WIDE)).sum().backward()
    (graph,) = layer._bridge._gradient_graphs.values()
    first, second = sorted(os.sched_getaffinity(0))[:2]
    for cpu in (first, second, first):
        monkeypatch.setattr(_threads, "_getcpu", lambda cpu=cpu: cpu)
        layer(torch.randn(8, WIDE)).sum().backward()
        for pinning in graph.pinnings:
            assert pinning.cpu == cpu
            for tid in pinning.workers:
                assert cpu not in os.sched_getaffinity(tid)


@pinnable
def test_follow_does_not_call_the_system_when_the_core_is_unchanged(monkeypatch):
    allowed = os.sched_getaffinity(0)
    pinning = WorkerPinning([threading.get_native_id()], allowed, -1)
    calls = []
    real = os.sched_setaffinity
    monkeypatch.setattr(os, "sched_setaffinity", lambda *a: calls.append(a) or real(*a))
    monkeypatch.setattr(_threads, "_getcpu", lambda: min(allowed))
    try:
        for _ in range(3):
            pinning.follow()
        assert len(calls) == 1
    finally:
        real(0, allowed)


def test_options_given_by_the_user_are_left_alone():
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 2
    layer = OnnxModule(linear_model(3, 2), session_options=options)
    layer(torch.randn(4, 3)).sum().backward()
    (graph,) = layer._bridge._gradient_graphs.values()
    assert graph.pinnings == [None] * len(graph.pinnings)


@pinnable
def test_one_thread_means_nothing_to_pin():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        layer = OnnxModule(linear_model(3, 2))
        layer(torch.randn(4, 3)).sum().backward()
    finally:
        torch.set_num_threads(threads)
    (graph,) = layer._bridge._gradient_graphs.values()
    assert graph.pinnings == [None] * len(graph.pinnings)


@pinnable
def test_workers_are_told_from_threads_started_meanwhile():
    # A thread another library starts while the session is created has the
    # process's cores, not the workers' mask: it is neither counted nor pinned.
    done = threading.Event()
    others = []

    def create(options):
        thread = threading.Thread(target=done.wait)
        thread.start()
        others.append(thread)
        return onnxruntime.InferenceSession(
            linear_model(3, 2).SerializeToString(), options, providers=["CPUExecutionProvider"]
        )

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 2
    try:
        session, pinning = start_pinned(create, options, 1)
        assert session.get_inputs()[0].name == "x"
        assert pinning is not None
        assert others[0].native_id not in pinning.workers
        assert os.sched_getaffinity(others[0].native_id) == os.sched_getaffinity(0)
        (worker,) = pinning.workers
        assert os.sched_getaffinity(worker) == os.sched_getaffinity(0) - {pinning.cpu}
    finally:
        done.set()
        for thread in others:
            thread.join()


@pinnable
def test_workers_not_found_are_not_followed(monkeypatch):
    # Told to expect more workers than onnxruntime starts: no pinning object
    # (the session itself is fine).
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 2

    def create(options):
        return onnxruntime.InferenceSession(
            linear_model(3, 2).SerializeToString(), options, providers=["CPUExecutionProvider"]
        )

    with pytest.raises(Exception, match="affinit"):
        start_pinned(create, options, 2)  # onnxruntime checks the count itself
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 2
    monkeypatch.setattr(_threads, "thread_ids", lambda: set())
    session, pinning = start_pinned(create, options, 1)
    assert pinning is None and session.get_inputs()[0].name == "x"


@pinnable
def test_a_worker_that_is_gone_stops_the_pinning():
    thread = threading.Thread(target=lambda: None)
    thread.start()
    gone = thread.native_id
    thread.join()
    # join() returns before the system thread has quite finished.
    for _ in range(1000):
        if not os.path.exists(f"/proc/self/task/{gone}"):
            break
        time.sleep(0.001)
    pinning = WorkerPinning([gone], os.sched_getaffinity(0), -1)
    pinning.follow()  # no error
    assert pinning.workers == []
    pinning.follow()


def test_affinities_refused_still_give_a_session(monkeypatch):
    from ortbridge._runtime import _sessions as _runtime
    from ortbridge.exceptions import OnnxModelError

    def refuse(create, options, n_workers, rests_openmp=False):
        raise OnnxModelError("onnxruntime cannot load the graph: bad affinity string")

    monkeypatch.setattr(_runtime, "start_pinned", refuse)
    layer = OnnxModule(linear_model(3, 2))
    x = torch.randn(4, 3)
    layer(x).sum().backward()
    (graph,) = layer._bridge._gradient_graphs.values()
    assert graph.pinnings == [None] * len(graph.pinnings)
    assert torch.allclose(layer(x), x @ layer.weight.T + layer.bias)


# -- torch's OpenMP workers --------------------------------------------------


_SPINNING = """
import json, os, time
# libgomp counts the cores it may use when it loads, and spins little where its
# threads outnumber them: the test's process may have left this thread on one.
try:
    os.sched_setaffinity(0, range(os.cpu_count()))
except OSError:  # cores this process may not use
    pass
import torch
from ortbridge._runtime import _threads

def parallel_op():  # big enough for ATen's parallel_for: the OpenMP workers join, then spin
    torch.ones(4_000_000).mul_(2)

def op_then_rest():
    parallel_op()
    assert _threads.rest_openmp()

def cpu_while_sleeping(before):  # least CPU time of the process over 20 ms sleeps
    least = float("inf")
    for _ in range(5):
        before()
        start = time.process_time()
        time.sleep(0.02)
        least = min(least, time.process_time() - start)
    return least

found = _threads.rest_openmp()
print(json.dumps({"found": found, "spinning": cpu_while_sleeping(parallel_op),
                  "rested": cpu_while_sleeping(op_then_rest) if found else None,
                  "after": torch.ones(4_000_000).mul_(2).sum().item()}))
"""


@pinnable
def test_resting_stops_torch_openmp_workers_spinning():
    """After a parallel op torch's OpenMP workers spin for a while (CPU time
    while the process sleeps); rested, they do not, and torch's next parallel
    op starts them again. In a fresh interpreter: libgomp spins far less once
    it manages more threads than cores (other tests' threads' pools)."""
    import json
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _SPINNING], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    found = json.loads(run.stdout)
    if not found["found"]:
        pytest.skip("torch's OpenMP runtime has no omp_pause_resource_all")
    if found["spinning"] < 0.002:
        pytest.skip(f"torch's OpenMP workers do not spin here ({found['spinning'] * 1e3:.2f} ms)")
    assert found["rested"] < found["spinning"] / 4, found
    assert found["after"] == 8_000_000


_FORKED = """
import os, torch
from ortbridge._runtime import _threads
torch.ones(4_000_000).mul_(2)  # the parent's OpenMP pool has its workers
pid = os.fork()
if pid == 0:
    rested = _threads.rest_openmp()
    torch.set_num_threads(1)
    os._exit(0 if rested is False and torch.ones(8).sum().item() == 8 else 3)
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_does_not_rest_the_openmp_pool_it_inherited():
    """The pool's threads were not copied by the fork: pausing it in the child
    waited for them forever. The child leaves it alone."""
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-c", _FORKED], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "0", run.stdout


@pytest.mark.parametrize("rests", [True, False])
def test_only_long_runs_of_sessions_that_spin_rest_openmp_first(monkeypatch, rests):
    calls = []
    monkeypatch.setattr(_threads, "rest_openmp", lambda: calls.append(1) or True)
    monkeypatch.setattr(_threads, "_getcpu", lambda: 0)
    pinning = WorkerPinning([], {0, 1}, 0, rests_openmp=rests)
    with pinning:  # short
        pass
    with pinning:  # short before: no rest; long itself
        time.sleep(2 * _threads.LONG_RUN_S)
    assert calls == []
    with pinning:  # long before
        pass
    assert calls == ([1] if rests else [])
    with pinning:  # short before
        pass
    assert len(calls) == (1 if rests else 0)


@pinnable
def test_the_onnxruntime_engine_rests_openmp_the_training_agent_does_not():
    """Resting pays where the workers spin within a run (the onnxruntime
    engine's sessions); where they sleep, it made the agent's steps slower."""
    backends = ["onnxruntime"] + (["training-agent"] if _ort.has_training() else [])
    for backend in backends:
        # Products large enough for the engine's sessions to keep torch's threads.
        layer = OnnxModule(linear_model(WIDE, WIDE), backend=backend)
        layer(torch.randn(8, WIDE)).sum().backward()
        (graph,) = layer._bridge._gradient_graphs.values()
        assert graph.pinnings and all(
            p.rests_openmp == (backend == "onnxruntime") for p in graph.pinnings
        ), backend


@pytest.mark.parametrize(
    "features, rows, threads",
    [(3, 4, 1), (256, 16, 1), (1024, 8, None)],
    ids=["tiny", "under-4M-multiply-adds", "8M-multiply-adds"],
)
def test_the_engines_sessions_run_on_one_thread_where_their_products_are_small(
    features, rows, threads
):
    """The onnxruntime engine sizes its CPU sessions by their graphs' work: a
    graph whose large products (1M multiply-adds or more each) total under 4M
    runs on one thread (a second one's hand-overs cost more than it gives
    back); larger work keeps torch's count (None). Not its inference session,
    and never options the user gave."""
    layer = OnnxModule(linear_model(features, features), backend="onnxruntime")
    x = torch.randn(rows, features)
    layer(x).sum().backward()
    (graph,) = layer._bridge._gradient_graphs.values()
    want = threads or torch.get_num_threads()
    assert [s.get_session_options().intra_op_num_threads for s in graph.sessions] == [want] * 2
    options = _ort.runtime().SessionOptions()
    options.intra_op_num_threads = 3
    mine = OnnxModule(
        linear_model(features, features), backend="onnxruntime", session_options=options
    )
    mine(x).sum().backward()
    (graph,) = mine._bridge._gradient_graphs.values()
    assert [s.get_session_options().intra_op_num_threads for s in graph.sessions] == [3, 3]


def test_the_thread_choice_reads_the_optimisers_shapes(monkeypatch):
    """The engine sizes its pools from the forward's shapes the optimiser's last
    inference left: no shape inference of its own (a build's cost)."""
    from ortbridge._engines.onnxruntime import _work

    def no_inference(model):
        raise AssertionError("the thread choice ran a shape inference")

    monkeypatch.setattr(_work, "_shapes", no_inference)
    layer = OnnxModule(linear_model(256, 256), backend="onnxruntime")
    layer(torch.randn(16, 256)).sum().backward()
    (graph,) = layer._bridge._gradient_graphs.values()
    assert [s.get_session_options().intra_op_num_threads for s in graph.sessions] == [1, 1]
