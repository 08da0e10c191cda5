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

from ..export.quantize.schemes import coarser
from ..limits import attention_bytes, check_fits
from ..parity.judge import Case, FloatPolicy, Reference, policy_for
from ..parity.loop import Plan, check_runtimes, measure
from ..parity.reference import ModelFile, ParityInputError, model_file
from ..parity.runs import Matrix, RuntimeRun, runtime_outputs
from ..parity.runtimes import load_runner
from .cases import BLOCKED, TRANSFORMERS_ROW, check_weights, file_dtype, file_inputs, left_padded
from .folder import float32_pretrained, transformers_module
from .models import load_model


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
        logits, past = decoder.step(out[-1], torch.ones(source.shape[0], total, dtype=torch.int64), states, src_mask, past,
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


def seq2seq_files(encoder, decoder) -> dict[str, ModelFile]:
    files = {role: model_file(p) for role, p in (("encoder", encoder), ("decoder", decoder)) if p is not None}
    if not files:
        raise ValueError("run_seq2seq_matrix needs an encoder file, a decoder file or both")
    for role, file in files.items():
        if file.seq2seq_role != role:
            raise ParityInputError(f"{file.path} is not a T5 {role} file")
    return files


def seq2seq_models(files: dict[str, ModelFile], model_dir):
    """The folder's float64-capable encoder and decoder, the folder checked to hold a decoder
    and the files' weights (the decoder loads once: a folder without one says so)."""
    model_dir = model_dir or next((f.contract.model_dir for f in files.values() if f.contract.model_dir), None)
    if not model_dir:
        raise ParityInputError(f"{' and '.join(str(f.path) for f in files.values())} do not say which model they "
                               "hold: pass --model DIR")
    for file in files.values():
        check_weights(file.contract, Path(model_dir).resolve(), file.path)
    return Path(model_dir), load_model(model_dir, "encoder"), load_model(model_dir, "decoder")


def seq2seq_case(encoder, decoder, n: int, batch: int) -> tuple[Case, Seq2SeqCase, np.ndarray]:
    """Source and target of length n: the judged Case (float64 logits; float32, transformers'
    floor, and the file's dtype as floors), its inputs, and the float64 encoder's states."""
    source, mask = left_padded(n, batch, decoder.vocab_size, seed=n)
    encoder.float(), decoder.float()
    inputs = Seq2SeqCase(f"L={n} B={batch}", source, mask, self_written_target(encoder, decoder, source, mask, n, n))
    states64, logits64 = reference_pipeline(encoder, decoder, inputs, torch.float64)
    floors = {name: (lambda d=d: reference_pipeline(encoder, decoder, inputs, d)[1].double().numpy())
              for name, d in (("float32", torch.float32), ("float16", torch.float16), ("bfloat16", torch.bfloat16))}
    floors["float32"] = floors["float32"]()  # transformers' row and float32 files need it; others on demand
    return Case(inputs.name, {}, Reference(logits64.numpy(), floors)), inputs, states64.numpy()


def check_fits_seq2seq(decoder, lengths, batch: int, ignore_size_limits: bool) -> None:
    for n in lengths:  # float64 self-attention over [n, n] in blocks, cross-attention whole, logits thrice
        need = attention_bytes(batch, decoder.num_heads, n, n, 8, 3) + 3.0 * batch * n * decoder.vocab_size * 8
        check_fits(need, f"validating T5 files at length {n}, batch {batch}", ignore_size_limits)


@torch.no_grad()
def transformers_run(model_dir: Path, inputs: list[Seq2SeqCase], class_name: str) -> RuntimeRun:
    """transformers' encoder-decoder (T5ForConditionalGeneration, UMT5...), float32, on every case: a reference row."""
    theirs = float32_pretrained(getattr(transformers_module(), class_name), model_dir)
    outputs = [theirs(input_ids=torch.from_numpy(c.source), attention_mask=torch.from_numpy(c.mask),
                      decoder_input_ids=torch.from_numpy(c.target)).logits.numpy() for c in inputs]
    return RuntimeRun(TRANSFORMERS_ROW, None, outputs=outputs)


def pipeline_runs(files: dict[str, ModelFile], decoder, runtimes, inputs: list[Seq2SeqCase], states64, np_dtype,
                  timeout: float, order: bool):
    """Per runtime, a RuntimeRun of decoder logits: the encoder file's states on that runtime (or
    the float64 reference's, in the file's dtype) fed to the decoder file on that runtime (or
    to the float64 decoder); order cells from both files."""
    if "encoder" in files:
        feeds = [file_inputs(files["encoder"].proto, c.source, c.mask) for c in inputs]
        encoder_runs = runtime_outputs(runtimes, files["encoder"].path, feeds, timeout, order)
    else:
        encoder_runs = (RuntimeRun(name, None, outputs=[s.astype(np_dtype) for s in states64]) for name in runtimes)
    for run in encoder_runs:
        cells = run.order_cells(f"encoder {np_dtype.__name__}")
        if run.problem or "decoder" not in files:
            logits = None if run.problem else [reference_logits(decoder, c, s) for c, s in zip(inputs, run.outputs)]
            yield PipelineRun(run.name, run.runtime, run.problem, logits, cells=cells)
            continue
        feeds = [decoder_feeds(files["decoder"].proto, c, s) for c, s in zip(inputs, run.outputs)]
        step = next(runtime_outputs((run.name,), files["decoder"].path, feeds, timeout, order))
        label = f"decoder {'float16' if np_dtype == np.float16 else 'float32'}"
        yield PipelineRun(run.name, step.runtime, step.problem, step.outputs, cells=cells + step.order_cells(label))


@dataclass
class PipelineRun(RuntimeRun):
    """A runtime's run of an encoder-decoder pipeline: its order cells made from both files'."""

    cells: list = None

    def order_cells(self, dtype: str) -> list:
        return self.cells or []


@torch.no_grad()
def seq2seq_plan(files: dict[str, ModelFile], model_dir, lengths, batch: int, ignore_size_limits: bool) -> Plan:
    """The cases of an encoder file, a decoder file or both (see the module docstring), judged by
    the logits they lead to, the target as long as the source at each length."""
    model_dir, encoder, decoder = seq2seq_models(files, model_dir)
    check_fits_seq2seq(decoder, lengths, batch, ignore_size_limits)
    scheme = coarser(f.scheme for f in files.values())
    dtype = file_dtype(files["decoder" if "decoder" in files else "encoder"].proto)
    judged = " + ".join(f"{role} file" for role in files)
    matrix = Matrix(" + ".join(str(f.path) for f in files.values()), decoder.bias_name,
                    f"{decoder.model_type} encoder-decoder: {judged} (logits)")
    cases, inputs, states64 = zip(*(seq2seq_case(encoder, decoder, n, batch) for n in lengths))
    rows = [(transformers_run(model_dir, inputs, decoder.transformers_class), FloatPolicy("float32"))] \
        if "decoder" in files else []
    np_dtype = np.float16 if dtype == "float16" else np.float32

    def runs(runtimes, timeout, order):
        return pipeline_runs(files, decoder, runtimes, inputs, states64, np_dtype, timeout, order)

    return Plan(matrix, list(cases), policy_for(dtype, scheme), reference_rows=rows, runs=runs)


def run_seq2seq_matrix(encoder_path=None, decoder_path=None, model_dir=None, runtimes: tuple[str, ...] = ("ort-cpu",),
                       lengths: tuple[int, ...] = (1, 17, 1024), batch: int = 3, timeout: float = 1800.0,
                       progress=None, ignore_size_limits: bool = False, order: bool = True) -> Matrix:
    check_runtimes(runtimes)
    plan = seq2seq_plan(seq2seq_files(encoder_path, decoder_path), model_dir, lengths, batch, ignore_size_limits)
    return measure(plan, runtimes, timeout, order, progress)
