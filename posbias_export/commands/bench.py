"""bench, bench-decode, bench-models, bench-embed: speed and memory side by side (posbias_export/bench/)."""
from __future__ import annotations

import argparse
import sys

from ..errors import UsageError
from .options import int_list, name_list, parser, positive_int


def build_bench_parser() -> argparse.ArgumentParser:
    from ..bench import attention as bench

    p = parser("bench", "Long-context attention: our export on ONNX Runtime CPU (blocked and plain forms) and OpenVINO "
                "vs PyTorch eager with the same bias and PyTorch fused causal SDPA without a bias; one process per "
                "configuration. Writes attention.md/.json/.png. (On a GPU: python -m posbias_export.gpu.attention.)", "examples:\n  python -m posbias_export bench\n  "
                "python -m posbias_export bench --biases alibi --lengths 512,2048 --repeats 2 --out-dir /tmp/bench")
    p.add_argument("--biases", type=name_list, default=bench.BIASES, help="comma-separated bias families (default all)")
    p.add_argument("--lengths", type=int_list, default=bench.LENGTHS, help=f"comma-separated sequence lengths (default "
                   f"{','.join(map(str, bench.LENGTHS))})")
    p.add_argument("--configs", type=name_list, default=bench.CONFIGS, help=f"from: {', '.join(bench.CONFIGS)}")
    p.add_argument("--variants", type=name_list, default=bench.VARIANTS, help=f"from: {', '.join(bench.VARIANTS)} "
                   f"(bidirectional and block run at the lengths >= {bench.LONG}, or the longest given; default all)")
    p.add_argument("--repeats", type=positive_int, default=3, help="timed forwards per configuration (after a warm-up)")
    p.add_argument("--heads", type=positive_int, default=8, help="attention heads (default 8)")
    p.add_argument("--head-dim", type=positive_int, default=64, help="dimension per head (default 64)")
    p.add_argument("--timeout", type=positive_int, default=900, help="seconds per configuration")
    p.add_argument("--profile-length", type=int, default=8192,
                   help="also profile ORT (blocked form) at this length; 0: no profile")
    p.add_argument("--out-dir", default="benchmarks", help="where the results files go (default benchmarks)")
    p.add_argument("--ignore-size-limits", action="store_true", help="run lengths whose memory estimate exceeds this "
                   "machine's (refused by default)")
    return p


def run_bench(args) -> int:
    from tqdm import tqdm

    from ..bench import attention

    with tqdm(total=attention.count(args.biases, args.lengths, args.configs, args.variants), desc="bench",
              unit="config", disable=None, file=sys.stderr) as bar:
        paths = attention.run_and_write(args.biases, args.lengths, args.configs, args.variants, args.repeats, args.heads,
                                        args.head_dim, args.timeout, args.profile_length, args.out_dir, bar.update,
                                        args.ignore_size_limits)
    print(paths[1].read_text())
    print("wrote " + ", ".join(str(x) for x in paths))
    return 0


def build_bench_decode_parser() -> argparse.ArgumentParser:
    from ..biases import BIASES
    from ..export import TARGETS

    p = parser("bench-decode", "Per-token decode latency: ONNX Runtime vs PyTorch eager with the same KV cache, side "
                "by side; writes decode.md and decode.json.")
    p.add_argument("--biases", type=name_list, default=BIASES, help="comma-separated bias families (default all)")
    p.add_argument("--contexts", type=int_list, default=(512, 4096),
                   help="comma-separated context lengths decoded from (default 512,4096)")
    p.add_argument("--steps", type=positive_int, default=32, help="decode steps timed per context")
    p.add_argument("--out-dir", default="benchmarks", help="where decode.md/.json go (default benchmarks)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: ONNX Runtime CUDA (cache kept on "
                   "the GPU) vs PyTorch eager on the GPU; writes gpu_decode.md/.json")
    p.add_argument("--target", choices=tuple(TARGETS), default="portable", help="export target of the decoder file")
    p.add_argument("--ignore-size-limits", action="store_true", help="decode from contexts whose memory estimate "
                   "exceeds this machine's (refused by default)")
    return p


def run_bench_decode(args) -> int:
    from tqdm import tqdm

    from ..bench.decode import run

    with tqdm(total=len(args.biases), desc="bench-decode", unit="bias", disable=None, file=sys.stderr) as bar:
        rows = run(args.biases, args.contexts, args.steps, args.out_dir, progress=bar.update, device=args.device,
                   target=args.target, ignore_size_limits=args.ignore_size_limits)
    for r in rows:
        print(f"{r['bias']:>13} context {r['context']:>5}: ORT {r['ort_ms_median']:.2f} ms/token, "
              f"PyTorch {r['torch_ms_median']:.2f} ms/token, ratio {r['ort_over_torch']:.2f}")
    return 0


def build_bench_models_parser() -> argparse.ArgumentParser:
    from ..bench import models as bench

    p = parser("bench-models", "Imported BLOOM / MPT / Falcon (alibi) / T5-encoder models: our blocked export vs a "
                "plain dynamo export vs Optimum's (if installed), time, peak RSS and error vs transformers on ONNX "
                "Runtime CPU, each cell in its own process; writes models.md/.json.")
    p.add_argument("--models", type=name_list, default=bench.MODEL_TYPES, help=f"from: {', '.join(bench.MODEL_TYPES)}")
    p.add_argument("--lengths", type=int_list, default=bench.LENGTHS,
                   help=f"comma-separated sequence lengths (default {','.join(map(str, bench.LENGTHS))})")
    p.add_argument("--repeats", type=positive_int, default=2, help="timed forwards per cell (default 2)")
    p.add_argument("--out-dir", default="benchmarks", help="where models.md/.json go (default benchmarks)")
    return p


def run_bench_models(args) -> int:
    from tqdm import tqdm

    from ..bench import models as bench

    total = len(args.models) * len(args.lengths) * len(bench.EXPORTERS)
    with tqdm(total=total, desc="bench-models", unit="cell", disable=None, file=sys.stderr) as bar:
        paths = bench.run_and_write(tuple(args.models), tuple(args.lengths), args.repeats, args.out_dir, bar.update)
    print("\n".join(f"wrote {path}" for path in paths))
    return 0


def build_bench_embed_parser() -> argparse.ArgumentParser:
    from ..bench import embedders as bench

    p = parser("bench-embed", "A JinaBERT v2 embedder at jina-v2-base's size (random weights): our blocked file vs the "
                "dense [H, L, L] form vs PyTorch eager, time and peak RSS per length and on a padded batch of short "
                "texts, each in its own process; writes embedders.md/.json.")
    p.add_argument("--lengths", type=int_list, default=bench.LENGTHS,
                   help=f"comma-separated lengths at batch 1 (default {','.join(map(str, bench.LENGTHS))})")
    p.add_argument("--forms", type=name_list, default=bench.FORMS,
                   help=f"from: {', '.join(bench.FORMS)} (the other forms' cells of an earlier run are kept)")
    p.add_argument("--out-dir", default="benchmarks", help="where embedders.md/.json go (default benchmarks)")
    return p


def run_bench_embed(args) -> int:
    from ..bench import embedders as bench

    unknown = [f for f in args.forms if f not in bench.FORMS]
    if unknown:
        raise UsageError(f"--forms: unknown form {unknown[0]!r}; choose from {', '.join(bench.FORMS)}")
    paths = bench.run_and_write(tuple(args.lengths), args.out_dir, tuple(args.forms),
                                progress=lambda m: print(m, file=sys.stderr))
    print("\n".join(f"wrote {path}" for path in paths))
    return 0


def build_bench_real_parser() -> argparse.ArgumentParser:
    from ..bench import real_models as bench

    p = parser("bench-real", "Imported models at the sizes people serve (published configurations, random weights "
                "written once into --work): export time and peak RSS per dtype; prefill of 512 and 4096 tokens and "
                "per-token decode on ONNX Runtime CPU beside transformers eager and the memory-bandwidth floor; "
                "writes real_models.md/.json.", "example:\n  python -m posbias_export bench-real --models bloom-560m,bloom-3b "
                "--run bloom-560m --work /tmp/real")
    p.add_argument("--models", type=name_list, default=["bloom-560m", "bloom-3b"], help=f"from: {', '.join(bench.PUBLISHED)}")
    p.add_argument("--run", type=name_list, default=["bloom-560m"],
                   help="models whose float32 file is also run (prefill, decode, transformers eager)")
    p.add_argument("--work", required=True, help="folder for the random-weight models and the exported files "
                   "(tens of GB for a 3B model)")
    p.add_argument("--threads", type=positive_int, default=2, help="ONNX Runtime and PyTorch threads (default 2)")
    p.add_argument("--out-dir", default="benchmarks", help="where real_models.md/.json go (default benchmarks)")
    return p


def run_bench_real(args) -> int:
    from pathlib import Path

    from ..bench import real_models as bench
    from ..export.files import work_folder

    from ..bench.quantized import ENCODER_ONLY

    usable = [m for m in bench.PUBLISHED if m not in ENCODER_ONLY]  # an encoder alone: bench-quant --real
    unknown = [m for m in args.models if m not in usable]
    if unknown:
        raise ValueError(f"unknown model {unknown[0]!r}; choose from {', '.join(usable)}"
                         + (" (an encoder alone is measured by bench-quant --real)" if unknown[0] in ENCODER_ONLY else ""))
    not_measured = [r for r in args.run if r not in args.models]
    if not_measured:  # it was ignored: a run the user asked for silently did not happen
        raise UsageError(f"--run {not_measured[0]} is not among --models ({', '.join(args.models)})")
    work = work_folder(Path(args.work), bench.PUBLISHED)  # before anything is written there
    command = "python -m posbias_export bench-real --models " + ",".join(args.models) + " --run " + ",".join(args.run)
    paths = bench.run_and_write(args.models, work, Path(args.out_dir), set(args.run), args.threads, command=command)
    print(paths[0].read_text())
    return 0


def build_bench_quant_parser() -> argparse.ArgumentParser:
    p = parser("bench-quant", "Quantized files beside the float32 ones: held-out perplexity of the trained checkpoints "
                "(training length and 16x it) float32 / int8 / int4 and the int4 choices; at real size (published "
                "configurations, random weights) file size, export memory, prefill 512 and decode on ONNX Runtime "
                "CPU beside the bandwidth floor and transformers eager (T5: the encoder-decoder pair and its policy); "
                "writes quantized.md/.json/.png.",
               "example:\n  python -m posbias_export bench-quant --corpus ../shared/data/tinyshakespeare.txt "
               "--real bloom-560m --work /tmp/real")
    p.add_argument("--models", default="models", help="folder of trained checkpoints (default models; '' skips them)")
    p.add_argument("--corpus", help="the text the checkpoints were trained on (held-out: its last 10%%)")
    p.add_argument("--max-tokens", type=positive_int, default=16384, help="held-out tokens per length (default 16384)")
    p.add_argument("--real", type=name_list, default=[], help="published configurations to run (bench-real's names)")
    p.add_argument("--work", help="folder for the random-weight models and files (with --real)")
    p.add_argument("--threads", type=positive_int, default=2, help="ONNX Runtime and PyTorch threads (default 2)")
    p.add_argument("--out-dir", default="benchmarks", help="where quantized.md/.json go (default benchmarks)")
    return p


def run_bench_quant(args) -> int:
    from pathlib import Path

    from ..bench import quantized
    from ..export.files import check_work_folder, work_folder
    from ..bench.real_models import PUBLISHED
    from ..hf.published import check_published_folder

    wrong = [m for m in args.real if m not in PUBLISHED]
    if wrong:
        raise ValueError(f"--real {wrong[0]!r}: choose from {', '.join(PUBLISHED)}")
    if args.real and not args.work:
        raise ValueError("--real needs --work (a folder for the random-weight models)")
    if args.models and not args.corpus:
        raise ValueError("the checkpoints' perplexity needs --corpus (or --models '' to skip them)")
    if not args.models and not args.real:
        raise UsageError("nothing to measure: give --models with --corpus, or --real with --work")
    command = "python -m posbias_export bench-quant" + (f" --models {args.models} --corpus CORPUS" if args.models else
                                                        " --models ''") + (f" --real {','.join(args.real)}" if args.real else "")
    quantized.previous_results(Path(args.out_dir) / "quantized.json")  # every refusal before anything is made
    if args.work and check_work_folder(Path(args.work), PUBLISHED).is_dir():
        for name in args.real:
            check_published_folder(name, Path(args.work))
    work = work_folder(Path(args.work), PUBLISHED) if args.work else None
    paths = quantized.run_and_write(Path(args.models) if args.models else None, Path(args.corpus) if args.corpus else None,
                                    args.real, work, Path(args.out_dir), args.threads,
                                    args.max_tokens, command, progress=lambda m: print(m, file=sys.stderr, flush=True))
    print(paths[0].read_text())
    return 0


def build_bench_clients_parser() -> argparse.ArgumentParser:
    from ..clients.checks import SUPPORTED

    p = parser("bench-clients", "The serving folder (--model DIR --out-dir OUT) in the clients people run: our "
               "generate, transformers.js and onnxruntime-web (posbias_export/clients/js), onnxruntime-genai, Optimum (its own "
               "environment, posbias_export/clients/optimum_env.sh; also Optimum's own export): tokens and logits vs transformers at "
               "a short and a 1024-token prompt; the same clients on --quantize int8/int4 folders; writes clients.md/.json.")
    p.add_argument("--models", type=name_list, default=SUPPORTED, help=f"from: {', '.join(SUPPORTED)}")
    p.add_argument("--no-optimum", action="store_true", help="skip Optimum (it builds a side environment once)")
    p.add_argument("--out-dir", default="benchmarks", help="where clients.md/.json go (default benchmarks)")
    return p


def run_bench_clients(args) -> int:
    from tqdm import tqdm

    from ..clients import checks as clients

    with tqdm(total=len(args.models), desc="bench-clients", unit="model", disable=None, file=sys.stderr) as bar:
        paths = clients.run_and_write(tuple(args.models), args.out_dir, not args.no_optimum, bar.update)
    print(paths[0].read_text())
    print("wrote " + ", ".join(str(x) for x in paths))
    return 0


def build_bench_serving_parser() -> argparse.ArgumentParser:
    from ..bench import serving as bench

    p = parser("bench-serving", "Serving at length: the in-place KV cache (--target ort) against the Concat file on a "
               "published configuration (random weights written once into --work), float32 and int4, decode per token "
               "after prompts of several lengths beside the memory-bandwidth floor; writes serving.md/.json.",
               "example:\n  python -m posbias_export bench-serving --models bloom-560m --contexts 512,4096 "
               "--work /tmp/real")
    p.add_argument("--models", type=name_list, default=["bloom-560m"], help="published decoder configurations "
                   "(bench-real's list, T5 aside)")
    p.add_argument("--contexts", type=int_list, default=list(bench.CONTEXTS), help="prompt lengths (default 512,4096)")
    p.add_argument("--schemes", type=name_list, default=list(bench.SCHEMES), help=f"from: {', '.join(bench.SCHEMES)}")
    p.add_argument("--steps", type=positive_int, default=16, help="timed decode steps after two warm-up steps")
    p.add_argument("--work", required=True, help="folder for the random-weight models and the exported files")
    p.add_argument("--threads", type=positive_int, default=2, help="ONNX Runtime threads (default 2)")
    p.add_argument("--files", type=name_list, default=list(bench.KIND_NAMES),
                   help=f"what to measure, from: {', '.join(bench.KIND_NAMES)} (default all; Optimum's and "
                   "transformers' in float32 only); a model's earlier rows of the others are kept")
    p.add_argument("--out-dir", default="benchmarks", help="where serving.md/.json go (default benchmarks)")
    return p


def run_bench_serving(args) -> int:
    from pathlib import Path

    from ..bench import serving as bench

    unknown = [f for f in args.files if f not in bench.KIND_NAMES]
    if unknown:
        raise ValueError(f"unknown --files {unknown[0]!r}; choose from {', '.join(bench.KIND_NAMES)}")
    command = (f"python -m posbias_export bench-serving --models {','.join(args.models)} --contexts "
               f"{','.join(map(str, args.contexts))} --schemes {','.join(args.schemes)} --files {','.join(args.files)}")
    paths = bench.run_and_write(args.models, Path(args.work), Path(args.out_dir), tuple(args.contexts), tuple(args.schemes),
                                args.steps, args.threads, command,
                                progress=lambda m: print(m, file=sys.stderr, flush=True),
                                kinds=tuple(bench.KIND_NAMES[f] for f in args.files))
    print(paths[0].read_text())
    return 0
