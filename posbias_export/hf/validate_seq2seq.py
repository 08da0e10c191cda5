"""Judge the files of a T5 encoder-decoder folder by the logits they lead to, on every runtime
and length, against our float64 implementation of the folder's model (hf/architectures/t5.py, t5_decoder.py):

- a decoder file: fed the float64 reference encoder's states (in the file's dtype) and target
  text; its logits against the float64 decoder's on the same inputs;
- a quantized encoder file: its features have no policy of their own (parity/quantized.py
  judges predictions), so they are fed to the float64 decoder and the logits judged (a float
  encoder file is judged on its features by hf/validate.py);
- both files of one folder: each runtime's encoder output fed to the decoder file on that
  runtime, as a client runs them (validation.py pairs them).

Source: left-padded random tokens. Target: the decoder start token, then text the float model
writes itself from that source at temperature 1 (the quantized policy is a perplexity promise
on the model's own text). Float files are judged by parity/tolerance.py, quantized ones by
parity/quantized.py (the coarser scheme of the two files). transformers'
T5ForConditionalGeneration, float32, is one more row whenever a decoder file is judged."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch

from ..export.metadata import read_metadata
from ..limits import attention_bytes, check_fits
from ..parity.matrix import Cell, Matrix, runtime_outputs
from ..parity.quantized import judge as judge_quantized
from ..parity.reference import ParityInputError, read_onnx
from ..parity.runtimes import load_runner
from ..parity.tolerance import FLOAT16, FLOAT32, compare
from .folder import transformers_module
from .models import has_decoder, load_model
from .validate import BLOCKED, TRANSFORMERS_ROW, check_weights, file_dtype, file_inputs, left_padded

SCHEME_ORDER = (None, "int8", "int4")  # coarser to the right: a pair is judged by its coarser file


def seq2seq_role(proto: onnx.ModelProto) -> str | None:
    """"decoder" for a file fed the encoder's states, "encoder" for one whose output is
    last_hidden_state, else None."""
    if any(i.name == "encoder_hidden_states" for i in proto.graph.input):
        return "decoder"
    return "encoder" if proto.graph.output and proto.graph.output[0].name == "last_hidden_state" else None


@dataclass
class Seq2SeqCase:
    name: str
    source: np.ndarray  # [B, S] int64, left-padded
    mask: np.ndarray  # [B, S] int64
    target: np.ndarray  # [B, T] int64: decoder start, then self-written text


@torch.no_grad()
def self_written_target(encoder, decoder, source: np.ndarray, mask: np.ndarray, length: int, seed: int) -> np.ndarray:
    """[B, length]: the decoder start token, then tokens sampled at temperature 1 from the float32
    model given the source, one step at a time through the decoder's cache."""
    gen = torch.Generator().manual_seed(seed)
    src, src_mask = torch.from_numpy(source), torch.from_numpy(mask)
    states = encoder(src, src_mask, settings=BLOCKED)  # [B, S, D]
    start = load_runner("ort/seq2seq.py").decoder_start(decoder.source_dir)  # as our generate and transformers read it
    out = [torch.full((source.shape[0], 1), start, dtype=torch.int64)]
    past, total = decoder.empty_past(source.shape[0]), 1
    while total < length:
        logits, past = decoder(out[-1], torch.ones(source.shape[0], total, dtype=torch.int64), states, src_mask, past,
                               settings=BLOCKED)
        out.append(torch.multinomial(torch.softmax(logits[:, -1].double(), -1), 1, generator=gen))
        total += 1
    return torch.cat(out, 1).numpy()


@torch.no_grad()
def reference_pipeline(encoder, decoder, case: Seq2SeqCase, dtype: torch.dtype):
    """The encoder's states [B, S, D] and the decoder's logits [B, T, V] in `dtype` (the modules
    are converted in place)."""
    src, mask, tgt = (torch.from_numpy(a) for a in (case.source, case.mask, case.target))
    encoder.to(dtype), decoder.to(dtype)
    states = encoder(src, mask, settings=BLOCKED)
    logits = decoder(tgt, torch.ones_like(tgt), states, mask, settings=BLOCKED)
    return states, logits


@torch.no_grad()
def reference_logits(decoder, case: Seq2SeqCase, states: np.ndarray) -> np.ndarray:
    """The float64 decoder's logits [B, T, V] on encoder states a runtime computed."""
    decoder.double()
    tgt, mask = torch.from_numpy(case.target), torch.from_numpy(case.mask)
    return decoder(tgt, torch.ones_like(tgt), torch.from_numpy(np.array(states, np.float64)), mask, settings=BLOCKED).numpy()


def decoder_feeds(proto: onnx.ModelProto, case: Seq2SeqCase, states: np.ndarray) -> dict[str, np.ndarray]:
    """What the decoder file asks (either naming): the target, its all-ones mask if the file has
    one, the encoder's states and mask, empty past tensors (a prefill)."""
    return file_inputs(proto, case.target, np.ones_like(case.target),
                       {"encoder_hidden_states": states, "encoder_attention_mask": case.mask})


def _scheme(metas: list[dict]) -> str | None:
    return max((m.get("quantized") for m in metas), key=SCHEME_ORDER.index)


@torch.no_grad()
def run_seq2seq_matrix(encoder_path: str | Path | None, decoder_path: str | Path | None, model_dir=None,
                       runtimes: tuple[str, ...] = ("ort-cpu",), lengths: tuple[int, ...] = (1, 17, 1024),
                       batch: int = 3, timeout: float = 1800.0, progress=None, ignore_size_limits: bool = False,
                       order: bool = True) -> Matrix:
    """The encoder file, the decoder file, or both (see the module docstring), judged by the
    logits they lead to, the target as long as the source at each length."""
    paths = {"encoder": encoder_path, "decoder": decoder_path}
    protos = {role: read_onnx(Path(p)) for role, p in paths.items() if p is not None}
    if not protos:
        raise ValueError("run_seq2seq_matrix needs an encoder file, a decoder file or both")
    metas = {role: read_metadata(p) for role, p in protos.items()}
    for role, proto in protos.items():
        if seq2seq_role(proto) != role:
            raise ParityInputError(f"{paths[role]} is not a T5 {role} file")
    model_dir = model_dir or next((m["model_dir"] for m in metas.values() if m.get("model_dir")), None)
    if not model_dir:
        raise ParityInputError(f"{' and '.join(map(str, filter(None, paths.values())))} do not say which model they "
                               "hold: pass --model DIR")
    if not has_decoder(model_dir):
        raise ParityInputError(f"{model_dir} holds no T5 decoder: the files' logits cannot be judged")
    for role, meta in metas.items():
        check_weights(meta, Path(model_dir).resolve(), Path(paths[role]))
    encoder, decoder = load_model(model_dir, "encoder"), load_model(model_dir, "decoder")
    heads, vocab = decoder.num_heads, decoder.vocab_size
    for n in lengths:  # float64 self-attention over [n, n] in blocks, cross-attention whole, logits thrice
        need = attention_bytes(batch, heads, n, n, 8, 3) + 3.0 * batch * n * vocab * 8
        check_fits(need, f"validating T5 files at length {n}, batch {batch}", ignore_size_limits)
    scheme = _scheme(list(metas.values()))
    dtype = file_dtype(protos["decoder"] if "decoder" in protos else protos["encoder"])
    tol, torch_dtype = (FLOAT16, torch.float16) if dtype == "float16" else (FLOAT32, torch.float32)
    label = f"{dtype} {scheme}" if scheme else dtype
    judged = " + ".join(f"{role} file" for role in protos)
    matrix = Matrix(" + ".join(str(p) for p in paths.values() if p is not None), "t5",
                    f"encoder-decoder: {judged} (logits)")

    cases, refs = [], []
    for n in lengths:
        source, mask = left_padded(n, batch, vocab, seed=n)
        encoder.float(), decoder.float()
        case = Seq2SeqCase(f"L={n} B={batch}", source, mask, self_written_target(encoder, decoder, source, mask, n, n))
        states64, logits64 = reference_pipeline(encoder, decoder, case, torch.float64)
        same32 = reference_pipeline(encoder, decoder, case, torch.float32)[1].double().numpy()  # transformers' floor
        same = same32 if torch_dtype == torch.float32 else \
            reference_pipeline(encoder, decoder, case, torch_dtype)[1].double().numpy()  # the file's floor
        cases.append(case)
        refs.append((states64.numpy(), logits64.numpy(), same, same32))

    if "decoder" in protos:
        theirs = getattr(transformers_module(), "T5ForConditionalGeneration").from_pretrained(str(model_dir)).float()
        for case, (_, logits64, _, same32) in zip(cases, refs):
            out = theirs(input_ids=torch.from_numpy(case.source), attention_mask=torch.from_numpy(case.mask),
                         decoder_input_ids=torch.from_numpy(case.target)).logits.numpy()
            parity = compare(out, logits64, same32, FLOAT32)
            matrix.cells.append(Cell(TRANSFORMERS_ROW, case.name, "float32", "pass" if parity.passed else "FAIL",
                                     parity.as_dict()))

    np_dtype = np.float16 if dtype == "float16" else np.float32
    for name, states, problem, order_cells in _encoder_states(protos, paths, runtimes, cases, refs, np_dtype, timeout,
                                                              order):
        if problem:
            matrix.cells += [Cell(name, case.name, label, problem) for case in cases]
            continue
        if "decoder" in protos:
            run = next(runtime_outputs((name,), Path(decoder_path),
                                       [decoder_feeds(protos["decoder"], c, s) for c, s in zip(cases, states)],
                                       timeout, order))
            if run.problem:
                matrix.cells += [Cell(name, case.name, label, run.problem) for case in cases]
                continue
            logits, order_cells = run.outputs, order_cells + run.order_cells(f"decoder {dtype}")
        else:
            logits = [reference_logits(decoder, c, s) for c, s in zip(cases, states)]
        for case, got, (_, logits64, same, _) in zip(cases, logits, refs):
            if got.shape != logits64.shape:
                matrix.cells.append(Cell(name, case.name, label, f"error: logits have shape {list(got.shape)}, "
                                         f"expected {list(logits64.shape)}"))
                continue
            parity = judge_quantized(got, logits64, scheme) if scheme else compare(got, logits64, same, tol)
            matrix.cells.append(Cell(name, case.name, label, "pass" if parity.passed else "FAIL", parity.as_dict()))
        matrix.cells += order_cells
        if progress:
            progress(1)
    return matrix


def _encoder_states(protos, paths, runtimes, cases, refs, np_dtype, timeout, order):
    """Per runtime: (name, the encoder states of every case, a problem or None, order cells):
    the encoder file's outputs on that runtime, or the float64 reference's in the file dtype."""
    if "encoder" not in protos:
        states = [s.astype(np_dtype) for s, *_ in refs]
        for name in runtimes:
            yield name, states, None, []
        return
    feeds = [file_inputs(protos["encoder"], c.source, c.mask) for c in cases]
    for run in runtime_outputs(runtimes, Path(paths["encoder"]), feeds, timeout, order):
        yield run.name, run.outputs, run.problem, run.order_cells(f"encoder {np_dtype.__name__}")
