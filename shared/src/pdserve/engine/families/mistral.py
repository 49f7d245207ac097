"""Mistral: Llama with a sliding window on every layer (or on those ``layer_types`` marks).

GGUF: llama.cpp writes Mistral as a ``llama`` file, without the window; it is served as Llama.
"""

from __future__ import annotations

from pdserve.engine.families import Family

FAMILY = Family("mistral")
