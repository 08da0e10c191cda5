"""serve: a folder written by --out-dir behind an OpenAI-compatible HTTP API, on Ray Serve
(posbias_export/serve/)."""
from __future__ import annotations

import argparse

from ..errors import UsageError
from .options import parser, positive_int

SERVE_EXAMPLES = """examples:
  python -m posbias_export serve jina_onnx/                            # embeddings on 127.0.0.1:8000
  python -m posbias_export serve bloom_onnx/ --port 8001 --replicas 2  # completions, two replicas
  python -m posbias_export serve bloom_onnx/ --address ray://head:10001 --host 0.0.0.0   # a Ray cluster

Then any OpenAI client: OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="-").embeddings.create(
model="jina_onnx", input=["..."]). GET /health, /v1/models, /metrics (Prometheus).
"""


def port(text: str) -> int:
    value = positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"a port is at most 65535, got {value}")
    return value


def build_serve_parser() -> argparse.ArgumentParser:
    p = parser("serve", "Serve a folder written by --out-dir (an embedder, a decoder with the in-place cache, a T5/UMT5 pair) "
               "behind the OpenAI API on Ray Serve: /v1/embeddings batched by token budget, /v1/completions "
               "continuously batched (a seq2seq pair: by request). Runs until Ctrl-C or SIGTERM (requests in flight finish first).",
               SERVE_EXAMPLES)
    p.add_argument("folder", metavar="DIR", help="a folder written by --out-dir")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0: every one)")
    p.add_argument("--port", type=port, default=8000, help="HTTP port (default 8000)")
    p.add_argument("--replicas", type=positive_int, default=1, help="model replicas (default 1)")
    p.add_argument("--max-replicas", type=positive_int,
                   help="autoscale between --replicas and this many (Ray Serve's autoscaler; on KubeRay the cluster's "
                        "adds nodes for them)")
    p.add_argument("--address", help="an existing Ray cluster's address (default: start Ray on this machine)")
    p.add_argument("--max-batch-tokens", type=positive_int,
                   help="embeddings: padded tokens per batch; a longer input runs alone (default 512, the "
                        "CPU's cheapest batch, or less where free memory is short)")
    p.add_argument("--slots", type=positive_int, help="completions: requests decoding together per replica (default 8)")
    p.add_argument("--threads", type=int, default=0,
                   help="ONNX Runtime threads per replica, and the CPUs each reserves in Ray (default: here, a lone "
                        "replica its session's own choice, several this machine's cores shared evenly; on a cluster 1)")
    p.add_argument("--allow-origin", action="append", type=origin, default=[], metavar="ORIGIN",
                   help="answer browsers' calls from pages at ORIGIN (CORS; e.g. https://app.example.com, repeatable, "
                        "* for any). Default: none, a page on another origin cannot read the answers")
    return p


def origin(text: str) -> str:
    from ..serve.app import check_origin

    try:
        return check_origin(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def run_serve(args) -> int:
    from ..serve.folder import FolderError, ServedFolder

    if args.threads < 0:
        raise UsageError(f"--threads must be >= 0, got {args.threads}")
    if args.max_replicas is not None and args.max_replicas < args.replicas:
        raise UsageError(f"--max-replicas ({args.max_replicas}) is below --replicas ({args.replicas})")
    try:
        served = ServedFolder.read(args.folder)
    except FolderError as err:
        raise UsageError(str(err)) from None
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError:
        raise UsageError("serve needs Ray Serve: pip install 'posbias_export[serve]'") from None
    from ..serve.launch import launch

    return launch(served, args.host, args.port, args.replicas, args.address, args.max_batch_tokens, args.threads,
                  args.slots, args.max_replicas, tuple(args.allow_origin))


def build_bench_serve_parser() -> argparse.ArgumentParser:
    from ..bench import serve_load as bench
    from .options import int_list, name_list

    p = parser("bench-serve", "serve under bounded load on loopback: embeddings (a jina-v2-base-shaped folder, "
               "concurrent clients x input lengths) and streamed completions (BLOOM-560m- and MPT-1B-shaped folders, "
               "concurrent streams): requests/s or tokens/s, latency percentiles, the whole server's peak RSS, beside the peer "
               "servers installed here; writes serve.md/.json.",
               "example:\n  python -m posbias_export bench-serve --work /tmp/real --lengths 512,2048 --clients 1,8")
    p.add_argument("--work", required=True, help="folder for the random-weight models and their served folders")
    p.add_argument("--lengths", type=int_list, default=bench.EMBED_LENGTHS,
                   help=f"embedding input tokens (default {','.join(map(str, bench.EMBED_LENGTHS))})")
    p.add_argument("--clients", type=int_list, default=bench.EMBED_CLIENTS,
                   help=f"concurrent embedding clients (default {','.join(map(str, bench.EMBED_CLIENTS))})")
    p.add_argument("--streams", type=int_list, default=bench.STREAMS,
                   help=f"concurrent completion streams (default {','.join(map(str, bench.STREAMS))})")
    p.add_argument("--decoders", type=name_list, default=bench.DECODERS,
                   help=f"completion models, from: {', '.join(bench.DECODERS)} (default all)")
    p.add_argument("--prompt", type=positive_int, default=bench.PROMPT, help=f"prompt tokens (default {bench.PROMPT})")
    p.add_argument("--new-tokens", type=positive_int, default=bench.NEW_TOKENS,
                   help=f"tokens per completion (default {bench.NEW_TOKENS})")
    p.add_argument("--max-cell-tokens", type=positive_int, default=bench.MAX_CELL_TOKENS,
                   help=f"skip an embedding cell sending more tokens than this (default {bench.MAX_CELL_TOKENS})")
    p.add_argument("--only", choices=("embeddings", "completions"),
                   help="measure this route's cells asked for, keeping every other row of the last serve.json")
    p.add_argument("--out-dir", default="benchmarks", help="where serve.md/.json go (default benchmarks)")
    return p


def run_bench_serve(args) -> int:
    import os
    import sys
    from pathlib import Path

    from ..bench import serve_load as bench

    for name in ("lengths", "clients", "streams"):
        bad = [v for v in getattr(args, name) if v < 1]
        if bad or not getattr(args, name):
            raise UsageError(f"--{name} takes positive integers, got {getattr(args, name)}")
    unknown = [d for d in args.decoders if d not in bench.DECODERS]
    if unknown:
        raise UsageError(f"--decoders: unknown {', '.join(unknown)} (from: {', '.join(bench.DECODERS)})")
    if max(args.lengths) > 1 << 20 or args.prompt + args.new_tokens > 1 << 20:
        raise UsageError("--lengths / --prompt + --new-tokens: at most 1048576 tokens")
    try:
        import openai  # noqa: F401
        import ray.serve  # noqa: F401
    except ImportError:
        raise UsageError("bench-serve needs Ray Serve and the openai client: pip install 'posbias_export[serve]'") from None
    work, out_dir = Path(args.work), Path(args.out_dir)
    for folder in (work, out_dir):  # both up front: a results folder refused after an hour of measuring loses it
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise UsageError(f"cannot make {folder}: {err.strerror or err}") from None
        if not os.access(folder, os.W_OK):
            raise UsageError(f"cannot write into {folder}")
    paths = bench.run_and_write(work, out_dir, tuple(args.lengths), tuple(args.clients),
                                tuple(args.streams), args.prompt, args.new_tokens,
                                progress=lambda m: print(m, file=sys.stderr, flush=True),
                                max_cell_tokens=args.max_cell_tokens, only=args.only, decoders=args.decoders)
    print("\n".join(f"wrote {path}" for path in paths))
    return 0
