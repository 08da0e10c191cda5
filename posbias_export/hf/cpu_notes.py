"""SERVING.md in a serving folder: how each client that loads it sets ONNX Runtime's
`session.set_denormal_as_zero`, and whether the folder's files need it.

Measured for each knob (Nov 2026): onnxruntime-genai 0.18 hands a dotted key of a decoder's
`session_options` to ONNX Runtime as a session config entry (a bad value there fails the load:
checked with session.load_model_format), so genai_config.json carries the flag itself;
transformers.js passes `session_options.extra.session` through to onnxruntime-node (checked the
same way); Optimum and sentence-transformers take an `onnxruntime.SessionOptions`; fastembed
exposes only `enable_cpu_mem_arena` and Triton's onnxruntime backend a fixed list of session keys,
so there the file's own floors are all there is (docs/cpu-kinds.md): none in a fused op's softmax."""
from __future__ import annotations

FLAG = "session.set_denormal_as_zero"

# client -> (the folder roles it serves, how its users set the flag)
CLIENTS = {
    "onnxruntime-genai": (("lm",), f'already set: genai_config.json\'s decoder `session_options` has `"{FLAG}": "1"`'),
    "Optimum": (("lm", "seq2seq", "encoder"),
                f'`so = onnxruntime.SessionOptions(); so.add_session_config_entry("{FLAG}", "1")`, then '
                "`ORTModelFor...from_pretrained(folder, session_options=so)`"),
    "sentence-transformers": (("encoder",), '`SentenceTransformer(folder, backend="onnx", model_kwargs={"session_options": '
                              "so})` with Optimum's `so`"),
    "transformers.js": (("lm", "seq2seq", "encoder"),
                        "`from_pretrained(folder, { session_options: { extra: { session: { set_denormal_as_zero: "
                        '"1" } } } })` (pipelines take the same option)'),
    "onnxruntime (Python, Node, web)": (("lm", "seq2seq", "encoder"),
                                        f'`add_session_config_entry("{FLAG}", "1")`; in JavaScript '
                                        '`{ extra: { session: { set_denormal_as_zero: "1" } } }`'),
    "fastembed": (("encoder",), "no knob (it exposes only `enable_cpu_mem_arena`): the portable file needs none"),
    "Triton (onnxruntime backend)": (("lm", "seq2seq", "encoder"),
                                     "no knob (its config.pbtxt reads a fixed list of session keys): the portable "
                                     "file needs none"),
}


# what a folder's files do about subnormal floats: every softmax floored (the portable body), or
# ONNX Runtime's fused attention op, whose softmax no file reaches
FLOORED = [
    "The attention in these files makes no subnormal float: every softmax floors its scores at the row's",
    "maximum minus 64 (a far key's weight, below e^-64 of the largest, is kept at that). Subnormal floats cost",
    "Intel cores a slow assist per operand (2-8x a long prompt's attention time in a default session); AMD",
    "cores barely notice them. So a default session is fast on both. The model's other layers can still make",
    f"a few (an activation far below zero); where your client has a knob, set ONNX Runtime's `{FLAG}` to",
    "`\"1\"` as well:",
]
FUSED = [
    "The attention in these files is ONNX Runtime's fused op (GroupQueryAttention for the cache written in",
    "place, MultiHeadAttention or ONNX Attention for a GPU target), which softmaxes inside, out of the file's",
    "reach, and gets the family's bias exact. After a long prompt its far keys make subnormal floats, which",
    "cost Intel cores a slow assist per operand (up to 2.5x a decode step in a default session); AMD cores",
    f"barely notice them. On an Intel CPU set ONNX Runtime's `{FLAG}` to `\"1\"`; where a client has no",
    "knob, ship the folder with `--target portable` (every softmax there is floored: no subnormal):",
]


def serving_notes(role: str, fused: bool) -> str:
    """SERVING.md for a folder whose files have this role ("lm", "seq2seq" or "encoder"); fused:
    its attention is ONNX Runtime's fused op (the in-place cache, the GPU targets), whose softmax
    our files cannot floor (biases/base.py says why the bias it gets is not floored either)."""
    rows = [f"| {client} | {how} |" for client, (roles, how) in CLIENTS.items() if role in roles]
    return "\n".join([
        "# Serving this folder on a CPU",
        "",
        *(FUSED if fused else FLOORED),
        "",
        "| client | how |",
        "|---|---|",
        *rows,
        "",
        "Written by posbias_export (docs/cpu-kinds.md).",
        "",
    ])
