"""onnxruntime's failures in plain words (``ortbridge._runtime._errors``)."""

from __future__ import annotations

from onnx import helper

from ortbridge._runtime._errors import culprit, plain, translate
from ortbridge.exceptions import NotDifferentiableError, OrtBridgeError

# Messages as onnxruntime 1.19.2 writes them (shortened where long).
_BUILDER = (
    "/onnxruntime_src/orttraining/orttraining/python/orttraining_pybind_state.cc:548 "
    "onnxruntime::python::addObjectMethodsForTraining(pybind11::module&)::<lambda("
    "onnxruntime::training::OrtModuleGraphBuilder*, const onnxruntime::training::"
    "TrainingGraphTransformerConfiguration&)> [ONNXRuntimeError] : 10 : INVALID_GRAPH : This "
    "is an invalid model. Type Error: Type 'tensor(double)' of input parameter (zrh) of "
    "operator (GRUGrad) in node (GRU__training_Grad/GRUGrad_0) is invalid."
)
_RUN = (
    "Error in backward pass execution: Non-zero status code returned while running "
    "SplitTraining node. Name:'Concat_output/ConcatReplacement/_Grad/SplitTraining_0' Status "
    "Message: /onnxruntime_src/orttraining/orttraining/training_ops/cpu/tensor/split.cc:81 "
    "virtual onnxruntime::common::Status onnxruntime::contrib::SplitTraining::Compute("
    "onnxruntime::OpKernelContext*) const Split operator does not support "
    "N11onnxruntime17PrimitiveDataTypeIdEE yet"
)
_ASSERT = (
    "/onnxruntime_src/orttraining/orttraining/core/graph/gradient_builder.cc:1253 virtual "
    "std::vector<onnxruntime::training::NodeDef> onnxruntime::training::GetPowGradient::"
    "GetGradientDefsImpl() const GradientBuilder is not implemented for CUDA Pow's input "
    "exponent."
)
_LOAD = (
    "[ONNXRuntimeError] : 9 : NOT_IMPLEMENTED : Could not find an implementation for "
    "ResizeGrad(1) node with name 'Resize_Y_Grad/ResizeGrad_0'"
)


def _model():
    nodes = [
        helper.make_node("GRU", ["x", "w", "r"], ["y"], name="GRU_"),
        helper.make_node("Concat", ["y", "y"], ["c"], name="Concat_output", axis=0),
        helper.make_node("Resize", ["c"], ["Y"], name="Resize_Y"),
    ]
    graph = helper.make_graph(nodes, "g", [], [])
    return helper.make_model(graph)


def test_plain_drops_sources_signatures_and_mangled_types():
    for text in (_BUILDER, _RUN, _ASSERT, _LOAD):
        words = plain(text)
        assert ".cc:" not in words and "lambda" not in words and "::" not in words, words
    assert plain(_RUN).startswith("Split operator does not support float64 yet")
    assert plain(_ASSERT) == "GradientBuilder is not implemented for CUDA Pow's input exponent."
    assert plain(_BUILDER).startswith("This is an invalid model. Type Error")


def test_culprit_traces_a_gradient_node_back_to_the_users_node():
    model = _model()
    assert culprit(_BUILDER, model) == ("GRU_", "GRU", "GRUGrad")
    assert culprit(_RUN, model) == ("Concat_output", "Concat", "SplitTraining")
    assert culprit(_LOAD, model) == ("Resize_Y", "Resize", "ResizeGrad")
    assert culprit(_ASSERT, model) is None


def test_translate_names_node_op_type_and_the_other_engine():
    error = translate(
        RuntimeError(_LOAD), "load the gradient graph", _model(), refuse="training-agent"
    )
    assert isinstance(error, NotDifferentiableError)
    assert (error.node, error.op_type) == ("Resize_Y", "Resize")
    text = str(error)
    assert "at node 'Resize_Y' (op type Resize), in its gradient kernel ResizeGrad" in text
    assert "no kernel" in text and 'backend="onnxruntime"' in text
    error = translate(RuntimeError(_RUN), "run the backward pass", _model())
    assert type(error) is OrtBridgeError
    assert str(error).startswith(
        "onnxruntime could not run the backward pass at node 'Concat_output' (op type Concat)"
    )
