"""What the judges of an imported model's files (hf/validate.py, hf/validate_seq2seq.py) feed a
file and check first: left-padded batches, the inputs a file asks for, its dtype, whether it
holds the folder's weights, and the text the float model writes itself (the quantized policy's
inputs)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx

from ..nn import AttentionSettings
from ..parity.quantized import sampled_ids_cached
from ..parity.reference import ParityInputError
from ..runners import runtimes_common

TRANSFORMERS_ROW = "transformers"
# blocked: the same math as plain (tested), in memory linear in L, so float64 fits at 16k too
BLOCKED = AttentionSettings(form="blocked")


def declared_inputs(proto: onnx.ModelProto) -> list[tuple]:
    """(name, shape, numpy dtype) of each graph input: a fixed axis as its int, a dynamic one None."""
    out = []
    for value in proto.graph.input:
        t = value.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
        out.append((value.name, shape, onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)))
    return out


def file_inputs(proto: onnx.ModelProto, ids: np.ndarray, mask: np.ndarray,
                extra: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Feeds for whatever the file asks, each made by its name's generator
    (runtimes/common/inputs.py): input_ids, attention_mask, token_type_ids, position_ids (from
    the mask), empty past tensors for a cached decoder (a prefill; a merged seq2seq decoder's
    use_cache_branch false), and the named `extra` tensors (a T5 decoder's
    encoder_hidden_states and encoder_attention_mask)."""
    inputs = runtimes_common("inputs")
    try:
        feeds = inputs.feeds_for(declared_inputs(proto), inputs.Case(ids, mask, dict(extra or {})))
    except inputs.UnknownInput as err:
        raise ParityInputError(f"validate --model: {err}") from None
    if "input_ids" not in feeds:
        raise ParityInputError("the file has no input_ids input")
    return feeds


def check_weights(contract, folder: Path, model_path: Path) -> None:
    """A file we exported names the weights it holds: a folder with other weights is refused
    (judging it against them would report a failure that says nothing about the file)."""
    from ..nn import file_sha256

    recorded = contract.weights_sha256
    if not recorded:
        return
    for entry in recorded.split(","):
        name, _, digest = entry.partition(":")
        if not (folder / name).is_file() or file_sha256(folder / name) != digest:
            raise ParityInputError(f"{model_path} was exported from other weights than {folder / name} "
                                   f"(sha256 recorded {digest[:12]}...); pass --model with the folder it came from")


def left_padded(length: int, batch: int, vocab: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """input_ids, attention_mask [B, L]: row r padded on the left by r * L / (2B) (row 0 none)."""
    gen = np.random.default_rng(seed)
    ids = gen.integers(0, vocab, (batch, length), dtype=np.int64)
    mask = np.ones((batch, length), np.int64)
    for row in range(batch):
        mask[row, : row * length // (2 * batch)] = 0
    return ids, mask


def file_dtype(proto: onnx.ModelProto) -> str:
    """float16 when the file's first output is (our float16 exports, Optimum's --dtype fp16), else float32."""
    elem = proto.graph.output[0].type.tensor_type.elem_type
    return "float16" if elem == onnx.TensorProto.FLOAT16 else "float32"


def self_written(model, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Each row's real tokens (the last mask.sum() positions, left padding kept) replaced by text
    the float model samples itself from the row's first real position, through its cache (one
    token a step: linear in the length)."""
    written = sampled_ids_cached(model.float(), ids.shape[0], ids.shape[1], model.vocab_size, seed=ids.shape[1])
    out = ids.copy()
    for row, real in enumerate(mask.sum(1)):
        if real:
            out[row, -real:] = written[row, :real]
    return out
