"""Tokenization for pdserve: Hugging Face tokenizers, chat templates, streaming detokenization.

This package must not import torch: the gateway uses it and does not install torch.
"""

from __future__ import annotations

from pdserve.tokenizer.chat_template import ChatTemplate, ChatTemplateError, ToolSupport
from pdserve.tokenizer.config import TokenizerConfig
from pdserve.tokenizer.detokenizer import IncrementalDetokenizer, SupportsDecode
from pdserve.tokenizer.stop import StopMatch, StopStringMatcher
from pdserve.tokenizer.stream import TextDelta, TextStream
from pdserve.tokenizer.tokenizer import Tokenizer

__all__ = [
    "ChatTemplate",
    "ChatTemplateError",
    "IncrementalDetokenizer",
    "StopMatch",
    "StopStringMatcher",
    "SupportsDecode",
    "TextDelta",
    "TextStream",
    "Tokenizer",
    "TokenizerConfig",
    "ToolSupport",
]
