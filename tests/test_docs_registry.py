"""docs/adding-an-architecture.md carries the registry's table of architectures as the registry
makes it (hf/registry_table.py): a new architecture or variant shows up there, or this fails."""
from __future__ import annotations

from pathlib import Path

from posbias_export.hf.registry_table import BEGIN, END, architecture_table

DOC = Path(__file__).resolve().parents[1] / "docs" / "adding-an-architecture.md"


def test_the_architecture_table_is_the_registrys():
    text = DOC.read_text(encoding="utf-8")
    assert BEGIN in text and END in text, f"{DOC.name} lost its generated table's markers"
    found = text[text.index(BEGIN):text.index(END) + len(END)]
    assert found == architecture_table(), f"paste into {DOC.name}:\n{architecture_table()}"


def test_every_registered_type_has_a_row():
    from posbias_export.hf.models import SUPPORTED

    table = architecture_table()
    assert all(f"| `{model_type}` |" in table for model_type in SUPPORTED)
