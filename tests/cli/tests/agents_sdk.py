"""The OpenAI Agents SDK and the `openai` client's tool-call stream assembly against a
running `kvplug serve` on Qwen2.5-Coder-0.5B-Instruct.

Usage: agents_sdk.py BASE_URL. Exits non-zero with a message on the first check that fails;
prints one line per check that passes. Run by tests/cli/tests/agent_dialect.rs through
scripts/openai-client.sh, which makes the venv.
"""

import asyncio
import json
import sys
from typing import Annotated

import openai
from agents import (
    Agent,
    MaxTurnsExceeded,
    ModelSettings,
    OpenAIChatCompletionsModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from pydantic import BaseModel, Field

base = sys.argv[1]
# A hang guard, not a speed bound: a tool-calling turn takes seconds in CI.
client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=1800)
set_tracing_disabled(True)


def check(cond, what):
    if not cond:
        sys.exit(f"FAIL: {what}")
    print(f"ok: {what}")


class Person(BaseModel):
    name: str = Field(max_length=40)
    age: int = Field(ge=0, le=130)
    languages: list[Annotated[str, Field(max_length=20)]] = Field(max_length=4)


called = []


@function_tool
def get_weather(city: str) -> str:
    """Get the current weather of a city."""
    called.append(("get_weather", {"city": city}))
    return f"The weather in {city} is sunny and 21 degrees Celsius."


@function_tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    called.append(("add", {"a": a, "b": b}))
    return a + b


async def main():
    model_id = (await client.models.list()).data[0].id
    model = OpenAIChatCompletionsModel(model=model_id, openai_client=client)

    # An output type: every answer is a valid Person (the schema constrains sampling).
    typed = Agent(
        name="inventor",
        instructions="You invent people.",
        model=model,
        model_settings=ModelSettings(temperature=0.7, max_tokens=200),
        output_type=Person,
    )
    valid = 0
    for i in range(10):
        r = await Runner.run(typed, f"Invent person number {i}: a programmer.")
        valid += isinstance(r.final_output, Person)
    check(valid == 10, f"Pydantic output_type: {valid} of 10 valid at temperature 0.7")

    # Two function tools; each question needs one of them. The SDK must get a well-formed
    # call with the right arguments, run the tool and send its result back. (Whether the
    # model then answers in text is the model's part: Qwen2.5-Coder-0.5B calls a tool again
    # after every tool result, also unconstrained, so the run may end at max_turns.)
    tooled = Agent(
        name="assistant",
        instructions="Answer with the tools. After the tool results arrive, answer the user in one sentence.",
        model=model,
        model_settings=ModelSettings(temperature=0, max_tokens=96),
        tools=[get_weather, add],
    )
    for question, expected, result in [
        ("What is the weather in Paris?", ("get_weather", {"city": "Paris"}), "sunny"),
        ("What is 17 + 25?", ("add", {"a": 17, "b": 25}), "42"),
    ]:
        called.clear()
        try:
            r = await Runner.run(tooled, question, max_turns=3)
            answer = r.final_output
            check(result in answer, f"answer {answer!r} uses the tool result")
        except MaxTurnsExceeded as e:
            answer = f"<no text answer in 3 turns: {e}>"
        check(called[:1] == [expected], f"{question}: the first call {called[:1]} is {expected}")
        print(f"  then: calls {called[1:]}, answer {answer!r}")

    # The same calls streamed and not: the client assembles the deltas into the same calls.
    tools = [
        {
            "type": "function",
            "function": {
                "name": "add",
                "description": "Add two integers",
                "parameters": {
                    "type": "object",
                    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                    "required": ["a", "b"],
                },
            },
        }
    ]
    ask = [{"role": "user", "content": "Use the tool to add 123 and 456."}]
    for choice in ["auto", "required"]:
        args = dict(model=model_id, messages=ask, tools=tools, tool_choice=choice, temperature=0, max_tokens=64)
        whole = (await client.chat.completions.create(**args)).choices[0]
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls or []]
        check(calls == [("add", {"a": 123, "b": 456})], f"{choice}: the call {calls}")
        parts, finish = {}, None
        async for chunk in await client.chat.completions.create(stream=True, **args):
            for c in chunk.choices:
                finish = c.finish_reason or finish
                for d in c.delta.tool_calls or []:
                    p = parts.setdefault(d.index, {"id": None, "name": "", "args": ""})
                    p["id"] = p["id"] or d.id
                    p["name"] += d.function.name or ""
                    p["args"] += d.function.arguments or ""
        streamed = [(p["name"], json.loads(p["args"])) for _, p in sorted(parts.items())]
        check(streamed == calls, f"{choice}: streamed {streamed} == {calls}")
        check(all(p["id"] for p in parts.values()), "every streamed call has an id")
        check(finish == whole.finish_reason == "tool_calls", f"{choice}: finish {finish}")


asyncio.run(main())
