"""transformers' architectures in small configurations, and their exports by both torch exporters.

Random weights (no download), eval mode. :data:`ZOO` maps a name to a factory
returning the transformers model and its inputs; :func:`exported` wraps the
model so that it returns its last hidden state, perturbs its weights (an
exporter merges initializers of equal values into one), sets its BatchNorm
running statistics to those of a batch of 64 random images, as a trained
model's are (at their initial mean 0 and variance 1, each convolution block
of the random MobileViT scales the gradient by about 0.1, and its first
blocks' gradients are denormal numbers of about 1e-40: a check relative to
the largest gradient then passes any value there, and a timing measures the
processor's denormal arithmetic; the model's own two images are too few:
MobileNetV2's last blocks, at 1x1, then divide by the spread of two values,
and float32 drifts from float64 by 3e-3) and exports it:
TorchScript with a dynamic batch and the parameters' names kept, or dynamo
with static shapes and eager attention (torch.export cannot decompose the
SDPA attention of several of them).

Used by ``tests/test_transformers_models.py`` (the architectures no engine
trained before) and ``benchmarks/survey_transformers.py`` (all of them).
"""

from __future__ import annotations

import torch
import transformers as tf
from conftest import export, export_torchscript


class Hidden(torch.nn.Module):
    """The model's last hidden state (or its first output): one tensor out."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x, mask=None):
        out = self.model(x) if mask is None else self.model(input_ids=x, attention_mask=mask)
        return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


def _image(size=32):
    return (torch.randn(2, 3, size, size),)


def _tokens(vocab=50, length=9, masked=True):
    # Not token 0: the padding index, whose embedding row torch never trains.
    ids = torch.randint(1, vocab, (2, length))
    if not masked:
        return (ids,)
    mask = torch.ones(2, length, dtype=torch.long)
    mask[0, -3:] = 0  # the first sequence's last three tokens are padding
    return ids, mask


_TEXT = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32)


def _bert():
    return tf.BertModel(tf.BertConfig(vocab_size=50, **_TEXT)), _tokens()


def _distilbert():
    config = tf.DistilBertConfig(vocab_size=50, dim=16, n_layers=2, n_heads=2, hidden_dim=32)
    return tf.DistilBertModel(config), _tokens()


def _gpt2():
    config = tf.GPT2Config(vocab_size=50, n_embd=16, n_layer=2, n_head=2, n_positions=32)
    return tf.GPT2Model(config), _tokens(masked=False)


def _llama():
    config = tf.LlamaConfig(vocab_size=50, **_TEXT)
    return tf.LlamaModel(config), _tokens(masked=False)


def _phi():
    config = tf.PhiConfig(vocab_size=50, **_TEXT)
    return tf.PhiModel(config), _tokens(masked=False)


def _t5():
    config = tf.T5Config(d_model=16, d_kv=8, num_heads=2, d_ff=32, num_layers=2, vocab_size=50)
    return tf.T5EncoderModel(config), _tokens()


def _whisper():
    config = tf.WhisperConfig(
        num_mel_bins=8,
        d_model=16,
        encoder_layers=2,
        encoder_attention_heads=2,
        encoder_ffn_dim=32,
        max_source_positions=10,
        decoder_layers=1,
        decoder_attention_heads=2,
        decoder_ffn_dim=32,
    )
    return tf.WhisperModel(config).get_encoder(), (torch.randn(2, 8, 20),)


def _wav2vec2():
    config = tf.Wav2Vec2Config(
        conv_dim=(8, 8),
        conv_stride=(5, 2),
        conv_kernel=(10, 3),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2,
        **_TEXT,
    )
    return tf.Wav2Vec2Model(config), (torch.randn(2, 400),)


def _vit():
    config = tf.ViTConfig(image_size=32, patch_size=8, **_TEXT)
    return tf.ViTModel(config, add_pooling_layer=False), _image()


def _clip_vision():
    config = tf.CLIPVisionConfig(image_size=32, patch_size=8, **_TEXT)
    return tf.CLIPVisionModel(config), _image()


def _swin():
    config = tf.SwinConfig(
        image_size=28, patch_size=4, embed_dim=8, depths=[1, 1], num_heads=[1, 2], window_size=3
    )
    return tf.SwinModel(config), _image(28)


def _segformer():
    config = tf.SegformerConfig(
        num_encoder_blocks=2,
        depths=[1, 1],
        sr_ratios=[2, 1],
        hidden_sizes=[8, 16],
        num_attention_heads=[1, 2],
        patch_sizes=[7, 3],
        strides=[4, 2],
        mlp_ratios=[2, 2],
    )
    return tf.SegformerModel(config), _image()


def _convnext():
    config = tf.ConvNextConfig(hidden_sizes=[8, 16], depths=[1, 1], num_stages=2)
    return tf.ConvNextModel(config), _image()


def _resnet():
    config = tf.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1])
    return tf.ResNetModel(config), _image()


def _mobilevit():
    config = tf.MobileViTConfig(
        image_size=32,
        hidden_sizes=[16, 16, 16],
        neck_hidden_sizes=[8, 8, 8, 16, 16, 16, 32],
        num_attention_heads=2,
    )
    return tf.MobileViTModel(config), _image()


def _mobilenet_v2():
    config = tf.MobileNetV2Config(image_size=32, depth_multiplier=0.25)
    return tf.MobileNetV2Model(config), _image()


#: name -> factory of (transformers model, inputs)
ZOO = {
    "bert": _bert,
    "distilbert": _distilbert,
    "gpt2": _gpt2,
    "llama": _llama,
    "phi": _phi,
    "t5-encoder": _t5,
    "whisper-encoder": _whisper,
    "wav2vec2": _wav2vec2,
    "vit": _vit,
    "clip-vision": _clip_vision,
    "swin": _swin,
    "segformer": _segformer,
    "convnext": _convnext,
    "resnet": _resnet,
    "mobilevit": _mobilevit,
    "mobilenet-v2": _mobilenet_v2,
}

EXPORTERS = ("torchscript", "dynamo")


def exported(name: str, exporter: str):
    """(torch model, inputs, ONNX model) of architecture ``name`` by ``exporter``."""
    torch.manual_seed(0)
    inner, inputs = ZOO[name]()
    if exporter == "dynamo":
        inner.config._attn_implementation = "eager"
    model = Hidden(inner).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.rand_like(param) * 0.2 - 0.1)
    rows = torch.Generator().manual_seed(1)
    batch = [
        torch.randn(64, *t.shape[1:], generator=rows) if t.is_floating_point() else t
        for t in inputs
    ]
    _calibrate_batch_norms(model, batch)
    if exporter == "dynamo":
        return model, inputs, export(model, inputs, dynamic_batch=False)
    names = ["x", "mask"][: len(inputs)]
    dynamic = {n: {0: "batch"} for n in names}
    return model, inputs, export_torchscript(model, inputs, input_names=names, dynamic_axes=dynamic)


def _calibrate_batch_norms(model, inputs):
    """Each BatchNorm's running statistics: those of ``inputs`` (one forward
    in training mode, a cumulative average); the model stays in eval mode.
    A model without BatchNorm is left as it is (and never run)."""
    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if not norms:
        return
    momenta = [norm.momentum for norm in norms]
    for norm in norms:
        norm.reset_running_stats()
        norm.momentum = None
        norm.train()
    with torch.no_grad():
        model(*inputs)
    for norm, momentum in zip(norms, momenta):
        norm.momentum = momentum
        norm.eval()


def gradient_errors(model, layer, inputs) -> dict:
    """One backward of ``sum(out**2)`` through both, in the torch model's mode.

    Returns ``output``: the outputs' largest difference; ``errors``: per
    parameter, its gradient's largest difference relative to the largest torch
    gradient of it, or to 1e-4 of the model's largest where that is more
    (float32 sums that cancel: an attention key bias's true gradient is 0,
    torch's is 1e-6 of the model's largest); ``missing``: torch parameters with a
    gradient that are not parameters of ``layer``; ``frozen``: parameters of
    ``layer`` that torch does not train (``requires_grad=False``: Whisper's
    sinusoidal positions; an ONNX file cannot say so). Tied weights are in
    the file once, under one of their names.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    ours = dict(layer.named_onnx_parameters())
    unknown = sorted(set(ours) - set(params))
    if unknown:
        raise AssertionError(f"parameters torch does not have: {unknown}")
    layer.train(model.training)  # eval: BatchNorm on its running statistics
    for net in (model, layer):
        net.zero_grad()
    out, ref = layer(*inputs), model(*inputs)
    (out**2).sum().backward()
    (ref**2).sum().backward()
    errors, frozen = {}, []
    largest = max(float(p.grad.abs().max()) for p in model.parameters() if p.grad is not None)
    for key, param in ours.items():
        expected = params[key].grad
        if not params[key].requires_grad:
            frozen.append(key)
        elif param.grad is None:
            errors[key] = float("inf") if expected is not None and expected.any() else 0.0
        elif expected is None:
            errors[key] = float(param.grad.abs().max()) / (1e-4 * largest)
        else:
            scale = max(float(expected.abs().max()), 1e-4 * largest)
            errors[key] = float((param.grad - expected).abs().max()) / scale
    covered = {id(params[key]) for key in ours}
    missing = [k for k, p in params.items() if p.grad is not None and id(p) not in covered]
    output = float((out - ref).abs().max())
    return {"output": output, "errors": errors, "missing": missing, "frozen": frozen}
