#!/usr/bin/env python3
"""`ds4 serve` driven by the official `openai` and `anthropic` Python clients.

Usage: scripts/serve-clients.py [DS4_BINARY]   (default target/release/ds4; needs
`pip install openai anthropic`). Starts the server with the embedded tiny model on the CPU on a
free port, checks both APIs streaming and not, and the refused requests, then stops it. Then
checks tools: a second server answers every request with a known tool call (its test hook
DS4_TEST_FORCED_ANSWER; the tiny model's own output is noise), which both clients must read as
tool calls, and conversations with the results must be accepted.
"""

import concurrent.futures
import json
import os
import subprocess
import sys
import threading
import time

import anthropic
import openai

binary = sys.argv[1] if len(sys.argv) > 1 else "target/release/ds4"


def start(ctx, forced=None):
    env = dict(os.environ)
    env.pop("DS4_TEST_FORCED_ANSWER", None)
    if forced is not None:
        env["DS4_TEST_FORCED_ANSWER"] = forced
    proc = subprocess.Popen(
        [binary, "serve", "--backend", "cpu", "--port", "0", "--ctx", str(ctx)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    line = proc.stdout.readline()
    prefix = "ds4 serve: listening on "
    assert line.startswith(prefix), f"no URL line: {line!r}"
    return proc, line[len(prefix):].strip()


server, url = start(128)
try:

    oa = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    assert [m.id for m in oa.models.list().data] == ["ds4"]

    msgs = [{"role": "user", "content": "Hello"}]
    r = oa.chat.completions.create(model="ds4", messages=msgs, max_tokens=4, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == 9 and 1 <= r.usage.completion_tokens <= 4
    assert isinstance((r.choices[0].message.model_extra or {}).get("reasoning_content"), str)

    no_think = {"thinking": False}
    once = oa.chat.completions.create(model="ds4", messages=msgs, max_tokens=4, temperature=0, extra_body=no_think)
    chunks = list(
        oa.chat.completions.create(
            model="ds4", messages=msgs, max_tokens=4, temperature=0, stream=True, extra_body=no_think
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == once.choices[0].message.content, (streamed, once.choices[0].message.content)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert chunks[-1].usage.completion_tokens == once.usage.completion_tokens

    an = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)
    m = an.messages.create(model="ds4", max_tokens=4, messages=msgs, extra_body={"temperature": 0})
    assert m.content[-1].type == "text" and m.stop_reason in ("end_turn", "max_tokens")
    with an.messages.stream(model="ds4", max_tokens=4, messages=msgs, extra_body={"temperature": 0}) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == m.content[-1].text, (text, m.content[-1].text)
    assert final.usage.output_tokens == m.usage.output_tokens
    t = an.messages.create(
        model="ds4", max_tokens=4, messages=msgs, thinking={"type": "enabled", "budget_tokens": 1024}
    )
    assert t.content[0].type == "thinking"

    def refused(call, status):
        try:
            call()
        except (openai.APIStatusError, anthropic.APIStatusError) as e:
            assert e.status_code == status, (e.status_code, status, e)
            return
        raise AssertionError(f"expected {status}")

    refused(lambda: oa.chat.completions.create(model="gpt-4", messages=msgs), 404)
    refused(lambda: oa.chat.completions.create(model="ds4", messages=msgs, temperature=-1), 400)
    refused(lambda: oa.chat.completions.create(model="ds4", messages=[{"role": "user", "content": "a" * 500}]), 400)
    refused(lambda: an.messages.create(model="claude", max_tokens=4, messages=msgs), 404)
    refused(lambda: an.messages.create(model="ds4", max_tokens=0, messages=msgs), 400)
    assert oa.chat.completions.create(model="ds4", messages=msgs, max_tokens=1).choices
    print("serve-clients: the openai and anthropic clients agree with ds4 serve")

    # Load: 200 requests from 20 clients at once (a client of each API per thread), both APIs;
    # all answered with the same greedy token, none lost.
    local = threading.local()

    def one(i):
        if not hasattr(local, "oa"):
            local.oa = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
            local.an = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=600)
        t0 = time.monotonic()
        if i % 2:
            r = local.oa.chat.completions.create(
                model="ds4", messages=msgs, max_tokens=1, temperature=0, extra_body=no_think
            )
            text = r.choices[0].message.content
        else:
            m = local.an.messages.create(model="ds4", max_tokens=1, messages=msgs, extra_body={"temperature": 0})
            text = m.content[-1].text
        return time.monotonic() - t0, text

    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        results = list(pool.map(one, range(200)))
    assert len(results) == 200 and len({text for _, text in results}) == 1, results
    times = sorted(t for t, _ in results)
    print(f"serve-clients: 200 requests from 20 clients: p50 {times[99] * 1000:.0f} ms, p99 {times[197] * 1000:.0f} ms")
finally:
    server.kill()
    server.wait()

# Tools. The forced answer: some text, then a call in DeepSeek V4's DSML.
FORCED = (
    "I will check.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
    "<｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n"
    "<｜DSML｜parameter name=\"days\" string=\"false\">3</｜DSML｜parameter>\n"
    "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
)
ARGS = {"city": "Paris", "days": 3}
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}
oa_tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": SCHEMA}}]
an_tools = [{"name": "get_weather", "description": "Weather", "input_schema": SCHEMA}]
server, url = start(2048, FORCED)
try:
    oa = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    question = {"role": "user", "content": "Weather in Paris?"}
    no_think = {"thinking": False}

    r = oa.chat.completions.create(model="ds4", messages=[question], tools=oa_tools, max_tokens=500, extra_body=no_think)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content == "I will check."
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == ARGS

    # The call and its result sent back: accepted, and every token of the first turn reused.
    history = [question, choice.message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": "Sunny"}]
    chunks = list(
        oa.chat.completions.create(
            model="ds4", messages=history, tools=oa_tools, tool_choice="auto", max_tokens=500, stream=True, extra_body=no_think
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [t for d in deltas for t in (d.tool_calls or [])]
    assert calls[0].function.name == "get_weather" and calls[0].id
    assert json.loads("".join(t.function.arguments or "" for t in calls)) == ARGS
    assert "".join(d.content or "" for d in deltas) == "I will check."
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

    an = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)
    m = an.messages.create(model="ds4", max_tokens=500, messages=[question], tools=an_tools)
    assert m.stop_reason == "tool_use", m
    assert [b.type for b in m.content] == ["text", "tool_use"]
    use = m.content[1]
    assert use.name == "get_weather" and use.input == ARGS
    counted = an.messages.count_tokens(model="ds4", messages=[question], tools=an_tools)
    assert counted.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens, (counted, m.usage)

    history = [
        question,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny"}]},
    ]
    with an.messages.stream(model="ds4", max_tokens=500, messages=history, tools=an_tools) as s:
        final = s.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [b.type for b in final.content] == ["text", "tool_use"]
    assert final.content[0].text == "I will check." and final.content[1].input == ARGS
    assert final.usage.cache_read_input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens + m.usage.output_tokens
    print("serve-clients: both clients read ds4 serve's tool calls and send back their results")
finally:
    server.kill()
    server.wait()
