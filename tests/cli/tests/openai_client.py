"""The official `openai` Python client against a running `kvplug serve`.

Usage: openai_client.py BASE_URL API_KEY. Exits non-zero with a message on the first check
that fails; prints one line per check that passes. Run by host/tests/serve.rs through
scripts/openai-client.sh, which makes the venv.
"""

import sys

import openai

base, key = sys.argv[1], sys.argv[2]
# A hang guard, not a speed bound: each request takes well under a second in CI.
client = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=1800)
question = [{"role": "user", "content": "What is the capital of France?"}]


def check(cond, what):
    if not cond:
        sys.exit(f"FAIL: {what}")
    print(f"ok: {what}")


models = client.models.list()
check(len(models.data) == 1 and models.data[0].object == "model", f"models: {models.data}")
model = models.data[0].id

r = client.chat.completions.create(model=model, messages=question, temperature=0, max_tokens=24)
answer = r.choices[0].message.content
check("Paris" in answer, f"chat answer {answer!r}")
check(r.choices[0].finish_reason == "stop", f"finish_reason {r.choices[0].finish_reason}")
check(r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0, f"usage {r.usage}")

pieces, finish, usage = [], None, None
stream = client.chat.completions.create(
    model=model,
    messages=question,
    temperature=0,
    max_tokens=24,
    stream=True,
    stream_options={"include_usage": True},
)
for chunk in stream:
    if chunk.usage is not None:
        usage = chunk.usage
    for c in chunk.choices:
        pieces.append(c.delta.content or "")
        finish = c.finish_reason or finish
check("".join(pieces) == answer, f"streamed {''.join(pieces)!r} == {answer!r}")
check(finish == "stop", f"streamed finish_reason {finish}")
cached = usage.prompt_tokens_details.cached_tokens
check(cached >= usage.prompt_tokens - 1, f"the repeated prompt was cached: {usage}")

c = client.completions.create(model=model, prompt="1, 2, 3, 4,", temperature=0, max_tokens=12, stop=["7"])
check(c.choices[0].finish_reason == "stop", f"completion stop: {c.choices[0]}")
check("5" in c.choices[0].text and "7" not in c.choices[0].text, f"completion {c.choices[0].text!r}")

# A last assistant message continued (continue_final_message, transformers' and vLLM's name).
counting = [{"role": "user", "content": "Count from 1 to 10, comma separated."},
            {"role": "assistant", "content": "1, 2, 3, 4,"}]
r = client.chat.completions.create(model=model, messages=counting, temperature=0, max_tokens=8,
                                   extra_body={"continue_final_message": True})
check(r.choices[0].message.content.startswith(" 5, 6"), f"continued {r.choices[0].message.content!r}")

try:
    client.chat.completions.create(model=model, messages=question, temperature=7)
    check(False, "temperature 7 refused")
except openai.BadRequestError as e:
    check(e.status_code == 400 and "temperature" in str(e), f"400 for temperature 7: {e}")

bad = openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0)
try:
    bad.models.list()
    check(False, "a wrong key refused")
except openai.AuthenticationError as e:
    check(e.status_code == 401, "401 for a wrong key")
