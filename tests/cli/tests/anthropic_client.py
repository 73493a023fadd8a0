"""The `anthropic` Python client against a running `kvplug serve` (Anthropic's Messages API)
on Qwen2.5-Coder-0.5B-Instruct, with the server's API key sent as `x-api-key`.

Usage: anthropic_client.py BASE_URL KEY. Exits non-zero with a message on the first check
that fails; prints one line per check that passes. Run by tests/cli/tests/agent_dialect.rs
through scripts/openai-client.sh, which makes the venv.
"""

import json
import sys

import anthropic
import openai

base, key = sys.argv[1], sys.argv[2]
# A hang guard, not a speed bound: a turn takes seconds in CI.
client = anthropic.Anthropic(base_url=base, api_key=key, max_retries=0, timeout=1800)
oai = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=1800)


def check(ok, what, detail=""):
    if not ok:
        print(f"FAIL {what}: {detail}")
        sys.exit(1)
    print(f"ok {what}")


# Greedy: the current API has no `temperature` (its default is 1); earlier versions' field is
# still read, sent as clients of those versions send it.
GREEDY = {"extra_body": {"temperature": 0}}


def text_of(message):
    return "".join(b.text for b in message.content if b.type == "text")


QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
SYSTEM = "You are a terse assistant."

# A message, and the same message streamed.
msg = client.messages.create(
    model="qwen", **GREEDY, max_tokens=32, system=SYSTEM, messages=QUESTION
)
check(msg.type == "message" and msg.role == "assistant", "a message", msg)
check("Paris" in text_of(msg), "its text", text_of(msg))
check(msg.stop_reason == "end_turn" and msg.stop_sequence is None, "end_turn", msg.stop_reason)
prompt = msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0)
check(prompt > 0 and msg.usage.output_tokens > 0, "usage", msg.usage)
with client.messages.stream(
    model="qwen", **GREEDY, max_tokens=32, system=SYSTEM, messages=QUESTION
) as stream:
    events = [e.type for e in stream]
    final = stream.get_final_message()
check(text_of(final) == text_of(msg), "the stream assembles into the message", text_of(final))
check(
    events[0] == "message_start" and events[-1] == "message_stop" and "text" in events,
    "stream events",
    events,
)
check(final.usage.output_tokens == msg.usage.output_tokens, "streamed usage", final.usage)
check(
    (final.usage.cache_read_input_tokens or 0) > 0,
    "the repeated prompt is read from the cache",
    final.usage,
)

# The same prompt counted, and rendered as the OpenAI route renders the same conversation.
count = client.messages.count_tokens(model="qwen", system=SYSTEM, messages=QUESTION)
check(count.input_tokens == prompt, "count_tokens", (count.input_tokens, prompt))

# A stop sequence inside the answer.
cut = client.messages.create(
    model="qwen", **GREEDY, max_tokens=32, system=SYSTEM, messages=QUESTION,
    stop_sequences=["ris"],
)
check(
    cut.stop_reason == "stop_sequence" and cut.stop_sequence == "ris"
    and text_of(msg).startswith(text_of(cut)) and "ris" not in text_of(cut),
    "stop_sequences",
    cut,
)
# Clients send their model's largest max_tokens: a bound, lowered to the server's limit.
large = client.messages.create(
    model="qwen", **GREEDY, max_tokens=32000, system=SYSTEM, messages=QUESTION
)
check(text_of(large) == text_of(msg), "max_tokens above the server's limit is a bound", large)
short = client.messages.create(model="qwen", **GREEDY, max_tokens=1, messages=QUESTION)
check(short.stop_reason == "max_tokens" and short.usage.output_tokens == 1, "max_tokens", short)

# A tool the model must call: the call, whole and streamed, with its arguments.
weather = {
    "name": "get_weather",
    "description": "The current weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
ask = [{"role": "user", "content": "What is the weather in Paris?"}]
called = client.messages.create(
    model="qwen", **GREEDY, max_tokens=64, tools=[weather],
    tool_choice={"type": "tool", "name": "get_weather"}, messages=ask,
)
uses = [b for b in called.content if b.type == "tool_use"]
check(
    called.stop_reason == "tool_use" and len(uses) == 1 and uses[0].name == "get_weather"
    and isinstance(uses[0].input.get("city"), str) and uses[0].id.startswith("toolu_"),
    "a tool_use block",
    called,
)
with client.messages.stream(
    model="qwen", **GREEDY, max_tokens=64, tools=[weather],
    tool_choice={"type": "tool", "name": "get_weather"}, messages=ask,
) as stream:
    streamed = stream.get_final_message()
check(
    [(b.name, b.input) for b in streamed.content if b.type == "tool_use"]
    == [(u.name, u.input) for u in uses] and streamed.stop_reason == "tool_use",
    "the streamed tool_use assembles into the same call",
    streamed,
)

# Its result goes back in the next request: rendered as the OpenAI route renders the same
# exchange (a tool message answering the call), token for token.
result = "18 degrees Celsius and sunny."
turns = ask + [
    {"role": "assistant", "content": called.content},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": uses[0].id, "content": result}
    ]},
]
answer = client.messages.create(
    model="qwen", **GREEDY, max_tokens=48, tools=[weather], messages=turns
)
check(answer.type == "message" and answer.content, "an answer after the tool result", answer)
counted = client.messages.count_tokens(model="qwen", tools=[weather], messages=turns)
same = oai.chat.completions.create(
    model="qwen", max_tokens=1, 
    tools=[{"type": "function", "function": {
        "name": "get_weather", "description": weather["description"],
        "parameters": weather["input_schema"]}}],
    messages=[
        {"role": "user", "content": ask[0]["content"]},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": uses[0].id, "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps(uses[0].input)},
        }]},
        {"role": "tool", "tool_call_id": uses[0].id, "content": result},
    ],
)
check(
    counted.input_tokens == same.usage.prompt_tokens,
    "the tool result is rendered as the chat template renders a tool message",
    (counted.input_tokens, same.usage.prompt_tokens),
)

# Structured output: output_config's JSON schema.
schema = {
    "type": "object",
    "properties": {"capital": {"type": "string"}},
    "required": ["capital"],
    "additionalProperties": False,
}
structured = client.messages.create(
    model="qwen", **GREEDY, max_tokens=48, messages=QUESTION,
    output_config={"format": {"type": "json_schema", "schema": schema}},
)
answer_object = json.loads(text_of(structured))
check(
    isinstance(answer_object.get("capital"), str) and set(answer_object) == {"capital"},
    "output_config's JSON schema",
    text_of(structured),
)

# A last assistant turn is a prefill: the answer goes on from it (a fresh turn counts from 1).
count_up = [{"role": "user", "content": "Count from 1 to 10, comma separated."},
            {"role": "assistant", "content": "1, 2, 3, 4,"}]
goes_on = client.messages.create(model="qwen", **GREEDY, max_tokens=8, messages=count_up)
check(text_of(goes_on).startswith(" 5, 6"), "a prefill is continued", text_of(goes_on))
# With tools offered too: the continuation is text, its leading space kept.
with_tools = client.messages.create(
    model="qwen", **GREEDY, max_tokens=8, messages=count_up,
    tools=[{"name": "get_time", "description": "The time now.",
            "input_schema": {"type": "object", "properties": {}}}],
)
check(text_of(with_tools).startswith(" 5, 6") and with_tools.stop_reason != "tool_use",
      "a prefill is continued with tools offered", with_tools)

# Refusals in Anthropic's shape; the server serves on.
for bad, what in [
    (dict(max_tokens=0, messages=QUESTION), "max_tokens 0"),
    (dict(max_tokens=8, messages=[{"role": "user", "content": [{"type": "image"}]}]), "an image"),
    (dict(max_tokens=8, messages=QUESTION, tools=[{"type": "web_search_20250305",
                                                   "name": "web_search"}]), "a server tool"),
]:
    try:
        client.messages.create(model="qwen", **bad)
        check(False, f"{what} is refused", "it was answered")
    except anthropic.BadRequestError as e:
        check(e.status_code == 400 and e.body["type"] == "error", f"{what} is refused", e.body)
try:
    anthropic.Anthropic(base_url=base, api_key="wrong", max_retries=0).messages.create(
        model="qwen", max_tokens=8, messages=QUESTION
    )
    check(False, "a wrong key is refused", "it was answered")
except anthropic.AuthenticationError as e:
    check(e.body["type"] == "error", "a wrong key is refused in Anthropic's shape", e.body)
again = client.messages.create(model="qwen", **GREEDY, max_tokens=32, system=SYSTEM,
                               messages=QUESTION)
check(text_of(again) == text_of(msg), "the server serves on")
