"""Command line: one parser builder and one runner per command; parse, call the API, print,
return an exit code. Errors are one line on stderr, exit 2. Heavy imports happen inside the
runners, after the arguments parsed."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

PROG = "posbias-export"

EXPORT_EXAMPLES = """examples:
  python -m posbias_export --bias alibi --out model.onnx
  python -m posbias_export --bias kerple_log --heads 8 --dim 256 --layers 4 --out kerple.onnx
  python -m posbias_export --bias window --bias-param window=128 --out window.onnx
  python -m posbias_export --bias t5 --bidirectional --arch block --out t5_block.onnx
  python -m posbias_export --bias alibi --opset 23 --dtype float16 --out alibi_fp16.onnx
  python -m posbias_export --checkpoint models/alibi.safetensors --out alibi.onnx
"""

VALIDATE_EXAMPLES = """examples:
  python -m posbias_export validate model.onnx
  python -m posbias_export validate model.onnx --runtimes ort-cpu,ort-cuda --lengths 1,17,4096 --batch 3
  python -m posbias_export validate model.onnx --inputs my_inputs.npz --json report.json
  python -m posbias_export validate a.onnx b.onnx --markdown benchmarks/parity.md

exit codes: 0 every runtime passed; 1 a failure, an error or an unavailable runtime; 2 bad usage
"""


COMMANDS_HELP = """commands (python -m posbias_export COMMAND --help):
  (none)         export a model to ONNX (the options above; --model DIR for a Hugging Face folder)
  validate       run a file on every runtime against a float64 PyTorch reference
  generate       generate bytes with a --kv-cache export on ONNX Runtime (CPU or CUDA)
  bench          long-context attention: time and peak memory, side by side with PyTorch
  bench-decode   per-token decode latency: ONNX Runtime vs PyTorch
  bench-models   imported BLOOM/MPT/Falcon/T5: our export vs dynamo vs Optimum, time, memory, error
  train          train a byte-level decoder on a text corpus
  evaluate       perplexity vs length through an exported file
  extrapolation  every checkpoint in models/: export, evaluate, tabulate"""


class CliError(Exception):
    """A usage problem: reported as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one readable line instead of usage + message
        raise CliError(message)


# --- argument types ------------------------------------------------------------------------
def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _name_list(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip() or not value.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return key.strip(), value.strip()


# --- export (the default command) ------------------------------------------------------------
_PARAM_DEST = "bias_param:"  # dest prefix of the per-family alias flags (--window, ...)


def _families_epilog() -> str:
    from .biases import BIASES, bias_class, hyper_parameter_fields

    lines = ["bias families and their hyper-parameters (--bias-param NAME=VALUE):"]
    fields = hyper_parameter_fields()
    for name in BIASES:
        cls = bias_class(name)
        own = [f"{f.name}={f.default} ({f.metadata['help']})" for family, f in fields if family == name]
        kind = "learned" if cls.learned else "fixed"
        lines.append(f"  {name:<13} {kind:<8} {'; '.join(own) or 'no hyper-parameters'}")
    return "\n".join(lines)


def build_export_parser() -> argparse.ArgumentParser:
    from .biases import BIASES, hyper_parameter_fields
    from .export import DTYPES, OPSETS
    from .nn import ARCHS, ATTENTION_FORMS
    from .nn.blocked import TARGETS
    from .nn.positions import RESIZE_METHODS

    p = _Parser(
        prog=PROG,
        description="Export a transformer with a positional attention bias to ONNX with dynamic batch and sequence "
        "axes, and check the result. Other commands: validate, generate, bench, bench-decode, train, evaluate, "
        "extrapolation (each with --help).",
        epilog=COMMANDS_HELP + "\n\n" + _families_epilog() + "\n\n" + EXPORT_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--bias", help=f"bias family: {', '.join(BIASES)} (taken from --checkpoint when given)")
    p.add_argument("--bias-param", type=_key_value, action="append", default=[], metavar="NAME=VALUE",
                   help="a hyper-parameter of the bias family (repeatable); see the list below")
    for family, f in hyper_parameter_fields():
        if f.metadata.get("alias"):
            p.add_argument(f.metadata["alias"], type=_positive_int, dest=f"{_PARAM_DEST}{f.name}", metavar="N",
                           help=f"{family}: {f.metadata['help']} (default {f.default}); same as --bias-param {f.name}=N")
    p.add_argument("--out", required=True, help="output .onnx path (written atomically)")
    p.add_argument("--arch", choices=ARCHS, default=None,
                   help="lm: byte-level decoder, input_ids [B, L] -> logits [B, L, 256]; "
                   "block: one transformer block, hidden [B, L, dim] in and out; "
                   "attention: attention alone, query/key/value [B, heads, L, dim/heads] -> same (default lm)")
    p.add_argument("--heads", type=_positive_int, help="attention heads (default 4)")
    p.add_argument("--dim", type=_positive_int, help="model width, divisible by --heads (default 128)")
    p.add_argument("--layers", type=_positive_int, help="transformer layers (default 2)")
    p.add_argument("--bidirectional", action="store_true", default=None, help="no causal mask; symmetric bias")
    p.add_argument("--opset", type=int, choices=OPSETS, default=None,
                   help="18 (portable; the default) or 23 (ONNX Attention op; the default for --target cuda)")
    p.add_argument("--target", choices=TARGETS, default="portable",
                   help="portable: runs everywhere (default); cuda: GPU-shaped blocks, each one ONNX Attention op "
                   "(opset 23, large blocks, no tensor past 2^31 elements) for ONNX Runtime CUDA; cuda-ort: the "
                   "same with com.microsoft.MultiHeadAttention (ONNX Runtime only, CPU or CUDA)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32",
                   help="weights and activations; float16 keeps scores, bias and softmax in float32")
    p.add_argument("--trace-len", type=_positive_int, default=16, help="sequence length used to trace (default 16)")
    p.add_argument("--kv-cache", action="store_true",
                   help="cached decoder for generation: input_ids, attention_mask, past_key.N/past_value.N in; "
                   "logits, present_key.N/present_value.N out (prefill and decode in one file)")
    p.add_argument("--attention", choices=ATTENTION_FORMS, default=None,
                   help="blocked: a Loop over query blocks, memory linear in L (default for opset 18, causal "
                   "or bidirectional); plain: the whole [heads, L, L] bias and scores at once (default for opset 23)")
    p.add_argument("--block", type=_positive_int, default=None,
                   help="blocked form: query rows per block (default 256; GPU targets 4096, fewer for long keys)")
    p.add_argument("--inline-functions", action="store_true",
                   help="expand the posbias.* functions into a flat graph of standard ops")
    p.add_argument("--attention-mask", action="store_true",
                   help="add an attention_mask [B, L] input (1 = token, 0 = padding; positions from its cumsum)")
    p.add_argument("--seed", type=int, default=0, help="weight init seed when no --checkpoint (default 0)")
    p.add_argument("--resize-positions", type=_positive_int,
                   help="learned positions: resize the table to N rows before export (else longer inputs are refused)")
    p.add_argument("--resize-method", choices=RESIZE_METHODS, default="interpolate",
                   help="how --resize-positions fills the new rows")
    p.add_argument("--checkpoint", help="safetensors or weights-only torch file; its saved config is used")
    p.add_argument("--model", metavar="DIR",
                   help="a local Hugging Face folder (config.json + safetensors) of a BLOOM, MPT, Falcon (alibi) or "
                   "T5 model: exported with input_ids, attention_mask -> logits (T5: the encoder, -> "
                   "last_hidden_state); nothing is downloaded")
    p.add_argument("--part", choices=("encoder", "decoder"), default=None,
                   help="with --model and a T5 encoder-decoder folder: which half (default encoder); the decoder file "
                   "carries its KV cache and takes encoder_hidden_states, encoder_attention_mask")
    p.add_argument("--validate", action="store_true",
                   help="after export, run the parity matrix (ort-cpu, openvino, node, reference); exit 1 on failure")
    return p


_CONFIG_FLAGS = {"bias": "bias", "heads": "num_heads", "dim": "dim", "layers": "num_layers"}


def given_config(args) -> dict:
    """The ModelConfig fields the command line sets (flags left out are not in the dict)."""
    given = {field: getattr(args, flag) for flag, field in _CONFIG_FLAGS.items() if getattr(args, flag) is not None}
    if args.bidirectional:
        given["causal"] = False
    params = dict(args.bias_param)
    for dest, value in vars(args).items():
        if dest.startswith(_PARAM_DEST) and value is not None:
            params[dest[len(_PARAM_DEST):]] = value
    if params:
        given["bias_params"] = params
    return given


# options that describe our own models; an imported folder brings its own architecture
_MODEL_FOLDER_CONFLICTS = ("bias", "heads", "dim", "layers", "bidirectional", "arch", "checkpoint", "resize_positions",
                           "attention_mask")


def run_export_folder(args) -> int:
    from .export import check_outputs
    from .hf.export import export_model

    given = [name for name in _MODEL_FOLDER_CONFLICTS if getattr(args, name)] + (["bias_param"] if args.bias_param else [])
    if args.dtype != "float32":
        given.append("dtype")
    if args.target != "portable":
        given.append("target")
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise CliError(f"--model takes the architecture and weights from the folder; drop {flags}")
    folder = Path(args.model)
    check_outputs([args.out], [args.model, *(sorted(folder.iterdir()) if folder.is_dir() else [])])
    report = export_model(args.model, args.out, opset=args.opset or 18, trace_len=args.trace_len, kv_cache=args.kv_cache,
                          inline_functions=args.inline_functions, attention=args.attention,
                          part=args.part or "encoder", **({"block": args.block} if args.block else {}))
    print(report.summary())
    if args.validate and args.part == "decoder":
        print("the T5 decoder file is checked by the test suite (greedy tokens against transformers.generate); "
              "validate --model judges single-input-sequence files")
        return 0
    if args.validate:
        return validate_and_report([args.out], None, None, 3, model_dir=args.model)
    return 0


def run_export(argv: list[str]) -> int:
    args = build_export_parser().parse_args(argv)
    if args.model:
        return run_export_folder(args)
    if args.part:
        raise CliError("--part chooses a half of a T5 folder given with --model")
    from .export import check_outputs, checkpoint_metadata, export_onnx
    from .nn import ModelConfig, build_model, load_checkpoint, read_checkpoint

    given = given_config(args)
    check_outputs([args.out], [args.checkpoint])  # fail fast, before loading or tracing anything
    if args.checkpoint:
        _, saved_cfg, _ = read_checkpoint(args.checkpoint)
        if saved_cfg is not None:
            saved = ModelConfig.from_dict(saved_cfg)
            merged = {**saved.to_dict(), **given,
                      "bias_params": {**saved.bias_params, **given.get("bias_params", {})}}
            if ModelConfig.from_dict(merged) != saved:
                raise CliError(f"options {', '.join(sorted(given))} contradict the checkpoint's saved config; drop them")
            cfg = saved
        else:
            if "bias" not in given:
                raise CliError("--bias is required: the checkpoint carries no config")
            cfg = ModelConfig(**given)
        model = load_checkpoint(args.checkpoint, cfg, args.arch)
    else:
        if "bias" not in given:
            raise CliError("--bias is required (or --checkpoint with a saved config)")
        model = build_model(ModelConfig(**given), seed=args.seed, arch=args.arch or "lm")
    if args.resize_positions:
        model.resize_positions(args.resize_positions, args.resize_method)
    report = export_onnx(model, args.out, opset=args.opset, dtype=args.dtype, trace_len=args.trace_len,
                         attention_mask=args.attention_mask, kv_cache=args.kv_cache,
                         inline_functions=args.inline_functions, attention=args.attention,
                         block=args.block, target=args.target,
                         metadata=checkpoint_metadata(args.checkpoint) if args.checkpoint else {"seed": args.seed})
    print(report.summary())
    if args.checkpoint:
        print(f"weights from {Path(args.checkpoint).resolve()} (sha256 recorded): validate and evaluate find them "
              "there, or take --checkpoint if the file moves")
    if args.validate:
        return validate_and_report([args.out], None, None, 3, args.checkpoint)
    return 0


# --- validate --------------------------------------------------------------------------------
def build_validate_parser() -> argparse.ArgumentParser:
    from .parity import DEFAULT_RUNTIMES, RUNTIMES

    p = _Parser(prog=f"{PROG} validate", description="Run an exported model on several runtimes and compare "
                "each with a float64 PyTorch reference rebuilt from the file's metadata.",
                epilog=VALIDATE_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models", nargs="+", help="ONNX files written by posbias_export (with --model: any exporter's)")
    p.add_argument("--runtimes", type=_name_list, default=None,
                   help=f"comma-separated, from: {', '.join(RUNTIMES)} (default: those of {','.join(DEFAULT_RUNTIMES)} "
                   "that are installed; a runtime named here that is not installed is a failure)")
    p.add_argument("--lengths", type=_int_list, default=None,
                   help="comma-separated sequence lengths to test (default 1,17 and 64x the trace length)")
    p.add_argument("--batch", type=_positive_int, default=3, help="rows per generated input (default 3)")
    p.add_argument("--checkpoint", help="trained weights the model was exported from (else metadata/seed)")
    p.add_argument("--inputs", help="your own inputs (.npz) instead of generated lengths")
    p.add_argument("--model", metavar="DIR",
                   help="a local Hugging Face folder (BLOOM, MPT, Falcon alibi, T5): judge the files (any exporter's) "
                   "against this model, left-padded batches, real tokens compared")
    p.add_argument("--json", help="write the full report as JSON")
    p.add_argument("--markdown", help="write the matrix as markdown")
    return p


def run_validate(argv: list[str]) -> int:
    args = build_validate_parser().parse_args(argv)
    from .export import check_outputs

    if args.json and args.markdown and args.json == args.markdown:
        raise CliError("--json and --markdown name the same file")
    check_outputs([args.json, args.markdown], [*args.models, args.inputs, args.checkpoint])
    if args.model and (args.checkpoint or args.inputs):
        raise CliError("--model judges generated left-padded inputs against the folder's model; drop "
                       + ("--checkpoint" if args.checkpoint else "--inputs"))
    return validate_and_report(args.models, args.runtimes, args.lengths, args.batch, args.checkpoint,
                               args.inputs, args.json, args.markdown, args.model)


def read_npz(path: str) -> dict:
    """Named arrays from an .npz archive; anything else (an .npy, random bytes, pickles) is one line."""
    import zipfile

    import numpy as np

    if not zipfile.is_zipfile(path):
        reason = "does not exist" if not Path(path).exists() else "is not an .npz archive (np.savez(path, input_ids=...))"
        raise CliError(f"inputs {path} {reason}")
    try:
        with np.load(path, allow_pickle=False) as data:
            return {k: data[k] for k in data.files}
    except (OSError, ValueError, zipfile.BadZipFile) as err:
        raise CliError(f"cannot read inputs {path}: {str(err).splitlines()[0]} (object arrays are refused)") from None


def validate_and_report(models, runtimes, lengths, batch, checkpoint=None, inputs=None, json_path=None, markdown=None,
                        model_dir=None) -> int:
    import json

    from tqdm import tqdm

    from .export.metadata import read_metadata
    from .parity import format_matrix, installed_defaults, load_model_file, parity_markdown, run_matrix
    from .parity.reference import read_onnx

    if runtimes is None:  # the defaults: validate on what is installed, say what is not
        runtimes, missing = installed_defaults()
        for name, reason in missing.items():
            print(f"skipping {name}: {reason}", file=sys.stderr)
        if not runtimes:
            raise CliError("none of the default runtimes is installed; name some with --runtimes")

    feeds = read_npz(inputs) if inputs else None
    matrices = []
    with tqdm(total=len(models) * len(runtimes), desc="validate", unit="runtime", disable=None, file=sys.stderr) as bar:
        for model in models:
            meta = read_metadata(read_onnx(model))
            model_lengths = lengths or (1, 17, 64 * int(meta.get("trace_len", 16)))
            if model_dir or meta.get("source") == "huggingface":  # a model from a Hugging Face folder, any exporter
                from .hf.validate import run_hf_matrix

                matrices.append(run_hf_matrix(model, model_dir, tuple(runtimes), model_lengths, batch,
                                              progress=bar.update))
                continue
            load_model_file(model)  # our own export: its metadata must be complete
            matrices.append(run_matrix(model, tuple(runtimes), model_lengths, batch, checkpoint, feeds, progress=bar.update))
    for m in matrices:
        print(format_matrix(m))
    ok = all(m.ok for m in matrices)
    if json_path:
        Path(json_path).write_text(json.dumps({"ok": ok, "models": [m.as_dict() for m in matrices]}, indent=1))
    if markdown:
        Path(markdown).write_text(parity_markdown(matrices, runtimes, lengths, batch))
    return 0 if ok else 1


# --- generate (lives with the runners: onnxruntime and numpy only) ----------------------------
def run_generate(argv: list[str]) -> int:
    from .parity import load_runner

    try:
        module = load_runner("ort/generate.py")
    except FileNotFoundError as err:
        raise CliError(f"{err} (a broken install: reinstall posbias_export)") from None
    return module.main(argv)


# --- benchmarks ------------------------------------------------------------------------------
def build_bench_parser() -> argparse.ArgumentParser:
    from .bench import attention as bench

    p = _Parser(prog=f"{PROG} bench", description="Long-context attention: our export on ONNX Runtime CPU (blocked "
                "and plain forms) and OpenVINO vs PyTorch eager with the same bias and PyTorch fused causal SDPA "
                "without a bias; one process per configuration. Writes attention.md/.json/.png.",
                epilog="examples:\n  python -m posbias_export bench\n  python -m posbias_export bench --biases alibi "
                "--lengths 512,2048 --repeats 2 --out-dir /tmp/bench", formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--biases", type=_name_list, default=bench.BIASES, help="comma-separated bias families (default all)")
    p.add_argument("--lengths", type=_int_list, default=bench.LENGTHS,
                   help=f"comma-separated sequence lengths (default {','.join(map(str, bench.LENGTHS))})")
    p.add_argument("--configs", type=_name_list, default=bench.CONFIGS, help=f"from: {', '.join(bench.CONFIGS)}")
    p.add_argument("--variants", type=_name_list, default=bench.VARIANTS,
                   help=f"from: {', '.join(bench.VARIANTS)} (bidirectional and block run at the lengths >= "
                        f"{bench.LONG}, or the longest given; default all)")
    p.add_argument("--repeats", type=_positive_int, default=3, help="timed forwards per configuration (after a warm-up)")
    p.add_argument("--heads", type=_positive_int, default=8, help="attention heads (default 8)")
    p.add_argument("--head-dim", type=_positive_int, default=64, help="dimension per head (default 64)")
    p.add_argument("--timeout", type=_positive_int, default=900, help="seconds per configuration")
    p.add_argument("--profile-length", type=int, default=8192,
                   help="also profile ORT (blocked form) at this length; 0: no profile")
    p.add_argument("--out-dir", default="benchmarks", help="where the results files go (default benchmarks)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: our GPU-shaped and portable exports on ONNX Runtime CUDA vs PyTorch eager, fused SDPA "
                   "and FlexAttention on the GPU, float16 and float32 (lengths default 1024,4096,16384,32768); "
                   "writes gpu_attention.md/.json")
    return p


def run_bench(argv: list[str]) -> int:
    args = build_bench_parser().parse_args(argv)

    from tqdm import tqdm

    from .bench import attention as bench

    out_dir = Path(args.out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise CliError(f"--out-dir {out_dir} is a file")
    if args.device == "cuda":
        return run_bench_gpu(args, out_dir)
    with tqdm(total=bench.count(args.biases, args.lengths, args.configs, args.variants), desc="bench",
              unit="config", disable=None, file=sys.stderr) as bar:
        cells = bench.run(args.biases, args.lengths, args.configs, args.repeats, args.heads, args.head_dim,
                          args.timeout, progress=bar.update, variants=args.variants)
    paths = bench.write(cells, out_dir, args.heads, args.head_dim)
    if args.profile_length:
        paths.append(bench.write_profile(args.biases, args.profile_length, args.heads, args.head_dim, out_dir))
    print(paths[1].read_text())
    print("wrote " + ", ".join(str(x) for x in paths))
    return 0


def run_bench_gpu(args, out_dir: Path) -> int:
    import tempfile

    import torch

    from .bench import gpu_attention

    if not torch.cuda.is_available():
        raise CliError("bench --device cuda needs a CUDA GPU visible to PyTorch")
    lengths = gpu_attention.LENGTHS if "--lengths" not in sys.argv else args.lengths
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="posbias-gpu-") as tmp:
        result = gpu_attention.run(args.biases, lengths, gpu_attention.DTYPES, gpu_attention.TARGETS, args.heads,
                                   args.head_dim, max(args.repeats, 10), Path(tmp), progress=print)
    paths = gpu_attention.write(result, out_dir)
    print("wrote " + ", ".join(str(x) for x in paths))
    return 0


def build_bench_decode_parser() -> argparse.ArgumentParser:
    from .biases import BIASES

    p = _Parser(prog=f"{PROG} bench-decode", description="Per-token decode latency: ONNX Runtime vs PyTorch eager "
                "with the same KV cache, side by side; writes decode.md and decode.json.")
    p.add_argument("--biases", type=_name_list, default=BIASES, help="comma-separated bias families (default all)")
    p.add_argument("--contexts", type=_int_list, default=(512, 4096),
                   help="comma-separated context lengths decoded from (default 512,4096)")
    p.add_argument("--steps", type=_positive_int, default=32, help="decode steps timed per context")
    p.add_argument("--out-dir", default="benchmarks", help="where decode.md/.json go (default benchmarks)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: ONNX Runtime CUDA (cache kept on the GPU) vs PyTorch eager on the GPU; writes "
                   "gpu_decode.md/.json")
    p.add_argument("--target", choices=("portable", "cuda", "cuda-ort"), default="portable",
                   help="export target of the decoder file (default portable)")
    return p


def run_bench_decode(argv: list[str]) -> int:
    args = build_bench_decode_parser().parse_args(argv)
    from tqdm import tqdm

    from .biases import BIASES
    from .bench.decode import run

    unknown = [b for b in args.biases if b not in BIASES]
    if unknown:
        raise CliError(f"unknown bias {unknown[0]!r}; choose one of: {', '.join(BIASES)}")
    with tqdm(total=len(args.biases), desc="bench-decode", unit="bias", disable=None, file=sys.stderr) as bar:
        rows = run(args.biases, args.contexts, args.steps, args.out_dir, progress=bar.update, device=args.device,
                   target=args.target)
    for r in rows:
        print(f"{r['bias']:>13} context {r['context']:>5}: ORT {r['ort_ms_median']:.2f} ms/token, "
              f"PyTorch {r['torch_ms_median']:.2f} ms/token, ratio {r['ort_over_torch']:.2f}")
    return 0


# --- train short, test long -----------------------------------------------------------------
def build_bench_models_parser() -> argparse.ArgumentParser:
    from .bench import models as bench

    p = _Parser(prog=f"{PROG} bench-models", description="Imported BLOOM / MPT / Falcon (alibi) / T5-encoder models: "
                "our blocked export vs a plain dynamo export vs Optimum's (if installed), time, peak RSS and error "
                "vs transformers on ONNX Runtime CPU, each cell in its own process; writes models.md/.json.")
    p.add_argument("--models", type=_name_list, default=bench.KINDS, help=f"from: {', '.join(bench.KINDS)}")
    p.add_argument("--lengths", type=_int_list, default=bench.LENGTHS,
                   help=f"comma-separated sequence lengths (default {','.join(map(str, bench.LENGTHS))})")
    p.add_argument("--repeats", type=_positive_int, default=2, help="timed forwards per cell (default 2)")
    p.add_argument("--out-dir", default="benchmarks", help="where models.md/.json go (default benchmarks)")
    return p


def run_bench_models(argv: list[str]) -> int:
    args = build_bench_models_parser().parse_args(argv)
    from tqdm import tqdm

    from .bench import models as bench

    unknown = [k for k in args.models if k not in bench.KINDS]
    if unknown:
        raise CliError(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(bench.KINDS)}")
    ensure_folder = Path(args.out_dir)
    if ensure_folder.exists() and not ensure_folder.is_dir():
        raise CliError(f"--out-dir {args.out_dir} is not a folder")
    total = len(args.models) * len(args.lengths) * len(bench.EXPORTERS)
    with tqdm(total=total, desc="bench-models", unit="cell", disable=None, file=sys.stderr) as bar:
        cells = bench.run(tuple(args.models), tuple(args.lengths), repeats=args.repeats, progress=bar.update)
    for path in bench.write(cells, ensure_folder):
        print(f"wrote {path}")
    return 0


def build_train_parser() -> argparse.ArgumentParser:
    from .biases import BIASES
    from .study.train import SCHEMES

    p = _Parser(prog=f"{PROG} train", description="Train a byte-level decoder on a text corpus (CPU, deterministic "
                "for a seed); writes OUT.safetensors and OUT.md (model card).",
                epilog="example:\n  python -m posbias_export train --bias alibi --corpus ../shared/data/tinyshakespeare.txt "
                "--train-len 64 --steps 600 --out models/alibi", formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bias", required=True, help=f"a bias ({', '.join(BIASES)}) or a scheme ({', '.join(SCHEMES)})")
    p.add_argument("--corpus", required=True, help="a text file (read as bytes); its last 10%% is held out")
    p.add_argument("--out", required=True, help="output path without extension")
    p.add_argument("--train-len", type=_positive_int, default=64, help="training sequence length (default 64)")
    p.add_argument("--steps", type=_positive_int, default=600, help="optimizer steps (default 600)")
    p.add_argument("--batch", type=_positive_int, default=32, help="sequences per step (default 32)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak AdamW learning rate (default 3e-3)")
    p.add_argument("--seed", type=int, default=0, help="init and data order seed (default 0)")
    p.add_argument("--heads", type=_positive_int, default=4, help="attention heads (default 4)")
    p.add_argument("--dim", type=_positive_int, default=128, help="model width (default 128)")
    p.add_argument("--layers", type=_positive_int, default=2, help="transformer layers (default 2)")
    return p


def run_train(argv: list[str]) -> int:
    args = build_train_parser().parse_args(argv)

    from .export import check_outputs
    from .nn import ModelConfig
    from .study.train import save_trained, scheme_fields, train

    fields = scheme_fields(args.bias, args.train_len)
    check_outputs([Path(args.out).with_suffix(".safetensors"), Path(args.out).with_suffix(".md")], [args.corpus])
    cfg = ModelConfig(num_heads=args.heads, dim=args.dim, num_layers=args.layers, **fields)
    model, card = train(cfg, args.corpus, args.train_len, args.steps, args.batch, args.lr, args.seed)
    command = "python -m posbias_export train " + " ".join(argv)
    save_trained(model, card, args.out, command)
    print(f"wrote {Path(args.out).with_suffix('.safetensors')} and .md: final loss {card['final_loss']:.4f}")
    return 0


def add_perplexity_options(p: argparse.ArgumentParser) -> None:
    """What evaluate and extrapolation share: the corpus, the lengths, the token budget."""
    p.add_argument("--corpus", required=True, help="a text file; perplexity is measured on its last 10%%")
    p.add_argument("--lengths", type=_int_list, default=(64, 128, 256, 512, 1024),
                   help="comma-separated evaluation lengths (default 64,128,256,512,1024)")
    p.add_argument("--max-tokens", type=_positive_int, default=16384, help="held-out tokens per length (default 16384)")


def build_evaluate_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=f"{PROG} evaluate", description="Perplexity vs evaluation length through ONNX Runtime over "
                "non-overlapping windows of the corpus's held-out split (its last 10%), checked against PyTorch.")
    p.add_argument("model", help="an lm export (e.g. python -m posbias_export --checkpoint models/alibi.safetensors --out m.onnx)")
    add_perplexity_options(p)
    p.add_argument("--checkpoint", help="weights for the PyTorch cross-check (default: the file's metadata)")
    p.add_argument("--json", help="write the results as JSON")
    return p


def run_evaluate(argv: list[str]) -> int:
    args = build_evaluate_parser().parse_args(argv)
    import json

    from tqdm import tqdm

    from .export import check_outputs
    from .study.evaluate import as_json, evaluate, format_results

    check_outputs([args.json], [args.model, args.corpus, args.checkpoint])

    with tqdm(total=len(args.lengths), desc="evaluate", unit="length", disable=None, file=sys.stderr) as bar:
        results = evaluate(args.model, args.corpus, args.lengths, args.max_tokens, args.checkpoint, progress=bar.update)
    print(format_results(results))
    if args.json:
        Path(args.json).write_text(json.dumps(as_json(results), indent=1))
    return 0


def build_extrapolation_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=f"{PROG} extrapolation", description="Export every checkpoint in --models, evaluate perplexity "
                "vs length on ONNX Runtime (checked against PyTorch); write extrapolation.md/.json/.png.")
    p.add_argument("--models", default="models", help="a folder of .safetensors checkpoints (default models)")
    add_perplexity_options(p)
    p.add_argument("--out-dir", default="benchmarks", help="where the results files go (default benchmarks)")
    return p


def run_extrapolation(argv: list[str]) -> int:
    args = build_extrapolation_parser().parse_args(argv)

    from tqdm import tqdm

    from .study.extrapolation import run

    count = len(list(Path(args.models).glob("*.safetensors")))
    with tqdm(total=count, desc="extrapolation", unit="model", disable=None, file=sys.stderr) as bar:
        run(args.models, args.corpus, args.lengths, args.max_tokens, args.out_dir, progress=bar.update)
    print((Path(args.out_dir) / "extrapolation.md").read_text())
    return 0


# --- dispatch --------------------------------------------------------------------------------
COMMANDS = {"validate": run_validate, "generate": run_generate, "bench": run_bench, "bench-decode": run_bench_decode,
            "bench-models": run_bench_models,
            "train": run_train, "evaluate": run_evaluate, "extrapolation": run_extrapolation}  # the default: export


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from .errors import ExportCheckError

    try:
        if argv and argv[0] in COMMANDS:
            return COMMANDS[argv[0]](argv[1:])
        return run_export(argv)
    except CliError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    except ExportCheckError as err:
        print(f"{PROG}: export check failed: {err}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as err:  # bad values from the API (ParityInputError, CheckpointError included)
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
