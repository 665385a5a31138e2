"""onnxruntime's com.microsoft fused nodes, each checked as ONNX's node cases are.

The cases (:mod:`ortbridge._coverage._contrib`) go through
:func:`ortbridge._coverage.run_case`: outputs against onnxruntime's fused
kernel, gradients against central finite differences of it.
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper

from ortbridge import OnnxModule, _coverage
from ortbridge._coverage._contrib import CASES, NEWER
from ortbridge._runtime import _ort


@pytest.mark.parametrize("name", list(CASES))
def test_each_fused_node_is_differentiated_correctly(name):
    result = _coverage.run_case(CASES[name](), backend="onnxruntime")
    if name in NEWER and _ort.version() < (1, 20):
        assert result.status == _coverage.REFUSED, (result.status, result.detail)
        assert CASES[name]().op_key.split(".")[-1] in result.detail
        return
    assert result.status == _coverage.CORRECT, (result.status, result.detail)
    assert result.checked > 0


def _module_of(graph):
    """The model of ``graph`` (com.microsoft nodes) and its OnnxModule, built
    with no warning (nothing frozen behind a node)."""
    ms = "com.microsoft"
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17), h.make_opsetid(ms, 1)])
    model.ir_version = 9
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return model, OnnxModule(model)


def test_weights_before_a_rotary_embedding_train_as_torch():
    """A query projection, onnxruntime's RotaryEmbedding and an output
    projection (the caches initializers, as decoders hold them): both
    projections train (the first stayed frozen behind the node before), the
    caches stay frozen, and the gradients equal torch's rotary embedding's."""
    rng = np.random.default_rng(0)
    wq = rng.standard_normal((8, 8)).astype(np.float32) * 0.3
    wo = rng.standard_normal((8, 4)).astype(np.float32) * 0.3
    caches = {"cos": np.cos(np.outer(np.arange(6), [1.0, 0.1])).astype(np.float32),
              "sin": np.sin(np.outer(np.arange(6), [1.0, 0.1])).astype(np.float32)}  # fmt: skip
    graph = h.make_graph(
        [
            h.make_node("MatMul", ["x", "wq"], ["q"]),
            h.make_node(
                "RotaryEmbedding",
                ["q", "pos", "cos", "sin"],
                ["r"],
                domain="com.microsoft",
                num_heads=2,
            ),  # fmt: skip
            h.make_node("MatMul", ["r", "wo"], ["y"]),
        ],
        "rope",
        [
            h.make_tensor_value_info("x", T.FLOAT, [2, 3, 8]),
            h.make_tensor_value_info("pos", T.INT64, [2, 3]),
        ],  # fmt: skip
        [h.make_tensor_value_info("y", T.FLOAT, [2, 3, 4])],
        [numpy_helper.from_array(v, k) for k, v in {"wq": wq, "wo": wo, **caches}.items()],
    )
    model, layer = _module_of(graph)
    assert sorted(n for n, _ in layer.named_onnx_parameters()) == ["wo", "wq"]
    x = torch.from_numpy(rng.standard_normal((2, 3, 8)).astype(np.float32))
    pos = torch.tensor([[0, 1, 2], [2, 3, 4]])
    out = layer(x, pos)

    q_w, o_w = torch.tensor(wq, requires_grad=True), torch.tensor(wo, requires_grad=True)
    q = (x @ q_w).reshape(2, 3, 2, 4)  # two heads of four, rotated in halves
    c, s = (torch.from_numpy(caches[k])[pos].unsqueeze(2) for k in ("cos", "sin"))
    first, second = q[..., :2], q[..., 2:]
    turned = torch.cat([first * c - second * s, second * c + first * s], -1)
    ref = turned.reshape(2, 3, 8) @ o_w
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    cotangent = torch.linspace(-1, 1, out.numel()).reshape(out.shape)
    (out * cotangent).sum().backward()
    (ref * cotangent).sum().backward()
    for name, want in (("wq", q_w.grad), ("wo", o_w.grad)):
        torch.testing.assert_close(layer.onnx_weight(name).grad, want, rtol=1e-4, atol=1e-5)


def test_a_grouped_query_attention_block_trains_as_torch():
    """Query, key and value projections, onnxruntime's GroupQueryAttention (four
    query heads sharing two key-value heads, rotary embeddings from its caches,
    causal) and an output projection: every projection trains, outputs equal
    the kernel's, gradients equal torch's (``repeat_interleave`` of the key
    and value heads, ``scaled_dot_product_attention(is_causal=True)``)."""
    rng = np.random.default_rng(0)
    weights = {
        name: (rng.standard_normal(shape) * 0.3).astype(np.float32)
        for name, shape in (("wq", (16, 64)), ("wk", (16, 32)), ("wv", (16, 32)), ("wo", (64, 8)))
    }
    angles = np.outer(np.arange(8), 10000.0 ** (-np.arange(8) / 8))
    caches = {"cos": np.cos(angles).astype(np.float32), "sin": np.sin(angles).astype(np.float32)}
    nodes = [h.make_node("MatMul", ["x", f"w{p}"], [p]) for p in "qkv"]
    nodes += [
        h.make_node(
            "GroupQueryAttention",
            ["q", "k", "v", "", "", "seqlens_k", "total", "cos", "sin"],
            ["a", "present_k", "present_v"],
            domain="com.microsoft",
            num_heads=4,
            kv_num_heads=2,
            do_rotary=1,
        ),  # fmt: skip
        h.make_node("MatMul", ["a", "wo"], ["y"]),
    ]
    graph = h.make_graph(
        nodes, "gqa",
        [h.make_tensor_value_info("x", T.FLOAT, [2, 5, 16]),
         h.make_tensor_value_info("seqlens_k", T.INT32, [2]),
         h.make_tensor_value_info("total", T.INT32, [])],
        [h.make_tensor_value_info("y", T.FLOAT, [2, 5, 8])],
        [numpy_helper.from_array(v, k) for k, v in {**weights, **caches}.items()],
    )  # fmt: skip
    model, layer = _module_of(graph)
    assert sorted(n for n, _ in layer.named_onnx_parameters()) == ["wk", "wo", "wq", "wv"]
    x = torch.from_numpy(rng.standard_normal((2, 5, 16)).astype(np.float32))
    lengths, total = torch.tensor([4, 4], dtype=torch.int32), torch.tensor(5, dtype=torch.int32)
    layer.eval()
    with torch.no_grad():
        start = layer(x, lengths, total)
    import onnxruntime

    feeds = {"x": x.numpy(), "seqlens_k": lengths.numpy(), "total": total.numpy()}
    kernel = onnxruntime.InferenceSession(model.SerializeToString()).run(None, feeds)[0]
    np.testing.assert_allclose(start.numpy(), kernel, rtol=1e-5, atol=1e-5)
    layer.train()
    out = layer(x, lengths, total)

    w = {k: torch.tensor(v, requires_grad=True) for k, v in weights.items()}
    c, s = (torch.from_numpy(caches[k][:5]).unsqueeze(1) for k in ("cos", "sin"))  # (S, 1, 8)

    def heads(t, n):
        t = t.reshape(2, 5, n, 16)
        t = torch.cat([t[..., :8] * c - t[..., 8:] * s, t[..., 8:] * c + t[..., :8] * s], -1)
        return t

    q, k = heads(x @ w["wq"], 4), heads(x @ w["wk"], 2)
    v = (x @ w["wv"]).reshape(2, 5, 2, 16)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    k, v = (t.repeat_interleave(2, dim=1) for t in (k, v))
    attended = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    ref = attended.transpose(1, 2).reshape(2, 5, 64) @ w["wo"]
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    cotangent = torch.linspace(-1, 1, out.numel()).reshape(out.shape)
    (out * cotangent).sum().backward()
    (ref * cotangent).sum().backward()
    for name, want in w.items():
        torch.testing.assert_close(layer.onnx_weight(name).grad, want.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "attrs, extra",
    [({"k_quant_type": "PER_TENSOR"}, 0), ({"kv_cache_bit_width": 8}, 0),
     ({"sliding_window_cache": 1}, 0), ({"qk_output": 1}, 0), ({}, 14), ({}, 12)],
    ids=["quantized-keys", "cache-bits", "window-cache", "scores-out", "q-norm", "k-scale"],
)  # fmt: skip
def test_group_query_attention_forms_without_a_decomposition_stay_fused(attrs, extra):
    """A GroupQueryAttention whose cache is quantized or shared with a window,
    that outputs its scores, or that reads key or value scales or query and
    key norms is not decomposed: it
    stays itself, which the engine then refuses by name, instead of being
    read as plain causal attention."""
    from ortbridge._engines.onnxruntime._ad_rewrites_fused import fused_as_standard

    inputs = (
        ["q", "k", "v", "", "", "seqlens_k", "total"] + [""] * (extra - 7) + ["w"] * bool(extra)
    )
    node = h.make_node(
        "GroupQueryAttention", inputs, ["y", "pk", "pv"], domain="com.microsoft",
        num_heads=2, kv_num_heads=1, **attrs,
    )  # fmt: skip
    values = [h.make_tensor_value_info(n, T.FLOAT, s) for n, s in
              (("q", [1, 3, 16]), ("k", [1, 3, 8]), ("v", [1, 3, 8]), ("w", [8]))]  # fmt: skip
    values += [h.make_tensor_value_info("seqlens_k", T.INT32, [1])]
    values += [h.make_tensor_value_info("total", T.INT32, [])]
    graph = h.make_graph([node], "g", values, [h.make_tensor_value_info("y", T.FLOAT, None)])
    ms = "com.microsoft"
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17), h.make_opsetid(ms, 1)])
    assert [n.op_type for n in fused_as_standard(model).graph.node] == ["GroupQueryAttention"]
    plain = h.make_node(
        "GroupQueryAttention", inputs[:7], ["y", "pk", "pv"], domain=ms,
        num_heads=2, kv_num_heads=1,
    )  # fmt: skip
    del model.graph.node[:]
    model.graph.node.append(plain)
    assert "GroupQueryAttention" not in [n.op_type for n in fused_as_standard(model).graph.node]


def test_group_query_attention_position_ids_decompose_where_their_reading_is_measured(
    monkeypatch,
):
    """Position ids move the rotary embedding only: without one they are not
    read, and the node is decomposed; with one, the kernel's reading (a first
    prompt counts on from their first element) is measured on onnxruntime
    1.31 (the node cases check it there): on an earlier one the node stays
    fused, refused by name."""
    from ortbridge._engines.onnxruntime import _ad_rewrites_fused
    from ortbridge._engines.onnxruntime._ad_rewrites_fused import fused_as_standard

    ms = "com.microsoft"

    def model(rotary: int) -> onnx.ModelProto:
        inputs = ["q", "k", "v", "", "", "seqlens_k", "total", "cos", "sin", "ids"]
        node = h.make_node(
            "GroupQueryAttention", inputs, ["y", "pk", "pv"], domain=ms,
            num_heads=2, kv_num_heads=1, do_rotary=rotary,
        )  # fmt: skip
        values = [h.make_tensor_value_info(n, T.FLOAT, s) for n, s in
                  (("q", [1, 3, 32]), ("k", [1, 3, 16]), ("v", [1, 3, 16]))]  # fmt: skip
        values += [h.make_tensor_value_info("seqlens_k", T.INT32, [1])]
        values += [h.make_tensor_value_info("total", T.INT32, [])]
        values += [h.make_tensor_value_info("ids", T.INT64, [1, 3])]
        caches = [
            onnx.numpy_helper.from_array(np.ones((8, 8), np.float32), name)
            for name in ("cos", "sin")
        ]
        graph = h.make_graph(
            [node], "g", values, [h.make_tensor_value_info("y", T.FLOAT, None)], caches
        )
        return h.make_model(graph, opset_imports=[h.make_opsetid("", 17), h.make_opsetid(ms, 1)])

    def fused(m):
        return "GroupQueryAttention" in [n.op_type for n in fused_as_standard(m).graph.node]

    monkeypatch.setattr(_ad_rewrites_fused._ort, "version", lambda: (1, 30))
    assert not fused(model(0))
    assert fused(model(1))
    monkeypatch.setattr(_ad_rewrites_fused._ort, "version", lambda: (1, 31))
    assert not fused(model(1))


def test_attention_with_a_bias_broadcast_over_the_batch_stays_fused_on_1_19():
    """onnxruntime 1.19's Attention reads a bias of batch 1 past its end (its
    output changes from run to run): there the node stays fused, refused by
    name; from 1.20 it is decomposed (the node case checks it)."""
    from ortbridge._engines.onnxruntime._ad_rewrites_fused import fused_as_standard

    ms = "com.microsoft"
    node = h.make_node("Attention", ["x", "w", "b", "", "", "bias"], ["y"], domain=ms, num_heads=2)
    values = [h.make_tensor_value_info(n, T.FLOAT, s) for n, s in
              (("x", [2, 4, 8]), ("w", [8, 24]), ("b", [24]), ("bias", [1, 2, 4, 4]))]  # fmt: skip
    graph = h.make_graph([node], "g", values, [h.make_tensor_value_info("y", T.FLOAT, None)])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17), h.make_opsetid(ms, 1)])
    ops = [n.op_type for n in fused_as_standard(model).graph.node]
    assert (ops == ["Attention"]) == (_ort.version() < (1, 20)), ops


def test_weights_after_a_fused_node_left_as_it_is_train_and_those_before_are_named():
    """A fused node with no decomposition (a GroupQueryAttention windowing
    capped scores; on onnxruntime 1.19 any window) is not differentiated, yet
    the file wraps: the weights after it train (onnx-ad is told its output's
    rank), those before it are frozen and named, asking for one is refused."""
    from ortbridge.exceptions import NotDifferentiableError

    rng = np.random.default_rng(0)
    shapes = {"wq": (16, 64), "wk": (16, 32), "wv": (16, 32), "wo": (64, 8)}
    weights = {n: (rng.standard_normal(s) * 0.3).astype(np.float32) for n, s in shapes.items()}
    nodes = [h.make_node("MatMul", ["x", f"w{p}"], [p]) for p in "qkv"]
    capped = {"softcap": 1.5} if _ort.version() >= (1, 20) else {}
    nodes += [
        h.make_node(
            "GroupQueryAttention", ["q", "k", "v", "", "", "seqlens_k", "total"],
            ["a", "pk", "pv"], name="gqa", domain="com.microsoft", num_heads=4,
            kv_num_heads=2, local_window_size=2, **capped,
        ),
        h.make_node("MatMul", ["a", "wo"], ["y"]),
    ]  # fmt: skip
    inputs = [h.make_tensor_value_info("x", T.FLOAT, [2, 5, 16])]
    inputs += [h.make_tensor_value_info("seqlens_k", T.INT32, [2])]
    inputs += [h.make_tensor_value_info("total", T.INT32, [])]
    inits = [numpy_helper.from_array(v, k) for k, v in weights.items()]
    graph = h.make_graph(nodes, "g", inputs, [h.make_tensor_value_info("y", T.FLOAT, None)], inits)
    ms = "com.microsoft"
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17), h.make_opsetid(ms, 1)])
    model.ir_version = 9
    feeds = {
        "x": rng.standard_normal((2, 5, 16)).astype(np.float32),
        "seqlens_k": np.array([4, 4], np.int32),
        "total": np.array(5, np.int32),
    }
    with pytest.warns(UserWarning, match=r"'gqa' \(op type GroupQueryAttention\) has no gradient"):
        layer = OnnxModule(model)
    assert sorted(n for n, _ in layer.named_onnx_parameters()) == ["wo"]
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.append(h.make_tensor_value_info("a", T.FLOAT, None))
    import onnxruntime

    y, a = onnxruntime.InferenceSession(probe.SerializeToString()).run(None, feeds)
    out = layer(*(torch.from_numpy(feeds[n]) for n in layer.input_names))
    torch.testing.assert_close(out, torch.from_numpy(y), rtol=1e-5, atol=1e-5)
    cotangent = torch.linspace(-1, 1, out.numel()).reshape(out.shape)
    (out * cotangent).sum().backward()
    want = np.einsum("bsi,bso->io", a, cotangent.numpy())
    np.testing.assert_allclose(layer.onnx_weight("wo").grad.numpy(), want, rtol=1e-4, atol=1e-5)
    # The refusal names the node and the form it has.
    form = r"'gqa' \(op type GroupQueryAttention\) \(not decomposed: a (local window|past, window)"
    with pytest.raises(NotDifferentiableError, match=form):
        OnnxModule(model, trainable=["wq"], backend="onnxruntime")


def test_a_contrib_op_with_no_decomposition_wraps_and_the_weights_after_it_train():
    """com.microsoft ``Inverse`` has no decomposition and onnx knows no
    contrib op's shapes: onnxruntime's own shape inference gives its
    output's rank, so the file wraps, the weight after it trains (its
    gradient from onnxruntime's own intermediate) and the one before it is
    frozen and named."""
    import onnxruntime

    rng = np.random.default_rng(0)
    w, wo = (rng.standard_normal((3, 3)).astype(np.float32) + 3 * np.eye(3, dtype=np.float32),
             rng.standard_normal((3, 2)).astype(np.float32))  # fmt: skip
    nodes = [
        h.make_node("MatMul", ["x", "w"], ["a"]),
        h.make_node("Inverse", ["a"], ["inv"], name="inverse", domain="com.microsoft"),
        h.make_node("MatMul", ["inv", "wo"], ["y"]),
    ]
    graph = h.make_graph(
        nodes, "g", [h.make_tensor_value_info("x", T.FLOAT, [2, 3, 3])],
        [h.make_tensor_value_info("y", T.FLOAT, None)],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(wo, "wo")],
    )  # fmt: skip
    ms = "com.microsoft"
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17), h.make_opsetid(ms, 1)])
    model.ir_version = 8
    with pytest.warns(UserWarning, match=r"'inverse' \(op type Inverse\) has no gradient here"):
        layer = OnnxModule(model)
    assert [n for n, _ in layer.named_onnx_parameters()] == ["wo"]
    x = (np.eye(3, dtype=np.float32) + 0.1 * rng.standard_normal((2, 3, 3))).astype(np.float32)
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.append(h.make_tensor_value_info("inv", T.FLOAT, None))
    y, inv = onnxruntime.InferenceSession(probe.SerializeToString()).run(None, {"x": x})
    out = layer(torch.from_numpy(x))
    torch.testing.assert_close(out, torch.from_numpy(y), rtol=1e-5, atol=1e-5)
    cotangent = torch.linspace(-1, 1, out.numel()).reshape(out.shape)
    (out * cotangent).sum().backward()
    want = np.einsum("bij,bik->jk", inv, cotangent.numpy())
    np.testing.assert_allclose(layer.onnx_weight("wo").grad.numpy(), want, rtol=1e-4, atol=1e-5)
