"""tools/ (the GPU lease's mechanics) and the measurements that belong to no command: what a
lease measures (posbias_export/gpu/) and the evidence behind design choices
(posbias_export/evidence/), whose results live in benchmarks/. Each imports against today's
package and answers --help."""
from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import posbias_export as pbe
from posbias_export.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[1]
TOOLS = sorted((ROOT / "tools").glob("*.py"))
MODULES = [f"posbias_export.{p.parent.name}.{p.stem}" for room in ("gpu", "evidence")
           for p in sorted((ROOT / "posbias_export" / room).glob("*.py")) if p.stem != "__init__"]
MODULES.append("posbias_export.biases.readme_blocks")


def test_benchmarks_holds_results_only():
    scripts = [p.name for p in (ROOT / "benchmarks").iterdir() if p.suffix in (".py", ".sh", ".js", ".mjs")]
    assert not scripts, f"scripts in benchmarks/: {scripts} (commands' scripts go to posbias_export/bench/, others to posbias_export/gpu/ or evidence/)"


def test_tools_holds_the_lease_mechanics_only():
    """The measurements live in the package, under its house rules (tests/test_house_rules.py,
    tests/test_layers.py); tools/ keeps what moves a lease: the script and the wheel cutter."""
    assert sorted(p.name for p in (ROOT / "tools").iterdir()) == ["README.md", "gpu_lease.sh", "gpu_wheel.py"]


@pytest.mark.parametrize("name", MODULES)
def test_measurement_imports(name):
    importlib.import_module(name)  # its imports of the package resolve


@pytest.mark.parametrize("argv", [[str(p)] for p in TOOLS] + [["-m", m] for m in MODULES], ids=lambda a: a[-1])
def test_tool_help(argv):
    proc = subprocess.run([sys.executable, *argv, "--help"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0 and "usage:" in proc.stdout, proc.stderr[-1000:]


def load_tool(name: str):
    """A lease mechanic (tools/NAME.py) by path, or a measurement module (gpu.NAME, evidence.NAME)."""
    if "." in name:
        return importlib.import_module(f"posbias_export.{name}")
    spec = importlib.util.spec_from_file_location(f"tools_{name}", ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_lease_script_parses_and_lists_no_families():
    """The lease's families come from the registry through the Python tools it calls."""
    text = (ROOT / "tools" / "gpu_lease.sh").read_text()
    assert subprocess.run(["bash", "-n", str(ROOT / "tools" / "gpu_lease.sh")]).returncode == 0
    assert not any(f" {b} " in f" {text} " for b in pbe.BIASES if b not in ("none",)), "a family named in the script"
    for call in ("pack", "receive", "work", "rehearse"):  # the lease's mechanics
        assert f"\n  {call})" in text
    # every work step the header lists is a case of run_step, and every case is listed
    listed = re.findall(r"^#   ([a-z_]+) ", text.split("The steps:")[1].split("set -u")[0], re.M)
    cases = re.findall(r"^    ([a-z_]+)\)", text, re.M)
    assert listed and sorted(listed) == sorted(cases), (listed, cases)


def fat_binary(entries: list[tuple[int, bytes]]) -> bytes:
    """A fat binary as nvcc lays it out: header, then per entry a 64-byte header (kind 2 = ELF,
    arch at +28) and its payload."""
    import struct

    body = b"".join(struct.pack("<HHIQ", 2, 0x101, 64, len(payload)) + bytes(12) + struct.pack("<I", arch)
                    + bytes(32) + payload for arch, payload in entries)
    return struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(body)) + body


def test_gpu_wheel_zeroes_every_architecture_but_sm90():
    """The slim provider keeps sm_90's code byte for byte and every entry's header; the other
    architectures' payloads become zeros (they compress to nothing)."""
    wheel = load_tool("gpu_wheel")
    code = {80: b"\x11" * 40, 90: b"\x22" * 24, 120: b"\x33" * 8}
    blob = bytearray(b"PAD!" * 2 + fat_binary(list(code.items())) + fat_binary([(90, b"\x44" * 16), (86, b"\x55" * 32)]))
    before = bytes(blob)
    zeroed = wheel.zero_other_arches(blob, 8, len(blob) - 8)
    assert zeroed == {80: 40, 120: 8, 86: 32}
    assert blob.count(b"\x22" * 24) == 1 and blob.count(b"\x44" * 16) == 1  # sm_90 untouched
    assert b"\x11" * 40 not in blob and b"\x33" * 8 not in blob and b"\x55" * 32 not in blob
    assert len(blob) == len(before) and sum(a != b for a, b in zip(blob, before)) == 40 + 8 + 32  # payloads only


def test_gpu_wheel_cuts_the_blob_to_the_calls(tmp_path, monkeypatch):
    """Each call's folder plus the working tree fits the carry limit; the first carries the files."""
    wheel = load_tool("gpu_wheel")
    monkeypatch.setattr(wheel, "CALL_LIMIT", 1000)
    monkeypatch.setattr(wheel, "MARGIN", 100)
    monkeypatch.setattr(wheel, "tree_bytes", lambda: 300)
    blob, files = tmp_path / "ort.tar.xz", tmp_path / "files.tar.xz"
    blob.write_bytes(bytes(range(256)) * 6)  # 1536 bytes
    files.write_bytes(b"f" * 200)
    folders = wheel.split(blob, files, tmp_path / "out")
    sizes = [sum(f.stat().st_size for f in folder.iterdir()) for folder in folders]
    assert [f.name for f in folders] == ["c1", "c2", "c3"] and max(sizes) <= 1000 - 100 - 300
    assert (folders[0] / "files.tar.xz").exists() and not (folders[1] / "files.tar.xz").exists()
    joined = b"".join((f / f"ort.tar.xz.{i}").read_bytes() for i, f in enumerate(folders, start=1))
    assert joined == blob.read_bytes()


@pytest.fixture(scope="module")
def tiny_attention(tmp_path_factory):
    from posbias_export.export import export_onnx
    from posbias_export.nn import ModelConfig, build_model

    path = tmp_path_factory.mktemp("att") / "alibi_attention.onnx"
    export_onnx(build_model(ModelConfig(bias="alibi", num_heads=2, dim=16), arch="attention"), path, check_growth=False)
    return path


def test_order_case_judges_each_run_against_the_cpu_outputs(tiny_attention, tmp_path):
    """gpu_order's verdict can fail: a CPU reference off by 1e-3 at one length flags that run only."""
    order = load_tool("gpu.order")
    runs = order.case(str(tiny_attention), "cpu", [16, 40, 40], order.SETTINGS["ort-defaults"], tmp_path)
    assert [r["agrees"] for r in runs] == [True, True, True] and max(r["max_abs_vs_cpu"] for r in runs) == 0.0
    ref = tmp_path / "alibi_attention_40.npy"
    np.save(ref, np.load(ref) + 1e-3)
    runs = order.case(str(tiny_attention), "cpu", [16, 40], order.SETTINGS["graph-opt-off"], tmp_path)
    assert [r["agrees"] for r in runs] == [True, False]
    assert runs[1]["max_abs_vs_cpu"] == pytest.approx(1e-3, rel=1e-3)


def test_gpu_timings_share_the_bench_worker_and_profile_what_ran(tiny_attention):
    """run_ort's rows (ORT CPU standing in for CUDA): times per length, then the profiled ops."""
    g = load_tool("gpu.attention")

    rows = g.run_ort(tiny_attention, [8, 32], "float32", 2, 8, 2, provider="cpu", profile=True)
    assert [r["length"] for r in rows] == [8, 32] and all(len(r["times"]) == 2 for r in rows)
    assert all(r["peak_rss"] > r["loaded_rss"] > 0 for r in rows)  # bench/worker.py's own fields
    for r in rows:
        assert r["profile"]["length"] == r["length"] and r["profile"]["ort_ops_ms"], r
        assert "cuda_kernels" not in r["profile"]  # no CUDA trace asked on the CPU


def test_gpu_targets_with_cudnn_off_and_what_ran():
    """cuDNN-off rows get their own targets; profiled rows are listed at 1024 and the target length."""
    g = load_tool("gpu.attention")

    def row(config, length, ms, profile=None):
        return {"bias": "alibi", "dtype": "float16", "config": config, "length": length, "times": [ms / 1e3] * 3,
                "gpu_bytes": 1e9, **({"profile": profile} if profile else {})}

    kernels = {"cuda_kernels": [{"kernel": "flash_fwd_kernel<Flash_fwd_kernel_traits<80>>", "us": 812.0}],
               "ort_ops_ms": {"MultiHeadAttention": 0.9}}
    rows = [row("flex", 16384, 1.0), row("ort-cuda-ort", 16384, 1.4, kernels), row("ort-cuda-ort-nocudnn", 16384, 2.0),
            row("ort-cuda-ort", 4096, 0.5, kernels)]
    checks = {c["target"]: c for c in g.targets({"rows": rows})}
    assert checks["alibi fp16 L=16384: export / compiled Flex <= 1.5x"]["met"]
    off = checks["alibi fp16 L=16384 (cuDNN SDPA off): export / compiled Flex <= 1.5x"]
    assert off["measured"] == pytest.approx(2.0) and not off["met"]
    text = "\n".join(g.what_ran(rows))
    assert "| alibi | float16 | ort-cuda-ort | 16384 | flash_fwd_kernel" in text and "| 4096 |" not in text


def test_gpu_parity_plan_covers_every_file_kind(tmp_path):
    """Issue 50's list: every family's default LM, the fused / slim-table / window attention files
    in both dtypes to 32768, an imported BLOOM float16 cuda-ort file, the in-place cache file on
    the shared-buffer runtimes; short jobs first."""
    parity = load_tool("gpu.parity")
    exports, jobs = parity.plan(tmp_path, small=False)
    names = {j["name"]: j for j in jobs}
    for b in pbe.BIASES:
        assert names[f"{b}_lm"]["runtimes"] == "ort-cpu,ort-cuda,ort-cuda-tf32" and names[f"{b}_lm_long"]["lengths"] == "16384"
        for dtype in ("float32", "float16"):
            long = names[f"att_{b}_{dtype}_cuda-ort_long"]
            assert long["lengths"] == "16384,32768" and long["batch"] == 1
            assert ("tf32" in long["runtimes"]) == (dtype == "float32")  # TF32 changes float32 matmuls only
            assert "ort-cpu" not in long["runtimes"]
    assert names["hf_bloom_float16_cuda-ort"]["model"] == "hf/bloom"  # relative: the files travel
    assert names["hf_bloom_float16_cuda-ort_long"]["lengths"] == "16384"
    assert "ort-cuda-shared" in names["alibi_kv_inplace"]["runtimes"].split(",")
    assert all("ort-cuda" in j["runtimes"] for j in jobs)
    assert parity.job_runtimes(names["alibi_kv_inplace"], cpu_only=True) == "ort-cpu,ort-cpu-shared"
    assert parity.job_runtimes(names["att_alibi_float16_cuda-ort_long"], cpu_only=True) == "ort-cpu"
    longs = [j["name"].endswith("_long") for j in jobs]
    assert longs == sorted(longs)  # every short job before the first long one
    assert {Path(p) for p, _ in exports} >= {tmp_path / f for j in jobs for f in j["files"] if not f.startswith("models/")}


def test_gpu_parity_write_names_the_jobs_that_did_not_run(tmp_path):
    import json

    parity = load_tool("gpu.parity")
    jobs = [{"name": n, "files": [f"lm/{n}.onnx"], "lengths": "16384"} for n in ("a_long", "b_long", "c_long")]
    run = tmp_path / "run"
    (run / "par").mkdir(parents=True)
    (run / "jobs.json").write_text(json.dumps({"jobs": jobs}))
    (run / "par" / "a_long.json").write_text(json.dumps({"ok": True, "models": []}))
    (run / "par" / "b_long.txt").write_text("...\nvalidate: error: CUDA out of memory\n")
    assert parity.not_run([run]) == ["b_long (lm/b_long.onnx; 16384): validate: error: CUDA out of memory",
                                     "c_long (lm/c_long.onnx; 16384): not started before the deadline"]
    parity.write([run], tmp_path)
    assert "## Not run" in (tmp_path / "gpu_parity.md").read_text()


def test_gpu_parity_write_lists_each_failing_cell(tmp_path):
    import json

    parity = load_tool("gpu.parity")

    def cell(runtime, case, max_abs, verdict="pass"):
        return {"runtime": runtime, "case": case, "dtype": "float32", "verdict": verdict,
                "parity": {"max_abs": max_abs, "budget_abs": 3e-5}}

    report = {"ok": False, "models": [{"model": "x/alibi_lm.onnx", "cells": [
        cell("ort-cpu", "L=4096 B=3", 2e-6), cell("ort-cuda", "L=1024 B=3", 1e-6), cell("ort-cuda", "L=4096 B=3", 5.4, "FAIL"),
        {"runtime": "ort-cuda", "case": "one session, sizes ascending", "dtype": "float32", "verdict": "pass",
         "parity": {"bit_identical": True, "max_abs_diff": 0.0}}]}]}
    (tmp_path / "run" / "par").mkdir(parents=True)
    (tmp_path / "run" / "par" / "alibi_lm.json").write_text(json.dumps(report))
    failures = parity.write([tmp_path / "run"], tmp_path)
    assert failures == ["alibi_lm.onnx ort-cuda L=4096 B=3: FAIL, max abs err 5.40e+00 (budget 3.00e-05)"]
    text = (tmp_path / "gpu_parity.md").read_text()
    assert "| alibi_lm.onnx | ort-cuda | 1024,4096 (3 cells) | 5.40e+00 | 3.00e-05 | FAIL |" in text
    assert "| alibi_lm.onnx | ort-cpu | 4096 (1 cells) | 2.00e-06 | 3.00e-05 | pass |" in text


def test_gpu_decode_real_write_counts_agreeing_tokens(tmp_path):
    import json

    decode = load_tool("gpu.decode_real")
    machine = {"gpu": "NVIDIA H100 80GB HBM3", "driver": "580", "cpus": 16, "onnxruntime": "1.31.1",
               "providers": ["CUDAExecutionProvider"], "torch": "2.11.0", "date": "2026-11-25"}
    run = {"name": "bloom-560m", "device": "cuda", "dtype": "float16", "prompt": 512, "new_tokens": 4, "machine": machine,
           "ort": {"prefill_s": 0.02, "decode_ms": [5.0, 5.0, 5.0, 5.0], "tokens": [1, 2, 3, 9]},
           "eager": {"prefill_s": 0.05, "decode_ms": [20.0] * 4, "tokens": [1, 2, 3, 4]},
           "generate": {"generate_s": 0.1, "tokens": [1, 2, 3, 4]}}
    (tmp_path / "gpu_decode_real.json").write_text(json.dumps(run))
    decode.write(tmp_path, tmp_path / "out.md")
    text = (tmp_path / "out.md").read_text()
    assert "| ours, ONNX Runtime cuda | 0.020 | 5.00 | 200.0 | 4.00x | 3 of 4 |" in text
    assert "| transformers.generate (prefill included) | - | 25.00 | 40.0 | - | 4 of 4 |" in text
    assert "NVIDIA H100" in text


@pytest.mark.slow
def test_gpu_lease_rehearsal_runs_every_step_on_the_cpu(tmp_path):
    """The whole lease (REHEARSAL=1: pack, receive, work on ORT CPU, short lengths, two
    families) end to end, and each writer reads what it left: what a GPU session must not find
    broken."""
    import os

    out = tmp_path / "out"
    env = {**os.environ, "REHEARSAL": "1", "PYTHON": sys.executable, "GPU_WORK": str(tmp_path / "work")}
    proc = subprocess.run(["bash", str(ROOT / "tools" / "gpu_lease.sh"), "rehearse", str(out)], env=env,
                          capture_output=True, text=True, timeout=1800, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert [line.split()[0] for line in (out / "calls.txt").read_text().splitlines()] == ["pack", "receive", "work"]
    subprocess.run(["tar", "-xzf", str(out / "results.tar.gz"), "-C", str(out)], check=True)
    results = out / "r"
    assert load_tool("gpu.parity").write([results], tmp_path) == []
    assert "## Not run" not in (tmp_path / "gpu_parity.md").read_text()
    load_tool("gpu.order").write(results / "order", tmp_path / "gpu_order.md")
    assert "DIFFER" not in (tmp_path / "gpu_order.md").read_text()
    load_tool("gpu.session").part_write([results / "timing"], tmp_path)
    assert "## What ran" in (tmp_path / "gpu_attention.md").read_text()
    assert "GENERATE TOKENS EQUAL" in (results / "generate.log").read_text()
    assert (results / "decode" / "decode.json").exists()


def test_gpu_attention_lengths_come_from_the_arguments_not_sys_argv(monkeypatch, tmp_path):
    """main([...]) called from Python: the lengths given in the list are used (not whatever
    sys.argv holds), and without --lengths the GPU defaults. The GPU work itself is stubbed."""
    import torch

    gpu_attention = load_tool("gpu.attention")

    seen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_attention, "run", lambda biases, lengths, *a, **k: seen.append(tuple(lengths)) or {})
    monkeypatch.setattr(gpu_attention, "write", lambda result, out: [])
    monkeypatch.setattr(sys, "argv", ["python", "-m", "pytest"])
    assert gpu_attention.main(["--lengths", "512,1024", "--out-dir", str(tmp_path)]) == 0
    assert gpu_attention.main(["--out-dir", str(tmp_path)]) == 0
    assert seen == [(512, 1024), tuple(gpu_attention.LENGTHS)]


def test_gpu_attention_without_a_gpu_is_one_line(monkeypatch, capsys, tmp_path):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert load_tool("gpu.attention").main(["--out-dir", str(tmp_path / "gpu")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["gpu_attention: error: the GPU attention benchmark needs a CUDA GPU visible to PyTorch"]
    assert not (tmp_path / "gpu").exists()


@pytest.mark.slow
def test_gpu_big_writes_exports_and_decodes_a_tiny_mpt_on_the_cpu(tmp_path):
    """The `big` lease step's tool on a tiny MPT (the 7B's code paths: shards, the float16
    in-place export, ORT decode per context, transformers eager up to max_seq_len only), and
    its writer reads what it left."""
    import json
    import os

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "posbias_export.gpu.big", "run", str(tmp_path / "out"), "--work",
                           str(tmp_path / "work"), "--provider", "cpu", "--contexts", "64,2100", "--steps", "3",
                           "--tiny"], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    stages = json.loads((tmp_path / "out" / "big.json").read_text())["stages"]
    assert stages["export"]["file_gb"] > 0 and stages["bandwidth"]["read_gbs"] > 0
    assert all(ms > 0 for ms in stages["bandwidth"]["floor_ms"].values())  # weights + that context's cache
    warm = load_tool("gpu.big").WARM_STEPS  # steps run before the timed ones, their tokens compared too
    for context in (64, 2100):
        assert stages[f"ort {context}"]["ran_on"] == "CPUExecutionProvider"
        assert len(stages[f"ort {context}"]["tokens"]) == 3 + warm and stages[f"ort {context}"]["decode_median_ms"] > 0
    assert len(stages["eager 64"]["tokens"]) == 3 + warm and "max_seq_len" in stages["eager 2100"]["error"]
    load_tool("gpu.big").write(tmp_path / "out", tmp_path)
    table = (tmp_path / "gpu_big.md").read_text()
    assert "| 2100 | eager | failed: past MPT's max_seq_len" in table and table.count("| ort | CPUExecutionProvider |") == 2


@pytest.mark.slow
def test_gpu_embed_judges_every_form_of_a_tiny_embedder_on_the_cpu(tmp_path):
    """The `embed` lease steps' tool on a tiny JinaBERT: our float16 GPU-target file, SDPA with the
    bias and FlexAttention with ALiBi as score_mod (the tool's own attention for the module) each
    within the float16 policy of the float64 module, and its writer reads what it left."""
    import json
    import os

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for args in (["build", str(tmp_path / "work"), "--tiny"],
                 ["run", str(tmp_path / "work"), str(tmp_path / "out"), "--provider", "cpu", "--tiny"]):
        proc = subprocess.run([sys.executable, "-m", "posbias_export.gpu.embed", *args], env=env, capture_output=True,
                              text=True, timeout=900, cwd=ROOT)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads((tmp_path / "out" / "gpu_embed.json").read_text())["rows"]
    timed = [r for r in rows if r["form"] in ("ours", "sdpa", "flex")]
    assert len(timed) == 9 and all(r["parity"]["passed"] and r["parity"]["cosine_min"] > 0.9999 for r in timed), timed
    load_tool("gpu.embed").write(tmp_path / "out", tmp_path / "gpu_embedders.md")
    assert (tmp_path / "gpu_embedders.md").read_text().count("| pass |") == 9


def test_gpu_cure_variants_drop_the_ifs_and_keep_the_outputs(tmp_path):
    """gpu/cure.py's variants (what the first lease ran beside the shipped files): `loop` has no If
    and the blocked Loop, `flat` no control flow at all; each agrees with its file on ORT CPU at
    one block, several blocks and an odd length."""
    import onnx

    from posbias_export.export.functions import all_nodes

    cure = load_tool("gpu.cure")
    core = pbe.build_model(pbe.ModelConfig(bias="kerple_log", num_heads=8, dim=512, num_layers=1), arch="attention")
    (tmp_path / "models").mkdir()
    pbe.export_onnx(core, tmp_path / "models" / "kerple_log_float32_cuda-ort.onnx", target="cuda-ort", block=16,
                    check_growth=False)
    made = cure.variants(tmp_path, ("loop", "flat"))
    ops = {p.stem.split("__")[1]: {n.op_type for n in all_nodes(onnx.load(p).graph.node)} for p in made}
    assert "If" not in ops["loop"] and "Loop" in ops["loop"]
    assert not {"If", "Loop"} & ops["flat"]
    assert cure.check_variants(tmp_path, lengths=(1, 16, 45)) == []


def test_floor_cost_compares_two_folders_of_one_file(tmp_path, monkeypatch):
    """evidence/floor_cost.py times namesakes in two folders, default session and flag, and writes its table."""
    for side in ("before", "after"):
        (tmp_path / side).mkdir()
        assert cli_main(["--bias", "alibi", "--arch", "attention", "--heads", "2", "--dim", "32", "--skip-growth-check",
                         "--out", str(tmp_path / side / "alibi.onnx")]) == 0
    out = tmp_path / "cost.md"
    monkeypatch.setattr(sys, "argv", ["floor_cost.py", str(tmp_path / "before"), str(tmp_path / "after"),
                                      "--lengths", "40", "--runs", "1", "--out", str(out)])
    assert load_tool("evidence.floor_cost").main() == 0
    text = out.read_text()
    assert "| alibi | 40 |" in text and "CPU vendor:" in text
    assert set(json.loads(out.with_suffix(".json").read_text())["alibi.onnx@40"]) == {"defaults", "flag"}
