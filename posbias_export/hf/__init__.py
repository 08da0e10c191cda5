"""Models people already have: BLOOM, MPT, Falcon (alibi=True) and the T5 encoder, read from a
local Hugging Face folder into our biased attention, exported and validated against
transformers itself."""
from .export import export_model
from .folder import FolderError
from .models import SUPPORTED, load_model

__all__ = ["SUPPORTED", "FolderError", "export_model", "load_model"]
