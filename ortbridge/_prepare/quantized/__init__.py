"""Quantized files (onnxruntime's quantizer's forms) read as float weights under fake quantization.

In: a model whose weights are integers, in QDQ form (``DequantizeLinear`` of
an int8 initializer), QOperator form (``QLinearConv``, ``QLinearMatMul``,
com.microsoft ``QGemm`` ...), dynamic form (``MatMulInteger``, com.microsoft
``DynamicQuantizeLSTM`` ...) or weight-only. Out: the same model with those weights as float
initializers of the same names, read under ``QuantizeLinear`` /
``DequantizeLinear`` pairs (:func:`lift_quantized_weights`, run by
:func:`.._normalize.normalize`), and the integers trained float weights are
saved as (:func:`requantized`, read by :func:`.._variants.with_weights`), or
the float model without the quantization (:func:`float_model`).
"""

from ._float import float_model
from ._lift import (
    QuantizedWeight,
    lift_quantized_weights,
    quantized_weights,
    recurrent_weights,
    requantized,
    unread_integer_weights,
)

__all__ = [
    "QuantizedWeight",
    "float_model",
    "lift_quantized_weights",
    "quantized_weights",
    "recurrent_weights",
    "requantized",
    "unread_integer_weights",
]
