"""The default command: export one of our models (flags or a checkpoint) or a Hugging Face
folder (--model DIR) to ONNX, optionally validating the file right after."""
from __future__ import annotations

import argparse

from ..errors import UsageError
from .options import key_value, parser, positive_int

EXPORT_EXAMPLES = """examples:
  python -m posbias_export --bias alibi --out model.onnx
  python -m posbias_export --bias kerple_log --heads 8 --dim 256 --layers 4 --out kerple.onnx
  python -m posbias_export --bias window --bias-param window=128 --out window.onnx
  python -m posbias_export --bias t5 --bidirectional --arch block --out t5_block.onnx
  python -m posbias_export --bias alibi --opset 23 --dtype float16 --out alibi_fp16.onnx
  python -m posbias_export --checkpoint models/alibi.safetensors --out alibi.onnx
"""

_PARAM_DEST = "bias_param:"  # dest prefix of the per-family alias flags (--window, ...)
_CONFIG_FLAGS = {"bias": "bias", "heads": "num_heads", "dim": "dim", "layers": "num_layers"}
# options that describe our own models; an imported folder brings its own architecture
_FOLDER_DECIDES = ("bias", "bias_param", "heads", "dim", "layers", "bidirectional", "arch", "checkpoint",
                   "resize_positions", "attention_mask")


def _families_epilog() -> str:
    from ..biases import BIASES, bias_class, hyper_parameter_fields

    lines = ["bias families and their hyper-parameters (--bias-param NAME=VALUE):"]
    for name in BIASES:
        own = [f"{f.name}={f.default} ({f.metadata['help']})" for family, f in hyper_parameter_fields() if family == name]
        lines.append(f"  {name:<13} {'learned' if bias_class(name).learned else 'fixed':<8} "
                     f"{'; '.join(own) or 'no hyper-parameters'}")
    return "\n".join(lines)


def build_export_parser(commands_help: str = "") -> argparse.ArgumentParser:
    from ..biases import BIASES, hyper_parameter_fields

    p = parser("", "Export a transformer with a positional attention bias to ONNX with dynamic batch and sequence "
                "axes, and check the result.", commands_help + "\n\n" + _families_epilog() + "\n\n" + EXPORT_EXAMPLES)
    p.add_argument("--bias", help=f"bias family: {', '.join(BIASES)} (taken from --checkpoint when given)")
    p.add_argument("--bias-param", type=key_value, action="append", default=[], metavar="NAME=VALUE",
                   help="a hyper-parameter of the bias family (repeatable); see the list below")
    for family, f in hyper_parameter_fields():
        if f.metadata.get("alias"):
            p.add_argument(f.metadata["alias"], type=positive_int, dest=f"{_PARAM_DEST}{f.name}", metavar="N",
                           help=f"{family}: {f.metadata['help']} (default {f.default}); same as --bias-param {f.name}=N")
    p.add_argument("--out", help="output .onnx path (written atomically)")
    p.add_argument("--out-dir", metavar="OUT", help="with --model: a folder the serving tools load as it is (Optimum, "
                   "transformers.js, onnxruntime-genai, Triton): Hugging Face names, model.onnx (T5: encoder_model.onnx "
                   "and decoder_model_merged.onnx), onnx/, genai_config.json, triton/, the folder's config and "
                   "tokenizer files; OUT must not exist or be empty")
    p.add_argument("--context-length", type=positive_int, metavar="N",
                   help="with --out-dir: genai_config.json's context_length (default 8192, not the config's position "
                   "limit: these files extrapolate past it)")
    _model_flags(p)
    _file_flags(p)
    _quantize_flags(p)
    _source_flags(p)
    return p


def _model_flags(p) -> None:
    """Our own model's shape."""
    from ..nn import ARCHS

    p.add_argument("--arch", choices=ARCHS, default=None,
                   help="lm: byte-level decoder, input_ids [B, L] -> logits [B, L, 256]; block: one transformer block, "
                   "hidden [B, L, dim] in and out; attention: query/key/value [B, heads, L, dim/heads] -> same (default lm)")
    p.add_argument("--heads", type=positive_int, help="attention heads (default 4)")
    p.add_argument("--dim", type=positive_int, help="model width, divisible by --heads (default 128)")
    p.add_argument("--layers", type=positive_int, help="transformer layers (default 2)")
    p.add_argument("--bidirectional", action="store_true", default=None, help="no causal mask; symmetric bias")


def _file_flags(p) -> None:
    """What the file is: opset, target, dtype, trace, cache, attention form."""
    from ..export import DTYPES, OPSETS, TARGETS
    from ..export.options import KV_DTYPES, LOGITS
    from ..nn import ATTENTION_FORMS

    p.add_argument("--opset", type=int, choices=OPSETS, default=None,
                   help="18 (portable; the default) or 23 (ONNX Attention op; the default for --target cuda)")
    p.add_argument("--target", choices=tuple(TARGETS), default=None,
                   help="; ".join(f"{t.name}: {t.help}" for t in TARGETS.values()) + " (default portable; "
                   "--out-dir of a causal LM: ort, which every client the folder names runs)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32",
                   help="weights and activations; float16 keeps scores, bias and softmax in float32")
    p.add_argument("--trace-len", type=positive_int, default=16, help="sequence length used to trace (default 16)")
    p.add_argument("--kv-cache", action="store_true",
                   help="cached decoder for generation: input_ids, attention_mask, past_key.N/past_value.N in; "
                   "logits, present_key.N/present_value.N out (prefill and decode in one file)")
    p.add_argument("--logits", choices=LOGITS, default=None,
                   help="with --kv-cache or --out-dir: all (every position; the default) or last (the last position "
                   "only, [B, 1, V]: what generation reads, no [B, L, V] tensor for a long prompt; Optimum, "
                   "transformers.js and generate take it, onnxruntime-genai does not for right-padded batches)")
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default="float",
                   help="with --kv-cache --target ort: float (the model's dtype; the default), float16 (float32 weights, "
                   "half the cache bytes: attention in float16) or int8 (a quarter of float32's cache bytes: one "
                   "calibrated scale per layer's keys and values); both for ONNX Runtime's own loops, not Optimum or "
                   "transformers.js")
    p.add_argument("--external-data", action="store_true",
                   help="the tensors in <out>.data beside the file at any size (else only past ~2 GB): ONNX Runtime "
                   "maps them and drops what it prepacks, so a session holds each weight once (BLOOM-560m int4: "
                   "1.00 GB instead of 1.26); transformers.js reads one file")
    p.add_argument("--attention", choices=ATTENTION_FORMS, default=None,
                   help="blocked: a Loop over query blocks, memory linear in L (default for opset 18); plain: the "
                   "whole [heads, L, L] bias and scores at once (default for opset 23)")
    p.add_argument("--block", type=positive_int, default=None,
                   help="blocked form: query rows per block (default 256; GPU targets 4096, fewer for long keys)")
    p.add_argument("--skip-growth-check", action="store_true",
                   help="skip the second trace (at 2 x trace-len + 1) that catches initializers sized by the trace "
                   "length: about half the export time; every other check still runs")
    p.add_argument("--inline-functions", action="store_true",
                   help="expand the posbias.* functions into a flat graph of standard ops")
    p.add_argument("--attention-mask", action="store_true",
                   help="add an attention_mask [B, L] input (1 = token, 0 = padding; positions from its cumsum)")


def _quantize_flags(p) -> None:
    from ..export.quantize.schemes import SCHEMES

    p.add_argument("--quantize", choices=tuple(SCHEMES), default=None,
                   help="LM files: weights of the linear layers and the embedding quantized by ONNX Runtime's own "
                   "tools (int8: quantize_dynamic, standard ops; int4: MatMulNBits, ONNX Runtime only); attention and "
                   "bias stay float; validate judges such files by the quantized policy")
    for cls in SCHEMES.values():  # each scheme declares its options' flags
        for f, flag, help_text in cls.option_flags():
            if isinstance(f.default, bool):
                p.add_argument(flag, action="store_const", const=not f.default, default=None,
                               dest=f"quant:{f.name}", help=help_text)
            elif "choices" in f.metadata:
                p.add_argument(flag, choices=f.metadata["choices"], default=None, dest=f"quant:{f.name}", help=help_text)
            else:
                p.add_argument(flag, type=int, default=None, dest=f"quant:{f.name}", metavar="N", help=help_text)


def _source_flags(p) -> None:
    """Where the weights come from: a seed, a checkpoint, a Hugging Face folder."""
    from ..hf.models import PART_NAMES
    from ..nn.positions import RESIZE_METHODS

    p.add_argument("--seed", type=int, default=0, help="weight init seed when no --checkpoint (default 0)")
    p.add_argument("--resize-positions", type=positive_int,
                   help="learned positions: resize the table to N rows before export (else longer inputs are refused)")
    p.add_argument("--resize-method", choices=RESIZE_METHODS, default="interpolate",
                   help="how --resize-positions fills the new rows")
    p.add_argument("--ignore-size-limits", action="store_true",
                   help="resize to a table whose memory estimate exceeds this machine's (refused by default)")
    p.add_argument("--checkpoint", help="safetensors or weights-only torch file; its saved config is used")
    p.add_argument("--model", metavar="DIR", help="a local Hugging Face folder (config.json + safetensors) of a BLOOM, "
                   "MPT, Falcon (alibi) or T5 model: exported with input_ids, attention_mask -> logits (T5: the encoder, "
                   "-> last_hidden_state); nothing is downloaded")
    p.add_argument("--part", choices=PART_NAMES, default=None,
                   help="with --model and a T5 encoder-decoder folder: which half (default encoder); the decoder file "
                   "carries its KV cache and takes encoder_hidden_states, encoder_attention_mask")
    p.add_argument("--validate", action="store_true",
                   help="after export, run the parity matrix (ort-cpu, openvino, node, reference); exit 1 on failure")


def given_config(args) -> dict:
    """The ModelConfig fields the command line sets (flags left out are not in the dict)."""
    given = {field: getattr(args, flag) for flag, field in _CONFIG_FLAGS.items() if getattr(args, flag) is not None}
    if args.bidirectional:
        given["causal"] = False
    params = dict(args.bias_param)
    params.update({dest[len(_PARAM_DEST):]: value for dest, value in vars(args).items()
                   if dest.startswith(_PARAM_DEST) and value is not None})
    return {**given, **({"bias_params": params} if params else {})}


def export_options(args):
    """The one ExportOptions value the command line asks for."""
    from ..export.options import ExportOptions

    return ExportOptions(opset=args.opset, dtype=args.dtype, trace_len=args.trace_len, target=args.target or "portable",
                         attention=args.attention, block=args.block, inline_functions=args.inline_functions,
                         check_growth=not args.skip_growth_check, attention_mask=bool(args.attention_mask),
                         kv_cache=args.kv_cache, logits=args.logits or "all", quantize=quantize_spec(args),
                         part=args.part or "encoder", context_length=args.context_length, kv_dtype=args.kv_dtype,
                         external_data=args.external_data)


def run_export(args) -> int:
    if bool(args.out) == bool(args.out_dir):
        raise UsageError("give --out FILE (or, with --model, --out-dir FOLDER)")
    if args.context_length is not None and not args.out_dir:
        raise UsageError("--context-length sets genai_config.json's: it needs --out-dir")
    if args.model:
        return run_export_folder(args)
    if args.out_dir:
        raise UsageError("--out-dir writes a serving folder for a Hugging Face model: it needs --model DIR")
    if args.part:
        raise UsageError("--part chooses a half of a T5 folder given with --model")
    from ..export import check_outputs, export_onnx, source_metadata
    from ..nn import model_for

    options = export_options(args)
    # fail fast, before loading or tracing anything; the file's tensors may go to <out>.data
    check_outputs([args.out, args.out + ".data"], [args.checkpoint])
    model = model_for(given_config(args), args.checkpoint, args.arch, args.seed)
    if args.resize_positions:
        model.resize_positions(args.resize_positions, args.resize_method, ignore_size_limits=args.ignore_size_limits)
    report = export_onnx(model, args.out, options, metadata=source_metadata(args.checkpoint, args.seed))
    print(report.summary())
    return _validate_after_export(args) if args.validate else 0


def quantize_spec(args):
    """--quantize and its options -> a schemes.Scheme (None: float weights); options without
    --quantize, or of another scheme, are a usage error, not silently ignored."""
    from ..export.quantize.schemes import SCHEMES, scheme

    given = {flag: (f.name, getattr(args, f"quant:{f.name}")) for cls in SCHEMES.values()
             for f, flag, _ in cls.option_flags() if getattr(args, f"quant:{f.name}") is not None}
    if not args.quantize:
        if given:
            raise UsageError(f"{', '.join(given)} need --quantize")
        return None
    wrong = [flag for flag, (name, _) in given.items() if name not in SCHEMES[args.quantize].__dataclass_fields__]
    if wrong:
        raise UsageError(f"{', '.join(wrong)} do not apply to --quantize {args.quantize}")
    return scheme(args.quantize, **dict(given.values()))


def run_export_folder(args) -> int:
    from ..hf.export import export_model

    given = [n for n in _FOLDER_DECIDES if getattr(args, n)]
    if given:
        raise UsageError("--model takes the architecture and weights from the folder; drop "
                         + ", ".join("--" + name.replace("_", "-") for name in given))
    options = export_options(args)
    if args.out_dir:
        from ..hf.ship import ship

        refused = [f for f, on in (("--kv-cache", args.kv_cache), ("--part", args.part), ("--attention", args.attention),
                                   ("--validate", args.validate), (f"--kv-dtype {args.kv_dtype}", args.kv_dtype != "float"),
                                   ("--external-data", args.external_data)) if on]
        if refused:
            raise UsageError(f"--out-dir decides what each client needs; drop {', '.join(refused)}")
        print(ship(args.model, args.out_dir, options if args.target else options.replace(target=None)).summary())
        return 0
    report = export_model(args.model, args.out, options)
    print(report.summary())
    if args.validate and args.part == "decoder":
        print("the T5 decoder file is checked by the test suite (greedy tokens against transformers.generate); "
              "validate --model judges single-input-sequence files")
        return 0
    return _validate_after_export(args) if args.validate else 0


def _validate_after_export(args) -> int:
    from .validate import report_validation

    return report_validation([args.out], None, None, 3, getattr(args, "checkpoint", None), model_dir=args.model)
