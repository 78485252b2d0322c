//! `ds4 serve` end to end: the binary on an ephemeral port with the embedded tiny model on the
//! CPU, driven over plain HTTP/1.1 (a small client on `TcpStream`, so the server's framing is
//! checked as bytes on the wire).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// Small, so a long prompt is easy to make and the caches are cheap.
const CTX: &str = "96";

struct Server {
    child: Child,
    addr: String,
    log: Arc<Mutex<String>>,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    fn start() -> Server {
        Server::with_ctx(CTX)
    }

    fn with_ctx(ctx: &str) -> Server {
        Server::spawn(ctx, None)
    }

    /// `forced`: every answer is this text (the server's test hook), not the model's noise.
    fn spawn(ctx: &str, forced: Option<&str>) -> Server {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_ds4"));
        cmd.args(["serve", "--backend", "cpu", "--port", "0", "--ctx", ctx]);
        match forced {
            Some(text) => cmd.env("DS4_TEST_FORCED_ANSWER", text),
            None => cmd.env_remove("DS4_TEST_FORCED_ANSWER"),
        };
        let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
        let log = Arc::new(Mutex::new(String::new()));
        let stderr = child.stderr.take().unwrap();
        let sink = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let mut l = sink.lock().unwrap();
                l.push_str(&line);
                l.push('\n');
            }
        });
        let mut first = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut first).unwrap();
        let addr = first
            .trim()
            .strip_prefix("ds4 serve: listening on http://")
            .unwrap_or_else(|| panic!("no URL line: {first:?}; log: {}", log.lock().unwrap()))
            .to_string();
        assert!(addr.starts_with("127.0.0.1:"), "binds the loopback address by default: {addr}");
        Server { child, addr, log }
    }

    fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// The log once `ok` holds for it (the worker logs a request just after answering it).
    fn wait_log(&self, ok: impl Fn(&str) -> bool) -> String {
        let t0 = Instant::now();
        while !ok(&self.log()) && t0.elapsed() < Duration::from_secs(30) {
            std::thread::sleep(Duration::from_millis(20));
        }
        self.log()
    }

    fn get(&self, path: &str) -> Reply {
        http(&self.addr, "GET", path, b"")
    }

    fn post(&self, path: &str, body: &Value) -> Reply {
        http(&self.addr, "POST", path, body.to_string().as_bytes())
    }
}

struct Reply {
    status: u16,
    headers: String,
    body: String,
}

impl Reply {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }
}

/// One request on a fresh connection (`Connection: close`), the whole reply read back, a chunked
/// body put together.
fn http(addr: &str, method: &str, path: &str, body: &[u8]) -> Reply {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(300))).unwrap();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    // The server may answer (413) before it has read a large body: a failed write is fine then.
    let _ = s.write_all(head.as_bytes()).and_then(|_| s.write_all(body));
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let raw = String::from_utf8(raw).unwrap();
    let (headers, rest) = raw.split_once("\r\n\r\n").unwrap_or_else(|| panic!("no header end: {raw:?}"));
    let status = headers.split(' ').nth(1).unwrap().parse().unwrap();
    let headers = headers.to_ascii_lowercase();
    let body = if headers.contains("transfer-encoding: chunked") { dechunk(rest) } else { rest.to_string() };
    Reply { status, headers, body }
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    loop {
        let (size, rest) = s.split_once("\r\n").expect("chunk size line");
        let n = usize::from_str_radix(size.trim(), 16).expect("hex chunk size");
        if n == 0 {
            return out;
        }
        out.push_str(&rest[..n]);
        s = &rest[n + 2..];
    }
}

/// The `data:` payloads of a server-sent event stream, with the event names.
fn sse(body: &str) -> Vec<(Option<String>, String)> {
    let mut out = Vec::new();
    for block in body.split("\n\n").filter(|b| !b.trim().is_empty()) {
        let mut event = None;
        let mut data = String::new();
        for line in block.lines() {
            if let Some(e) = line.strip_prefix("event: ") {
                event = Some(e.to_string());
            } else if let Some(d) = line.strip_prefix("data: ") {
                data.push_str(d);
            }
        }
        if !data.is_empty() {
            out.push((event, data));
        }
    }
    out
}

fn chat(messages: Value, extra: Value) -> Value {
    let mut body = json!({"model": "ds4", "messages": messages, "max_tokens": 3, "temperature": 0});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

fn user(text: &str) -> Value {
    json!([{"role": "user", "content": text}])
}

#[test]
fn health_models_and_both_apis_streaming_and_not() {
    let s = Server::start();
    let h = s.get("/health");
    assert_eq!(h.status, 200);
    assert_eq!(h.json()["status"], "ok");
    let m = s.get("/v1/models");
    assert_eq!(m.status, 200);
    assert_eq!(m.json()["data"][0]["id"], "ds4");
    assert_eq!(s.get("/v1/models/ds4").json()["id"], "ds4");
    assert_eq!(s.get("/v1/models/gpt-4").status, 404);

    // OpenAI, not streaming, thinking on: the tokens go to reasoning_content until </think>.
    let r = s.post("/v1/chat/completions", &chat(user("Hello"), json!({"thinking": true})));
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert!(v["choices"][0]["message"]["reasoning_content"].is_string());
    let u = &v["usage"];
    assert_eq!(u["prompt_tokens"], 9, "BOS, <｜User｜>, 5 bytes, <｜Assistant｜>, <think>");
    assert!(u["completion_tokens"].as_u64().unwrap() >= 1 && u["completion_tokens"].as_u64().unwrap() <= 3);
    assert_eq!(u["total_tokens"], u["prompt_tokens"].as_u64().unwrap() + u["completion_tokens"].as_u64().unwrap());

    // OpenAI, streaming: chunks, the last with finish_reason and usage, then [DONE].
    let r = s.post("/v1/chat/completions", &chat(user("Hello"), json!({"stream": true, "thinking": false})));
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.headers.contains("content-type: text/event-stream"), "{}", r.headers);
    let events = sse(&r.body);
    assert_eq!(events.last().unwrap().1, "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1].iter().map(|(_, d)| serde_json::from_str(d).unwrap()).collect();
    assert!(chunks.iter().all(|c| c["object"] == "chat.completion.chunk"));
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let last = chunks.last().unwrap();
    assert!(last["choices"][0]["finish_reason"].is_string());
    assert_eq!(last["usage"]["prompt_tokens"], 9);
    let streamed: String =
        chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect::<Vec<_>>().concat();
    // The same request without streaming gives the same text.
    let once = s.post("/v1/chat/completions", &chat(user("Hello"), json!({"thinking": false}))).json();
    assert_eq!(once["choices"][0]["message"]["content"], streamed);
    assert!(once["choices"][0]["message"].get("reasoning_content").is_none());

    // Anthropic, not streaming.
    let body = json!({"model": "ds4", "max_tokens": 3, "temperature": 0, "system": "Be brief",
                      "messages": [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}]});
    let r = s.post("/v1/messages", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["type"], "message");
    assert_eq!(v["content"].as_array().unwrap().last().unwrap()["type"], "text");
    let text = v["content"][0]["text"].as_str().unwrap().to_string();
    assert!(["end_turn", "max_tokens"].contains(&v["stop_reason"].as_str().unwrap()));
    assert!(v["usage"]["input_tokens"].as_u64().unwrap() > 0);
    assert!(v["usage"]["output_tokens"].as_u64().unwrap() >= 1);

    // Anthropic, streaming: the event sequence, and the same text.
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    let r = s.post("/v1/messages", &sbody);
    assert_eq!(r.status, 200, "{}", r.body);
    let events = sse(&r.body);
    let names: Vec<&str> = events.iter().map(|(e, _)| e.as_deref().unwrap()).collect();
    assert_eq!(names[0], "message_start");
    assert_eq!(names[1], "content_block_start");
    assert_eq!(&names[names.len() - 3..], ["content_block_stop", "message_delta", "message_stop"]);
    assert!(names[2..names.len() - 3].iter().all(|n| *n == "content_block_delta"), "{names:?}");
    for (e, d) in &events {
        assert_eq!(serde_json::from_str::<Value>(d).unwrap()["type"], e.as_deref().unwrap());
    }
    let streamed: String = events
        .iter()
        .filter(|(e, _)| e.as_deref() == Some("content_block_delta"))
        .map(|(_, d)| serde_json::from_str::<Value>(d).unwrap()["delta"]["text"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(streamed, text);
    let delta: Value = serde_json::from_str(&events[events.len() - 2].1).unwrap();
    assert_eq!(delta["usage"]["output_tokens"], v["usage"]["output_tokens"]);

    // Anthropic with thinking: a thinking block first, then the text block.
    let mut tbody = body.clone();
    tbody["thinking"] = json!({"type": "enabled", "budget_tokens": 1024});
    let v = s.post("/v1/messages", &tbody).json();
    assert_eq!(v["content"][0]["type"], "thinking");
    assert_eq!(v["content"][1]["type"], "text");
}

#[test]
fn greedy_answer_equals_ds4_run() {
    let s = Server::start();
    let body = chat(
        json!([{"role": "system", "content": "You are a helpful assistant"}, {"role": "user", "content": "Hello"}]),
        json!({"max_tokens": 6, "thinking": false}),
    );
    let v = s.post("/v1/chat/completions", &body).json();
    let got = v["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    let run = Command::new(env!("CARGO_BIN_EXE_ds4"))
        .args(["run", "--backend", "cpu", "--ctx", CTX, "-p", "Hello", "--temp", "0", "-n", "6", "--nothink"])
        .output()
        .unwrap();
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let want = String::from_utf8(run.stdout).unwrap();
    assert!(!got.is_empty(), "the tiny model says something");
    assert_eq!(Some(got.as_str()), want.strip_suffix('\n').or(Some("")), "server vs ds4 run");
}

#[test]
fn a_prompt_extending_the_last_one_reuses_its_tokens() {
    let s = Server::start();
    let no_think = json!({"thinking": false});
    let first =
        s.post("/v1/chat/completions", &chat(user("Hello"), json!({"thinking": false, "max_tokens": 1}))).json();
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let answer = first["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    let convo = json!([
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "More"},
    ]);
    let second = s.post("/v1/chat/completions", &chat(convo.clone(), no_think.clone())).json();
    let prompt1 = first["usage"]["prompt_tokens"].as_u64().unwrap();
    // The first answer's one token was sampled, never fed: the session holds the first prompt.
    assert_eq!(second["usage"]["prompt_tokens_details"]["cached_tokens"], prompt1);
    let want = format!("(reused {prompt1}, prefilled ");
    let log = s.wait_log(|l| l.contains(&want));
    assert!(log.contains(&want), "{log}");

    // Something else in between resets the session; the same conversation then starts from
    // scratch and gives the same tokens.
    s.post("/v1/chat/completions", &chat(user("Other"), no_think.clone()));
    let fresh = s.post("/v1/chat/completions", &chat(convo, no_think)).json();
    assert_eq!(fresh["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(fresh["choices"][0]["message"]["content"], second["choices"][0]["message"]["content"]);
    assert_eq!(fresh["usage"], {
        let mut u = second["usage"].clone();
        u["prompt_tokens_details"]["cached_tokens"] = json!(0);
        u
    });
}

/// The tiny model samples multi-byte filler tokens that the prompt renderer, given the answer
/// back as text, spells byte by byte: the server aligns the prompt to the sampled tokens, so the
/// next turn still reuses them.
#[test]
fn an_answer_sent_back_reuses_the_sampled_tokens_however_it_retokenizes() {
    let s = Server::start();
    // Sampled at temperature 1 with the default seed: an answer with fillers and valid UTF-8.
    let body = chat(user("Hello"), json!({"thinking": false, "max_tokens": 8, "temperature": 1}));
    let first = s.post("/v1/chat/completions", &body).json();
    let answer = first["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    assert!(answer.contains("<|filler_"), "a filler token in the answer: {answer:?}");
    assert_eq!(first["choices"][0]["finish_reason"], "length");
    let convo = json!([
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "More"},
    ]);
    let second = s.post("/v1/chat/completions", &chat(convo, json!({"thinking": false}))).json();
    // Eight sampled, seven fed (the last one never is).
    let fed = first["usage"]["prompt_tokens"].as_u64().unwrap() + 7;
    assert_eq!(second["usage"]["prompt_tokens_details"]["cached_tokens"], fed, "{second}");
}

#[test]
fn concurrent_requests_are_all_answered_in_turn() {
    let s = Server::start();
    let addr = s.addr.clone();
    let threads: Vec<_> = (0..4)
        .map(|i| {
            let addr = addr.clone();
            std::thread::spawn(move || {
                let body = chat(user(&format!("Hi {i}")), json!({"max_tokens": 2, "stream": i % 2 == 1}));
                http(&addr, "POST", "/v1/chat/completions", body.to_string().as_bytes())
            })
        })
        .collect();
    for t in threads {
        let r = t.join().unwrap();
        assert_eq!(r.status, 200, "{}", r.body);
        assert!(r.body.contains("\"usage\""), "{}", r.body);
    }
    let log = s.wait_log(|l| l.matches("generated").count() >= 4);
    assert_eq!(log.matches("generated").count(), 4, "{log}");
}

#[test]
fn stop_strings_cut_the_answer() {
    let s = Server::start();
    let full = s.post("/v1/chat/completions", &chat(user("Hello"), json!({"max_tokens": 8, "thinking": false}))).json();
    let text = full["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    let chars: Vec<char> = text.chars().collect();
    assert!(chars.len() >= 3, "the tiny model's answer is long enough to cut: {text:?}");
    let stop: String = chars[1..3].iter().collect();
    let cut = &text[..text.find(&stop).unwrap()];
    for stream in [false, true] {
        let body =
            chat(user("Hello"), json!({"max_tokens": 8, "thinking": false, "stop": [stop.clone()], "stream": stream}));
        let r = s.post("/v1/chat/completions", &body);
        let (content, finish) = if stream {
            let events = sse(&r.body);
            let chunks: Vec<Value> =
                events[..events.len() - 1].iter().map(|(_, d)| serde_json::from_str(d).unwrap()).collect();
            let content: String =
                chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect::<Vec<_>>().concat();
            (content, chunks.last().unwrap()["choices"][0]["finish_reason"].clone())
        } else {
            let v = r.json();
            (
                v["choices"][0]["message"]["content"].as_str().unwrap().to_string(),
                v["choices"][0]["finish_reason"].clone(),
            )
        };
        assert_eq!(content, cut, "stream {stream}");
        assert_eq!(finish, "stop");
    }
    let body = json!({"model": "ds4", "max_tokens": 8, "temperature": 0, "stop_sequences": [stop],
                      "messages": [{"role": "user", "content": "Hello"}]});
    let v = s.post("/v1/messages", &body).json();
    assert_eq!(v["content"][0]["text"], cut);
    assert_eq!(v["stop_reason"], "stop_sequence");
    assert_eq!(v["stop_sequence"], stop);
}

/// The log line of request `#n`, once there.
fn request_line(s: &Server, n: u32) -> String {
    let tag = format!("#{n} ");
    let log = s.wait_log(|l| l.lines().any(|x| x.contains(&tag)));
    log.lines().find(|l| l.contains(&tag)).unwrap_or_else(|| panic!("no line for #{n}: {log}")).to_string()
}

/// The number after `key` in a log line.
fn number_after(line: &str, key: &str) -> usize {
    let at = line.find(key).unwrap_or_else(|| panic!("no {key:?} in {line}")) + key.len();
    line[at..].chars().take_while(char::is_ascii_digit).collect::<String>().parse().unwrap()
}

/// An answer longer than any budget here (the test hook forces it), so no end of sentence comes
/// before the client leaves, however fast the machine.
fn endless_answer() -> String {
    (0..20000).map(|i| char::from(b'a' + (i * 7 % 26) as u8)).collect()
}

/// After a client leaves, the engine samples at most one more token (the one being computed),
/// and the next request is served at once.
fn check_left_within_one_token(s: &Server, budget: usize) {
    let line = request_line(s, 1);
    let left_after = number_after(&line, "the client left after ");
    let generated = number_after(&line, "generated ");
    assert!(generated <= left_after + 1, "{generated} tokens generated, the client left after {left_after}: {line}");
    assert!(generated < budget / 2, "it stopped long before its budget of {budget}: {line}");
    let t0 = Instant::now();
    let r = s.post("/v1/chat/completions", &chat(user("Next"), json!({"max_tokens": 1})));
    assert_eq!(r.status, 200, "{}", r.body);
    let line = request_line(s, 2);
    // Queued behind nothing: its whole time is its own prefill and one token.
    assert!(t0.elapsed() < Duration::from_secs(20), "{line}");
    eprintln!("left after {left_after} tokens, {generated} generated; next: {line}");
}

#[test]
fn a_client_that_leaves_mid_stream_stops_the_generation_within_one_token() {
    let s = Server::spawn("8192", Some(&endless_answer()));
    let body = chat(user("Hello"), json!({"max_tokens": 10000, "stream": true})).to_string();
    let mut c = TcpStream::connect(&s.addr).unwrap();
    write!(
        c,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    // Wait for the chunks of a few tokens (after the opening one), then hang up.
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    let chunks = |seen: &[u8]| String::from_utf8_lossy(seen).matches("chat.completion.chunk").count();
    while chunks(&seen) < 4 {
        let n = c.read(&mut buf).unwrap();
        assert!(n > 0);
        seen.extend_from_slice(&buf[..n]);
    }
    drop(c);
    eprintln!("the client read {} token chunks", chunks(&seen) - 1);
    check_left_within_one_token(&s, 8192);
}

#[test]
fn a_client_that_leaves_before_a_whole_answer_stops_the_generation_within_one_token() {
    let s = Server::spawn("8192", Some(&endless_answer()));
    let body = chat(user("Hello"), json!({"max_tokens": 10000})).to_string();
    let mut c = TcpStream::connect(&s.addr).unwrap();
    write!(
        c,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    // Hang up once the engine is generating (the log shows nothing for a request until it ends).
    std::thread::sleep(Duration::from_millis(500));
    assert!(!s.log().contains("#1 "), "still generating: {}", s.log());
    drop(c);
    check_left_within_one_token(&s, 8192);
}

#[test]
fn a_client_that_leaves_during_a_long_prefill_stops_it() {
    let s = Server::with_ctx("32768");
    // Tens of thousands of prompt tokens (the stand-in vocabulary has about one token per byte):
    // many seconds of prefill on the CPU, fed one token at a time.
    let long: String = endless_answer()[..15000].repeat(2);
    let body = chat(user(&long), json!({"max_tokens": 10})).to_string();
    let mut c = TcpStream::connect(&s.addr).unwrap();
    write!(
        c,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    std::thread::sleep(Duration::from_millis(1000));
    drop(c);
    let line = request_line(&s, 1);
    let prompt = number_after(&line, "prompt ");
    let prefilled = number_after(&line, "prefilled ");
    assert!(prompt > 20000, "{line}");
    assert!(prefilled < prompt, "the prefill stopped early: {line}");
    assert_eq!(number_after(&line, "generated "), 0, "{line}");
    assert!(line.contains("the client left after 0 tokens"), "{line}");
    // The next request is served at once.
    let t0 = Instant::now();
    let r = s.post("/v1/chat/completions", &chat(user("Next"), json!({"max_tokens": 1})));
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(t0.elapsed() < Duration::from_secs(20));
    eprintln!("{line}");
}

#[test]
fn bad_input_gets_a_4xx_in_the_apis_format_and_the_server_stays_up() {
    let s = Server::start();
    let oa = "/v1/chat/completions";
    let an = "/v1/messages";
    let long = "a".repeat(200);
    let cases: Vec<(&str, Vec<u8>, u16)> = vec![
        (oa, b"{\"model\": ".to_vec(), 400),
        (oa, b"[1, 2]".to_vec(), 400),
        (oa, json!({"model": "ds4"}).to_string().into_bytes(), 400),
        (oa, chat(user("Hi"), json!({"temperature": "hot"})).to_string().into_bytes(), 400),
        (oa, chat(user("Hi"), json!({"temperature": -1})).to_string().into_bytes(), 400),
        (oa, chat(user("Hi"), json!({"top_p": 2})).to_string().into_bytes(), 400),
        (oa, chat(user("Hi"), json!({"max_tokens": 0})).to_string().into_bytes(), 400),
        (oa, chat(user("Hi"), json!({"stop": [""]})).to_string().into_bytes(), 400),
        (oa, chat(user("Hi"), json!({"model": "gpt-4"})).to_string().into_bytes(), 404),
        (oa, chat(json!([]), json!({})).to_string().into_bytes(), 400),
        (
            oa,
            chat(json!([{"role": "user"}, {"role": "assistant", "content": "x"}]), json!({})).to_string().into_bytes(),
            400,
        ),
        (oa, chat(json!([{"role": "tool", "content": "x"}]), json!({})).to_string().into_bytes(), 400),
        (oa, chat(user("Hi"), json!({"tools": [{"type": "function"}]})).to_string().into_bytes(), 400),
        (oa, chat(user("Hi"), json!({"tools": {"type": "function"}})).to_string().into_bytes(), 400),
        (oa, chat(user("Hi"), json!({"tools": openai_tools(), "tool_choice": "maybe"})).to_string().into_bytes(), 400),
        (
            oa,
            chat(user("Hi"), json!({"tools": openai_tools(), "tool_choice": {"type": "function", "function": {"name": "x"}}}))
                .to_string()
                .into_bytes(),
            400,
        ),
        (
            oa,
            chat(
                json!([{"role": "user", "content": "Hi"},
                       {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                       {"role": "tool", "tool_call_id": "c2", "content": "x"}]),
                json!({}),
            )
            .to_string()
            .into_bytes(),
            400,
        ),
        (
            an,
            json!({"model": "ds4", "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "x"}]}]})
                .to_string()
                .into_bytes(),
            400,
        ),
        (
            an,
            json!({"model": "ds4", "max_tokens": 4, "tools": [{"type": "web_search_20250305", "name": "web_search"}],
                   "messages": [{"role": "user", "content": "Hi"}]})
            .to_string()
            .into_bytes(),
            400,
        ),
        (
            an,
            json!({"model": "ds4", "max_tokens": 4, "tools": [{"name": "f"}], "messages": [{"role": "user", "content": "Hi"}]})
                .to_string()
                .into_bytes(),
            400,
        ),
        (oa, chat(user(&long), json!({})).to_string().into_bytes(), 400),
        (oa, vec![b' '; 9 << 20], 413),
        (an, b"not json".to_vec(), 400),
        (an, json!({"model": "ds4", "messages": [{"role": "user", "content": "Hi"}]}).to_string().into_bytes(), 400),
        (
            an,
            json!({"model": "claude", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]})
                .to_string()
                .into_bytes(),
            404,
        ),
        (
            an,
            json!({"model": "ds4", "max_tokens": 4, "messages": [{"role": "user", "content": long}]})
                .to_string()
                .into_bytes(),
            400,
        ),
        (
            an,
            json!({"model": "ds4", "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image"}]}]})
                .to_string()
                .into_bytes(),
            400,
        ),
        (an, vec![b' '; 9 << 20], 413),
    ];
    for (path, body, status) in cases {
        let r = http(&s.addr, "POST", path, &body);
        let shown = String::from_utf8_lossy(&body[..body.len().min(120)]).to_string();
        assert_eq!(r.status, status, "{path} {shown}: {}", r.body);
        let v = r.json();
        if path == oa {
            assert!(v["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{}", r.body);
            assert_eq!(v["error"]["type"], "invalid_request_error");
        } else {
            assert_eq!(v["type"], "error");
            assert!(v["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{}", r.body);
            let want = match status {
                404 => "not_found_error",
                413 => "request_too_large",
                _ => "invalid_request_error",
            };
            assert_eq!(v["error"]["type"], want, "{}", r.body);
        }
    }
    assert_eq!(s.get("/health").status, 200);
    assert_eq!(s.get("/nowhere").status, 404);
    let r = s.post(oa, &chat(user("Hi"), json!({"max_tokens": 1})));
    assert_eq!(r.status, 200, "{}", r.body);
}

/// 200 requests from 20 clients at once: every one answered, with the same greedy token (the
/// prompt is the same, so after the first each one reuses the whole prompt); p50 and p99 printed.
#[test]
fn load_200_requests_from_20_clients() {
    let s = Server::start();
    let addr = s.addr.clone();
    let clients: Vec<_> = (0..20)
        .map(|_| {
            let addr = addr.clone();
            std::thread::spawn(move || {
                let body = chat(user("Hi"), json!({"max_tokens": 1, "thinking": false})).to_string();
                (0..10)
                    .map(|_| {
                        let t0 = Instant::now();
                        let r = http(&addr, "POST", "/v1/chat/completions", body.as_bytes());
                        assert_eq!(r.status, 200, "{}", r.body);
                        (t0.elapsed(), r.json()["choices"][0]["message"]["content"].clone())
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let results: Vec<(Duration, Value)> = clients.into_iter().flat_map(|c| c.join().unwrap()).collect();
    assert_eq!(results.len(), 200);
    assert!(results.iter().all(|(_, c)| *c == results[0].1), "every answer is the same greedy token");
    let mut times: Vec<Duration> = results.iter().map(|(t, _)| *t).collect();
    times.sort();
    eprintln!("200 requests, 20 clients: p50 {:?}, p99 {:?}", times[99], times[197]);
    let log = s.wait_log(|l| l.matches("generated").count() >= 200);
    assert_eq!(log.matches("generated 1,").count(), 200, "{log}");
}

#[test]
fn a_model_that_cannot_load_is_one_error_line() {
    let out = Command::new(env!("CARGO_BIN_EXE_ds4")).args(["serve", "-m", "no-such-model.gguf"]).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(out.stdout.is_empty(), "no URL is printed");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("ds4: error: -m/--model: model file no-such-model.gguf does not exist"), "{err}");
}

#[test]
fn a_taken_port_is_one_error_line() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let out = Command::new(env!("CARGO_BIN_EXE_ds4")).args(["serve", "--port", &port]).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&format!("ds4: error: --host 127.0.0.1 --port {port}: cannot listen there")), "{err}");
}

// ---------------------------------------------------------------------------------------------
// Tools

/// What the forced-answer server "generates": some text, then a call in DeepSeek V4's DSML.
const FORCED_CALL: &str = "I will check.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n\
    <｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n\
    <｜DSML｜parameter name=\"days\" string=\"false\">3</｜DSML｜parameter>\n\
    </｜DSML｜invoke>\n</｜DSML｜tool_calls>";

fn openai_tools() -> Value {
    json!([{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                           "required": ["city"]}}}])
}

/// The same tool in Anthropic's form.
fn anthropic_tools() -> Value {
    let f = &openai_tools()[0]["function"];
    json!([{"name": f["name"], "description": f["description"], "input_schema": f["parameters"]}])
}

fn weather_args() -> Value {
    json!({"city": "Paris", "days": 3})
}

#[test]
fn requests_with_tools_are_accepted_and_the_tools_are_in_the_prompt() {
    let s = Server::with_ctx("2048");
    let plain = s.post("/v1/chat/completions", &chat(user("Hello"), json!({"max_tokens": 1}))).json();
    let with_tools = chat(user("Hello"), json!({"max_tokens": 2, "tools": openai_tools(), "tool_choice": "auto"}));
    let r = s.post("/v1/chat/completions", &with_tools);
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let prompt = v["usage"]["prompt_tokens"].as_u64().unwrap();
    // The tools section is long: hundreds of tokens of the byte-level stand-in vocabulary.
    assert!(prompt > plain["usage"]["prompt_tokens"].as_u64().unwrap() + 500, "{prompt}");
    // The noise the tiny model writes is no tool call.
    assert!(["stop", "length"].contains(&v["choices"][0]["finish_reason"].as_str().unwrap()), "{v}");

    // Anthropic renders the same tool the same way: count_tokens agrees with OpenAI's usage.
    let count = json!({"model": "ds4", "messages": [{"role": "user", "content": "Hello"}],
                       "tools": anthropic_tools(), "thinking": {"type": "enabled"}});
    let n = s.post("/v1/messages/count_tokens", &count);
    assert_eq!(n.status, 200, "{}", n.body);
    assert_eq!(n.json()["input_tokens"].as_u64(), Some(prompt));

    // tool_choice "none" leaves the tools out.
    let none = chat(user("Hello"), json!({"max_tokens": 1, "tools": openai_tools(), "tool_choice": "none"}));
    assert_eq!(s.post("/v1/chat/completions", &none).json()["usage"]["prompt_tokens"], plain["usage"]["prompt_tokens"]);

    // Streaming and Anthropic requests with tools: see the next tests.
}

#[test]
fn count_tokens_counts_the_prompt() {
    let s = Server::start();
    let count = |body: Value| {
        let r = s.post("/v1/messages/count_tokens", &body);
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()["input_tokens"].as_u64().unwrap()
    };
    let hello = json!([{"role": "user", "content": "Hello"}]);
    // BOS, <｜User｜>, 5 bytes, <｜Assistant｜>, </think> (or <think>).
    assert_eq!(count(json!({"model": "ds4", "messages": hello})), 9);
    assert_eq!(count(json!({"model": "ds4", "messages": hello, "thinking": {"type": "enabled"}})), 9);
    // Eight more bytes of system text.
    assert_eq!(count(json!({"model": "ds4", "messages": hello, "system": "Be brief"})), 17);
    // The same as a request's usage.
    let body = json!({"model": "ds4", "max_tokens": 1, "system": "Be brief", "messages": hello});
    let u = s.post("/v1/messages", &body).json()["usage"].clone();
    assert_eq!(u["input_tokens"].as_u64().unwrap() + u["cache_read_input_tokens"].as_u64().unwrap(), 17);
    let r = s.post("/v1/messages/count_tokens", &json!({"model": "claude", "messages": hello}));
    assert_eq!((r.status, r.json()["error"]["type"].clone()), (404, json!("not_found_error")));
    let r = http(&s.addr, "POST", "/v1/messages/count_tokens", b"{");
    assert_eq!((r.status, r.json()["type"].clone()), (400, json!("error")));
}

/// A tool call the model writes (forced through the server's test hook) comes back in each API's
/// format, streaming and not. One conversation goes on turn by turn, through both APIs in turn:
/// each turn sends back the calls and their results, and reuses every token fed before it (the
/// calls render back exactly as they were generated, and both APIs render the same conversation
/// alike).
#[test]
fn a_generated_tool_call_comes_back_in_each_apis_format() {
    let s = Server::spawn("2048", Some(FORCED_CALL));
    let question = json!({"role": "user", "content": "Weather in Paris?"});
    // Tokens the session holds after a turn: its prompt and its answer (the last token, the end of
    // the tool calls, is fed too: the handler stops the engine one token later).
    let fed = |prompt: &Value, completion: &Value| prompt.as_u64().unwrap() + completion.as_u64().unwrap();

    // 1. OpenAI, not streaming.
    let body = chat(json!([question]), json!({"max_tokens": 500, "thinking": false, "tools": openai_tools()}));
    let v = s.post("/v1/chat/completions", &body).json();
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{v}");
    let msg1 = choice["message"].clone();
    assert_eq!(msg1["content"], "I will check.");
    let calls = msg1["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0]["type"], "function");
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    let args: Value = serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, weather_args());
    let id1 = calls[0]["id"].as_str().unwrap().to_string();
    assert!(id1.starts_with("call_"));
    let fed1 = fed(&v["usage"]["prompt_tokens"], &v["usage"]["completion_tokens"]);

    // 2. OpenAI, streaming, with the result: the text, then the call (its id and name, then its
    // arguments), then the finish.
    let result1 = json!({"role": "tool", "tool_call_id": id1, "content": "Sunny, 21 C"});
    let mut body = chat(json!([question, msg1, result1]), json!({"max_tokens": 500, "thinking": false}));
    body["tools"] = openai_tools();
    body["stream"] = json!(true);
    let events = sse(&s.post("/v1/chat/completions", &body).body);
    assert_eq!(events.last().unwrap().1, "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1].iter().map(|(_, d)| serde_json::from_str(d).unwrap()).collect();
    let deltas: Vec<&Value> = chunks.iter().map(|c| &c["choices"][0]["delta"]).collect();
    let text: String = deltas.iter().filter_map(|d| d["content"].as_str()).collect();
    assert_eq!(text, "I will check.");
    let call_deltas: Vec<&Value> = deltas.iter().filter_map(|d| d.get("tool_calls")).map(|t| &t[0]).collect();
    assert!(call_deltas.iter().all(|d| d["index"] == 0));
    assert_eq!(call_deltas[0]["function"]["name"], "get_weather");
    let id2 = call_deltas[0]["id"].as_str().unwrap().to_string();
    assert!(id2.starts_with("call_") && id2 != id1);
    let args: String = call_deltas.iter().filter_map(|d| d["function"]["arguments"].as_str()).collect();
    assert_eq!(serde_json::from_str::<Value>(&args).unwrap(), weather_args());
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "tool_calls");
    assert_eq!(last["usage"]["prompt_tokens_details"]["cached_tokens"], fed1, "{last}");
    let fed2 = fed(&last["usage"]["prompt_tokens"], &last["usage"]["completion_tokens"]);

    // 3. Anthropic, not streaming: the same conversation in Anthropic's blocks.
    let assistant = |id: &str| {
        json!({"role": "assistant", "content": [{"type": "text", "text": "I will check."},
                                                {"type": "tool_use", "id": id, "name": "get_weather", "input": weather_args()}]})
    };
    let result = |id: &str, text: &str| json!({"role": "user", "content": [{"type": "tool_result", "tool_use_id": id, "content": [{"type": "text", "text": text}]}]});
    let mut convo = vec![
        question.clone(),
        assistant(&id1),
        result(&id1, "Sunny, 21 C"),
        assistant(&id2),
        result(&id2, "Still sunny"),
    ];
    let body = json!({"model": "ds4", "max_tokens": 500, "messages": convo, "tools": anthropic_tools()});
    let m = s.post("/v1/messages", &body).json();
    assert_eq!(m["stop_reason"], "tool_use", "{m}");
    assert_eq!(m["content"][0], json!({"type": "text", "text": "I will check."}));
    let block = &m["content"][1];
    assert_eq!(
        (&block["type"], &block["name"], &block["input"]),
        (&json!("tool_use"), &json!("get_weather"), &weather_args())
    );
    let id3 = block["id"].as_str().unwrap().to_string();
    assert!(id3.starts_with("toolu_"));
    assert_eq!(m["usage"]["cache_read_input_tokens"], fed2, "{m}");
    let fed3 = fed(&m["usage"]["input_tokens"], &m["usage"]["output_tokens"]) + fed2;

    // 4. Anthropic, streaming: the text block, then the tool_use block with its input in one delta.
    convo.extend([assistant(&id3), result(&id3, "Sunny again")]);
    let body =
        json!({"model": "ds4", "max_tokens": 500, "messages": convo, "tools": anthropic_tools(), "stream": true});
    let events = sse(&s.post("/v1/messages", &body).body);
    let names: Vec<&str> = events.iter().map(|(e, _)| e.as_deref().unwrap()).collect();
    let data: Vec<Value> = events.iter().map(|(_, d)| serde_json::from_str(d).unwrap()).collect();
    let n = names.len();
    assert_eq!(names[..2], ["message_start", "content_block_start"]);
    assert_eq!(data[0]["message"]["usage"]["cache_read_input_tokens"], fed3, "{:?}", data[0]);
    assert_eq!(
        names[n - 6..],
        [
            "content_block_stop",
            "content_block_start",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop"
        ]
    );
    assert_eq!(data[n - 5]["content_block"]["type"], "tool_use");
    assert_eq!(data[n - 5]["content_block"]["name"], "get_weather");
    assert_eq!(data[n - 5]["index"], 1);
    assert_eq!(data[n - 4]["delta"]["type"], "input_json_delta");
    let input: Value = serde_json::from_str(data[n - 4]["delta"]["partial_json"].as_str().unwrap()).unwrap();
    assert_eq!(input, weather_args());
    assert_eq!(data[n - 2]["delta"]["stop_reason"], "tool_use");
    let text: String = data.iter().filter_map(|d| d["delta"]["text"].as_str()).collect();
    assert_eq!(text, "I will check.");
}

/// With tools the template keeps every turn's reasoning: a thinking turn that called a tool, sent
/// back with its reasoning and the result, reuses every token of that turn.
#[test]
fn a_thinking_tool_call_turn_is_reused_with_its_reasoning() {
    let forced = format!("Need the weather.</think>{FORCED_CALL}");
    let s = Server::spawn("2048", Some(&forced));
    let question = json!({"role": "user", "content": "Weather in Paris?"});
    let body = chat(json!([question]), json!({"max_tokens": 500, "thinking": true, "tools": openai_tools()}));
    let v = s.post("/v1/chat/completions", &body).json();
    let msg = v["choices"][0]["message"].clone();
    assert_eq!(msg["reasoning_content"], "Need the weather.", "{v}");
    assert_eq!(msg["content"], "I will check.");
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls");
    let id = msg["tool_calls"][0]["id"].clone();
    let convo = json!([question, msg, {"role": "tool", "tool_call_id": id, "content": "Sunny"}]);
    let v2 = s
        .post("/v1/chat/completions", &chat(convo, json!({"max_tokens": 1, "thinking": true, "tools": openai_tools()})))
        .json();
    let fed = v["usage"]["prompt_tokens"].as_u64().unwrap() + v["usage"]["completion_tokens"].as_u64().unwrap();
    assert_eq!(v2["usage"]["prompt_tokens_details"]["cached_tokens"], fed, "{v2}");
}
