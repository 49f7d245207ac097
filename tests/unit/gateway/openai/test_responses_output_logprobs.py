"""Which tokens' logprobs a Response's ``output_text`` part lists: those whose text it holds,
a held-back token's with the text it ends in, none of a reasoning's or a call's."""

from __future__ import annotations

from typing import Any

from pdserve.gateway.openai.responses_api.items import OutputItems
from pdserve.gateway.request import OutputDelta
from pdserve.gateway.tools.spec import ToolCallDelta


def entry(token: str) -> dict[str, Any]:
    return {"token": token, "logprob": -0.5, "bytes": list(token.encode()), "top_logprobs": []}


def delta(
    text: str = "", reasoning: str = "", calls: tuple[ToolCallDelta, ...] = ()
) -> OutputDelta:
    return OutputDelta(text, (1,), 0, reasoning=reasoning, tool_calls=calls)


def test_a_held_back_token_goes_with_the_text_it_ends_in_and_reasoning_keeps_its_own() -> None:
    items = OutputItems("r1")
    events = items.step(delta(reasoning="think"), [entry("think")])
    events += items.step(delta(), [entry("Hel")])  # NOTE: its text held back (a stop candidate?)
    events += items.step(delta("Hello"), [entry("lo")])
    events += items.step(delta(" you"), [entry(" you")])
    events += items.finish("completed")
    reasoning, message = items.output("completed")
    assert "logprobs" not in reasoning["content"][0]
    part = message["content"][0]
    assert [e["token"] for e in part["logprobs"]] == ["Hel", "lo", " you"]
    assert "".join(e["token"] for e in part["logprobs"]) == part["text"]
    deltas = [e.fields for e in events if e.type == "response.output_text.delta"]
    assert [[x["token"] for x in d["logprobs"]] for d in deltas] == [["Hel", "lo"], [" you"]]
    (done,) = [e.fields for e in events if e.type == "response.output_text.done"]
    assert done["logprobs"] == part["logprobs"]
    assert all(
        "logprobs" not in e.fields for e in events if e.type.startswith("response.reasoning")
    )


def test_a_calls_tokens_are_listed_nowhere() -> None:
    items = OutputItems("r2")
    items.step(delta("Sure."), [entry("Sure.")])
    items.step(delta(), [entry("<tool_call>")])
    items.step(delta(calls=(ToolCallDelta(0, "call_1", "f", "{}"),)), [entry("{}")])
    items.step(delta("Done"), [entry("Done")])
    items.finish("completed")
    first, call, last = items.output("completed")
    assert call["type"] == "function_call"
    assert [e["token"] for e in first["content"][0]["logprobs"]] == ["Sure."]
    assert [e["token"] for e in last["content"][0]["logprobs"]] == ["Done"]


def test_no_entries_no_logprobs() -> None:
    items = OutputItems("r3")
    events = items.step(delta("Hi"))
    events += items.finish("completed")
    (message,) = items.output("completed")
    assert message["content"][0]["logprobs"] == []
    assert [e.fields["logprobs"] for e in events if e.type == "response.output_text.delta"] == [[]]
