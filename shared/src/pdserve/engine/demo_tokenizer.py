"""The demo model's tokenizer: every byte is a token, plus a few special tokens.

Built with the ``tokenizers`` library as a byte-level BPE without merges, so any UTF-8 text
round-trips and the files load unchanged in transformers (``PreTrainedTokenizerFast``).
This module does not need torch.
"""

from __future__ import annotations

import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors

NUM_BYTE_TOKENS = 256

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"
END_TOKEN = "<|end|>"
ROLES = ("system", "user", "assistant", "tool")

SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, *(f"<|{role}|>" for role in ROLES), END_TOKEN)
"""Special tokens in id order, after the 256 byte tokens."""

VOCAB_SIZE = NUM_BYTE_TOKENS + len(SPECIAL_TOKENS)


def special_token_id(token: str) -> int:
    """The id of one of `SPECIAL_TOKENS`."""
    return NUM_BYTE_TOKENS + SPECIAL_TOKENS.index(token)


BOS_TOKEN_ID = special_token_id(BOS_TOKEN)
EOS_TOKEN_ID = special_token_id(EOS_TOKEN)
PAD_TOKEN_ID = special_token_id(PAD_TOKEN)
END_TOKEN_ID = special_token_id(END_TOKEN)

CHAT_TEMPLATE = """\
{{- bos_token }}
{%- for message in messages %}
    {%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}
        {{- raise_exception('unsupported role: ' ~ message['role']) }}
    {%- endif %}
    {{- '<|' + message['role'] + '|>' }}
    {%- if message['content'] is string %}
        {{- message['content'] }}
    {%- else %}
        {%- for part in message['content'] if part['type'] == 'text' %}
            {{- part['text'] }}
        {%- endfor %}
    {%- endif %}
    {{- '<|end|>' + '\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|assistant|>' }}
{%- endif %}
"""
"""Each message is ``<|role|>content<|end|>`` and a newline; text parts of list contents are
joined; the generation prompt is ``<|assistant|>``."""


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (the ByteLevel alphabet)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {byte: chr(byte) for byte in printable}
    num_shifted = 0
    for byte in range(NUM_BYTE_TOKENS):
        if byte not in mapping:
            mapping[byte] = chr(NUM_BYTE_TOKENS + num_shifted)
            num_shifted += 1
    return mapping


def build_demo_tokenizer() -> tokenizers.Tokenizer:
    """Builds the tokenizer: token id ``b`` is byte ``b``; specials follow from id 256.

    Encoding with special tokens prepends ``<|bos|>``.
    """
    vocab = {char: byte for byte, char in byte_to_unicode().items()}
    tokenizer = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS]
    )
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN}:1 $B:1",
        special_tokens=[(BOS_TOKEN, BOS_TOKEN_ID)],
    )
    return tokenizer


def tokenizer_config() -> dict[str, object]:
    """The contents of the demo model's ``tokenizer_config.json``."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "model_max_length": 2048,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
