"""OpenAI's Responses API against a running `kvplug serve` on Qwen2.5-Coder-0.5B-Instruct:
the `openai` client's `client.responses` (whole and streamed, `previous_response_id`,
retrieved and deleted by id, their input items, function calls and their outputs, `text.format`,
the output text's log-probabilities) and the OpenAI Agents SDK's default model,
which speaks the Responses API.

Usage: responses_client.py BASE_URL. Exits non-zero with a message on the first check that
fails; prints one line per check that passes. Run by tests/cli/tests/agent_dialect.rs
through scripts/openai-client.sh, which makes the venv.
"""

import asyncio
import json
import sys

import openai
from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool
from agents import set_tracing_disabled

base = sys.argv[1]
# A hang guard, not a speed bound: a turn takes seconds in CI.
client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=1800)
set_tracing_disabled(True)


def check(ok, what, detail=""):
    if not ok:
        print(f"FAIL {what}: {detail}")
        sys.exit(1)
    print(f"ok {what}")


ASK = dict(
    model="qwen",
    instructions="You are a terse assistant.",
    input="What is the capital of France? Answer in one word.",
    temperature=0,
    max_output_tokens=32,
)

first = client.responses.create(**ASK)
check(first.status == "completed" and "Paris" in first.output_text, "a response", first)
check(first.output[0].type == "message" and first.output[0].role == "assistant", "its item")
check(first.usage.input_tokens > 0 and first.usage.output_tokens > 0, "usage", first.usage)
check(first.id.startswith("resp_") and len(first.id) == 37, "an unguessable id", first.id)
with client.responses.stream(**ASK) as stream:
    kinds = [e.type for e in stream]
    final = stream.get_final_response()
check(final.output_text == first.output_text, "the stream assembles into the response")
check(
    kinds[:2] == ["response.created", "response.in_progress"]
    and kinds[-1] == "response.completed"
    and "response.output_text.delta" in kinds,
    "stream events",
    kinds,
)

# The output text's log-probabilities (`include`), whole and streamed: a token's own and the
# alternatives asked for, the tokens spelling the text.
asked = dict(ASK, include=["message.output_text.logprobs"], top_logprobs=2)
part = client.responses.create(**asked).output[0].content[0]
check(
    part.logprobs
    and all(t.logprob <= 0 and len(t.top_logprobs) == 2 for t in part.logprobs)
    and "".join(t.token for t in part.logprobs) == part.text,
    "logprobs of the output text",
    part,
)
with client.responses.stream(**asked) as stream:
    streamed = [t.token for e in stream if e.type == "response.output_text.delta" for t in e.logprobs]
    gathered = stream.get_final_response().output[0].content[0]
check(
    "".join(streamed) == gathered.text and streamed == [t.token for t in gathered.logprobs],
    "streamed logprobs gather into the response's",
    (streamed, gathered),
)
check(not first.output[0].content[0].logprobs, "no logprobs unasked", first.output[0])

bounded = client.responses.create(**{**ASK, "max_output_tokens": 100000})
check(bounded.output_text == first.output_text, "max_output_tokens is a bound", bounded.status)

# The next turn continues the stored response: its conversation is rendered again and its
# K/V comes from the cache (all of the first prompt at least).
second = client.responses.create(
    model="qwen", instructions=ASK["instructions"], input="And of Germany?",
    previous_response_id=first.id, temperature=0, max_output_tokens=32,
)
cached = second.usage.input_tokens_details.cached_tokens
check(
    cached >= first.usage.input_tokens and second.usage.input_tokens > cached,
    "previous_response_id continues the conversation from the cache",
    (cached, first.usage.input_tokens, second.usage.input_tokens),
)
try:
    client.responses.create(model="qwen", input="hi", previous_response_id="resp_nowhere")
    check(False, "an unknown previous_response_id is refused", "it was answered")
except openai.BadRequestError as e:
    check(e.status_code == 400, "an unknown previous_response_id is refused")
unstored = client.responses.create(**ASK, store=False)
try:
    client.responses.create(model="qwen", input="hi", previous_response_id=unstored.id)
    check(False, "a response made with store false is not stored", "it was continued")
except openai.BadRequestError:
    check(True, "a response made with store false is not stored")

# A stored response comes back by id as it was answered; a deleted one is gone.
got = client.responses.retrieve(first.id)
check(
    got.model_dump() == first.model_dump(), "a stored response is retrieved by id", got
)

# Its input items, and the second's (the first exchange, then its own input), newest first.
items = list(client.responses.input_items.list(first.id))
check(
    [(i.type, i.role, i.content[0].text) for i in items]
    == [("message", "user", ASK["input"])],
    "a stored response's input items",
    items,
)
items = list(client.responses.input_items.list(second.id, order="asc", limit=1))
check(
    [(i.role, i.content[0].text) for i in items]
    == [("user", ASK["input"]), ("assistant", first.output_text), ("user", "And of Germany?")],
    "input items page by page, oldest first",
    items,
)
try:
    client.responses.input_items.list(unstored.id)
    check(False, "an unstored response's input items are a 404", "they were listed")
except openai.NotFoundError:
    check(True, "an unstored response's input items are a 404")


def unparsed(v):
    """`v` without the `parsed` fields the client adds to a streamed response's text."""
    if isinstance(v, dict):
        return {k: unparsed(x) for k, x in v.items() if k != "parsed"}
    if isinstance(v, list):
        return [unparsed(x) for x in v]
    return v


got = client.responses.retrieve(final.id)
check(
    got.model_dump() == unparsed(final.model_dump()),
    "a streamed response is stored as it ended",
    (got, final),
)
for gone, what in ((unstored.id, "an unstored response"), ("resp_nowhere", "an unknown id")):
    try:
        client.responses.retrieve(gone)
        check(False, f"retrieving {what} is a 404", "it was found")
    except openai.NotFoundError:
        check(True, f"retrieving {what} is a 404")
client.responses.delete(bounded.id)
try:
    client.responses.retrieve(bounded.id)
    check(False, "a deleted response is not retrieved", "it was found")
except openai.NotFoundError:
    check(True, "a deleted response is not retrieved")
try:
    client.responses.create(model="qwen", input="hi", previous_response_id=bounded.id)
    check(False, "a deleted response is not continued", "it was continued")
except openai.BadRequestError:
    check(True, "a deleted response is not continued")
try:
    client.responses.delete(bounded.id)
    check(False, "deleting it again is a 404", "it was deleted twice")
except openai.NotFoundError:
    check(True, "deleting it again is a 404")

# A function the model must call, whole and streamed; its output goes back in the next
# request, rendered as the chat route renders the same exchange.
add = {
    "type": "function",
    "name": "add",
    "description": "Add two integers.",
    "parameters": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
    "strict": True,
}
CALL = dict(
    model="qwen", input="Use the tool to add 123 and 456.", tools=[add],
    tool_choice="required", temperature=0, max_output_tokens=64,
)
called = client.responses.create(**CALL)
calls = [i for i in called.output if i.type == "function_call"]
check(
    len(calls) == 1 and calls[0].name == "add"
    and json.loads(calls[0].arguments) == {"a": 123, "b": 456},
    "a function_call item with the right arguments",
    called.output,
)
with client.responses.stream(**CALL) as stream:
    kinds = [e.type for e in stream]
    streamed = stream.get_final_response()
check(
    [(i.name, json.loads(i.arguments)) for i in streamed.output if i.type == "function_call"]
    == [("add", {"a": 123, "b": 456})] and "response.function_call_arguments.delta" in kinds,
    "the streamed function call assembles into the same call",
    kinds,
)
back = client.responses.create(
    model="qwen", tools=[add], temperature=0, max_output_tokens=32,
    previous_response_id=called.id,
    input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "579"}],
)
check(back.status in ("completed", "incomplete"), "an answer after the function output", back)
chat = client.chat.completions.create(
    model="qwen", max_tokens=1, temperature=0,
    tools=[{"type": "function", "function": {k: add[k] for k in ("name", "description", "parameters")}}],
    messages=[
        {"role": "user", "content": CALL["input"]},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": calls[0].call_id, "type": "function",
            "function": {"name": "add", "arguments": calls[0].arguments}}]},
        {"role": "tool", "tool_call_id": calls[0].call_id, "content": "579"},
    ],
)
check(
    back.usage.input_tokens == chat.usage.prompt_tokens,
    "the function output is rendered as the chat template renders a tool message",
    (back.usage.input_tokens, chat.usage.prompt_tokens),
)

# Structured output under text.format.
schema = {
    "type": "object",
    "properties": {"capital": {"type": "string"}},
    "required": ["capital"],
    "additionalProperties": False,
}
structured = client.responses.create(
    model="qwen", input=ASK["input"], temperature=0, max_output_tokens=48,
    text={"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}},
)
obj = json.loads(structured.output_text)
check(set(obj) == {"capital"} and isinstance(obj["capital"], str), "text.format's schema", obj)

# A refusal names its field; the server serves on.
try:
    client.responses.create(model="qwen", input="hi", background=True)
    check(False, "background is refused", "it was answered")
except openai.BadRequestError as e:
    check(e.status_code == 400 and "background" in str(e), "background is refused")


# The Agents SDK's default model speaks the Responses API: it gets the call, runs the
# tool and sends its output back.
tool_calls = []


@function_tool
def add_numbers(a: int, b: int) -> int:
    """Add two integers."""
    tool_calls.append((a, b))
    return a + b


async def agent():
    model = OpenAIResponsesModel(
        model="qwen",
        openai_client=openai.AsyncOpenAI(
            base_url=base + "/v1", api_key="unused", max_retries=0, timeout=1800
        ),
    )
    a = Agent(
        name="adder",
        instructions="Use the tool to add numbers.",
        model=model,
        model_settings=ModelSettings(temperature=0, max_tokens=64, tool_choice="required"),
        tools=[add_numbers],
        tool_use_behavior="stop_on_first_tool",
    )
    r = await Runner.run(a, "Add 17 and 25.", max_turns=2)
    check(tool_calls == [(17, 25)], "the Agents SDK's call reached the tool", tool_calls)
    check(str(r.final_output) == "42", "the tool's output is the run's", r.final_output)


asyncio.run(agent())
