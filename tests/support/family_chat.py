"""Fake models that chat in a family's own format, for the gateway tests: a byte-level
tokenizer (token id == byte, as `support.gateway_fakes`'s) whose added tokens are the family's
markup, marked special as the families' tokenizers mark them, and the family's chat template.
A fake prefill given one (`use`) makes the gateway see that model; `script` makes every
completion the given text, its markup as the markup's own tokens.

* gpt-oss: harmony's tokens and a template in harmony's shape (``<|start|>ROLE<|message|>``,
  a system message with the reasoning effort, calls as commentary messages to
  ``functions.NAME``, the generation prompt ``<|start|>assistant``); the real one is long, and
  what the gateway needs of it is that.
* DeepSeek: a template in DeepSeek-R1's shape (its tool calls and tool outputs written as
  DeepSeek's templates write them, DeepSeek-V3's call format; the generation prompt opens a
  think block) over DeepSeek's tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from support.gateway_cluster import Cluster
from support.gateway_fakes import EOS_TOKEN, FakePrefill, _bytes_to_unicode

HARMONY_TOKENS = (
    "<|start|>",
    "<|channel|>",
    "<|message|>",
    "<|constrain|>",
    "<|end|>",
    "<|call|>",
    "<|return|>",
)
GPT_OSS_TEMPLATE = (
    # NOTE: as gpt-oss's own template, a system message says the reasoning effort asked for.
    "{%- if not reasoning_effort is defined %}{%- set reasoning_effort = 'medium' %}{%- endif %}"
    "<|start|>system<|message|>Reasoning: {{ reasoning_effort }}<|end|>"
    "{%- if tools %}<|start|>developer<|message|># Tools\n\n## functions\n\n"
    "namespace functions {\n{%- for tool in tools %}\n// {{ tool.function.description }}\n"
    "type {{ tool.function.name }} = (_: {{ tool.function.parameters | tojson }}) => any;\n"
    "{%- endfor %}\n} // namespace functions<|end|>{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}{%- for c in m.tool_calls %}"
    "<|start|>assistant to=functions.{{ c.function.name }}<|channel|>commentary "
    "<|constrain|>json<|message|>{{ c.function.arguments | tojson }}<|call|>"
    "{%- endfor %}"
    "{%- elif m.role == 'tool' %}<|start|>functions.tool to=assistant<|channel|>commentary"
    "<|message|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>"
    "{{ m.content }}<|end|>"
    "{%- else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|start|>assistant{%- endif %}"
)

DEEPSEEK_TOKENS = (
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁outputs▁begin｜>",
    "<｜tool▁outputs▁end｜>",
    "<｜tool▁output▁begin｜>",
    "<｜tool▁output▁end｜>",
)
DEEPSEEK_R1_TEMPLATE = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}"
    "{% endif %}{% set ns = namespace(is_first=false, is_tool=false, is_output_first=true, "
    "system_prompt='') %}{%- for message in messages %}{%- if message['role'] == 'system' %}"
    "{% set ns.system_prompt = message['content'] %}{%- endif %}{%- endfor %}"
    "{{bos_token}}{{ns.system_prompt}}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{%- set ns.is_tool = false -%}"
    "{{'<｜User｜>' + message['content']}}{%- endif %}"
    "{%- if message['role'] == 'assistant' and message['content'] is none %}"
    "{%- set ns.is_tool = false -%}{%- for tool in message['tool_calls']%}"
    "{%- if not ns.is_first %}{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' "
    "+ tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n' "
    "+ tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'}}"
    "{%- set ns.is_first = true -%}{%- else %}{{'\\n' + '<｜tool▁call▁begin｜>' "
    "+ tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n' "
    "+ tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'}}"
    "{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}{%- endif %}{%- endfor %}{%- endif %}"
    "{%- if message['role'] == 'assistant' and message['content'] is not none %}"
    "{%- if ns.is_tool %}{{'<｜tool▁outputs▁end｜>' + message['content'] + "
    "'<｜end▁of▁sentence｜>'}}{%- set ns.is_tool = false -%}{%- else %}"
    "{% set content = message['content'] %}{% if '</think>' in content %}"
    "{% set content = content.split('</think>')[-1] %}{% endif %}"
    "{{'<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>'}}{%- endif %}{%- endif %}"
    "{%- if message['role'] == 'tool' %}{%- set ns.is_tool = true -%}"
    "{%- if ns.is_output_first %}{{'<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' "
    "+ message['content'] + '<｜tool▁output▁end｜>'}}{%- set ns.is_output_first = false %}"
    "{%- else %}{{'\\n<｜tool▁output▁begin｜>' + message['content'] + "
    "'<｜tool▁output▁end｜>'}}{%- endif %}{%- endif %}"
    "{%- endfor -%}{% if ns.is_tool %}{{'<｜tool▁outputs▁end｜>'}}{% endif %}"
    "{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜><think>\\n'}}{% endif %}"
)


def family_tokenizer_json(special_tokens: Sequence[str]) -> str:
    """A byte-level tokenizer: token id == byte value, then the fakes' EOS (256) and
    `special_tokens` (257...), all marked special."""
    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    tokenizer = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([EOS_TOKEN, *special_tokens])
    return tokenizer.to_str()


@dataclass(frozen=True)
class FamilyModel:
    """What a prefill of a family's model sends in GetModelInfo."""

    tokenizer_json: str
    tokenizer_config: dict[str, object]
    chat_template: str

    def encode(self, text: str) -> tuple[int, ...]:
        """`text` as this tokenizer's ids (markup written in it becomes its token)."""
        tokenizer = tokenizers.Tokenizer.from_str(self.tokenizer_json)
        return tuple(tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        """The text of `token_ids`, special tokens kept."""
        tokenizer = tokenizers.Tokenizer.from_str(self.tokenizer_json)
        return str(tokenizer.decode(list(token_ids), skip_special_tokens=False))

    def use(self, prefill: FakePrefill) -> None:
        prefill.tokenizer_json = self.tokenizer_json
        prefill.tokenizer_config = self.tokenizer_config
        prefill.chat_template = self.chat_template

    def script(self, cluster: Cluster, text: str) -> None:
        """Makes every completion of `cluster`'s fakes `text` (then EOS)."""
        ids = self.encode(text)
        for instance in [*cluster.prefills, *cluster.decodes]:
            instance.knobs.script_ids = ids


GPT_OSS = FamilyModel(
    family_tokenizer_json(HARMONY_TOKENS),
    {"eos_token": EOS_TOKEN, "chat_template": GPT_OSS_TEMPLATE},
    GPT_OSS_TEMPLATE,
)
DEEPSEEK = FamilyModel(
    family_tokenizer_json(DEEPSEEK_TOKENS),
    {
        "eos_token": EOS_TOKEN,
        "bos_token": "<｜begin▁of▁sentence｜>",
        "chat_template": DEEPSEEK_R1_TEMPLATE,
    },
    DEEPSEEK_R1_TEMPLATE,
)
