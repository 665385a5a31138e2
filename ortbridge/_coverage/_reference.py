"""onnxruntime inference of a case's graph: the reference the engine is checked against."""

from __future__ import annotations

import re

import onnx

from ._cases import CaseResult, _add_note, _first_line, _Skip


def _reference_session(model: onnx.ModelProto):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    return ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )


def _load(model: onnx.ModelProto, result: CaseResult):
    """The reference session; ``model`` is adapted in place to what onnxruntime reads.

    onnx stamps its newest cases with an IR version and an opset onnxruntime
    may not read yet: the IR version (the file format) is lowered, and the
    model converted to onnxruntime's newest opset by onnx's version converter
    where it can (it refuses where the semantics differ). Both are noted.
    """
    notes = []
    for _ in range(3):
        try:
            session = _reference_session(model)
        except Exception as exc:
            text = str(exc)
            ir = re.search(r"max supported IR version: (\d+)", text)
            opset = re.search(r"support for domain ai\.onnx is till opset (\d+)", text)
            if ir and int(ir.group(1)) < model.ir_version:
                model.ir_version = int(ir.group(1))
                notes.append(f"IR version lowered to {model.ir_version}")
                continue
            if opset:
                target, current = int(opset.group(1)), _opset(model)
                try:
                    converted = onnx.version_converter.convert_version(model, target)
                except Exception as err:
                    raise _Skip(
                        f"onnxruntime reads ai.onnx opsets up to {target}, the case is opset "
                        f"{current} and onnx cannot convert it: {_first_line(err)}"
                    ) from None
                converted.ir_version = min(converted.ir_version, model.ir_version)
                model.CopyFrom(converted)
                notes.append(f"converted from opset {current} to {target}")
                continue
            raise _Skip(f"onnxruntime does not load the case: {_first_line(exc)}") from None
        for note in notes:
            _add_note(result, note)
        return session
    raise _Skip(f"onnxruntime does not load the case ({'; '.join(notes)})")


def _opset(model: onnx.ModelProto) -> int:
    return max([o.version for o in model.opset_import if o.domain in ("", "ai.onnx")] or [0])
