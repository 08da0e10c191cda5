"""Long-context attention benchmark: our export (blocked and plain forms) on ONNX Runtime CPU
and OpenVINO, against PyTorch eager with the same bias and PyTorch's fused causal SDPA
without a bias, all in ONE run, every configuration in its own process (clean peak RSS).

Three variants: attention alone, causal (arch "attention": query, key, value [1, H, L, d] ->
[1, H, L, d], float32), so the numbers are about attention and nothing else; the same
bidirectional; and a whole transformer block (arch "block", hidden [1, L, H*d]) against the same
block in PyTorch with the fused causal kernel and no bias.
"""
from __future__ import annotations

import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from ..biases import BIASES, DEFAULT_BIAS, bias_class
from ..environment import describe, environment
from ..export.files import write_text_atomic
from ..limits import total_memory_share
from ..plots import length_axes, pyplot_for, save_figure
from .harness import Measured, run_into, write_results

LENGTHS = (512, 2048, 8192, 16384)
# ort-blocked-flag: the same file in a session with session.set_denormal_as_zero (the knob clients
# do not set): beside ort-blocked, whether the file's speed depends on it on this CPU
CONFIGS = ("ort-blocked", "ort-blocked-flag", "ort-plain", "openvino", "torch-eager", "torch-sdpa")
VARIANTS = ("causal", "bidirectional", "block")
# The bidirectional and block variants: our default export, OpenVINO on it, and the fused anchor,
# at the long lengths only (the targets are there; the plain forms would not fit anyway).
VARIANT_CONFIGS = {"causal": CONFIGS, "bidirectional": ("ort-blocked", "ort-blocked-flag", "openvino", "torch-sdpa"),
                   "block": ("ort-blocked", "ort-blocked-flag", "openvino", "torch-sdpa")}
LONG = 8192
DEFAULT_BLOCK_ROWS = 256  # the blocked form's rows per block (nn/plans.py DEFAULT_BLOCK)
WORKER = Path(__file__).with_name("worker.py")
# Peak bytes per score element of the plain forms, measured at L=8192 (H=8): ORT ~9 GB (4.2),
# PyTorch eager ~4.7 GB (2.2). 4.5 with headroom decides what to skip rather than swap or crash.
PLAIN_BYTES_PER_SCORE = 4.5 * 4
# The targets (benchmarks report whether they hold; tests never time anything).
TARGET_RSS_BYTES = 1 << 30
TARGET_LENGTHS = (8192, 16384)
TARGET_DEFAULT_RATIO = 1.0  # ALiBi and "none" vs fused SDPA without a bias
TARGET_OTHER_RATIO = 1.5  # every other bias; a block; bidirectional
TARGET_FLAG_RATIO = 1.05  # a default session's time vs the same file with subnormals flushed: no dependence


@dataclass
class Timing(Measured):
    """One (bias, config, length) measurement, or why it was not made."""

    bias: str
    config: str
    length: int
    loaded_rss: int | None = None
    variant: str = "causal"

    def as_dict(self) -> dict:
        return {**asdict(self), "min": self.min, "median": self.median}


def predicted_peak(config: str, heads: int, length: int) -> int:
    """Plain forms hold H*L^2 scores several times over; the others stay small."""
    if config in ("ort-plain", "torch-eager"):
        return int(PLAIN_BYTES_PER_SCORE * heads * length * length)
    return 0


def export_attention(bias: str, form: str, heads: int, head_dim: int, workdir: Path, variant: str = "causal") -> Path:
    from ..export import export_onnx
    from ..nn import ModelConfig, build_model

    cfg = ModelConfig(bias=bias, num_heads=heads, dim=heads * head_dim, causal=variant != "bidirectional")
    model = build_model(cfg, arch="block" if variant == "block" else "attention")
    path = workdir / f"{bias}_{form}_{variant}.onnx"
    export_onnx(model, path, attention=form, check_growth=False)
    return path


def variant_lengths(variant: str, lengths) -> list[int]:
    """causal: all; the others: the long ones (>= 8192), or the longest asked for."""
    lengths = list(lengths)
    return lengths if variant == "causal" else ([n for n in lengths if n >= LONG] or [max(lengths)])


def run_cell(cell: Timing, model: Path | None, heads: int, head_dim: int, repeats: int, timeout: float) -> Timing:
    runner = {"ort-blocked": "ort", "ort-blocked-flag": "ort", "ort-plain": "ort"}.get(cell.config, cell.config)
    cmd = [sys.executable, str(WORKER), "--runner", runner, "--bias", cell.bias, "--length", str(cell.length),
           "--heads", str(heads), "--head-dim", str(head_dim), "--repeats", str(repeats), "--variant", cell.variant,
           "--session", "flag" if cell.config == "ort-blocked-flag" else "defaults"]
    got = run_into(cell, cmd + (["--model", str(model)] if model is not None else []), timeout)
    cell.loaded_rss = got and got["loaded_rss"]
    return cell


def plan(biases, lengths, configs, variants=VARIANTS) -> list[Timing]:
    """Every cell to measure, in order; torch-sdpa has no bias, so it runs once per length."""
    unknown = sorted(set(configs) - set(CONFIGS)) + sorted(set(biases) - set(BIASES)) + sorted(set(variants) - set(VARIANTS))
    if unknown:
        raise ValueError(f"unknown bench configs, biases or variants: {', '.join(unknown)}")
    cells = []
    for variant in variants:
        chosen = [c for c in configs if c in VARIANT_CONFIGS[variant]]
        for length in variant_lengths(variant, lengths):
            for bias in biases:
                for config in chosen:
                    if config == "torch-sdpa" and bias != biases[0]:
                        continue
                    cells.append(Timing("-" if config == "torch-sdpa" else bias, config, length, variant=variant))
    return cells


def run(biases=BIASES, lengths=LENGTHS, configs=CONFIGS, repeats: int = 3, heads: int = 8, head_dim: int = 64,
        timeout: float = 900.0, workdir=None, progress=None, variants=("causal",)) -> list[Timing]:
    """Every cell of plan(); each exported model is made once."""
    budget = total_memory_share()
    cells = plan(biases, lengths, configs, variants)
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        models = {}
        for cell in cells:
            need = predicted_peak(cell.config, heads, cell.length)
            if need > budget:
                cell.skipped = f"skipped: needs ~{need / 1e9:.0f} GB (H*L^2 scores), budget {budget / 1e9:.0f} GB"
            else:
                model = None
                if cell.config in ("ort-blocked", "ort-blocked-flag", "ort-plain", "openvino"):
                    key = (cell.bias, "plain" if cell.config == "ort-plain" else "blocked", cell.variant)
                    if key not in models:
                        models[key] = export_attention(*key[:2], heads, head_dim, Path(tmp), key[2])
                    model = models[key]
                run_cell(cell, model, heads, head_dim, repeats, timeout)
            if progress:
                progress(1)
    return cells


def count(biases, lengths, configs, variants=("causal",)) -> int:
    return len(plan(biases, lengths, configs, variants))


def _find(cells, bias, config, length, variant="causal") -> Timing | None:
    for cell in cells:
        if (cell.config == config and cell.length == length and cell.variant == variant
                and (cell.bias == bias or config == "torch-sdpa")):
            return cell
    return None


def ratio(cells, bias, length, config, baseline, variant="causal") -> float | None:
    ours, base = _find(cells, bias, config, length, variant), _find(cells, bias, baseline, length, variant)
    if ours is None or base is None or not ours.ok or not base.ok:
        return None
    return ours.min / base.min


def _target(text: str, measured, limit) -> dict:
    return {"target": text, "measured": measured, "met": measured is not None and measured <= limit}


def targets(cells) -> list[dict]:
    """Issue 16's targets, judged on this run's numbers (None: not measured in this run)."""
    biases = list(dict.fromkeys(c.bias for c in cells if c.config != "torch-sdpa"))
    out = []
    for n in TARGET_LENGTHS:
        for bias in biases:
            limit = TARGET_DEFAULT_RATIO if bias in (DEFAULT_BIAS, "none") else TARGET_OTHER_RATIO
            out.append(_target(f"causal {bias} L={n}: ORT time <= {limit:g}x fused causal SDPA (no bias)",
                               ratio(cells, bias, n, "ort-blocked", "torch-sdpa"), limit))
    for bias in biases:
        cell = _find(cells, bias, "ort-blocked", TARGET_LENGTHS[-1])
        out.append(_target(f"causal {bias} L={TARGET_LENGTHS[-1]}: ORT peak RSS <= 1 GiB (1.07 GB)",
                           cell.peak_rss if cell is not None and cell.ok else None, TARGET_RSS_BYTES))
    for bias in biases:
        out.append(_target(f"block {bias} L={LONG}: ORT time <= {TARGET_OTHER_RATIO:g}x the PyTorch block with fused "
                           "causal SDPA (no bias)", ratio(cells, bias, LONG, "ort-blocked", "torch-sdpa", "block"),
                           TARGET_OTHER_RATIO))
    for bias in biases:
        for n in TARGET_LENGTHS:
            out.append(_target(f"bidirectional {bias} L={n}: ORT time <= {TARGET_OTHER_RATIO:g}x fused non-causal SDPA "
                               "(no bias)", ratio(cells, bias, n, "ort-blocked", "torch-sdpa", "bidirectional"),
                               TARGET_OTHER_RATIO))
        cell = _find(cells, bias, "ort-blocked", TARGET_LENGTHS[-1], "bidirectional")
        out.append(_target(f"bidirectional {bias} L={TARGET_LENGTHS[-1]}: ORT peak RSS <= 1 GiB (1.07 GB)",
                           cell.peak_rss if cell is not None and cell.ok else None, TARGET_RSS_BYTES))
    for variant in VARIANTS:
        for bias in biases:
            for n in TARGET_LENGTHS:
                measured = ratio(cells, bias, n, "ort-blocked", "ort-blocked-flag", variant)
                if measured is not None:
                    out.append(_target(f"{variant} {bias} L={n}: default session <= {TARGET_FLAG_RATIO:g}x the same file "
                                       "with session.set_denormal_as_zero", measured, TARGET_FLAG_RATIO))
    for bias in biases:
        for n in TARGET_LENGTHS:
            out.append(_target(f"causal {bias} L={n}: OpenVINO f32 time <= 1x ORT on the same file",
                               ratio(cells, bias, n, "openvino", "ort-blocked"), 1.0))
    return out


def _fmt_time(cell: Timing | None) -> str:
    if cell is None:
        return ""
    if not cell.ok:
        return "skip" if cell.skipped and cell.skipped.startswith("skipped") else "fail"
    return f"{cell.min:.3f} / {cell.median:.3f}"


def _fmt_gb(cell: Timing | None) -> str:
    return f"{cell.peak_rss / 1e9:.2f}" if cell is not None and cell.ok else ""


def _fmt_ratio(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}x"


VARIANT_TITLES = {
    "causal": "Causal attention alone",
    "bidirectional": "Bidirectional attention alone (`ort-blocked`: the bidirectional blocked form; "
                     "`torch-sdpa`: the fused kernel, not causal, no bias)",
    "block": "A whole transformer block (`--arch block`, dim = heads x head dim; `torch-sdpa`: the same "
             "block in PyTorch with the fused causal kernel and no bias)",
}


def _variant_tables(cells, variant: str) -> list[str]:
    ours = [c for c in cells if c.variant == variant]
    biases = list(dict.fromkeys(c.bias for c in ours if c.config != "torch-sdpa"))
    lengths = sorted({c.length for c in ours})
    configs = [c for c in CONFIGS if any(x.config == c for x in ours)]
    anchors = ["torch-sdpa"] + (["torch-eager"] if "torch-eager" in configs else [])
    anchors += ["ort-blocked-flag"] if "ort-blocked-flag" in configs else []
    named = {"ort-blocked-flag": "flag on"}
    lines = [f"## {VARIANT_TITLES[variant]}", "", "Ratios (min time): ORT blocked in a default session vs the PyTorch "
             "anchors" + (", and vs itself with session.set_denormal_as_zero (`flag on`: 1.00x means the default session "
                          "loses nothing to subnormal floats on this CPU)" if "ort-blocked-flag" in anchors else "") + ".", "",
             "| bias | " + " | ".join(f"L={n} vs {named.get(a, a.removeprefix('torch-'))}" for n in lengths for a in anchors)
             + " |", "|---|" + "---|" * (len(lengths) * len(anchors))]
    for bias in biases:
        row = [_fmt_ratio(ratio(cells, bias, n, "ort-blocked", a, variant)) for n in lengths for a in anchors]
        lines.append(f"| {bias} | " + " | ".join(row) + " |")
    lines += ["", "Time (s, min / median) and peak RSS (GB).", "",
              "| bias | L | " + " | ".join(f"{c} s | {c} GB" for c in configs) + " |",
              "|---|---|" + "---|---|" * len(configs)]
    for bias in biases:
        for n in lengths:
            cols = [f"{_fmt_time(_find(cells, bias, c, n, variant))} | {_fmt_gb(_find(cells, bias, c, n, variant))}"
                    for c in configs]
            lines.append(f"| {bias} | {n} | " + " | ".join(cols) + " |")
    return lines + [""]


def markdown(cells, env: dict, heads: int, head_dim: int) -> str:
    lines = [
        "# Long-context attention: ONNX Runtime CPU vs PyTorch", "",
        "Generated by `python -m posbias_export bench` (do not edit by hand). Attention alone: "
        f"query/key/value [1, {heads}, L, {head_dim}], float32, batch 1; also a whole block. Every cell ran in "
        "its own process; time is seconds per forward, min / median over the repeats after one warm-up; RSS is "
        "that process's peak. `ort-blocked` is our default export (a Loop over query blocks) in ONNX Runtime's "
        "default session (what Optimum, transformers.js, fastembed, genai and Triton give you), `ort-blocked-flag` "
        "the same file with `session.set_denormal_as_zero=1`, `ort-plain` "
        "the whole [H, L, L] form, `openvino` the default export on OpenVINO f32, `torch-eager` the "
        "PyTorch model with the same bias, `torch-sdpa` PyTorch's fused kernel WITHOUT a bias "
        "(the practical limit here).", "",
        describe(env), "",
        "## Targets", "",
        "| target | measured | met |", "|---|---|---|",
    ]
    for t in targets(cells):
        m = t["measured"]
        shown = "-" if m is None else (f"{m / 1e9:.2f} GB" if "RSS" in t["target"] else f"{m:.2f}x")
        verdict = "yes" if t["met"] else ("not measured in this run" if m is None else "NO")
        lines.append(f"| {t['target']} | {shown} | {verdict} |")
    lines.append("")
    for variant in VARIANTS:
        if any(c.variant == variant for c in cells):
            lines += _variant_tables(cells, variant)
    notes = sorted({f"{c.variant} {c.config} L={c.length}: {c.skipped}" for c in cells if c.skipped and c.config == "torch-sdpa"}
                   | {f"{c.variant} {c.bias} {c.config} L={c.length}: {c.skipped}" for c in cells
                      if c.skipped and c.config != "torch-sdpa"})
    if notes:
        lines += ["## Not measured", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def plot(cells, path: Path) -> bool:
    """Writes the figure; returns False when matplotlib is missing (skipped, said on stderr)."""
    plt = pyplot_for(path)
    if plt is None:
        return False

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.8))
    styles = {"ort-blocked": "-o", "ort-blocked-flag": ":o", "ort-plain": "--s", "openvino": "-^", "torch-eager": ":x",
              "torch-sdpa": "-k"}
    for config in CONFIGS:
        points = sorted((c.length, c.min, c.peak_rss) for c in cells
                        if c.config == config and c.ok and c.bias in (DEFAULT_BIAS, "-") and c.variant == "causal")
        if points:
            label = f"{config} ({'no bias' if config == 'torch-sdpa' else DEFAULT_BIAS})"
            ax_t.plot([p[0] for p in points], [p[1] for p in points], styles[config], label=label)
            ax_m.plot([p[0] for p in points], [p[2] / 1e9 for p in points], styles[config], label=label)
    for bias in dict.fromkeys(c.bias for c in cells if c.bias not in (DEFAULT_BIAS, "-")):
        points = sorted((c.length, c.min) for c in cells
                        if c.config == "ort-blocked" and c.bias == bias and c.ok and c.variant == "causal")
        if points:
            ax_t.plot([p[0] for p in points], [p[1] for p in points], "-", lw=0.8, alpha=0.6, label=f"ort-blocked ({bias})")
    for ax, title, unit in ((ax_t, "time per forward", "s"), (ax_m, "peak RSS", "GB")):
        length_axes(ax, "sequence length L", unit, title)
    ax_t.legend(fontsize=7)
    save_figure(plt, fig, path, "Causal attention, H=8, d=64, fp32, batch 1")
    return True


def write(cells, out_dir: Path, heads: int, head_dim: int, stem: str = "attention") -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    env = environment()
    data = {"heads": heads, "head_dim": head_dim, "environment": env, "targets": targets(cells),
            "cells": [c.as_dict() for c in cells]}
    json_md = write_results(out_dir, stem, data, markdown(cells, env, heads, head_dim))[::-1]
    png = out_dir / f"{stem}.png"
    return json_md + [png] if plot(cells, png) else json_md


def profile_biases(biases) -> list[str]:
    """The two ends of what the per-block bias costs: the default bias (its key-row shortcut,
    if it has one) and the first other family that evaluates its bias for every (query, key) pair."""
    full = [b for b in biases if b != DEFAULT_BIAS and bias_class(b).key_row_function is None
            and not bias_class(b).head_independent]
    return [b for b in biases if b == DEFAULT_BIAS] + full[:1]


def scores_per_forward(heads: int, length: int, variant: str) -> int:
    """The (query, key) scores attention computes: the lower triangle with its diagonal (causal), or all."""
    return heads * length * (length + 1) // 2 if variant == "causal" else heads * length * length


def write_profile(biases, length: int, heads: int, head_dim: int, out_dir: Path, stem: str = "attention") -> Path:
    """ORT's profiler (a default session) on the blocked export at `length`: every family's bytes
    moved per score, causal and bidirectional, and the per-operator tables of profile_biases(biases)."""
    from .worker import make_inputs, ort_runner

    profiler = ort_runner("profile.py")
    inputs = dict(zip(("query", "key", "value"), make_inputs(heads, head_dim, length)))
    moved, tables = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        for variant in ("causal", "bidirectional"):
            for bias in biases:
                result = profiler.profile(export_attention(bias, "blocked", heads, head_dim, Path(tmp), variant), inputs)
                moved[bias, variant] = (result["bytes"] / scores_per_forward(heads, length, variant), result["kernel_us"])
                if variant == "causal" and bias in profile_biases(biases):
                    tables.append(profiler.markdown(result, f"{bias}, blocked form"))
    lines = [f"# Where ONNX Runtime's time goes: blocked attention at L={length}", "",
             f"Generated by `python -m posbias_export bench` with ORT's profiler, a default session (H={heads}, "
             f"d={head_dim}, fp32, batch 1). {describe(environment(bandwidth=False))}", "",
             "## Bytes moved per score", "",
             "Every kernel's inputs and outputs (ONNX Runtime's activation and output sizes; shapes and aliasing "
             "views left out) summed over a forward, divided by the scores attention computes (H L (L + 1) / 2 "
             "causal, H L^2 bidirectional). A score is 4 bytes: the floor of a form that writes the scores once "
             "and reads them once is 8; every pass over [H, rows, keys] adds 4 (a read) or 8 (a read and a write).",
             "", "| bias | causal B/score | causal kernels s | bidirectional B/score | bidirectional kernels s |",
             "|---|---|---|---|---|"]
    for bias in biases:
        cells = [moved[bias, v] for v in ("causal", "bidirectional")]
        lines.append(f"| {bias} | " + " | ".join(f"{b:.1f} | {us / 1e6:.3f}" for b, us in cells) + " |")
    lines += ["", "## Kernel time by operator (causal)", "",
              "Node kernel time summed by operator, per forward.", "", *tables]
    path = out_dir / f"{stem}_profile.md"
    write_text_atomic(path, "\n".join(lines))
    return path


def check_lengths(lengths, heads: int, head_dim: int, ignore: bool = False) -> None:
    """Before anything runs: the longest length's q, k, v and one block's scores (the blocked
    form; the plain forms are skipped per cell when they cannot fit) fit this machine."""
    from ..limits import attention_bytes, check_fits, check_index

    longest = max(lengths)
    check_index(longest, "a bench length")
    need = 4.0 * heads * longest * head_dim * 4 + attention_bytes(1, heads, DEFAULT_BLOCK_ROWS, longest)
    check_fits(need, f"bench at length {longest}", ignore)


def run_and_write(biases=BIASES, lengths=LENGTHS, configs=CONFIGS, variants=VARIANTS, repeats: int = 3, heads: int = 8,
                  head_dim: int = 64, timeout: float = 900.0, profile_length: int = 8192, out_dir="benchmarks",
                  progress=None, ignore_size_limits: bool = False) -> list[Path]:
    """`bench`: every cell, then attention.md/.json/.png (and the ORT profile at profile_length).
    A run in which no cell measured anything writes nothing (the results files it would replace
    stay) and is a ValueError."""
    from ..export.files import output_folder

    plan(biases, lengths, configs, variants)  # unknown names: one line before anything runs
    check_lengths([*lengths, profile_length or 1], heads, head_dim, ignore_size_limits)
    out = output_folder(out_dir)
    cells = run(biases, lengths, configs, repeats, heads, head_dim, timeout, progress=progress, variants=variants)
    if not any(cell.ok for cell in cells):
        reasons = sorted({cell.skipped for cell in cells if cell.skipped})
        raise ValueError(f"no configuration ran ({reasons[0] if reasons else 'nothing measured'}); "
                         f"the results in {out} are left as they were")
    paths = write(cells, out, heads, head_dim)
    if profile_length:
        paths.append(write_profile(biases, profile_length, heads, head_dim, out))
    return paths
