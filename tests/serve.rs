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
        let mut child = Command::new(env!("CARGO_BIN_EXE_ds4"))
            .args(["serve", "--backend", "cpu", "--port", "0", "--ctx", ctx])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
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

#[test]
fn a_client_that_leaves_mid_stream_frees_the_engine() {
    // Room for thousands of tokens: even a fast build is still generating when the client leaves.
    let s = Server::with_ctx("8192");
    let body = chat(user("Hello"), json!({"max_tokens": 10000, "stream": true})).to_string();
    let mut c = TcpStream::connect(&s.addr).unwrap();
    write!(
        c,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    // Wait for the first content chunk, then hang up.
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains("_content\"")
        && !String::from_utf8_lossy(&seen).contains("\"content\":\"")
    {
        let n = c.read(&mut buf).unwrap();
        assert!(n > 0);
        seen.extend_from_slice(&buf[..n]);
    }
    drop(c);
    let t0 = Instant::now();
    let r = s.post("/v1/chat/completions", &chat(user("Next"), json!({"max_tokens": 1})));
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(t0.elapsed() < Duration::from_secs(120), "the next request waited for the abandoned one");
    let log = s.log();
    let line = log.lines().find(|l| l.contains("#1 ")).unwrap();
    assert!(line.contains("stopped by the handler"), "{log}");
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
