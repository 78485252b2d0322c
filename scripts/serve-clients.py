#!/usr/bin/env python3
"""`ds4 serve` driven by the official `openai` and `anthropic` Python clients.

Usage: scripts/serve-clients.py [DS4_BINARY]   (default target/release/ds4; needs
`pip install openai anthropic`). Starts the server with the embedded tiny model on the CPU on a
free port, checks both APIs streaming and not, and the refused requests, then stops it.
"""

import subprocess
import sys

import anthropic
import openai

binary = sys.argv[1] if len(sys.argv) > 1 else "target/release/ds4"
server = subprocess.Popen(
    [binary, "serve", "--backend", "cpu", "--port", "0", "--ctx", "128"],
    stdout=subprocess.PIPE,
    text=True,
)
try:
    line = server.stdout.readline()
    prefix = "ds4 serve: listening on "
    assert line.startswith(prefix), f"no URL line: {line!r}"
    url = line[len(prefix):].strip()

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
finally:
    server.kill()
    server.wait()
