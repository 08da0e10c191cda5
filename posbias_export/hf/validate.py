"""Judge ANY ONNX file of a BLOOM / MPT / Falcon / T5-encoder model (ours, Optimum's, a plain
dynamo export) against the model in its Hugging Face folder, on every runtime and length, with
the policy of parity/tolerance.py.

The float64 reference is our implementation of the folder's model (hf/), not transformers in
float64: transformers' BLOOM and MPT turn NaN in float64 with left padding (a fully masked
padding row meets finfo(float64).min plus the bias, giving -inf - -inf), and MPT computes its
softmax in float32 whatever the dtype. transformers itself is judged as one more row of the
matrix, float32 against the same reference, so a disagreement between it and our
implementation fails the matrix too. Only real tokens are compared (padding rows are arbitrary
in every implementation)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import onnx
import torch

from ..export.metadata import read_metadata
from ..limits import attention_bytes, check_fits
from ..nn import AttentionSettings
from ..parity.matrix import NOT_RUN, Cell, Matrix, runtime_outputs
from ..parity.reference import ParityInputError, read_onnx, torch_outputs
from ..parity.runtimes import DEFAULT_RUNTIMES, RUNTIMES
from ..parity.quantized import judge as judge_quantized
from ..parity.tolerance import FLOAT16, FLOAT32, Tolerance, compare
from .folder import transformers_module
from .models import architecture, load_model

TRANSFORMERS_ROW = "transformers"
BLOCKED = AttentionSettings(form="blocked")


def file_inputs(proto: onnx.ModelProto, ids: np.ndarray, mask: np.ndarray,
                extra: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Feeds for whatever the file asks: input_ids, attention_mask, position_ids (from the
    mask), empty past tensors for a cached decoder (past length 0: a prefill), and the named
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
        elif "past" in name:
            dims = value.type.tensor_type.shape.dim
            shape = [batch if i == 0 else (d.dim_value if d.HasField("dim_value") else 0) for i, d in enumerate(dims)]
            dtype = onnx.helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type)
            feeds[name] = np.zeros(shape, dtype)
        else:
            raise ParityInputError(f"cannot feed input {name!r}: validate --model knows input_ids, attention_mask, "
                                   "position_ids and past key/value tensors")
    if "input_ids" not in feeds:
        raise ParityInputError("the file has no input_ids input")
    return feeds


def transformers_tolerance(model, length: int) -> Tolerance:
    """The policy for transformers' own float32 row. BLOOM and MPT add ALiBi as slope * absolute
    key position (softmax-equivalent to our -slope * |i - j|): in float32 each of those values
    carries up to half an ulp of its magnitude, which softmax does not cancel. At 4096 tokens
    that is ulp(2048) / 2 = 1.2e-4 per score, far above float32 arithmetic's own error (~2e-6
    here), so the floor grows by one ulp of the largest bias. Measured on the tiny BLOOM:
    2.9e-5 at 4096, 5.6e-6 at 1024."""
    magnitude = model.transformers_bias_magnitude(length)
    if magnitude == 0.0:
        return FLOAT32
    ulp = float(np.spacing(np.float32(magnitude)))
    return dataclasses.replace(FLOAT32, atol=FLOAT32.atol + ulp,
                               why=f"{FLOAT32.why}; + ulp({magnitude:.0f}) for its absolute-position ALiBi")


def check_weights(meta: dict, folder: Path, model_path: Path) -> None:
    """A file we exported names the weights it holds: a folder with other weights is refused
    (judging it against them would report a failure that says nothing about the file)."""
    from ..nn import file_sha256

    recorded = meta.get("weights_sha256")
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


def _self_written(model, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Each row's real tokens (the last mask.sum() positions, left padding kept) replaced by text
    the float model samples itself from the row's first real position."""
    from ..parity.quantized import sampled_ids

    float_model = model.float()
    written = sampled_ids(lambda x: float_model(x, torch.ones_like(x)), ids.shape[0], ids.shape[1],
                          model.vocab_size, seed=ids.shape[1])
    out = ids.copy()
    for row, real in enumerate(mask.sum(1)):
        if real:
            out[row, -real:] = written[row, :real]
    return out


def transformers_model(model_dir: Path, model_type: str):
    """transformers' own implementation of the folder's model (the class the architecture names)."""
    from .models import load_model

    cls = getattr(transformers_module(), architecture(model_type).transformers_class)
    reference = cls.from_pretrained(str(model_dir)).float().eval()
    return load_model(model_dir, lazy=True).as_trained(reference)


@torch.no_grad()
def run_hf_matrix(model_path: str | Path, model_dir: str | Path | None = None,
                  runtimes: tuple[str, ...] = DEFAULT_RUNTIMES, lengths: tuple[int, ...] = (1, 17, 1024),
                  batch: int = 3, timeout: float = 1800.0, progress=None, ignore_size_limits: bool = False,
                  order: bool = True) -> Matrix:
    unknown = [r for r in runtimes if r not in RUNTIMES]
    if unknown:
        raise ParityInputError(f"unknown runtime(s) {unknown}; choose from {', '.join(RUNTIMES)}")
    model_path = Path(model_path)
    proto = read_onnx(model_path)
    meta = read_metadata(proto)
    model_dir = model_dir or meta.get("model_dir")
    if not model_dir:
        raise ParityInputError(f"{model_path} does not say which model it holds: pass --model DIR")
    from .validate_seq2seq import run_seq2seq_matrix, seq2seq_role

    role = seq2seq_role(proto)
    if role == "decoder" or (role == "encoder" and meta.get("quantized")):  # judged by the logits they lead to
        return run_seq2seq_matrix(model_path if role == "encoder" else None, model_path if role == "decoder" else None,
                                  model_dir, runtimes, lengths, batch, timeout, progress, ignore_size_limits, order)
    ours = load_model(model_dir)
    check_weights(meta, ours.source_dir, model_path)
    for n in lengths:  # transformers' eager attention holds [B, H, L, L] scores; our float64 run blocks of them
        need = attention_bytes(batch, ours.num_heads, n, n, 4, 3) + 3.0 * batch * n * ours.vocab_size * 8
        check_fits(need, f"validating {model_path} at length {n}, batch {batch}", ignore_size_limits)
    theirs = transformers_model(Path(model_dir), ours.model_type)
    output = proto.graph.output[0].name
    # a float16 file is judged against PyTorch float16's own error (parity/tolerance.py), as ours are
    dtype = file_dtype(proto)
    scheme = meta.get("quantized")  # weights quantized: judged by parity/quantized.py's policy
    last = meta.get("logits") == "last"  # a generation file: the last position's logits only
    tol, torch_dtype = (FLOAT16, torch.float16) if dtype == "float16" else (FLOAT32, torch.float32)
    matrix = Matrix(str(model_path), ours.bias_name, f"{ours.model_type} {ours.arch} ({output})")
    cases, refs = [], []
    limit = ours.max_length()
    for n in lengths:
        ids, mask = left_padded(n, batch, ours.vocab_size, seed=n)
        if scheme:  # the quantized policy judges text the float model writes (parity/quantized.py)
            ids = _self_written(ours, ids, mask)
        keep = mask.astype(bool)
        args = torch.from_numpy(ids), torch.from_numpy(mask)
        if last:  # left-padded rows: the last position is a real token in every row
            keep = np.zeros_like(keep)
            keep[:, -1] = True
        # blocked: the same math as plain (tested), in memory linear in L, so float64 fits at 16k too
        ref64 = ours.double()(*args, settings=BLOCKED).numpy()[keep]
        same = ours.float()(*args, settings=BLOCKED).numpy()[keep]  # transformers' row: float32
        same_file = same if dtype == "float32" else torch_outputs(ours, args, torch_dtype, BLOCKED)[keep]
        if limit is not None and n > limit:
            hf = f"{NOT_RUN}transformers' {ours.model_type} stops at {limit} tokens"
        else:
            out = theirs(input_ids=args[0], attention_mask=args[1])
            hf = (out.last_hidden_state if ours.arch == "encoder" else out.logits).numpy()[keep]
        cases.append((f"L={n} B={batch}", file_inputs(proto, ids, mask)))
        refs.append((ref64, same, keep, hf, same_file))
    for index, (case, _) in enumerate(cases):
        ref64, same, _, hf, _ = refs[index]
        if isinstance(hf, str):
            matrix.cells.append(Cell(TRANSFORMERS_ROW, case, "float32", hf))
        else:
            parity = compare(hf, ref64, same, transformers_tolerance(ours, lengths[index]))
            matrix.cells.append(Cell(TRANSFORMERS_ROW, case, "float32", "pass" if parity.passed else "FAIL",
                                     parity.as_dict()))
    for run in runtime_outputs(runtimes, model_path, [f for _, f in cases], timeout, order):
        name, outputs = run.name, run.outputs
        for index, (case, _) in enumerate(cases):
            if run.problem:
                matrix.cells.append(Cell(name, case, dtype, run.problem))
                continue
            ref64, _, keep, _, same = refs[index]
            got = outputs[index]
            if last and got.shape[:2] == (keep.shape[0], 1):
                got = np.concatenate([np.zeros((got.shape[0], keep.shape[1] - 1, *got.shape[2:]), got.dtype), got], 1)
            if got.shape[:2] != keep.shape:
                matrix.cells.append(Cell(name, case, dtype, f"error: output {output} has shape "
                                         f"{list(outputs[index].shape)}, expected [{keep.shape[0]}, {keep.shape[1]}, ...]"))
                continue
            parity = judge_quantized(got[keep], ref64, scheme) if scheme else compare(got[keep], ref64, same, tol)
            label = f"{dtype} {scheme}" if scheme else dtype
            matrix.cells.append(Cell(name, case, label, "pass" if parity.passed else "FAIL", parity.as_dict()))
        matrix.cells += run.order_cells(dtype)
        if progress:
            progress(1)
    return matrix
