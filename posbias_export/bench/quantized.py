"""Quantized files measured side by side with the float32 file they come from:

1. the trained checkpoints in models/: held-out perplexity (tiny Shakespeare, its last 10%) at
   the training length and at 16x it, float32 / int8 / int4 on ONNX Runtime CPU, and the int4
   choices (block size, symmetric or not, MatMulNBits' accuracy level) on the ALiBi checkpoint;
2. real size (published configurations, random weights, as bench-real): file size, export time
   and peak RSS, prefill of 512 tokens, per-token decode beside the memory-bandwidth floor of
   each file's bytes and transformers eager; greedy tokens compared with the float file's.

`python -m posbias_export bench-quant` -> benchmarks/quantized.md / .json.
"""
from __future__ import annotations

import json
import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ..export.quantize.schemes import SCHEMES as ALL_SCHEMES
from ..export.quantize.schemes import scheme as quant_scheme
from ..peers import ort_runs
from ..hf.published import published_folder
from ..parity.tokens import agreeing
from . import real_models as real
from ..environment import copy_bandwidth_gbs
from ..export.files import scratch
from .harness import failure, md_table, measured_python, targets_section, write_results

TRAIN_LENGTH_FACTOR = 16  # extrapolation: 16x the training length, as the issue asks
# (scheme, options) of the checkpoint table; the variants run on the ALiBi checkpoint only
SCHEMES = {name: quant_scheme(name) for name in ALL_SCHEMES}  # each with its defaults
VARIANTS = {
    "int8 per-tensor": quant_scheme("int8", per_channel=False),
    "int4 block 16": quant_scheme("int4", block=16),
    "int4 block 32 symmetric": quant_scheme("int4", symmetric=True),
    "int4 block 64": quant_scheme("int4", block=64),
    "int4 block 128": quant_scheme("int4", block=128),
    "int4 accuracy level 0 (unset: float32 compute)": quant_scheme("int4", accuracy_level=0),
}
# targets of the issue: perplexity within 1% (int8) / 3% (int4) of float32; decode time vs float32
PPL_TARGET = {name: math.expm1(cls.policy.max_kl) for name, cls in ALL_SCHEMES.items()}  # validate's promise
DECODE_TARGET = {"int8": 0.5, "int4": 0.3}
FLOOR_TARGET = 1.5
EXPORT_BOUND = (1.5, 1.0)  # streamed quantized export: peak RSS <= 1.5x the file + 1 GB
ENCODER_ONLY = {"umt5-xxl-encoder"}  # int8 only, judged on its embedding: float32 (23 GB) cannot run here


@dataclass
class QuantResults:
    lengths: tuple[int, ...] = ()
    checkpoints: dict = field(default_factory=dict)  # name -> label -> {length: ppl}
    variants: dict = field(default_factory=dict)  # label -> {length: ppl}
    real: list = field(default_factory=list)  # dicts: model, scheme, file_gb, export_s, export_peak_gb, runs
    commands: list = field(default_factory=list)


def checkpoint_perplexity(models_dir: Path, corpus: Path, max_tokens: int, progress=print) -> tuple[dict, dict, tuple]:
    """Held-out perplexity of every checkpoint, float32 / int8 / int4, at its training length and
    16x it; the int4/int8 variants on the ALiBi checkpoint."""
    from ..export import checkpoint_metadata, export_onnx
    from ..nn import checkpoint_card, load_checkpoint
    from ..study.evaluate import evaluate

    rows, variants, lengths = {}, {}, ()
    with tempfile.TemporaryDirectory(prefix="posbias-quant-") as tmp:
        for ckpt in sorted(models_dir.glob("*.safetensors")):
            model = load_checkpoint(ckpt)
            train_len = int(checkpoint_card(ckpt).get("train_len", 64))
            lengths = tuple(train_len * 2 ** k for k in range(TRAIN_LENGTH_FACTOR.bit_length()))  # 64 .. 1024
            if model.cfg.position == "learned":
                continue  # its table stops at the training length: no 16x to measure
            specs = {"float32": None, **SCHEMES, **(VARIANTS if ckpt.stem == "alibi" else {})}
            rows[ckpt.stem] = {}
            for label, spec in specs.items():
                progress(f"{ckpt.stem}: {label}")
                path = Path(tmp) / f"{ckpt.stem}_{label.replace(' ', '_')}.onnx"
                export_onnx(model, path, check_growth=False, metadata=checkpoint_metadata(ckpt), quantize=spec)
                at = (lengths[0], lengths[-1]) if label in VARIANTS else lengths  # variants: both ends only
                got = {r.length: r.ort_ppl for r in evaluate(path, corpus, at, max_tokens, torch_check=False)}
                (variants if label in VARIANTS else rows[ckpt.stem])[label] = got
                path.unlink()
    return rows, variants, lengths


def real_rows(name: str, work: Path, threads: int, new_tokens: int, progress=print) -> list[dict]:
    """float32 / int8 / int4 (/ int4 at accuracy level 0, decoders) files of a published
    configuration: export (own process, peak RSS), prefill 512, decode, tokens vs the float file's,
    and where a decode step's time goes (ONNX Runtime's profiler, per operator type), beside
    transformers eager. A scheme whose export or run fails is a row with its error (an export
    killed for memory is a result)."""
    import shutil

    folder, seq2seq, alone = published_folder(name, work, progress=progress), name in real.SEQ2SEQ, name in ENCODER_ONLY
    bandwidth, out, float_tokens = copy_bandwidth_gbs(), [], None
    schemes = [("float32", None), ("int8", SCHEMES["int8"]), ("int4", SCHEMES["int4"])]
    schemes += [] if seq2seq else [("int4 accuracy level 0", VARIANTS["int4 accuracy level 0 (unset: float32 compute)"])]
    schemes = schemes[1:2] if alone else schemes
    with scratch(work) as files:  # every file made goes here, never over one of the user's in WORK
        for label, spec in schemes:
            place = Path(files) / label.replace(" ", "_")
            try:
                place.mkdir()
                measure = _encoder_row if alone else _seq2seq_row if seq2seq else _decoder_row
                out.append(measure(name, label, spec, folder, place, threads, new_tokens, bandwidth, progress))
            except Exception as err:  # noqa: BLE001 - an export killed for memory, a run that fails: a row
                out.append({"model": name, "scheme": label, "error": failure(err)})
            finally:
                shutil.rmtree(place, ignore_errors=True)
            float_tokens = out[-1].get("tokens") if spec is None else float_tokens
        if alone:  # Optimum exports no encoder alone with a cache-less text task here; no decoder to time
            return out
        optimum = _optimum_int8_row(name, folder, Path(files), threads, new_tokens, bandwidth, progress)
    out += [optimum] if optimum is not None else []
    for row in out:
        if "tokens" in row:
            row["tokens_equal_float"] = agreeing(row["tokens"], float_tokens or [])
    progress(f"{name}: transformers eager")
    eager = real.worker_run("transformers-seq2seq" if seq2seq else "transformers", folder, 512, new_tokens,
                            threads)["decode_ms"]
    return [{**row, "eager_ms": eager} for row in out]


def _encoder_row(name, label, spec, folder, place, threads, *_) -> dict:
    """An encoder alone, int8 (its float32 file would not fit here): the streamed export (own process,
    peak RSS), one forward of 512 tokens on ORT CPU, and its embedding judged against transformers'
    float32 run block by block (peers/eager_runs.encoder_streamed) by parity/embedding.py's policy."""
    import numpy as np

    from ..parity.embedding import judge

    path, ours, ref = (place / f for f in (f"{name}.onnx", "ours.npy", "reference.npy"))
    seconds, peak, _ = measured_python(["-m", "posbias_export", "--model", str(folder), "--out", str(path),
                                        "--skip-growth-check", *spec.flags()])
    got = real.worker_run("encoder", path, 512, 0, threads, "--save", str(ours))
    theirs = real.worker_run("transformers-encoder-streamed", folder, 512, 0, threads, "--save", str(ref))
    return {"model": name, "scheme": label, "file_gb": real.weight_bytes(path) / 1e9, "export_s": seconds,
            "export_peak_gb": peak, "prefill_s": got["prefill_s"], "run_peak_gb": got["peak_gb"],
            "reference_s": theirs["prefill_s"], "reference_peak_gb": theirs["peak_gb"],
            "parity": judge(np.load(ours), np.load(ref), np.ones((1, 512), bool), label).as_dict()}


def _decoder_row(name, label, spec, folder, place, threads, new_tokens, bandwidth, progress) -> dict:
    path = place / f"{name}.onnx"
    progress(f"{name}: export {label}")
    seconds, peak, _ = measured_python(["-m", "posbias_export", "--model", str(folder), "--kv-cache",
                                        "--logits", "last", "--out", str(path), "--skip-growth-check",
                                        *(spec.flags() if spec else [])])
    progress(f"{name}: run {label}")
    return {"model": name, "scheme": label, "export_s": seconds, "export_peak_gb": peak,
            **_run_figures(path, real.weight_bytes(path), threads, new_tokens, bandwidth),
            "step_profile": ort_runs.decode_step_profile(path, threads, past=512)}


def _run_figures(path: Path, size: int, threads: int, new_tokens: int, bandwidth: float) -> dict:
    """A decoder file's prefill of 512 tokens and greedy steps (own process), beside its floor."""
    got = real.worker_run("ort", path, 512, new_tokens, threads)
    return {"file_gb": size / 1e9, "prefill_s": got["prefill_s"], "run_peak_gb": got["peak_gb"],
            "decode_ms": got["decode_ms"], "floor_ms": size / (bandwidth * 1e9) * 1e3,
            "bandwidth_gbs": bandwidth, "tokens": got["tokens"]}


OPTIMUM_INT8 = "int8 (Optimum's export + quantizer)"


def _optimum_int8_row(name, folder, work, threads, new_tokens, bandwidth, progress) -> dict | None:
    """What Optimum users do for int8: its float32 export, then `optimum-cli onnxruntime quantize
    --avx2 --per_channel` (ORTQuantizer: quantize_dynamic on the whole file), each in its own
    process; the file run as ours. None without Optimum's side environment; a failure is a row."""
    import shutil

    cli = real.optimum_cli()
    if cli is None:
        return None
    exported, quantized = work / f"{name}_optimum", work / f"{name}_optimum_int8"
    step = "export"
    try:
        progress(f"{name}: Optimum export")
        export_s, export_peak, _ = measured_python(["export", "onnx", "--model", str(folder), "--task",
                                                    "text-generation-with-past", str(exported)], program=str(cli))
        step = "quantizer"
        progress(f"{name}: Optimum quantizer")
        quant_s, quant_peak, _ = measured_python(["onnxruntime", "quantize", "--onnx_model", str(exported), "--avx2",
                                                  "--per_channel", "-o", str(quantized)], program=str(cli))
        path = next(quantized.glob("*.onnx"))
        size = real.folder_bytes(quantized)
        progress(f"{name}: run {OPTIMUM_INT8}")
        return {"model": name, "scheme": OPTIMUM_INT8, "export_s": export_s + quant_s,
                "export_peak_gb": max(export_peak, quant_peak),
                "optimum": {"export_s": export_s, "export_peak_gb": export_peak, "quantize_s": quant_s,
                            "quantize_peak_gb": quant_peak},
                **_run_figures(path, size, threads, new_tokens, bandwidth)}
    except (RuntimeError, ValueError, StopIteration) as err:  # a failed child, or no file written
        words = failure(err) if str(err) else "wrote no .onnx file"  # StopIteration: no file
        return {"model": name, "scheme": OPTIMUM_INT8, "error": f"Optimum's {step}: {words}"}
    finally:
        shutil.rmtree(exported, ignore_errors=True)
        shutil.rmtree(quantized, ignore_errors=True)


def _seq2seq_row(name, label, spec, folder, place, threads, new_tokens, bandwidth, progress) -> dict:
    """A T5 folder shipped (--out-dir: encoder and cached decoder): export, the encoder over 512
    tokens, decoder steps, and for a quantized pair validate's policy at 64 and 512 tokens (its
    seq2seq matrix, ORT CPU)."""
    from ..hf.validate_seq2seq import run_seq2seq_matrix

    ship_dir = place / "shipped"
    progress(f"{name}: export {label}")
    seconds, peak, _ = measured_python(["-m", "posbias_export", "--model", str(folder), "--out-dir", str(ship_dir),
                                        "--skip-growth-check", *(spec.flags() if spec else [])])
    files = ship_dir / "encoder_model.onnx", ship_dir / "decoder_model_merged.onnx"
    progress(f"{name}: run {label}")
    got = real.worker_run("seq2seq", ship_dir, 512, new_tokens, threads)
    row = {"model": name, "scheme": label, "file_gb": sum(real.weight_bytes(f) for f in files) / 1e9,
           "decoder_gb": real.weight_bytes(files[1]) / 1e9, "export_s": seconds, "export_peak_gb": peak,
           "prefill_s": got["prefill_s"], "run_peak_gb": got["peak_gb"], "decode_ms": got["decode_ms"],
           "floor_ms": real.weight_bytes(files[1]) / (bandwidth * 1e9) * 1e3, "bandwidth_gbs": bandwidth,
           "tokens": got["tokens"], "step_profile": ort_runs.decode_step_profile(files[1], threads, past=16, source=512)}
    if spec is not None:
        progress(f"{name}: policy {label}")
        matrix = run_seq2seq_matrix(*files, folder, ("ort-cpu",), (64, 512), batch=1, order=False)
        row["policy"] = {c.case: {"verdict": c.verdict, "kl_mean": c.parity["kl_mean"],
                                  "top1_decided": c.parity["top1_decided"], "decided": c.parity["decided_positions"]}
                         for c in matrix.cells if c.runtime == "ort-cpu"}
    return row


def render(r: QuantResults) -> str:
    lines = [f"<!-- generated by: {'; '.join(r.commands)} -->", "# Quantized files: int8 and int4 weights", "",
             "Weights quantized by ONNX Runtime's own tools (`--quantize int8`: `quantize_dynamic`, MatMulInteger; "
             "`--quantize int4`: `MatMulNBitsQuantizer`, MatMulNBits and GatherBlockQuantized, block 32, "
             "asymmetric, accuracy level 4: int8 compute): every linear layer and the token embedding (a tied LM head gets its own transposed "
             "copy, quantized); attention, the positional bias, norms and softmax stay float32. Machine: 2 CPU "
             "cores, ONNX Runtime CPU, 2 threads.", ""]
    lines += _checkpoint_lines(r) + _variant_lines(r) + _real_lines(r.real, False) + _profile_lines(r.real)
    lines += _real_lines(r.real, True) + _encoder_lines(r.real)
    return "\n".join(lines + targets_section(targets(r))) + "\n"


def _checkpoint_lines(r: QuantResults) -> list[str]:
    if not r.checkpoints:
        return []
    short, long = r.lengths[0], r.lengths[-1]
    lines = ["## Trained checkpoints: held-out perplexity (tiny Shakespeare, last 10%)", "",
             f"Evaluated at {', '.join(map(str, r.lengths))} tokens: the training length ({short}) up to "
             f"{TRAIN_LENGTH_FACTOR}x it ({long}: extrapolation); the table shows both ends, the worst change is "
             "over every length, and quantized.png draws each checkpoint's curves (float32 solid, int8 dashed, "
             "int4 dotted). Targets: int8 within 1%, int4 within 3% of float32.", "",
             f"| checkpoint | float32 @{short} | int8 @{short} | int4 @{short} | float32 @{long} | int8 @{long} | "
             f"int4 @{long} | worst change int8 / int4 | verdict |", "|---|---|---|---|---|---|---|---|---|"]
    for name, got in r.checkpoints.items():
        change = {s: max(got[s][str(n)] / got["float32"][str(n)] - 1 for n in r.lengths) for s in SCHEMES}
        ok = all(change[s] <= PPL_TARGET[s] for s in SCHEMES)
        cells = [f"{got[s][str(n)]:.3f}" for n in (short, long) for s in ("float32", *SCHEMES)]
        lines.append(f"| {name} | {' | '.join(cells)} | {100 * change['int8']:+.2f}% / {100 * change['int4']:+.2f}% | "
                     f"{'met' if ok else 'NOT met'} |")
    return lines


def _variant_lines(r: QuantResults) -> list[str]:
    if not r.variants:
        return []
    base = r.checkpoints.get("alibi", {}).get("float32", {})
    lines = ["", "## Quantizer choices on the ALiBi checkpoint", "",
             f"| choice | ppl @{r.lengths[0]} | change | ppl @{r.lengths[-1]} | change |", "|---|---|---|---|---|"]
    for label, got in {"int8 (per-channel, the default)": r.checkpoints["alibi"]["int8"],
                       "int4 block 32 asymmetric, accuracy level 4 (the default)": r.checkpoints["alibi"]["int4"],
                       **r.variants}.items():
        lines.append(f"| {label} | " + " | ".join(f"{got[str(n)]:.3f} | {100 * (got[str(n)] / base[str(n)] - 1):+.2f}%"
                                                  for n in (r.lengths[0], r.lengths[-1])) + " |")
    return lines


REAL_HEADERS = {
    False: ["model", "weights", "file GB", "export s", "export peak GB", "prefill 512 s", "run peak GB", "decode ms/token",
            "vs float32", "floor ms", "decode / floor", "eager ms/token", "eager / ours", "tokens agreeing with float32"],
    True: ["model", "weights", "files GB", "export s", "export peak GB", "encoder 512 s", "run peak GB", "decoder ms/step",
           "vs float32", "floor ms", "step / floor", "eager ms/step", "eager / ours", "policy @64", "policy @512",
           "tokens agreeing with float32"]}
REAL_INTROS = {
    False: ["## Real size: ONNX Runtime CPU, prompt 512, 16 greedy steps",
            "Files exported with `--model DIR --kv-cache --logits last [--quantize ...]` (quantized weight by weight as "
            "the export streams: no float file); the floor is the file's bytes over the measured copy bandwidth; tokens "
            "compared with the float32 file's, up to the first that differs (random weights: near-uniform predictions, so "
            "a flipped token says little; see the checkpoints above for accuracy)."],
    True: ["## Real size, encoder-decoder: ONNX Runtime CPU, source 512, 16 greedy steps",
           "Folders written with `--model DIR --out-dir OUT [--quantize ...]` (encoder_model.onnx and the cached "
           "decoder_model_merged.onnx, both quantized); the floor is the decoder file's bytes over the measured copy "
           "bandwidth; the policy is validate's on the pair (the quantized encoder's output into the quantized decoder, "
           "on text the float model writes from a random source; KL budget int8 0.00995, int4 0.0296 nats)."]}


def _real_cells(x: dict, base: dict, seq2seq: bool) -> list[str]:
    """A real-size row's cells past model and weights; base: its float32 row."""
    cells = [f"{x['file_gb']:.2f}", f"{x['export_s']:.0f}", f"{x['export_peak_gb']:.2f}", f"{x['prefill_s']:.2f}",
             f"{x['run_peak_gb']:.2f}", f"{x['decode_ms']:.1f}", f"{x['decode_ms'] / base['decode_ms']:.2f}",
             f"{x['floor_ms']:.1f}", f"{x['decode_ms'] / x['floor_ms']:.2f}", f"{x['eager_ms']:.1f}",
             f"{x['eager_ms'] / x['decode_ms']:.2f}"]
    policies = [x.get("policy", {}).get(f"L={n} B=1") for n in (64, 512)] if seq2seq else []
    cells += [f"KL {p['kl_mean']:.4f}, {p['verdict'].split()[0]}" if p else "-" for p in policies]
    return cells + [f"{x['tokens_equal_float']}/{len(x['tokens']) if seq2seq else 16}"]


def _real_lines(rows: list[dict], seq2seq: bool) -> list[str]:
    """The real-size rows of one kind (decoders, or encoder-decoder pairs), each beside its float32 row."""
    got = [x for x in rows if (x["model"] in real.SEQ2SEQ) == seq2seq and x["model"] not in ENCODER_ONLY]
    if not got:
        return []
    header = REAL_HEADERS[seq2seq]
    floats = {x["model"]: x for x in got if x["scheme"] == "float32" and "error" not in x}
    body = [[x["model"], x["scheme"], f"failed: {x.get('error', 'no float32 row').replace('|', '/')}"]
            + [""] * (len(header) - 3) if "error" in x or x["model"] not in floats else
            [x["model"], x["scheme"], *_real_cells(x, floats[x["model"]], seq2seq)] for x in got]
    title, intro = REAL_INTROS[seq2seq]
    lines = ["", title, "", intro, ""] + md_table(header, body)
    theirs = [x for x in got if "optimum" in x]
    if theirs:
        lines += ["", f"{OPTIMUM_INT8}: its export s and peak are Optimum's float32 export and then its "
                  "quantizer (ORTQuantizer, `--avx2 --per_channel`: quantize_dynamic on the whole file), "
                  "each in its own process: the seconds added, the larger peak:", ""]
        lines += [f"- {x['model']}: export {x['optimum']['export_s']:.0f} s at {x['optimum']['export_peak_gb']:.2f} GB, "
                  f"quantizer {x['optimum']['quantize_s']:.0f} s at {x['optimum']['quantize_peak_gb']:.2f} GB"
                  for x in theirs]
    return lines


def _encoder_lines(rows: list[dict]) -> list[str]:
    got = [x for x in rows if x["model"] in ENCODER_ONLY]
    header = ["model", "weights", "file GB", "export s", "export peak GB", "forward 512 s", "run peak GB",
              "embedding cosine (budget)", "worst token cosine", "float32 reference s, peak GB"]
    body = [[x["model"], x["scheme"], f"failed: {x['error']}"] + [""] * 7 if "error" in x else
            [x["model"], x["scheme"], f"{x['file_gb']:.2f}", f"{x['export_s']:.0f}", f"{x['export_peak_gb']:.2f}",
             f"{x['prefill_s']:.1f}", f"{x['run_peak_gb']:.2f}",
             f"{x['parity']['cosine_min']:.5f} ({x['parity']['budget_cosine']})", f"{x['parity']['token_cosine_min']:.4f}",
             f"{x['reference_s']:.0f}, {x['reference_peak_gb']:.2f}"] for x in got]
    return ["", "## Real size, an encoder alone: ONNX Runtime CPU, 512 tokens", "",
            "Exported with `--model DIR --out FILE --quantize int8` from bfloat16 shards (quantized weight by weight "
            "as the export streams); the embedding (mean of the tokens' states) judged against transformers float32, "
            "run block by block from the shards (the float32 model is larger than this machine's memory).", ""
            ] + md_table(header, body) if got else []


def _profile_lines(rows: list[dict], top: int = 8) -> list[str]:
    """Per model: one decode step (512 cached tokens) by operator type, each file side by side."""
    from .worker import ort_runner

    lines = []
    for model in dict.fromkeys(x["model"] for x in rows):
        got = {x["scheme"]: x["step_profile"] for x in rows if x["model"] == model and "step_profile" in x}
        if not got:
            continue
        step = ("one decoder step after 16 cached tokens, with a 512-token source" if model in real.SEQ2SEQ else
                "one step after 512 cached tokens")
        lines += ["", f"## Where a decode step goes: {model}", "",
                  f"ONNX Runtime's profiler (session option enable_profiling), {step}, "
                  "mean of 4 after a warm-up, all cores; ms per operator type (the largest), then the rest and the "
                  "step's wall time.", ""] + ort_runner("profile.py").side_by_side(got, top)
    return lines


def targets(r: QuantResults) -> list[tuple[str, str, bool]]:
    out = []
    for name, got in r.checkpoints.items():
        for s in SCHEMES:
            worst = max(got[s][str(n)] / got["float32"][str(n)] - 1 for n in r.lengths)
            out.append((f"{name} {s}: held-out perplexity within {100 * PPL_TARGET[s]:.0f}% of float32 at "
                        f"{', '.join(map(str, r.lengths))} tokens", f"{100 * worst:+.2f}%", worst <= PPL_TARGET[s]))
    floats = {x["model"]: x for x in r.real if x["scheme"] == "float32" and "error" not in x}
    for x in r.real:
        label = f"{x['model']} {x['scheme']}" + (" (encoder-decoder)" if x["model"] in real.SEQ2SEQ else
                                                 " (encoder)" if x["model"] in ENCODER_ONLY else "")
        if x["scheme"] in DECODE_TARGET and "error" in x:
            out.append((f"{label}: exported and run", f"failed: {x['error'][:120]}", False))
        elif x["scheme"] in DECODE_TARGET and x["model"] in floats:
            ratio = x["decode_ms"] / floats[x["model"]]["decode_ms"]
            out.append((f"{label}: decode <= {DECODE_TARGET[x['scheme']]}x float32",
                        f"{x['decode_ms']:.1f} / {floats[x['model']]['decode_ms']:.1f} ms = {ratio:.2f}",
                        ratio <= DECODE_TARGET[x["scheme"]]))
            out.append((f"{label}: decode within {FLOOR_TARGET}x its bandwidth floor",
                        f"{x['decode_ms']:.1f} / {x['floor_ms']:.1f} ms = {x['decode_ms'] / x['floor_ms']:.2f}",
                        x["decode_ms"] <= FLOOR_TARGET * x["floor_ms"]))
        if x["scheme"] in DECODE_TARGET and "export_peak_gb" in x and x["model"] not in real.SEQ2SEQ:
            bound = EXPORT_BOUND[0] * x["file_gb"] + EXPORT_BOUND[1]
            out.append((f"{label}: export peak <= {EXPORT_BOUND[0]}x the file + {EXPORT_BOUND[1]:.0f} GB",
                        f"{x['export_peak_gb']:.2f} GB (bound {bound:.2f})", x["export_peak_gb"] <= bound))
        if "parity" in x:
            out.append((f"{label}: embedding cosine to float32 >= {x['parity']['budget_cosine']}",
                        f"{x['parity']['cosine_min']:.5f}", x["parity"]["passed"]))
        for case, p in x.get("policy", {}).items():
            out.append((f"{label}: the quantized policy on the pair at {case}",
                        f"KL {p['kl_mean']:.4f} nats", p["verdict"] == "pass"))
    return out


def plot(r: QuantResults, path: Path) -> None:
    """Perplexity vs length per checkpoint: the quantized curves beside the float32 one."""
    from ..plots import length_axes, pyplot_for, save_figure

    plt = pyplot_for(path)
    if plt is None or not r.checkpoints:
        return
    names = list(r.checkpoints)
    cols = 5
    fig, axes = plt.subplots((len(names) + cols - 1) // cols, cols, figsize=(3.2 * cols, 5.6), squeeze=False)
    for ax, name in zip(axes.flat, names):
        for label, style in (("float32", "-"), ("int8", "--"), ("int4", ":")):
            got = r.checkpoints[name][label]
            ax.plot(r.lengths, [got[str(n)] for n in r.lengths], style, marker="o", markersize=3, label=label)
        length_axes(ax, "", "", name, fontsize=9, log_values=False)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    save_figure(plt, fig, path, f"Held-out perplexity vs length (trained at {r.lengths[0]}): float32, int8, int4 files "
                "on ONNX Runtime", fontsize=10)


def run_and_write(models_dir: Path, corpus: Path, real_names: list[str], work: Path, out_dir: Path, threads: int,
                  max_tokens: int, command: str, progress=print) -> list[Path]:
    results = previous_results(out_dir / "quantized.json")  # other runs' rows: a real-size run takes minutes
    out_dir.mkdir(parents=True, exist_ok=True)
    if models_dir is not None:
        rows, variants, lengths = checkpoint_perplexity(models_dir, corpus, max_tokens, progress)
        results.checkpoints = {k: {s: {str(n): p for n, p in v.items()} for s, v in got.items()} for k, got in rows.items()}
        results.variants = {k: {str(n): p for n, p in v.items()} for k, v in variants.items()}
        results.lengths = lengths
    for name in real_names:
        results.real = [x for x in results.real if x["model"] != name] + real_rows(name, work, threads, 16, progress)
    results.commands = sorted(set(results.commands) | {command})
    paths = write_results(out_dir, "quantized", results.__dict__, render(results))
    plot(results, out_dir / "quantized.png")
    return [*paths, out_dir / "quantized.png"]


def previous_results(path: Path) -> QuantResults:
    """The results file of an earlier run, or empty ones; ValueError (one line) for a file of
    another shape (not ours to overwrite)."""
    if not path.is_file():
        return QuantResults()
    try:
        results = QuantResults(**json.loads(path.read_text()))
    except (ValueError, TypeError, UnicodeDecodeError):
        raise ValueError(f"{path} is not a results file of bench-quant; move it away") from None
    results.lengths = tuple(results.lengths)
    return results
