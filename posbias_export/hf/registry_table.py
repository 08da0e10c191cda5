"""The table of imported architectures in docs/adding-an-architecture.md, made from the registry
(ARCHITECTURES, PARTS, VARIANTS), so the docs cannot fall behind a new architecture
(tests/test_docs_registry.py compares the doc with it)."""
from __future__ import annotations

from .imported import ARCHITECTURES, PARTS
from .tiny import VARIANTS

BEGIN, END = "<!-- architectures: generated from the registry -->", "<!-- end of the generated table -->"


def architecture_table() -> str:
    """One row per model_type: its role, its part, bias, transformers' class, tiny variants."""
    lines = [BEGIN, "| model_type | role | parts | bias | compared with | tiny variants |", "|---|---|---|---|---|---|"]
    for model_type, cls in sorted(ARCHITECTURES.items()):
        parts = ", ".join(["encoder" if (model_type, "decoder") in PARTS else "whole"]
                          + sorted(p for (t, p) in PARTS if t == model_type))
        variants = ", ".join(f"`{k}`" for k, v in VARIANTS.items() if v.model_type == model_type)
        compared = f"`{cls.transformers_class}`" if cls.transformers_class else "our float64 module (no transformers class)"
        lines.append(f"| `{model_type}` | {cls.role} | {parts} | {cls.bias_name} | {compared} | {variants} |")
    return "\n".join(lines + [END])
