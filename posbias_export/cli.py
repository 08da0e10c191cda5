"""Command line: the table of commands (name, summary, where its parser and runner live), which
also writes the top-level help, and dispatch. Each command's parsing and its call into the API
live in commands/; errors are one line on stderr, exit 2. Heavy imports happen inside the
runners, after the arguments parsed."""
from __future__ import annotations

import importlib
import sys
import warnings
from dataclasses import dataclass

from .errors import ExportCheckError, UsageError
from .commands.options import PROG


@dataclass(frozen=True)
class Command:
    name: str  # "" for the default command (export)
    summary: str
    module: str  # commands.<module> holds build_<parser> and run_<runner>
    parser: str | None  # None: the runner takes the raw arguments (generate parses its own)
    runner: str

    def load(self, attr: str):
        return getattr(importlib.import_module(f"{__package__}.commands.{self.module}"), attr)


COMMANDS = (
    Command("", "export a model to ONNX (the options above; --model DIR for a Hugging Face folder)", "export",
            "build_export_parser", "run_export"),
    Command("validate", "run a file on every runtime against a float64 PyTorch reference", "validate",
            "build_validate_parser", "run_validate"),
    Command("generate", "generate with a --kv-cache export on ONNX Runtime (CPU or CUDA)", "generate", None,
            "run_generate"),
    Command("bench", "long-context attention: time and peak memory, side by side with PyTorch", "bench",
            "build_bench_parser", "run_bench"),
    Command("bench-decode", "per-token decode latency: ONNX Runtime vs PyTorch", "bench", "build_bench_decode_parser",
            "run_bench_decode"),
    Command("bench-models", "imported BLOOM/MPT/Falcon/T5: our export vs dynamo vs Optimum, time, memory, error",
            "bench", "build_bench_models_parser", "run_bench_models"),
    Command("bench-embed", "a JinaBERT v2 embedder at published size: our file vs the dense [H, L, L] form, at length",
            "bench", "build_bench_embed_parser", "run_bench_embed"),
    Command("bench-real", "imported models at published sizes (random weights): export memory, prefill, decode",
            "bench", "build_bench_real_parser", "run_bench_real"),
    Command("bench-serving", "decode at length: the in-place KV cache vs the Concat file, beside the floor", "bench",
            "build_bench_serving_parser", "run_bench_serving"),
    Command("bench-quant", "int8 / int4 files: held-out perplexity, size, export memory, decode vs float32",
            "bench", "build_bench_quant_parser", "run_bench_quant"),
    Command("bench-clients", "the serving folder in transformers.js, onnxruntime-genai, Optimum: tokens and logits",
            "bench", "build_bench_clients_parser", "run_bench_clients"),
    Command("serve", "serve a --out-dir folder behind the OpenAI API on Ray Serve (embeddings, completions)", "serve",
            "build_serve_parser", "run_serve"),
    Command("bench-serve", "serve under load: embeddings and streamed completions, requests/s, latency, server RSS",
            "serve", "build_bench_serve_parser", "run_bench_serve"),
    Command("show-bias", "draw a bias family's values per head from its float64 reference", "show_bias",
            "build_show_bias_parser", "run_show_bias"),
    Command("train", "train a byte-level decoder on a text corpus", "study", "build_train_parser", "run_train"),
    Command("evaluate", "perplexity vs length through an exported file", "study", "build_evaluate_parser",
            "run_evaluate"),
    Command("extrapolation", "every checkpoint in models/: export, evaluate, tabulate", "study",
            "build_extrapolation_parser", "run_extrapolation"),
)


def commands_help() -> str:
    lines = ["commands (python -m posbias_export COMMAND --help):"]
    return "\n".join(lines + [f"  {c.name or '(none)':<14} {c.summary}" for c in COMMANDS])


def parser_of(command: Command):
    build = command.load(command.parser)
    return build(commands_help()) if not command.name else build()


def dispatch(argv: list[str]) -> int:
    named = {c.name: c for c in COMMANDS if c.name}
    command = named[argv[0]] if argv and argv[0] in named else COMMANDS[0]
    rest = argv[1:] if command.name else argv
    if command.parser is None:
        return command.load(command.runner)(rest)
    args = parser_of(command).parse_args(rest)
    args.argv = rest  # as typed (train records its command in the model card)
    return command.load(command.runner)(args)


OUTPUT_FLAGS = ("--out", "--out-dir", "--output", "--json", "--markdown")


def disk_full_target(err: Exception, argv: list[str]) -> str:
    """A full disk reported by a write() names no file: name what the command was writing."""
    import errno

    if not isinstance(err, OSError) or err.errno not in (errno.ENOSPC, errno.EDQUOT) or err.filename:
        return ""
    named = [(flag, argv[i + 1]) for i, flag in enumerate(argv[:-1]) if flag in OUTPUT_FLAGS]
    named += [tuple(a.split("=", 1)) for a in argv if a.split("=", 1)[0] in OUTPUT_FLAGS and "=" in a]
    if not named:
        return ""
    return " (writing " + ", ".join(f"{value} ({flag})" for flag, value in named) + "; nothing was left there)"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from .runners import atomic

    atomic().on_sigterm_raise()  # SIGTERM (timeout, systemd, a container stop) cleans up as Ctrl-C does
    try:
        with warnings.catch_warnings():  # the one line a user reads is ours, not a library's warning
            warnings.simplefilter("ignore")
            return dispatch(argv)
    except UsageError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    except ExportCheckError as err:
        print(f"{PROG}: export check failed: {err}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as err:  # bad values from the API (ParityInputError, CheckpointError included)
        print(f"{PROG}: error: {err}{disk_full_target(err, argv)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as stop:  # atomic writes and temporary folders are gone by now
        return stopped(stop)
    except ImportError as err:  # a stop during an extension's first import arrives wrapped (atomic.stop_behind)
        stop = atomic().stop_behind(err)
        if stop is None:
            raise
        return stopped(stop)


def stopped(stop: KeyboardInterrupt) -> int:
    terminated = type(stop).__name__ == "Terminated"
    print(f"{PROG}: {'terminated' if terminated else 'interrupted'}", file=sys.stderr)
    return 143 if terminated else 130


if __name__ == "__main__":
    sys.exit(main())
