"""h2o-server through OpenAI's own Python client (the `openai` package), as an application
would call it: chat, streamed tool calls, JSON schema output, logit_bias, logprobs and error
objects. Run by tests/openai_client.rs with the server's base URL; prints one line per check
and exits non-zero at the first that fails."""

import json
import pathlib
import sys
import urllib.request

import openai

BASE = sys.argv[1]
client = openai.OpenAI(base_url=BASE + "/v1", api_key="unused", max_retries=0)

# a tool, and a conversation that calls it once before asking (shared with the Rust tests)
with open(pathlib.Path(__file__).resolve().parents[3] / "tests/data/weather-call.json") as f:
    _weather = json.load(f)
WEATHER = _weather["tools"]
WEATHER_CHAT = _weather["messages"]


def check(name, ok, detail=""):
    if not ok:
        print(f"FAILED {name}: {detail}", flush=True)
        sys.exit(1)
    print(f"ok {name}", flush=True)


def tokenize(text):
    body = json.dumps({"content": text}).encode()
    req = urllib.request.Request(BASE + "/tokenize", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req) as r:
        return json.load(r)["tokens"]


# a plain chat
r = client.chat.completions.create(
    model="any", messages=[{"role": "user", "content": "What is the capital of France?"}],
    temperature=0, max_tokens=12)
check("chat", r.choices[0].message.content and r.usage.completion_tokens > 0, r)

# a tool call, whole
r = client.chat.completions.create(
    model="any", messages=WEATHER_CHAT, tools=WEATHER, tool_choice="required",
    temperature=0, max_tokens=48)
call = r.choices[0].message.tool_calls[0] if r.choices[0].message.tool_calls else None
check("tool call", call is not None and call.function.name == "get_weather"
      and r.choices[0].finish_reason == "tool_calls", r)
whole_arguments = call.function.arguments
check("tool call arguments", isinstance(json.loads(whole_arguments).get("city"), str),
      whole_arguments)

# the same, streamed: the deltas put together as OpenAI's docs tell clients to
calls = {}
finish = None
stream = client.chat.completions.create(
    model="any", messages=WEATHER_CHAT, tools=WEATHER, tool_choice="required",
    temperature=0, max_tokens=48, stream=True)
for chunk in stream:
    if not chunk.choices:
        continue
    choice = chunk.choices[0]
    finish = choice.finish_reason or finish
    for d in choice.delta.tool_calls or []:
        c = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
        if d.id:
            c["id"] = d.id
        if d.function and d.function.name:
            c["name"] += d.function.name
        if d.function and d.function.arguments:
            c["arguments"] += d.function.arguments
check("streamed tool call", list(calls) == [0] and calls[0]["name"] == "get_weather"
      and calls[0]["id"] and finish == "tool_calls", (calls, finish))
check("streamed arguments = whole", calls[0]["arguments"] == whole_arguments,
      (calls[0]["arguments"], whole_arguments))

# the tool's result goes back, and the answer is text
r = client.chat.completions.create(
    model="any", tools=WEATHER, tool_choice="none", temperature=0, max_tokens=16,
    messages=WEATHER_CHAT + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": calls[0]["id"], "type": "function",
            "function": {"name": "get_weather", "arguments": whole_arguments}}]},
        {"role": "tool", "tool_call_id": calls[0]["id"], "content": "25 degrees, sunny"},
    ])
check("tool result answered in text", r.choices[0].message.content
      and not r.choices[0].message.tool_calls, r)

# JSON schema output: parses and follows the schema
schema = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
r = client.chat.completions.create(
    model="any", messages=[{"role": "user", "content": "Describe a person as JSON."}],
    response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}},
    temperature=0, max_tokens=64)
person = json.loads(r.choices[0].message.content)
check("json schema", set(person) == {"name", "age"} and isinstance(person["name"], str)
      and isinstance(person["age"], int) and not isinstance(person["age"], bool), person)

# logit_bias: banning the greedy first token changes it
question = [{"role": "user", "content": "Name a colour."}]
first = client.chat.completions.create(
    model="any", messages=question, temperature=0, max_tokens=1, logprobs=True)
token = first.choices[0].logprobs.content[0].token
ids = tokenize(token)
check("first token is one token", len(ids) == 1, (token, ids))
banned = client.chat.completions.create(
    model="any", messages=question, temperature=0, max_tokens=1, logprobs=True,
    logit_bias={str(ids[0]): -100})
check("logit_bias", banned.choices[0].logprobs.content[0].token != token,
      (token, banned.choices[0].logprobs.content[0].token))

# logprobs: one per token, log-probabilities, top lists sorted
r = client.chat.completions.create(
    model="any", messages=question, temperature=0, max_tokens=6, logprobs=True, top_logprobs=3)
content = r.choices[0].logprobs.content
check("logprobs count", len(content) == r.usage.completion_tokens, (len(content), r.usage))
for lp in content:
    tops = [t.logprob for t in lp.top_logprobs]
    check("logprob", lp.logprob <= 0 and len(tops) == 3 and tops == sorted(tops, reverse=True)
          and abs(tops[0] - lp.logprob) < 1e-4, lp)  # greedy: the token is the likeliest

# errors come back as OpenAI's error objects, naming the field
for name, kwargs, param in [
    ("bad tool_choice", {"tools": WEATHER, "tool_choice": "sometimes"}, "tools"),
    ("top_logprobs without logprobs", {"top_logprobs": 2}, "top_logprobs"),
    ("temperature out of range", {"temperature": 7}, "temperature"),
]:
    try:
        client.chat.completions.create(model="any", messages=question, max_tokens=1, **kwargs)
        check(name, False, "no error")
    except openai.BadRequestError as e:
        check(name, e.status_code == 400 and e.body.get("param") == param
              and e.body.get("type") == "invalid_request_error" and e.body.get("message"), e.body)

try:
    client.chat.completions.create(
        model="any", messages=[{"role": "user", "content": "word " * 5000}], max_tokens=1)
    check("prompt over the context", False, "no error")
except openai.BadRequestError as e:
    check("prompt over the context", e.body.get("type") == "exceed_context_size_error"
          and e.body.get("n_prompt_tokens", 0) > e.body.get("n_ctx", 1 << 30), e.body)

print("all checks passed")
