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
import torch

from ..limits import attention_bytes, check_fits
from ..parity.judge import Case, FloatPolicy, Reference, policy_for
from ..parity.loop import Plan, check_runtimes, measure
from ..parity.reference import ModelFile, ParityInputError, model_file, torch_outputs
from ..parity.runs import NOT_RUN, Matrix, RuntimeRun
from ..parity.runtimes import DEFAULT_RUNTIMES
from ..parity.tolerance import FLOAT32, Tolerance
from .cases import BLOCKED, TRANSFORMERS_ROW, check_weights, file_dtype, file_inputs, left_padded, self_written
from .folder import float32_pretrained, transformers_module
from .models import architecture, load_model


def transformers_tolerance(model, length: int) -> Tolerance:
    """The policy for transformers' own float32 row. BLOOM, MPT and Falcon add ALiBi as slope *
    absolute key position (softmax-equivalent to our -slope * |i - j|): in float32 each of those
    values carries up to half an ulp of its magnitude, which softmax does not cancel. At 4096
    tokens that is ulp(2048) / 2 = 1.2e-4 per score, far above float32 arithmetic's own error
    (~2e-6 here), so the floor grows by one ulp of the largest bias. Measured on the tiny BLOOM:
    2.9e-5 at 4096, 5.6e-6 at 1024; on the tiny grouped Falcon 2.3e-5 at 4096 (transformers
    5.24), past the floor-only budget of 2.2e-5."""
    magnitude = model.transformers_bias_magnitude(length)
    if magnitude == 0.0:
        return FLOAT32
    ulp = float(np.spacing(np.float32(magnitude)))
    return dataclasses.replace(FLOAT32, atol=FLOAT32.atol + ulp,
                               why=f"{FLOAT32.why}; + ulp({magnitude:.0f}) for its absolute-position ALiBi")


def transformers_model(model_dir: Path, model_type: str):
    """transformers' own implementation of the folder's model (the class the architecture names)."""
    from .models import load_model

    cls = getattr(transformers_module(), architecture(model_type).transformers_class)
    reference = float32_pretrained(cls, model_dir).eval()
    return load_model(model_dir, lazy=True).as_trained(reference)


def imported_case(ours, file: ModelFile, n: int, batch: int, scheme: str | None) -> Case:
    """A left-padded batch of length n, judged on its real tokens (the last position only for a
    --logits last file); float64 and float32 from our implementation, blocked."""
    ids, mask = left_padded(n, batch, ours.vocab_size, seed=n)
    if scheme and ours.arch != "encoder":  # the quantized policy judges text the float model writes (parity/quantized.py)
        ids = self_written(ours, ids, mask)
    keep = mask.astype(bool)
    last = file.contract.logits == "last"
    if last:  # left-padded rows: the last position is a real token in every row
        keep = np.zeros_like(keep)
        keep[:, -1] = True
    args = torch.from_numpy(ids), torch.from_numpy(mask)
    floors = {name: (lambda d=d: torch_outputs(ours, args, d, BLOCKED)[keep])
              for name, d in (("float16", torch.float16), ("bfloat16", torch.bfloat16))}
    floors["float32"] = ours.float()(*args, settings=BLOCKED).numpy()[keep]
    ref64 = ours.double()(*args, settings=BLOCKED).numpy()[keep]
    return Case(f"L={n} B={batch}", file_inputs(file.proto, ids, mask), Reference(ref64, floors, keep, last))


def transformers_run(theirs, ours, cases: list[Case], lengths) -> RuntimeRun:
    """transformers' own float32 outputs on every case (a reference row), or why it cannot run one."""
    from ..limits import available_bytes

    limit, outputs = ours.max_length(), []
    table = ours.transformers_table_bytes()
    for case, n in zip(cases, lengths):
        if limit is not None and n > limit:
            outputs.append(f"{NOT_RUN}transformers' {ours.model_type} stops at {limit} tokens")
            continue
        if table > available_bytes() / 2:  # estimated before transformers allocates it
            outputs.append(f"{NOT_RUN}transformers' {ours.model_type} builds a {table / 1e9:.3g} GB position table "
                           f"(its config's max_seq_len), more than this machine can hold")
            continue
        out = theirs(input_ids=torch.from_numpy(case.feeds["input_ids"]),
                     attention_mask=torch.from_numpy(case.feeds["attention_mask"]))
        outputs.append((out.last_hidden_state if ours.arch == "encoder" else out.logits).numpy())
    return RuntimeRun(TRANSFORMERS_ROW, None, outputs=outputs)


def check_fits_imported(ours, path, lengths, batch: int, ignore_size_limits: bool) -> None:
    for n in lengths:  # transformers' eager attention holds [B, H, L, L] scores; our float64 run blocks of them
        need = attention_bytes(batch, ours.num_heads, n, n, 4, 3) + 3.0 * batch * n * ours.vocab_size * 8
        check_fits(need, f"validating {path} at length {n}, batch {batch}", ignore_size_limits)


@torch.no_grad()
def hf_plan(file: ModelFile, model_dir, lengths, batch: int, ignore_size_limits: bool) -> Plan:
    """The cases of one file of an imported causal LM or encoder, judged on its own outputs
    against our float64 implementation of the folder's model, and transformers' float32 row."""
    model_dir = model_dir or file.contract.model_dir
    if not model_dir:
        raise ParityInputError(f"{file.path} does not say which model it holds: pass --model DIR")
    ours = load_model(model_dir)
    check_weights(file.contract, ours.source_dir, file.path)
    check_fits_imported(ours, file.path, lengths, batch, ignore_size_limits)
    # a float16 file is judged against PyTorch float16's own error (parity/tolerance.py), as ours are
    dtype, scheme = file_dtype(file.proto), file.scheme
    output = file.proto.graph.output[0].name
    reference = "" if ours.transformers_class else "; reference: our float64 implementation, none is installable"
    matrix = Matrix(str(file.path), ours.bias_name, f"{ours.model_type} {ours.arch} ({output}){reference}")
    cases = [imported_case(ours, file, n, batch, scheme) for n in lengths]
    return Plan(matrix, cases, runtime_policy(ours, dtype, scheme, cases, lengths, file.float16_cache), file.path, scheme,
                reference_rows=transformers_rows(ours, Path(model_dir), cases, lengths), order_label=dtype)


def transformers_rows(ours, model_dir: Path, cases: list[Case], lengths) -> list:
    """transformers' own float32 row with its policy, where transformers implements the model."""
    if not ours.transformers_class:
        return []
    theirs = transformers_model(model_dir, ours.model_type)
    row = FloatPolicy("float32", {c.name: transformers_tolerance(ours, n) for c, n in zip(cases, lengths)})
    return [(transformers_run(theirs, ours, cases, lengths), row)]


def run_hf_matrix(model_path: "str | Path | ModelFile", model_dir: str | Path | None = None,
                  runtimes: tuple[str, ...] = DEFAULT_RUNTIMES, lengths: tuple[int, ...] = (1, 17, 1024),
                  batch: int = 3, timeout: float = 1800.0, progress=None, ignore_size_limits: bool = False,
                  order: bool = True) -> Matrix:
    """One file of an imported causal LM or encoder judged on its own outputs (a T5 decoder, or
    a quantized encoder, is judged by the logits it leads to: validation.py routes it to
    hf/validate_seq2seq.py)."""
    check_runtimes(runtimes)
    plan = hf_plan(model_file(model_path), model_dir, lengths, batch, ignore_size_limits)
    return measure(plan, runtimes, timeout, order, progress)


def runtime_policy(ours, dtype: str, scheme: str | None, cases: list[Case], lengths, float16_cache: bool = False):
    """The runtimes' policy. A float32 file whose key row is absolute (Falcon's: its bfloat16
    rounding is not shift-invariant) adds |bias| up to its magnitude to every score, so float32
    rounds each score by up to half an ulp of it, which softmax does not cancel and PyTorch's
    floor (the bias as row minus column, small near the diagonal) does not show: one ulp more,
    the rule transformers' own row follows. Measured on the tiny Falcon at 4096 tokens (the
    largest key value 724, ulp 6.1e-5): ONNX Runtime 1.3e-5, OpenVINO 2.2e-5, the reference
    evaluator 2.9e-5 against a floor-only budget of 1.9e-5; PyTorch float32 itself 1.8e-6."""
    policy = policy_for(dtype, scheme, embeddings=ours.arch == "encoder", float16_cache=float16_cache)
    if scheme or dtype != "float32" or float16_cache:
        return policy
    extra = {c.name: float(np.spacing(np.float32(m))) for c, n in zip(cases, lengths)
             if (m := ours.file_bias_magnitude(n)) > 0}
    return dataclasses.replace(policy, extra_atol=extra) if extra else policy
