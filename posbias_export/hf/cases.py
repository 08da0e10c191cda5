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


def file_inputs(proto: onnx.ModelProto, ids: np.ndarray, mask: np.ndarray,
                extra: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Feeds for whatever the file asks: input_ids, attention_mask, position_ids (from the
    mask), empty past tensors for a cached decoder (past length 0: a prefill; a merged seq2seq
    decoder's use_cache_branch false), and the named
    `extra` tensors (a T5 decoder's encoder_hidden_states and encoder_attention_mask)."""
    feeds = {}
    batch = ids.shape[0]
    for value in proto.graph.input:
        name = value.name
        if extra and name in extra:
            feeds[name] = extra[name]
        elif name == "input_ids":
            feeds[name] = ids
        elif name == "attention_mask":
            feeds[name] = mask
        elif name == "position_ids":
            feeds[name] = np.clip(mask.cumsum(-1) - 1, 0, None).astype(np.int64)
        elif name == "use_cache_branch":  # a merged seq2seq decoder's prefill: it computes its caches
            feeds[name] = np.array([False])
        elif runtimes_common("cache").is_cache_input(name):
            dims = value.type.tensor_type.shape.dim
            shape = [batch if i == 0 else (d.dim_value if d.HasField("dim_value") else 0) for i, d in enumerate(dims)]
            dtype = onnx.helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type)
            feeds[name] = np.zeros(shape, dtype)
        else:
            raise ParityInputError(f"cannot feed input {name!r}: validate --model knows input_ids, attention_mask, "
                                   "position_ids, use_cache_branch and past key/value tensors")
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
