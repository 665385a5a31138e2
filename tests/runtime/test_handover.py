"""Tensors handed to onnxruntime by pointer: every element type, empty and
strided tensors, and graph outputs that are graph inputs."""

from __future__ import annotations

import gc

import onnx
import pytest
import torch
from onnx import TensorProto, helper

from ortbridge import OnnxModule
from ortbridge._runtime._runs import InferenceGraph, to_ortvalues

CPU = torch.device("cpu")

TYPES = {
    torch.float32: TensorProto.FLOAT,
    torch.float64: TensorProto.DOUBLE,
    torch.float16: TensorProto.FLOAT16,
    torch.bfloat16: TensorProto.BFLOAT16,  # no numpy type: handed over by DLPack
    torch.int64: TensorProto.INT64,
    torch.int32: TensorProto.INT32,
    torch.int16: TensorProto.INT16,
    torch.int8: TensorProto.INT8,
    torch.uint8: TensorProto.UINT8,
    torch.bool: TensorProto.BOOL,
}


def _identities(elem: int, n: int, passed: bool = False) -> onnx.ModelProto:
    """``n`` inputs copied by Identity nodes; ``passed``: each input an output too."""
    nodes = [helper.make_node("Identity", [f"x{i}"], [f"y{i}"]) for i in range(n)]
    inputs = [helper.make_tensor_value_info(f"x{i}", elem, None) for i in range(n)]
    outputs = [helper.make_tensor_value_info(f"y{i}", elem, None) for i in range(n)]
    if passed:
        outputs += [helper.make_tensor_value_info(f"x{i}", elem, None) for i in range(n)]
    graph = helper.make_graph(nodes, "identities", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _tensor(dtype, shape):
    values = torch.arange(-7, -7 + int(torch.tensor(shape).prod()), dtype=torch.float64)
    return values.reshape(shape).to(dtype)


@pytest.mark.parametrize("dtype", list(TYPES), ids=lambda t: str(t).split(".")[-1])
def test_every_element_type_reaches_the_run_as_it_is(dtype):
    graph = InferenceGraph(_identities(TYPES[dtype], 4), CPU)
    base = _tensor(dtype, (6, 5))
    fed = [
        base,
        base.t(),  # strided: copied to row-major here
        base[:, 1:3],  # a view at an offset, strided
        base[:0],  # empty
    ]
    feeds = {f"x{i}": t for i, t in enumerate(fed)}
    try:
        outs = graph.run(feeds)
    except Exception as exc:  # a kernel this onnxruntime lacks is not the hand-over's
        if dtype == torch.bfloat16 and "NOT_IMPLEMENTED" in str(exc):
            pytest.skip(f"this onnxruntime has no bfloat16 Identity kernel: {exc}")
        raise
    for got, want in zip(outs, fed):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)


def test_bool_beside_a_dlpack_only_type_reaches_the_run():
    """A bfloat16 tensor sends the whole call over DLPack: a bool beside it
    still goes as uint8 flagged bool (onnxruntime 1.19 refuses DLPack's bool)."""
    graph = helper.make_graph(
        [helper.make_node("Identity", [x], [f"{x}_out"]) for x in ("b", "h")],
        "mixed",
        [helper.make_tensor_value_info("b", TensorProto.BOOL, None),
         helper.make_tensor_value_info("h", TensorProto.BFLOAT16, None)],
        [helper.make_tensor_value_info("b_out", TensorProto.BOOL, None),
         helper.make_tensor_value_info("h_out", TensorProto.BFLOAT16, None)],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    fed = {"b": torch.tensor([True, False, True]), "h": _tensor(torch.bfloat16, (2, 3))}
    try:
        outs = InferenceGraph(model, CPU).run(fed)
    except Exception as exc:
        if "NOT_IMPLEMENTED" in str(exc):
            pytest.skip(f"this onnxruntime has no bfloat16 Identity kernel: {exc}")
        raise
    assert torch.equal(outs[0], fed["b"]) and torch.equal(outs[1], fed["h"])


def test_an_output_that_is_an_input_is_the_fed_tensor_and_outlives_the_call():
    graph = InferenceGraph(_identities(TensorProto.FLOAT, 2, passed=True), CPU)
    x, strided = torch.randn(3, 4), torch.randn(4, 3).t()
    want = [x.clone(), strided.clone()]
    outs = graph.run({"x0": x, "x1": strided})
    # onnxruntime hands a passed-through input back over the memory it was
    # given: the output must be a tensor holding that memory, not a bare pointer.
    assert outs[2].data_ptr() == x.data_ptr() and outs[2] is not x
    del x, strided
    gc.collect()
    torch.randn(64, 64)  # reuse freed memory, if any was freed
    for got, expected in zip(outs[2:], want):
        assert torch.equal(got, expected)
    assert torch.equal(outs[0], want[0]) and torch.equal(outs[1], want[1])


def test_the_values_wrap_the_tensors_memory_without_a_copy():
    x = torch.randn(5, 7)
    vector, held = to_ortvalues([x])
    assert held[0] is x
    assert vector[0].data_ptr() == x.data_ptr()


def test_a_graph_output_that_is_its_input_trains(backend, tmp_path):
    """A layer returning its input beside a product (onnx-ad refused the
    graph, onnxruntime 1.19.2's builder failed or killed the process): it
    builds on every engine, gives the input back, the input's gradient adds
    the pass-through's, and the saved file keeps the output's name."""
    torch.manual_seed(0)
    w = torch.randn(4, 2)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "passed",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 2]),
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4]),
        ],
        [helper.make_tensor("w", TensorProto.FLOAT, [4, 2], w.flatten().tolist())],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    layer = OnnxModule(model, backend=backend)
    assert layer.output_names == ["y", "x"]
    x = torch.randn(3, 4, requires_grad=True)
    y, passed = layer(x)
    torch.testing.assert_close(passed, x.detach(), rtol=0, atol=0)
    (y.sum() + (passed * 3).sum()).backward()
    torch.testing.assert_close(x.grad, w.sum(1).expand(3, 4) + 3)
    torch.testing.assert_close(layer.onnx_weight("w").grad, x.detach().sum(0)[:, None].expand(4, 2))
    with torch.no_grad():
        torch.testing.assert_close(layer.eval()(x)[1], x.detach(), rtol=0, atol=0)
    layer.save(tmp_path / "passed.onnx")
    saved = onnx.load(tmp_path / "passed.onnx")
    assert [o.name for o in saved.graph.output] == ["y", "x"]
