"""Smoke test of the long-context benchmark (tiny lengths; no timing is judged here) and its
bookkeeping: skip rules, failure reporting, the targets table."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

from posbias_export.bench import attention as bench
from posbias_export.cli import main as cli_main
from posbias_export.environment import environment



def _timing(bias, config, length, times=(), peak_rss=None, loaded_rss=None, **kw):
    """A Timing from positional figures (times, peak RSS, loaded RSS), as the tables read them."""
    return bench.Timing(bias, config, length, times=list(times), peak_rss=peak_rss, loaded_rss=loaded_rss, **kw)

@pytest.mark.slow
def test_bench_command_end_to_end(tmp_path, capsys):
    out = tmp_path / "bench"
    # 300 > the 256-row block: the Loop runs (64 takes the If's one-block branch)
    argv = ["bench", "--biases", "kerple_log", "--lengths", "64,300", "--repeats", "1",
            "--profile-length", "300", "--out-dir", str(out)]
    assert cli_main(argv) == 0
    data = json.loads((out / "attention.json").read_text())
    cells = data["cells"]
    # causal: 1 bias x 2 lengths x 5 per-bias configs (ort-blocked and its denormals-as-zero twin,
    # ort-plain, openvino, torch-eager) + torch-sdpa once per length; bidirectional and block: the
    # longest length only, 1 bias x 3 configs (ort-blocked, its twin, openvino) + torch-sdpa
    assert len(cells) == (1 * 2 * 5 + 2) + 2 * (1 * 3 + 1)
    for cell in cells:
        assert cell["skipped"] is None, cell
        assert len(cell["times"]) == 1 and cell["times"][0] > 0
        assert cell["peak_rss"] >= cell["loaded_rss"] > 0
    assert {c["config"] for c in cells} == set(bench.CONFIGS)
    assert {(c["variant"], c["length"]) for c in cells if c["variant"] != "causal"} == {("bidirectional", 300), ("block", 300)}
    assert data["targets"][0]["target"].startswith("causal kerple_log L=8192")
    md = (out / "attention.md").read_text()
    assert "## Targets" in md and "| kerple_log | 300 |" in md
    assert "## Bidirectional attention alone" in md and "## A whole transformer block" in md
    assert (out / "attention.png").stat().st_size > 10_000
    profile = (out / "attention_profile.md").read_text()
    # the profiler sees the kernels inside the Loop body, not just the Loop node
    for op in ("MatMul", "Softmax"):
        assert f"| {op} |" in profile
    assert "Loop " in profile and "If " in profile
    assert "attention.md" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["bench", "--biases", "alibi,bogus"], "unknown bench configs, biases or variants: bogus"),
    (["bench", "--configs", "ort-gpu"], "unknown bench configs, biases or variants: ort-gpu"),
    (["bench", "--variants", "causal,sideways"], "unknown bench configs, biases or variants: sideways"),
    (["bench", "--lengths", "0"], "positive"),
], ids=["bias", "config", "variant", "length"])
def test_bench_bad_arguments_exit_2_with_one_line(argv, message, capsys, tmp_path):
    assert cli_main(argv + ["--out-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_plain_forms_are_skipped_when_they_cannot_fit(monkeypatch, tmp_path):
    monkeypatch.setattr(bench, "total_memory_share", lambda: 10_000_000)  # 10 MB
    cells = bench.run(["alibi"], [512], ("ort-plain", "torch-eager"), repeats=1, workdir=tmp_path)
    assert all(c.skipped and c.skipped.startswith("skipped: needs") for c in cells)
    assert bench.predicted_peak("ort-blocked", 8, 16384) == 0
    assert bench.predicted_peak("torch-eager", 8, 8192) == pytest.approx(18 * 8 * 8192**2)


def test_a_failing_worker_is_reported_not_raised(tmp_path):
    cell = bench.run_cell(_timing("alibi", "ort-blocked", 16), tmp_path / "missing.onnx", 8, 64, 1, 60)
    assert not cell.ok and cell.skipped.startswith("failed (exit 1)")


def test_targets_judge_the_measured_ratios():
    """ALiBi must reach 1x fused SDPA, other biases 1.5x; 1 GB at 16384; block and bidirectional 1.5x."""
    cells = [_timing("alibi", "ort-blocked", 8192, [1.2], 1, 1),
             _timing("kerple_log", "ort-blocked", 8192, [1.2], 1, 1),
             _timing("-", "torch-sdpa", 8192, [1.0], 1, 1),
             _timing("alibi", "ort-blocked", 16384, [4.0], 900 << 20, 1),
             _timing("kerple_log", "ort-blocked", 16384, [4.0], 1100 << 20, 1),
             _timing("-", "torch-sdpa", 16384, [4.0], 1, 1),
             _timing("alibi", "ort-blocked", 8192, [2.0], 1, 1, variant="block"),
             _timing("-", "torch-sdpa", 8192, [1.0], 1, 1, variant="block"),
             _timing("alibi", "openvino", 8192, [1.1], 1, 1)]
    judged = {t["target"]: t["met"] for t in bench.targets(cells) if t["measured"] is not None}
    assert judged == {
        "causal alibi L=8192: ORT time <= 1x fused causal SDPA (no bias)": False,  # 1.2x
        "causal kerple_log L=8192: ORT time <= 1.5x fused causal SDPA (no bias)": True,
        "causal alibi L=16384: ORT time <= 1x fused causal SDPA (no bias)": True,
        "causal kerple_log L=16384: ORT time <= 1.5x fused causal SDPA (no bias)": True,
        "causal alibi L=16384: ORT peak RSS <= 1 GiB (1.07 GB)": True,
        "causal kerple_log L=16384: ORT peak RSS <= 1 GiB (1.07 GB)": False,
        "block alibi L=8192: ORT time <= 1.5x the PyTorch block with fused causal SDPA (no bias)": False,  # 2x
        "causal alibi L=8192: OpenVINO f32 time <= 1x ORT on the same file": True,  # 1.1 / 1.2
    }


def test_targets_not_measured_say_so():
    """A run on a subset of lengths has no figure for some targets: not a failed target."""
    cells = [_timing("alibi", "ort-blocked", 512, [0.01], 1, 1), _timing("-", "torch-sdpa", 512, [0.01], 1, 1)]
    text = bench.markdown(cells, environment(), 8, 64)
    rows = [l for l in text.splitlines() if l.startswith(f"| causal {bench.DEFAULT_BIAS} L=")]
    assert rows and all(l.endswith("| - | not measured in this run |") for l in rows)


def test_without_matplotlib_tables_are_written_and_the_plot_skipped(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    cells = [_timing("alibi", "ort-blocked", 512, [0.01], 1, 1)]
    paths = bench.write(cells, tmp_path, 8, 64)
    assert [p.name for p in paths] == ["attention.json", "attention.md"] and all(p.is_file() for p in paths)
    assert not (tmp_path / "attention.png").exists()
    assert "matplotlib is not installed: skipped" in capsys.readouterr().err


def test_decode_steps_alternate_in_chunks_after_settling():
    """bench-decode keeps `steps` timings per runtime, taken in alternating chunks of 16 after
    8 settling steps each (the other runtime's threads are still awake there)."""
    from posbias_export.bench.decode import time_alternating

    calls = []
    first, second = time_alternating(lambda: calls.append("ort"), lambda: calls.append("torch"), steps=20)
    assert len(first) == len(second) == 20
    assert calls == ["ort"] * 24 + ["torch"] * 24 + ["ort"] * 12 + ["torch"] * 12


def test_bench_real_renders_targets_from_measured_figures():
    """bench-real's table judges each figure against its target: export peak / file <= 1.5,
    decode / bandwidth floor <= 1.2, transformers eager / ours >= 2; tokens compared."""
    from posbias_export.bench.real_models import RealRow, render
    from posbias_export.environment import copy_bandwidth_gbs

    row = RealRow("bloom-560m", {"n_layer": 24}, 2.24, exports=[
        {"dtype": "float32", "seconds": 80.0, "peak_gb": 0.8, "file_gb": 2.24, "ratio": 0.8 / 2.24},
        {"dtype": "float16", "seconds": 60.0, "peak_gb": 2.3, "file_gb": 1.12, "ratio": 2.3 / 1.12}],
        runs=[{"prompt": 512, "lean": False, "prefill_s": 2.0, "peak_gb": 3.3, "weights_gb": 2.24, "decode_ms": 90.0,
               "floor_ms": 80.0, "bandwidth_gbs": 28.0, "tokens": [1, 2], "transformers_decode_ms": 400.0,
               "tokens_equal": True}])
    text = render([row], "python -m posbias_export bench-real")
    assert text.startswith("<!-- generated by: python -m posbias_export bench-real -->")
    exports = [line for line in text.splitlines() if line.startswith("| bloom-560m | float")]
    assert exports[0].endswith("| met |") and exports[1].endswith("| NOT met |")
    run = next(line for line in text.splitlines() if line.startswith("| bloom-560m | 512"))
    assert "| 1.12 |" in run and "| 4.44 |" in run and run.endswith("| yes |")  # 90/80, 400/90
    assert "| bloom-560m | decode <= 1.2 x the bandwidth floor | 90.0 / 80.0 ms = 1.12 | met |" in text
    assert "| bloom-560m | export float16: peak RSS <= 1.5 x the file's weights + 0.5 GB | 2.30 GB / 1.12 GB = 2.05 | NOT met |" in text
    assert copy_bandwidth_gbs(megabytes=8, repeats=2) > 0.1


def test_bench_real_refuses_an_unknown_model_in_one_line(capsys, tmp_path):
    assert cli_main(["bench-real", "--models", "gpt-5", "--work", str(tmp_path), "--out-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "unknown model 'gpt-5'" in err and len(err.splitlines()) == 1


def test_harness_keeps_hand_written_prose_and_earlier_rows(tmp_path):
    """Regenerating a results file keeps what a person wrote below the mark (what we know of a
    number lives in the markdown, not in code) and the rows of models this run did not measure;
    a results file of another shape is refused in one line, not overwritten."""
    import json

    from posbias_export.bench.harness import PROSE_MARK, kept_rows, write_results

    write_results(tmp_path, "r", [{"name": "a", "ms": 1.0}], "# Results\n\n| a | 1.0 |\n")
    md = tmp_path / "r.md"
    md.write_text(md.read_text() + f"\n{PROSE_MARK}\n\n## Why a is slow\n\nThe cache copy.\n")
    write_results(tmp_path, "r", [{"name": "a", "ms": 2.0}], "# Results\n\n| a | 2.0 |\n")
    text = md.read_text()
    assert "| a | 2.0 |" in text and "| a | 1.0 |" not in text
    assert text.count(PROSE_MARK) == 1 and text.rstrip().endswith("The cache copy.")
    assert kept_rows(tmp_path / "r.json", {"b"}) == [{"name": "a", "ms": 2.0}]
    assert kept_rows(tmp_path / "r.json", {"a"}) == []
    (tmp_path / "other.json").write_text(json.dumps({"name": "not rows"}))
    with pytest.raises(ValueError, match="not a results file of this benchmark"):
        kept_rows(tmp_path / "other.json", {"a"})


def test_run_child_reports_failures_in_one_line():
    from posbias_export.bench.harness import ChildFailed, run_child

    assert run_child([sys.executable, "-c", "print('noise'); print('{\"times\": [1.0]}')"], 60) == {"times": [1.0]}
    for code, words in (("import sys; sys.exit(3)", "failed (exit 3)"),
                        ("print('{\"error\": \"no memory\"}')", "error: no memory"),
                        ("import time; time.sleep(5)", "timed out after 1 s")):
        with pytest.raises(ChildFailed, match=re.escape(words)):
            run_child([sys.executable, "-c", code], 1 if "sleep" in code else 60)


def test_bench_serving_renders_targets_and_refuses_names_first(tmp_path, capsys):
    """The serving table judges in-place against Concat and against the floor from measured
    figures; an unknown model is one line and creates no folder."""
    from posbias_export.bench.serving import ServingRow, render, targets

    def run(scheme, file, ms, floor=10.0):
        return {"scheme": scheme, "file": file, "context": 4096, "prefill_s": 1.0, "prefill_peak_gb": 1.0,
                "peak_gb": 1.2, "decode_ms": ms, "floor_ms": floor, "tokens": [1, 2, 3]}

    row = ServingRow("bloom-560m", runs=[run("int4", "concat", 50.0), run("int4", "in place", 25.0),
                                         run("float32", "concat", 90.0, 60.0), run("float32", "in place", 80.0, 60.0)],
                     bandwidth_gbs=40.0)
    verdicts = {t: (v, ok) for _, t, v, ok in targets([row])}
    assert verdicts["int4 at 4096: in place / Concat <= 0.6"] == ("0.50", True)
    assert verdicts["int4 at 4096: in place / floor <= 1.3"] == ("2.50", False)
    assert verdicts["float32 at 4096: in place / floor <= 1.2"] == ("1.33", False)
    assert "| bloom-560m | int4 | in place | 4096 | 2 | - | 1.00 | 1.00 | 1.20 | 25.0 | - | 10.0 | 2.50 | yes |" in render([row], "cmd")
    assert cli_main(["bench-serving", "--models", "gpt-17b", "--work", str(tmp_path / "w"),
                     "--out-dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown model(s) gpt-17b" in err[0]
    assert not (tmp_path / "w").exists() and not (tmp_path / "o").exists()


def test_bench_serving_measured_in_parts_keeps_what_it_did_not_repeat(tmp_path, capsys):
    """A model measured again with --files optimum,eager keeps its earlier runs of our files, and
    the new rows are judged against the Concat file's tokens; an unknown --files is one line."""
    from posbias_export.bench.serving import EAGER, OPTIMUM, ServingRow, merged, render

    def run(file, context, ms, tokens=(1, 2, 3)):
        return {"scheme": "float32", "file": file, "context": context, "prefill_s": 1.0, "prefill_peak_gb": 1.0,
                "peak_gb": 1.2, "decode_ms": ms, "floor_ms": 10.0, "tokens": list(tokens)}

    earlier = ServingRow("bloom-560m", runs=[run("concat", 512, 50.0), run("in place", 512, 40.0),
                                             run(OPTIMUM, 512, 99.0)], bandwidth_gbs=40.0)
    fresh = ServingRow("bloom-560m", runs=[run(EAGER, 512, 120.0, (1, 2, 4)), run(OPTIMUM, 512, 60.0)], bandwidth_gbs=41.0)
    row = merged(earlier, fresh)
    assert [(r["file"], r["decode_ms"]) for r in row.runs] == [("concat", 50.0), ("in place", 40.0), (OPTIMUM, 60.0),
                                                               (EAGER, 120.0)]
    table = render([row], "cmd")
    assert f"| bloom-560m | float32 | {OPTIMUM} | 512 | 2 | - | 1.00 | 1.00 | 1.20 | 60.0 | - | 10.0 | 6.00 | yes |" in table
    assert f"| bloom-560m | float32 | {EAGER} | 512 | 2 | - | 1.00 | 1.00 | 1.20 | 120.0 | - | 10.0 | 12.00 | no |" in table
    # a client that cannot serve a prompt is a row saying why (Optimum's MPT past its max_seq_len)
    row.runs.append({"scheme": "float32", "file": OPTIMUM, "context": 4096, "error": "RunnerError: 2048 by 4096"})
    assert f"| bloom-560m | float32 | {OPTIMUM} | 4096 | | | failed: RunnerError: 2048 by 4096 |" in render([row], "cmd")
    assert cli_main(["bench-serving", "--files", "optimum,tensorrt", "--work", str(tmp_path / "w"),
                     "--out-dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown --files 'tensorrt'" in err[0]
    assert not (tmp_path / "w").exists()


def test_bench_serving_judges_our_files_beside_llama_cpp(monkeypatch):
    """Issue 60's targets from measured rows: each of our in-place files over llama.cpp's file
    bytes, peak RSS, and decode CPU time per token at 4096; without llama_cpp its rows are
    skipped with the reason."""
    from posbias_export.bench.serving import LLAMA_CPP, ServingRow, llama_cpp_targets, render
    from posbias_export.peers import llama_cpp_runs

    def run(file, context, cpu, file_gb, peak, scheme="int4"):
        return {"scheme": scheme, "file": file, "context": context, "prefill_s": 1.0, "prefill_peak_gb": 1.0,
                "peak_gb": peak, "decode_ms": cpu, "decode_cpu_ms": cpu, "file_gb": file_gb, "floor_ms": 10.0,
                "tokens": [1]}

    row = ServingRow("bloom-560m", runs=[run("in place", 4096, 99.0, 0.40, 1.0), run("in place, float16 cache", 4096, 40.0, 0.40, 0.9),
                                         run(LLAMA_CPP, 4096, 50.0, 0.39, 1.0),
                                         run("in place", 4096, 60.0, 0.37, 1.0, scheme="int4-b64")], bandwidth_gbs=16.0)
    got = {t: (v, ok) for _, t, v, ok in llama_cpp_targets([row])}
    name = "int4 at 4096, ours (in place, float16 cache) / llama.cpp"
    assert got[f"{name}: peak RSS <= 1.1"] == ("0.90", True)
    assert got[f"{name}: decode CPU ms/token <= 0.9"] == ("0.80", True)
    plain = "int4 at 4096, ours (in place) / llama.cpp"
    assert got[f"{plain}: file bytes <= 1.05"] == ("1.03", True)
    assert got[f"{plain}: decode CPU ms/token <= 0.9"] == ("1.98", False)
    # blocks of 64 (4.56 bits a weight) are judged beside Q4_0 (4.5), as int4's blocks of 32 are
    assert got["int4-b64 at 4096, ours (in place) / llama.cpp: file bytes <= 1.05"] == ("0.95", True)
    assert "| bloom-560m | int4 | llama.cpp | 4096 | 2 | 0.39 | 1.00 | 1.00 | 1.00 | 50.0 | 50.0 | 10.0 | 5.00 | - |" in render([row], "c")
    monkeypatch.setitem(__import__("sys").modules, "llama_cpp", None)
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    assert "llama_cpp is not importable" in llama_cpp_runs.missing()


def test_a_sharded_random_folder_loads_as_published(tmp_path, monkeypatch):
    """The 7B writer (hf/shards.py) on a tiny MPT: several shards and an index, bfloat16, the
    head tied on load by transformers, weights at the initializer's scale, norms at one."""
    import transformers as tf

    from posbias_export.hf import shards

    monkeypatch.setattr(shards, "SHARD_BYTES", 100_000)
    out = shards.write_sharded(("MptForCausalLM", "MptConfig", dict(
        vocab_size=500, d_model=64, n_layers=2, n_heads=4, max_seq_len=128, expansion_ratio=4)), tmp_path / "m")
    assert len(list(out.glob("model-*-of-*.safetensors"))) >= 3 and (out / "model.safetensors.index.json").is_file()
    model = tf.AutoModelForCausalLM.from_pretrained(out)
    wqkv = model.transformer.blocks[0].attn.Wqkv.weight.detach().float()
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    assert model.transformer.wte.weight.dtype == torch.bfloat16 and abs(float(wqkv.std()) - 0.02) < 0.002
    assert float(model.transformer.blocks[0].norm_1.weight.float().min()) == 1.0


def test_a_sharded_t5_is_drawn_by_its_own_initializer_and_its_table_written_once(tmp_path):
    """T5's initializer scales each projection by its fan-in (q by (d_model * d_kv)^-1/2, the
    feed-forward's output by d_ff^-1/2, the table N(0, 1)): a flat N(0, 0.02) at UMT5-XXL's width
    gave attention logits ~13 wide and an int8 file at cosine 0.43, a property of the draw, not of
    a published model. The encoder's embed_tokens, the same tensor as shared, is written once."""
    import json

    import transformers as tf

    from posbias_export.hf import shards

    fields = dict(vocab_size=1000, d_model=256, d_kv=32, d_ff=512, num_layers=2, num_heads=8, feed_forward_proj="gated-gelu")
    out = shards.write_sharded(("UMT5EncoderModel", "UMT5Config", fields), tmp_path / "u", "float32")
    assert "encoder.embed_tokens.weight" not in json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    model = tf.UMT5EncoderModel.from_pretrained(out)
    attention, ff = model.encoder.block[1].layer[0].SelfAttention, model.encoder.block[0].layer[1].DenseReluDense
    for weight, std in ((attention.q.weight, (256 * 32) ** -0.5), (attention.k.weight, 256 ** -0.5),
                        (ff.wo.weight, 512 ** -0.5), (model.shared.weight, 1.0)):
        assert abs(float(weight.detach().std()) / std - 1) < 0.05, (weight.shape, float(weight.detach().std()), std)
    assert model.encoder.embed_tokens.weight.data_ptr() == model.shared.weight.data_ptr()


def test_a_bench_writes_only_what_it_made(tmp_path, monkeypatch):
    """bench-quant once deleted WORK/<name>_<scheme>.onnx and WORK/<name>_<scheme>/ it had not
    made, and bench-real measured whatever folder it found at WORK/<name>: now every file a bench
    makes lives in its own scratch folder (gone after the run), and WORK/<name> is reused only if it
    is the published configuration."""
    import json

    from posbias_export.bench import quantized, real_models
    from posbias_export.hf import published

    work = tmp_path / "work"
    folder = work / "bloom-560m"
    folder.mkdir(parents=True)
    config = published.PUBLISHED["bloom-560m"][2]
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "bloom"}))
    mine = [work / "bloom-560m_int8.onnx", work / "bloom-560m_int4" / "keep.txt"]
    for path in mine:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("a user's file")
    made = []

    def fake_row(name, label, spec, folder, place, *rest):
        (place / f"{name}.onnx").write_text("export")
        made.append(place / f"{name}.onnx")
        return {"model": name, "scheme": label, "tokens": [1]}

    monkeypatch.setattr(quantized, "_decoder_row", fake_row)
    monkeypatch.setattr(real_models, "optimum_cli", lambda: None)  # Optimum's row: its own test
    monkeypatch.setattr(quantized, "copy_bandwidth_gbs", lambda: 40.0)
    for module in (quantized, real_models):  # the exports, and the runs (real_models.worker_run)
        monkeypatch.setattr(module, "measured_python", lambda *a, **k: (0.0, 0.0, json.dumps({"decode_ms": [1.0]})))
    rows = quantized.real_rows("bloom-560m", work, 1, 2, progress=lambda m: None)
    assert len(rows) == 4 and all(p.parent != work for p in made)
    assert all(p.read_text() == "a user's file" for p in mine)
    assert sorted(p.name for p in work.iterdir()) == ["bloom-560m", "bloom-560m_int4", "bloom-560m_int8.onnx"]
    (folder / "config.json").write_text(json.dumps({**config, "hidden_size": 64, "model_type": "bloom"}))
    with pytest.raises(ValueError, match="not the published bloom-560m configuration \\(hidden_size is 64"):
        published.published_folder("bloom-560m", work)


def test_bench_quant_measures_optimums_quantizer_in_its_scratch_and_judges_the_export_bound(tmp_path, monkeypatch):
    """Optimum's int8 (its export, then its quantizer) is one more row, made in bench-quant's
    scratch folder and removed; a quantizer that fails is a row with its words. The streamed
    export's bound (peak <= 1.5x the file + 1 GB) is a target per quantized row."""
    from posbias_export.bench import quantized, real_models

    calls = []

    def fake_child(args, program=None, **_):
        calls.append(args)
        if args[:2] == ["onnxruntime", "quantize"]:
            out = Path(args[args.index("-o") + 1])
            out.mkdir()
            (out / "model_quantized.onnx").write_bytes(b"x" * 1000)
            return 30.0, 9.5, ""
        if args[:2] == ["export", "onnx"]:
            return 60.0, 6.0, ""
        return 1.0, 1.5, '{"prefill_s": 0.5, "decode_ms": [20.0, 22.0], "tokens": [1, 2]}'

    monkeypatch.setattr(real_models, "optimum_cli", lambda: tmp_path / "optimum-cli")
    monkeypatch.setattr(quantized, "measured_python", fake_child)
    monkeypatch.setattr(real_models, "measured_python", fake_child)
    row = quantized._optimum_int8_row("bloom-560m", tmp_path / "folder", tmp_path, 2, 2, 40.0, lambda m: None)
    assert row["export_s"] == 90.0 and row["export_peak_gb"] == 9.5 and row["optimum"]["quantize_peak_gb"] == 9.5
    assert row["decode_ms"] == 21.0 and row["file_gb"] == 1e-6
    assert [c[:2] for c in calls] == [["export", "onnx"], ["onnxruntime", "quantize"], ["-m", "posbias_export.bench.real_models"]]
    assert not list(tmp_path.glob("bloom-560m_optimum*"))  # both folders removed

    from posbias_export.bench import harness

    def killed(args, program=None, **_):  # the real kill's message, from a real child
        if args[:2] == ["export", "onnx"]:
            return 60.0, 6.0, ""
        return harness.measured_python(["-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])

    monkeypatch.setattr(quantized, "measured_python", killed)
    row = quantized._optimum_int8_row("bloom-560m", tmp_path / "folder", tmp_path, 2, 2, 40.0, lambda m: None)
    assert row["scheme"] == quantized.OPTIMUM_INT8 and str(tmp_path) not in row["error"]
    assert re.fullmatch(r"Optimum's quantizer: killed by signal 9 at \d+\.\d GB of peak RSS", row["error"]), row

    results = quantized.QuantResults(real=[
        {"model": "bloom-560m", "scheme": "int8", "file_gb": 0.82, "export_peak_gb": 1.9, "decode_ms": 30.0,
         "floor_ms": 29.0},
        {"model": "bloom-560m", "scheme": "int4", "file_gb": 0.52, "export_peak_gb": 6.78, "decode_ms": 28.0,
         "floor_ms": 18.0}])
    bounds = {t: (v, ok) for t, v, ok in quantized.targets(results) if "export peak" in t}
    assert bounds == {"bloom-560m int8: export peak <= 1.5x the file + 1 GB": ("1.90 GB (bound 2.23)", True),
                      "bloom-560m int4: export peak <= 1.5x the file + 1 GB": ("6.78 GB (bound 1.78)", False)}


def test_bench_clients_checks_names_before_making_its_folder(tmp_path, capsys):
    assert cli_main(["bench-clients", "--models", "gpt2", "--out-dir", str(tmp_path / "o"), "--no-optimum"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown model(s) gpt2" in err[0] and not (tmp_path / "o").exists()


def test_bench_real_refuses_a_run_it_would_ignore(tmp_path, capsys):
    assert cli_main(["bench-real", "--models", "bloom-560m", "--run", "bloom-3b", "--work", str(tmp_path / "w"),
                     "--out-dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--run bloom-3b is not among --models" in err[0]
    assert not (tmp_path / "w").exists() and not (tmp_path / "o").exists()


@pytest.mark.parametrize("command", [["bench-real", "--models", "bloom-560m"],
                                     ["bench-serving", "--models", "bloom-560m"],
                                     ["bench-quant", "--models", "", "--real", "bloom-560m"]],
                         ids=["real", "serving", "quant"])
def test_a_work_folder_of_other_files_is_refused_before_anything_is_written(tmp_path, capsys, command):
    """`--work /` once wrote a 2 GB bloom-560m folder into the root: a bench uses a --work folder it
    makes (new or empty) or made (its mark, or only the published models' names in it)."""
    from posbias_export.export.files import WORK_MARK

    system = tmp_path / "system"
    (system / "etc").mkdir(parents=True)
    before = sorted(p.name for p in system.iterdir())
    assert cli_main([*command, "--work", str(system), "--out-dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--work {system} holds files no benchmark made ('etc'" in err[0]
    assert sorted(p.name for p in system.iterdir()) == before and not (tmp_path / "o").exists()
    ours = tmp_path / "ours"
    (ours / "bloom-560m").mkdir(parents=True)
    (ours / "bloom-560m_int4.onnx").write_text("")
    from posbias_export.export.files import work_folder
    from posbias_export.hf.published import PUBLISHED

    assert work_folder(ours, PUBLISHED) == ours and (ours / WORK_MARK).is_file()  # a folder a bench made
    (ours / "notes.txt").write_text("mine")
    assert work_folder(ours, PUBLISHED) == ours  # marked: it is the bench's folder now


@pytest.mark.parametrize("command, results", [(["bench-serving", "--models", "bloom-560m"], "serving.json"),
                                              (["bench-quant", "--models", "", "--real", "bloom-560m"], "quantized.json")],
                         ids=["serving", "quant"])
@pytest.mark.parametrize("problem", ["foreign-results", "other-configuration"])
def test_a_refused_bench_run_makes_nothing(tmp_path, capsys, command, results, problem):
    """A foreign results file in --out-dir, or another model's folder under the published name in
    WORK, is refused before WORK or --out-dir is made or marked (before: both were, then refused)."""
    work, out = tmp_path / "w", tmp_path / "o"
    if problem == "foreign-results":
        out.mkdir()
        (out / results).write_text("not ours")
    else:
        (work / "bloom-560m").mkdir(parents=True)
        (work / "bloom-560m" / "config.json").write_text('{"n_layer": 2}')
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert cli_main([*command, "--work", str(work), "--out-dir", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and ("move it away" in err[0] or "not the published bloom-560m" in err[0]), err
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before


def test_client_results_name_no_path_of_this_machine(tmp_path, monkeypatch):
    """clients.md once embedded a client's temporary folder in an error cell: every absolute path
    in a row's text is cut to its last part before the results are written."""
    from posbias_export.clients import checks

    leak = f"Load model from {tmp_path}/bloom/decoder_model_merged.onnx failed: bad input"
    monkeypatch.setattr(checks, "run", lambda model_types, optimum, progress: [
        {"client": "transformers.js", "model": "bloom", "prompt": "short", "error": leak}])
    monkeypatch.setattr(checks, "client_versions", lambda: {"transformers": "x", "transformers_js": "y",
                                                            "onnxruntime_genai": "z"})
    md, js = checks.run_and_write(["bloom"], tmp_path / "out", optimum=False)
    import json

    assert str(tmp_path) not in md.read_text() and "…/decoder_model_merged.onnx failed: bad input" in md.read_text()
    assert str(tmp_path) not in js.read_text()
    assert json.loads(js.read_text())["rows"][0]["error"] == "Load model from …/decoder_model_merged.onnx failed: bad input"


@pytest.mark.slow
def test_bench_embed_runs_every_form_and_judges_its_targets(tmp_path, monkeypatch):
    """bench-embed end to end at a tiny size: each form in its own process, a padded short batch,
    the dense form's row where it dies, and the markdown's targets from the measured cells."""
    from posbias_export.bench import embedders

    monkeypatch.setattr(embedders, "BASE", dict(vocab=300, hidden=48, heads=6, layers=2, max_len=512))
    monkeypatch.setattr(embedders, "SHORT_BATCH", (4, 32))
    monkeypatch.setattr(embedders, "COLD_FROM", 2048)  # the long lengths' one cold forward, each form
    monkeypatch.setattr(embedders, "LENGTHS", (64, 2048))  # the longest: judged as "runs"
    paths = embedders.run_and_write((64, 2048), tmp_path, progress=lambda m: None)
    data = json.loads(paths[1].read_text())
    cells = {(c["form"], c["length"], c["batch"]): c for c in data["cells"]}
    from posbias_export.peers import llama_cpp_runs

    forms = [f for f in embedders.FORMS if f != "llama.cpp" or not llama_cpp_runs.missing()]  # where it is here
    assert set(cells) == {(f, n, b) for f in forms for n, b in ((64, 1), (2048, 1), (32, 4))}
    assert all(c["times"] and c["peak_rss"] for c in cells.values()), cells
    text = paths[0].read_text()
    assert "| 2048 | 1 |" in text and "ours <= 1.0x the dense form's time" in text
    assert "| 2048 tokens run (our file) | ran | met |" in text


def test_a_cold_measurement_times_the_first_forward_alone():
    """bench/worker.py --cold (bench-embed's long lengths): no warm-up forward before the timed ones."""
    from posbias_export.bench.worker import timed

    calls = []
    times, out = timed(lambda: calls.append(1) or len(calls), 2, warmup=False)
    assert len(calls) == 2 and len(times) == 2 and out == 2
    calls.clear()
    times, out = timed(lambda: calls.append(1) or len(calls), 2)
    assert len(calls) == 3 and len(times) == 2 and out == 3


def test_the_profile_runner_profiles_a_decode_step(exports, tmp_path):
    """runtimes/ort/profile.py: a cached decoder's steady step after --past tokens, every kernel
    counted once (shares sum to 1, the containers apart), and a missing model as one line."""
    import subprocess

    from posbias_export.runners import RUNTIMES_DIR

    model = exports.cli("alibi", extra=("--kv-cache",))
    script = str(RUNTIMES_DIR / "ort" / "profile.py")
    done = subprocess.run([sys.executable, script, str(model), "--past", "40", "--runs", "2", "--json"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert got["wall_us"] > 0 and got["ops"] and all(row["calls"] >= 1 for row in got["ops"])
    assert sum(row["share"] for row in got["ops"]) == pytest.approx(1.0)
    assert {row["op"] for row in got["ops"]} & {"MatMul", "Gemm", "FusedMatMul", "MultiHeadAttention",
                                                "GroupQueryAttention"}
    assert not {c["op"] for c in got["containers"]} - {"If", "Loop", "Scan"}
    missing = subprocess.run([sys.executable, script, str(tmp_path / "none.onnx")], capture_output=True, text=True,
                             timeout=300)
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1 and "error" in missing.stderr


@pytest.mark.slow
def test_bench_quant_judges_a_sharded_encoder_alone_on_its_embedding(tmp_path, monkeypatch):
    """The UMT5-XXL row at a tiny size, end to end: bfloat16 shards written tensor by tensor, the
    streamed int8 export in its own process, a 512-token forward on ORT CPU, and the embedding judged
    against transformers float32 run block by block; the table and its targets from that row."""
    from posbias_export.bench import quantized
    from posbias_export.hf import published

    tiny = ("UMT5EncoderModel", "UMT5Config", dict(vocab_size=32100, d_model=64, d_kv=16, d_ff=96, num_layers=2,
                                                    num_heads=4, feed_forward_proj="gated-gelu"))
    monkeypatch.setitem(published.PUBLISHED, "tiny-umt5", tiny)
    monkeypatch.setitem(published.SHARDED, "tiny-umt5", "bfloat16")
    monkeypatch.setattr(quantized, "ENCODER_ONLY", {"tiny-umt5"})
    [row] = quantized.real_rows("tiny-umt5", tmp_path / "work", 2, 2, progress=lambda m: None)
    assert "error" not in row, row
    assert row["parity"]["passed"] and row["parity"]["cosine_min"] >= 0.99 and row["file_gb"] > 0
    md = quantized.render(quantized.QuantResults(commands=["bench-quant"], checkpoints={}, variants={}, lengths=[64],
                                                 real=[row]))
    assert "## Real size, an encoder alone" in md and "| tiny-umt5 | int8 |" in md
    assert "tiny-umt5 int8 (encoder): embedding cosine to float32 >= 0.99 |" in md
    assert "tiny-umt5 int8 (encoder): export peak <=" in md


def test_a_node_clients_cell_gives_the_error_message_not_the_quoted_source_line():
    """bench-clients --models umt5: transformers.js has no umt5; Node prints the throwing source
    line first, and the cell must carry the message under it."""
    from posbias_export.clients.checks import node_error

    stderr = ("file:///js/node_modules/@huggingface/transformers/dist/transformers.node.mjs:123\n"
              "            throw Error(`Unsupported model type: ${model_type}`);\n            ^\n\n"
              "Error: Unsupported model type: umt5\n    at Function.from_pretrained (file:///js/x.mjs:1:2)\n")
    assert node_error(stderr) == "Error: Unsupported model type: umt5"
    assert node_error("TypeError: x is not a function\n") == "TypeError: x is not a function"
    assert node_error("") == "node failed"
