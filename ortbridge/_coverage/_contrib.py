"""onnxruntime's com.microsoft fused nodes as node cases (beside ONNX's own).

One node per case, as onnxruntime's transformer optimizer writes them, its
float inputs the ones differentiated (weights too), its reference outputs
onnxruntime's fused kernel's. The harness checks them as ONNX's node cases
(``tests/test_contrib_coverage.py``; ``benchmarks/op_coverage.py`` adds
their rows to the op-coverage table). The onnxruntime engine writes each
node as the standard ops it fuses
(:mod:`ortbridge._engines.onnxruntime._ad_rewrites_fused`): a wrong
decomposition shows as a ``wrong`` case.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper

from .._runtime import _ort
from ._cases import NodeCase

_MS = "com.microsoft"


def _random(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _case(
    name, op_type, inputs: dict, outputs: list[str], types=(), domain=_MS, constants=(), **attrs
) -> NodeCase:
    """``op_type`` reading ``inputs`` (name -> value; a blank name skips a slot); ``types``:
    the outputs' element types after the first (float); ``constants``: the
    inputs that are initializers (a weight the node does not differentiate)."""
    slots = [k if k.strip() else "" for k in inputs]  # blank names: empty slots
    node = h.make_node(op_type, slots, outputs, name, domain=domain, **attrs)
    given = {k: v for k, v in inputs.items() if k.strip() and k not in constants}
    elem = {np.dtype(np.float32): T.FLOAT, np.dtype(np.int32): T.INT32, np.dtype(np.int64): T.INT64}
    graph = h.make_graph(
        [node], name,
        [h.make_tensor_value_info(k, elem[v.dtype], list(v.shape)) for k, v in given.items()],
        [h.make_tensor_value_info(o, t, None)
         for o, t in zip([o for o in outputs if o], (T.FLOAT, *types))],
        [numpy_helper.from_array(inputs[k], k) for k in constants],
    )  # fmt: skip
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17), h.make_opsetid(_MS, 1)])
    model.ir_version = 9
    import onnxruntime  # the reference: the fused kernel

    reference = onnxruntime.InferenceSession(model.SerializeToString()).run(None, given)
    return NodeCase(name, op_type, domain, False, model, list(given.values()), reference)


def _packed_4bit(n: int, k: int, block: int, seed: int) -> dict:
    """A random 4-bit blockwise weight as MatMulNBits reads it: packed values
    (low nibble first), a scale per block, zero points packed likewise."""
    rng = np.random.default_rng(seed)
    blocks = -(-k // block)
    values = rng.integers(0, 16, (n, blocks, block), dtype=np.uint8)
    zero = rng.integers(0, 16, (n, 2 * (-(-blocks // 2))), dtype=np.uint8)
    return {
        "packed": values[..., 0::2] | (values[..., 1::2] << 4),
        "scales": (rng.random(n * blocks) * 0.1 + 0.02).astype(np.float32),
        "zero_points": (zero[:, 0::2] | (zero[:, 1::2] << 4)).reshape(-1),
    }


def _rotary_caches(positions: int, half: int) -> dict:
    """The cosine and sine caches a RoPE model holds: (positions, half)."""
    angles = np.outer(np.arange(positions), 10000.0 ** (-np.arange(half) / half))
    return {"cos": np.cos(angles).astype(np.float32), "sin": np.sin(angles).astype(np.float32)}


def _lengths(*values):
    return np.array(values, np.int32)


def _gqa_padded(label: str, extra: dict | None = None, **attrs) -> NodeCase:
    """GroupQueryAttention over 4 query heads on 2 key-value heads, the second
    sequence padded after its fourth token, with ``attrs`` and, after the
    rotary caches' slots and position ids, the inputs ``extra``."""
    after = (
        {
            "   ": np.zeros(0, np.float32),
            "    ": np.zeros(0, np.float32),
            "     ": np.zeros(0, np.int64),
            **extra,
        }
        if extra
        else {}
    )
    return _case(
        f"group_query_attention_{label}", "GroupQueryAttention",
        {"q": _random(2, 6, 32, seed=31), "k": _random(2, 6, 16, seed=32),
         "v": _random(2, 6, 16, seed=33), "": np.zeros(0, np.float32),
         " ": np.zeros(0, np.float32), "seqlens_k": _lengths(5, 3),
         "total_sequence_length": np.array(6, np.int32), **after},
        ["y", "present_key", "present_value"], (T.FLOAT, T.FLOAT), num_heads=4, kv_num_heads=2,
        **attrs,
    )  # fmt: skip


CASES = {
    "skip_layer_norm": lambda: _case(
        "skip_layer_norm", "SkipLayerNormalization",
        {"x": _random(2, 3, 8), "skip": _random(2, 3, 8, seed=1), "gamma": _random(8, seed=2),
         "beta": _random(8, seed=3), "bias": _random(8, seed=4)},
        ["y"], epsilon=1e-5,
    ),
    "skip_layer_norm_sum_output": lambda: _case(
        "skip_layer_norm_sum_output", "SkipLayerNormalization",
        {"x": _random(2, 3, 8), "skip": _random(2, 3, 8, seed=1), "gamma": _random(8, seed=2)},
        ["y", "", "", "sum"], (T.FLOAT,), epsilon=1e-5,
    ),
    "simplified_layer_norm": lambda: _case(
        "simplified_layer_norm", "SimplifiedLayerNormalization",
        {"x": _random(2, 3, 8), "gamma": _random(8, seed=2)}, ["y"], domain="", epsilon=1e-5,
        axis=-1,
    ),
    "skip_simplified_layer_norm": lambda: _case(
        "skip_simplified_layer_norm", "SkipSimplifiedLayerNormalization",
        {"x": _random(2, 3, 8), "skip": _random(2, 3, 8, seed=1), "gamma": _random(8, seed=2)},
        ["y"], epsilon=1e-5,
    ),
    "bias_gelu": lambda: _case(
        "bias_gelu", "BiasGelu", {"a": _random(2, 3, 8), "b": _random(8, seed=1)}, ["y"]
    ),
    "fast_gelu": lambda: _case(
        "fast_gelu", "FastGelu", {"x": _random(2, 3, 8), "bias": _random(8, seed=1)}, ["y"]
    ),
    "gelu": lambda: _case("gelu", "Gelu", {"x": _random(2, 3, 8)}, ["y"]),
    "fused_matmul": lambda: _case(
        "fused_matmul", "FusedMatMul", {"a": _random(2, 4, 3), "b": _random(2, 5, 4, seed=1)},
        ["y"], alpha=0.5, transA=1, transB=1,
    ),
    "attention_mask_index": lambda: _case(
        "attention_mask_index", "Attention",
        {"x": _random(2, 5, 8), "w": _random(8, 24, seed=1) * 0.3, "bias": _random(24, seed=2),
         "mask": _lengths(5, 3)},
        ["y"], num_heads=2,
    ),
    "attention_raw_mask": lambda: _case(
        "attention_raw_mask", "Attention",
        {"x": _random(2, 5, 8), "w": _random(8, 24, seed=1) * 0.3, "bias": _random(24, seed=2),
         "mask": np.array([[1, 1, 1, 1, 1], [1, 1, 0, 1, 0]], np.int32)},
        ["y"], num_heads=2,
    ),
    "attention_unidirectional": lambda: _case(
        "attention_unidirectional", "Attention",
        {"x": _random(2, 5, 8), "w": _random(8, 24, seed=1) * 0.3, "bias": _random(24, seed=2)},
        ["y"], num_heads=2, unidirectional=1,
    ),
    "multi_head_attention": lambda: _case(
        "multi_head_attention", "MultiHeadAttention",
        {"q": _random(2, 4, 8), "k": _random(2, 6, 8, seed=1), "v": _random(2, 6, 8, seed=2),
         "bias": _random(24, seed=3) * 0.3,
         "key_padding_mask": np.array([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]], np.int32)},
        ["y"], num_heads=2,
    ),
    "multi_head_attention_bias": lambda: _case(
        "multi_head_attention_bias", "MultiHeadAttention",
        {"q": _random(2, 4, 8), "k": _random(2, 6, 8, seed=1), "v": _random(2, 6, 8, seed=2),
         "": np.zeros(0, np.float32), " ": np.zeros(0, np.int32),
         "attention_bias": _random(1, 2, 4, 6, seed=4)},
        ["y"], num_heads=2,
    ),
    "attention_past_unidirectional": lambda: _case(
        "attention_past_unidirectional", "Attention",
        {"x": _random(2, 3, 16, seed=14), "w": _random(16, 48, seed=15) * 0.3,
         "bias": _random(48, seed=16), "mask": np.array([[1] * 7, [0, 1, 1, 1, 1, 1, 1]], np.int32),
         "past": _random(2, 2, 2, 4, 8, seed=17)},
        ["y", "present"], (T.FLOAT,), num_heads=2, unidirectional=1,
    ),
    "multi_head_attention_past": lambda: _case(
        "multi_head_attention_past", "MultiHeadAttention",
        {"q": _random(2, 3, 16, seed=9), "k": _random(2, 3, 16, seed=10),
         "v": _random(2, 3, 16, seed=11), "": np.zeros(0, np.float32),
         " ": np.zeros(0, np.int32), "  ": np.zeros(0, np.float32),
         "past_key": _random(2, 2, 4, 8, seed=12), "past_value": _random(2, 2, 4, 8, seed=13)},
        ["y", "present_key", "present_value"], (T.FLOAT, T.FLOAT), num_heads=2,
    ),
    "attention_bias": lambda: _case(
        "attention_bias", "Attention",
        {"x": _random(2, 4, 8, seed=18), "w": _random(8, 24, seed=19) * 0.3,
         "bias": _random(24, seed=20), "mask": np.array([[1, 1, 1, 1], [1, 1, 1, 0]], np.int32),
         " ": np.zeros(0, np.float32), "attention_bias": _random(2, 2, 4, 4, seed=21)},
        ["y"], num_heads=2,
    ),
    "multi_head_attention_past_mask": lambda: _case(
        "multi_head_attention_past_mask", "MultiHeadAttention",
        {"q": _random(2, 3, 16, seed=22), "k": _random(2, 3, 16, seed=23),
         "v": _random(2, 3, 16, seed=24), "": np.zeros(0, np.float32),
         "key_padding_mask": np.array([[1] * 7, [0, 1, 1, 1, 1, 1, 0]], np.int32),
         "  ": np.zeros(0, np.float32),
         "past_key": _random(2, 2, 4, 8, seed=25), "past_value": _random(2, 2, 4, 8, seed=26)},
        ["y", "present_key", "present_value"], (T.FLOAT, T.FLOAT), num_heads=2,
    ),
    "embed_layer_norm": lambda: _case(
        "embed_layer_norm", "EmbedLayerNormalization",
        {"ids": np.array([[1, 4, 2, 9, 3], [0, 5, 5, 7, 1]], np.int32),
         "segments": np.array([[0, 0, 1, 1, 1], [0, 1, 1, 1, 1]], np.int32),
         "words": _random(10, 8), "positions": _random(16, 8, seed=1),
         "segment_table": _random(2, 8, seed=2), "gamma": _random(8, seed=3),
         "beta": _random(8, seed=4),
         "mask": np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], np.int32)},
        ["y", "mask_index"], (T.INT32,), epsilon=1e-5,
    ),
    "matmul_nbits": lambda: _case(
        "matmul_nbits", "MatMulNBits",
        {"a": _random(2, 3, 40), **_packed_4bit(24, 40, 16, seed=5), " ": np.zeros(0),
         "bias": _random(24, seed=6)},
        ["y"], constants=("packed", "scales", "zero_points"), K=40, N=24, bits=4,
        block_size=16,
    ),
    "quick_gelu": lambda: _case(
        "quick_gelu", "QuickGelu", {"x": _random(2, 3, 8, seed=44)}, ["y"], alpha=1.5
    ),
    "rotary_embedding": lambda: _case(
        "rotary_embedding", "RotaryEmbedding",
        {"x": _random(2, 3, 8), "positions": np.array([[0, 1, 2], [3, 4, 5]], np.int64),
         **_rotary_caches(8, 2)},
        ["y"], constants=("cos", "sin"), num_heads=2,
    ),
    "rotary_embedding_interleaved_partial": lambda: _case(
        "rotary_embedding_interleaved_partial", "RotaryEmbedding",
        {"x": _random(2, 3, 8, seed=1), "positions": np.array([2], np.int64),
         **_rotary_caches(8, 1)},
        ["y"], constants=("cos", "sin"), num_heads=2, rotary_embedding_dim=2, interleaved=1,
    ),
    "group_query_attention": lambda: _case(
        "group_query_attention", "GroupQueryAttention",
        {"q": _random(2, 5, 32), "k": _random(2, 5, 16, seed=1), "v": _random(2, 5, 16, seed=2),
         "": np.zeros(0, np.float32), " ": np.zeros(0, np.float32),
         "seqlens_k": _lengths(4, 4), "total_sequence_length": np.array(5, np.int32)},
        ["y", "present_key", "present_value"], (T.FLOAT, T.FLOAT), num_heads=4, kv_num_heads=2,
    ),
    "group_query_attention_packed_rotary": lambda: _case(
        "group_query_attention_packed_rotary", "GroupQueryAttention",
        {"qkv": _random(2, 5, 64, seed=3), "": np.zeros(0, np.float32),
         " ": np.zeros(0, np.float32), "  ": np.zeros(0, np.float32),
         "   ": np.zeros(0, np.float32), "seqlens_k": _lengths(4, 4),
         "total_sequence_length": np.array(5, np.int32), **_rotary_caches(16, 8)},
        ["y", "present_key", "present_value"], (T.FLOAT, T.FLOAT), constants=("cos", "sin"),
        num_heads=2, kv_num_heads=1, do_rotary=1,
    ),
    "group_query_attention_past": lambda: _case(
        "group_query_attention_past", "GroupQueryAttention",
        {"q": _random(1, 3, 16, seed=4), "k": _random(1, 3, 8, seed=5),
         "v": _random(1, 3, 8, seed=6), "past_key": _random(1, 1, 2, 8, seed=7),
         "past_value": _random(1, 1, 2, 8, seed=8), "seqlens_k": _lengths(4),
         "total_sequence_length": np.array(5, np.int32)},
        ["y", "present_key", "present_value"], (T.FLOAT, T.FLOAT), num_heads=2, kv_num_heads=1,
    ),
    # Rows of unequal pasts (seqlens_k - S + 1 each), their rotary positions
    # counted on from them; and a past buffer longer than the total (a cache
    # allocated ahead), of which each row reads its own first keys.
    "group_query_attention_past_ragged": lambda: _gqa_decode("past_ragged", 4, (4, 2), 5),
    "group_query_attention_past_buffer": lambda: _gqa_decode("past_buffer", 8, (4, 6), 7),
}  # fmt: skip


def _gqa_decode(label: str, buffer: int, lengths, total: int, positions=None) -> NodeCase:
    """GroupQueryAttention decoding one token a row after a past buffer of
    ``buffer`` keys, with rotary embeddings (and ``positions`` as position ids)."""
    rows = len(lengths)
    ids = {"position_ids": np.array(positions, np.int64)} if positions is not None else {}
    return _case(
        f"group_query_attention_{label}", "GroupQueryAttention",
        {"q": _random(rows, 1, 32, seed=36), "k": _random(rows, 1, 16, seed=37),
         "v": _random(rows, 1, 16, seed=38), "past_key": _random(rows, 1, buffer, 16, seed=39),
         "past_value": _random(rows, 1, buffer, 16, seed=40), "seqlens_k": _lengths(*lengths),
         "total_sequence_length": np.array(total, np.int32), **_rotary_caches(16, 8), **ids},
        ["y", "present_key", "present_value"], (T.FLOAT, T.FLOAT), constants=("cos", "sin"),
        num_heads=2, kv_num_heads=1, do_rotary=1,
    )  # fmt: skip


if _ort.version() >= (1, 31):
    # Position ids: a first prompt reads their first element and counts on
    # from it in every row; later calls read them as they are.
    CASES["group_query_attention_position_ids"] = lambda: _gqa_decode(
        "position_ids", 4, (4, 2), 5, positions=[[6], [1]]
    )
    CASES["group_query_attention_prompt_position_ids"] = lambda: _case(
        "group_query_attention_prompt_position_ids", "GroupQueryAttention",
        {"q": _random(2, 4, 32, seed=41), "k": _random(2, 4, 16, seed=42),
         "v": _random(2, 4, 16, seed=43), "": np.zeros(0, np.float32),
         " ": np.zeros(0, np.float32), "seqlens_k": _lengths(3, 2),
         "total_sequence_length": np.array(4, np.int32), **_rotary_caches(16, 8),
         "position_ids": np.array([[3, 4, 5, 6], [0, 1, 2, 3]], np.int64)},
        ["y", "present_key", "present_value"], (T.FLOAT, T.FLOAT), constants=("cos", "sin"),
        num_heads=2, kv_num_heads=1, do_rotary=1,
    )  # fmt: skip

if _ort.version() >= (1, 20):
    # 1.19's kernel has no softcap, and its windowed output for a padding
    # query differs between sessions of other settings (no reference there).
    CASES["group_query_attention_softcap"] = lambda: _gqa_padded("softcap", softcap=1.5)
    # (1.19's Attention reads a bias broadcast over the batch past its end:
    # its output changes from run to run, refused there.)
    CASES["attention_bias_broadcast"] = lambda: _case(
        "attention_bias_broadcast", "Attention",
        {"x": _random(2, 4, 8, seed=27), "w": _random(8, 24, seed=28) * 0.3,
         "bias": _random(24, seed=29), "": np.zeros(0, np.int32),
         " ": np.zeros(0, np.float32), "attention_bias": _random(1, 2, 4, 4, seed=30)},
        ["y"], num_heads=2, unidirectional=1,
    )  # fmt: skip
    # A shared cache: the past buffer of 6 holds 3 keys, the 2 new ones
    # are written after them in place, the keys after those unread.
    CASES["multi_head_attention_shared_cache"] = lambda: _case(
        "multi_head_attention_shared_cache", "MultiHeadAttention",
        {"q": _random(2, 2, 16, seed=45), "k": _random(2, 2, 16, seed=46),
         "v": _random(2, 2, 16, seed=47), "": np.zeros(0, np.float32),
         " ": np.zeros(0, np.int32), "  ": np.zeros(0, np.float32),
         "past_key": _random(2, 2, 6, 8, seed=48), "past_value": _random(2, 2, 6, 8, seed=49),
         "past_sequence_length": np.array(3, np.int32)},
        ["y", "present_key", "present_value"], (T.FLOAT, T.FLOAT), num_heads=2,
        unidirectional=1,
    )  # fmt: skip
    CASES["group_query_attention_window"] = lambda: _gqa_padded("window", local_window_size=2)
    CASES["group_query_attention_smooth"] = lambda: _gqa_padded("smooth", smooth_softmax=1)
    CASES["group_query_attention_noncausal"] = lambda: _gqa_padded("noncausal", causal=0)
    CASES["group_query_attention_bias_sinks"] = lambda: _gqa_padded(
        "bias_sinks", {"attention_bias": _random(2, 4, 6, 6, seed=34),
                       "head_sink": _random(4, seed=35)}, softcap=2.0,
    )  # fmt: skip


#: Cases onnxruntime before 1.20 runs otherwise (its MultiHeadAttention
#: kernel reads the mask and bias differently, its GroupQueryAttention a past
#: state): the engine refuses them there.
NEWER = frozenset(
    {"multi_head_attention", "multi_head_attention_bias", "group_query_attention_past",
     "group_query_attention_past_ragged", "group_query_attention_past_buffer",
     "multi_head_attention_past_mask"}
)  # fmt: skip


def contrib_cases(op_keys=None) -> list[NodeCase]:
    """The fused-node cases (all, or those of ``op_keys``: ``com.microsoft.Attention``,
    ``SimplifiedLayerNormalization``), references computed now."""
    cases = [build() for build in CASES.values()]
    return [case for case in cases if op_keys is None or case.op_key in op_keys]
