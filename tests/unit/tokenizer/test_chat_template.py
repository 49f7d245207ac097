from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from pdserve.tokenizer import ChatTemplate, ChatTemplateError, Tokenizer, ToolSupport

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "ça va? 👋"},
        {"role": "assistant", "content": "Oui."},
        {"role": "user", "content": "<|end|> is just text here"},
    ],
    [
        {"role": "user", "content": [{"type": "text", "text": "Look: "}, {"type": "image"}]},
        {"role": "assistant", "content": None, "tool_calls": None},
        {"role": "tool", "content": "42"},
    ],
]


@pytest.fixture(scope="module")
def hf_tokenizer(demo_tokenizer_dir: Path) -> PreTrainedTokenizerBase:
    tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(demo_tokenizer_dir)
    return tokenizer


def test_demo_template_renders_the_expected_prompt(demo_tokenizer: Tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": t} for t in ("Hi", "!")]},
    ]
    expected = "<|bos|><|system|>Be brief.<|end|>\n<|user|>Hi!<|end|>\n"
    assert demo_tokenizer.apply_chat_template(messages) == expected + "<|assistant|>"
    assert demo_tokenizer.apply_chat_template(messages, add_generation_prompt=False) == expected


def test_demo_chat_prompt_ids(demo_tokenizer: Tokenizer) -> None:
    ids = demo_tokenizer.encode_chat([{"role": "user", "content": "é"}])
    special = demo_tokenizer.token_to_id
    assert ids == [
        special("<|bos|>"),
        special("<|user|>"),
        0xC3,
        0xA9,
        special("<|end|>"),
        ord("\n"),
        special("<|assistant|>"),
    ]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_matches_transformers(
    demo_tokenizer_dir: Path,
    hf_tokenizer: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
) -> None:
    ours = Tokenizer.from_pretrained(demo_tokenizer_dir)
    text = ours.apply_chat_template(messages, add_generation_prompt)
    assert text == hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours.encode_chat(messages, add_generation_prompt) == hf_tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, return_dict=False
    )


CONTINUED: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, I am"}],
    # NOTE: trailing spaces the template keeps, and text that also stands earlier.
    [{"role": "user", "content": "Say: yes"}, {"role": "assistant", "content": "yes "}],
    [
        {"role": "user", "content": "Go on"},
        {"role": "assistant", "content": [{"type": "text", "text": "Once upon"}]},
    ],
]


@pytest.mark.parametrize("messages", CONTINUED)
def test_continue_final_message_matches_transformers(
    demo_tokenizer_dir: Path, hf_tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]]
) -> None:
    ours = Tokenizer.from_pretrained(demo_tokenizer_dir)
    text = ours.apply_chat_template(messages, False, continue_final_message=True)
    assert text == hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    assert not text.endswith("<|end|>\n")
    ids = ours.encode_chat(messages, False, continue_final_message=True)
    assert ids == hf_tokenizer.apply_chat_template(
        messages, add_generation_prompt=False, continue_final_message=True, return_dict=False
    )


def test_continue_final_message_refusals(demo_tokenizer: Tokenizer) -> None:
    turn = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    with pytest.raises(ChatTemplateError, match="add_generation_prompt"):
        demo_tokenizer.apply_chat_template(turn, True, continue_final_message=True)
    empty = [turn[0], {"role": "assistant", "content": "  "}]
    with pytest.raises(ChatTemplateError, match="a last message with text"):
        demo_tokenizer.apply_chat_template(empty, False, continue_final_message=True)
    silent = ChatTemplate("{% for m in messages %}[{{ m.role }}]{% endfor %}")
    with pytest.raises(ChatTemplateError, match="does not write the last message"):
        silent.render(turn, add_generation_prompt=False, continue_final_message=True)


def test_template_sees_the_same_variables_as_transformers(
    demo_tokenizer: Tokenizer, hf_tokenizer: PreTrainedTokenizerBase
) -> None:
    template = (
        "{% for m in messages %}{{ m | tojson }}{% endfor %}|{{ bos_token }}|{{ eos_token }}"
        "|{{ pad_token }}|{{ tools | tojson }}|{{ add_generation_prompt }}|{{ flavour }}"
        "{% generation %}<gen>{% endgeneration %}"
        "{% for i in range(5) %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}"
    )
    messages = [{"role": "user", "content": "<b>&</b> é", "name": None}]
    tools = [{"type": "function", "function": {"name": "f"}}]
    ours = ChatTemplate(template).render(
        messages,
        special_tokens=demo_tokenizer.config.special_tokens,
        tools=tools,
        flavour="x",
    )
    theirs = hf_tokenizer.apply_chat_template(
        messages,
        tools=tools,
        chat_template=template,
        tokenize=False,
        add_generation_prompt=True,
        flavour="x",
    )
    assert ours == theirs
    assert '{"role": "user", "content": "<b>&</b> é"}' in ours


def test_raise_exception_and_unknown_roles(demo_tokenizer: Tokenizer) -> None:
    with pytest.raises(ChatTemplateError, match="unsupported role: robot"):
        demo_tokenizer.apply_chat_template([{"role": "robot", "content": "beep"}])
    with pytest.raises(ChatTemplateError, match="empty"):
        demo_tokenizer.apply_chat_template([])


def test_sandbox_blocks_python_internals() -> None:
    template = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError):
        template.render([{"role": "user", "content": "x"}])
    mutating = ChatTemplate("{% set _ = messages.append(1) %}{{ messages | length }}")
    with pytest.raises(ChatTemplateError):
        mutating.render([{"role": "user", "content": "x"}])


def test_bad_templates_and_inputs() -> None:
    with pytest.raises(ChatTemplateError, match="compile"):
        ChatTemplate("{% for %}")
    with pytest.raises(ChatTemplateError, match="JSON-like"):
        ChatTemplate("{{ messages }}").render([{"role": "user", "content": object()}])


def test_no_chat_template(demo_tokenizer: Tokenizer) -> None:
    tokenizer = Tokenizer.from_files(demo_tokenizer.tokenizer_json)
    assert tokenizer.chat_template is None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tokenizer.encode_chat([{"role": "user", "content": "x"}])


@pytest.mark.parametrize(
    ("source", "support"),
    [
        # renders every message's text and nothing else (SmolLM2's kind)
        ("{% for m in messages %}{{ m.role }}: {{ m['content'] }}\n{% endfor %}",
         ToolSupport(system=True, tools=False, tool_calls=False, tool_responses=True)),
        # adds text to content: a message without content fails, so calls are not rendered
        ("{% for m in messages %}{{ m.role + ': ' + m['content'] }}{% endfor %}",
         ToolSupport(system=True, tools=False, tool_calls=False, tool_responses=True)),
        # refuses roles it does not know
        ("{% for m in messages %}{% if m.role not in ('user', 'assistant') %}"
         "{{ raise_exception('bad role') }}{% endif %}{{ m.content }}{% endfor %}",
         ToolSupport(system=False, tools=False, tool_calls=False, tool_responses=False)),
        # renders tools and calls
        ("{{ tools | tojson }}{% for m in messages %}{{ m.content }}"
         "{% if m.tool_calls %}{{ m.tool_calls | tojson }}{% endif %}{% endfor %}",
         ToolSupport(system=True, tools=True, tool_calls=True, tool_responses=True)),
    ],
)  # fmt: skip
def test_tool_support_is_probed_by_rendering(source: str, support: ToolSupport) -> None:
    assert ChatTemplate(source).tool_support == support


def test_a_model_without_a_template_renders_no_tool_parts(byte_level_bpe: Tokenizer) -> None:
    assert not any(byte_level_bpe.tool_support)
