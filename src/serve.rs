//! `ds4 serve`: an OpenAI- and Anthropic-compatible HTTP server over one [`Engine`].
//!
//! One worker thread owns the engine (one session: the weights are uploaded once per process)
//! and takes jobs from a queue in arrival order, one sequence at a time. HTTP handlers parse and
//! check a request, render its prompt, queue it, and turn the worker's token events into a JSON
//! body or server-sent events. Tools follow DeepSeek V4's format (see [`ds4::chat`]): schemas in
//! the system text, calls written by the model in DSML and returned as each API's tool calls.
//!
//! A handler that stops listening (a client gone, a stop string found, the tool calls complete)
//! marks its job stopped; the worker checks that mark at every sampled token, so at most one
//! more token is computed.

use std::convert::Infallible;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;

use ds4::chat::{self, BlockState, Conversation, Message, ParsedCall, ToolCall, UserPart};
use ds4::engine::{Engine, EngineError, Event, GenParams, StopReason};
use ds4::sample::SamplerConfig;
use ds4::tokenizer::{ThinkMode, Tokenizer};

/// The model id clients name in `model`.
pub const MODEL_ID: &str = "ds4";
/// Largest request body accepted.
const BODY_LIMIT: usize = 8 << 20;
/// Test hook: when set, every answer is this text (its special strings as special tokens)
/// instead of sampled tokens, so tests can see a known tool call come back.
const FORCED_ANSWER_VAR: &str = "DS4_TEST_FORCED_ANSWER";

/// Sampling defaults, as `ds4 run`.
const DEFAULT_TEMPERATURE: f32 = 1.0;
const DEFAULT_MIN_P: f32 = 0.05;
const DEFAULT_SEED: u64 = 42;

/// Which API a request came through: errors and bodies take its format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Api {
    OpenAi,
    Anthropic,
}

/// A refused or failed request: its status and message, rendered in the API's error format.
#[derive(Debug)]
struct ApiError {
    status: StatusCode,
    msg: String,
}

impl ApiError {
    fn bad(msg: impl Into<String>) -> ApiError {
        ApiError { status: StatusCode::BAD_REQUEST, msg: msg.into() }
    }

    fn into_response(self, api: Api) -> Response {
        let body = match api {
            Api::OpenAi => {
                let kind = if self.status.is_server_error() { "server_error" } else { "invalid_request_error" };
                let code = match self.status {
                    StatusCode::NOT_FOUND => json!("model_not_found"),
                    StatusCode::PAYLOAD_TOO_LARGE => json!("request_too_large"),
                    _ => Value::Null,
                };
                json!({"error": {"message": self.msg, "type": kind, "param": null, "code": code}})
            }
            Api::Anthropic => {
                json!({"type": "error", "error": {"type": anthropic_kind(self.status), "message": self.msg}})
            }
        };
        (self.status, Json(body)).into_response()
    }
}

fn anthropic_kind(status: StatusCode) -> &'static str {
    match status {
        StatusCode::NOT_FOUND => "not_found_error",
        StatusCode::PAYLOAD_TOO_LARGE => "request_too_large",
        StatusCode::SERVICE_UNAVAILABLE => "overloaded_error",
        s if s.is_server_error() => "api_error",
        _ => "invalid_request_error",
    }
}

/// What a handler asks the worker to do.
struct Job {
    id: u64,
    prompt: Vec<u32>,
    params: GenParams,
    arrived: Instant,
    path: &'static str,
    tx: mpsc::UnboundedSender<Out>,
    client: Arc<Client>,
}

/// What the worker reports for a job, in order: `Start`, then `Token`s, then `Done`; or `Error`.
enum Out {
    Start { prompt_tokens: usize, reused: usize },
    Token { id: u32, text: String },
    Done { stop: StopReason, tail: String },
    Error(ApiError),
}

/// Shared by a job's handler and the worker: how many tokens were sampled, and whether (after how
/// many) the handler stopped listening. One lock for both, so no token is sampled and handed on
/// after the stop is marked: the worker samples at most one token more.
#[derive(Default)]
struct Client(Mutex<ClientState>);

#[derive(Default)]
struct ClientState {
    sampled: usize,
    /// Tokens sampled when the handler stopped listening, and whether the client left.
    stopped: Option<(usize, bool)>,
}

impl Client {
    fn state(&self) -> std::sync::MutexGuard<'_, ClientState> {
        // A panic elsewhere while holding this lock leaves plain counters: still usable.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The worker sampled a token: false if the handler no longer wants it.
    fn sampled_one(&self) -> bool {
        let mut s = self.state();
        s.sampled += 1;
        s.stopped.is_none()
    }

    fn stop(&self, client_left: bool) {
        let mut s = self.state();
        if s.stopped.is_none() {
            s.stopped = Some((s.sampled, client_left));
        }
    }

    fn stopped(&self) -> Option<(usize, bool)> {
        self.state().stopped
    }
}

/// The handler's side of a job: dropped before the job finished (the client went away, and
/// with it the handler's future or its stream), it tells the worker to stop.
struct Watch {
    client: Arc<Client>,
    done: bool,
}

impl Watch {
    /// The worker finished the job (or failed it): nothing to stop.
    fn finished(&mut self) {
        self.done = true;
    }

    /// The handler has what it needs (a stop string, the end of the tool calls).
    fn stop(&mut self) {
        self.client.stop(false);
        self.done = true;
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        if !self.done {
            self.client.stop(true);
        }
    }
}

/// Token ids the handlers need to split reasoning from the answer.
#[derive(Clone, Copy)]
struct Ids {
    think: u32,
    think_end: u32,
    eos: u32,
}

struct AppState {
    jobs: mpsc::UnboundedSender<Job>,
    next_id: AtomicU64,
    ids: Ids,
    /// The model's tokenizer: handlers render prompts (and count tokens) off the engine thread.
    tok: Arc<Tokenizer>,
    /// Distinguishes this process's tool-call ids from an earlier run's.
    boot: u64,
}

/// Starts the worker (which calls `make_engine` on its own thread: a session stays on the thread
/// that made it), binds `host:port`, prints the URL and serves until interrupted.
pub fn run(make_engine: Box<dyn FnOnce() -> Result<Engine> + Send>, host: &str, port: u16) -> Result<()> {
    // Bound before the model loads, so a taken port fails at once.
    let listener = std::net::TcpListener::bind((host, port))
        .with_context(|| format!("--host {host} --port {port}: cannot listen there"))?;
    listener.set_nonblocking(true)?;
    let forced = std::env::var(FORCED_ANSWER_VAR).ok();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<(Ids, Tokenizer)>>();
    let (jobs_tx, jobs_rx) = mpsc::unbounded_channel::<Job>();
    std::thread::Builder::new()
        .name("ds4-engine".into())
        .spawn(move || {
            let ready = make_engine().and_then(|mut engine| {
                let tok = Tokenizer::from_gguf(&engine.model().file)?;
                if let Some(text) = &forced {
                    eprintln!("ds4 serve: test hook {FORCED_ANSWER_VAR}: every answer is forced");
                    let ids = engine.tokenizer().encode_rendered(text);
                    engine.force_output(Some(ids));
                }
                Ok((engine, tok))
            });
            match ready {
                Ok((engine, tok)) => {
                    let s = *engine.tokenizer().specials();
                    let ids = Ids { think: s.think, think_end: s.think_end, eos: s.eos };
                    let _ = ready_tx.send(Ok((ids, tok)));
                    worker(engine, jobs_rx);
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                }
            }
        })
        .context("cannot start the engine thread")?;
    let (ids, tok) = ready_rx.recv().context("the engine thread ended while loading")??;
    let boot = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::from_std(listener)?;
        let addr = listener.local_addr()?;
        {
            use std::io::Write;
            let mut out = std::io::stdout().lock();
            writeln!(out, "ds4 serve: listening on http://{addr}")?;
            out.flush()?;
        }
        let state = Arc::new(AppState { jobs: jobs_tx, next_id: AtomicU64::new(1), ids, tok: Arc::new(tok), boot });
        axum::serve(listener, router(state))
            .with_graceful_shutdown(async {
                let _ = tokio::signal::ctrl_c().await;
            })
            .await
            .context("the server failed")
    })
}

fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/health", get(|| async { Json(json!({"status": "ok"})) }))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/messages", post(messages))
        .route("/v1/messages/count_tokens", post(count_tokens))
        .fallback(|| async {
            ApiError { status: StatusCode::NOT_FOUND, msg: "no such endpoint".into() }.into_response(Api::OpenAi)
        })
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .with_state(state)
}

fn model_object() -> Value {
    json!({"id": MODEL_ID, "object": "model", "created": 0, "owned_by": "ds4"})
}

async fn models() -> Json<Value> {
    Json(json!({"object": "list", "data": [model_object()]}))
}

async fn model(axum::extract::Path(id): axum::extract::Path<String>) -> Response {
    match check_model(&id) {
        Ok(()) => Json(model_object()).into_response(),
        Err(e) => e.into_response(Api::OpenAi),
    }
}

/// The engine thread: jobs one at a time, in the order they came.
fn worker(mut engine: Engine, mut jobs: mpsc::UnboundedReceiver<Job>) {
    while let Some(job) = jobs.blocking_recv() {
        // The model's own tokens for the answers sent back, so the session's state is reused.
        let prompt = engine.align(&job.prompt);
        let ctx = engine.ctx();
        // At least one position must be left for the answer.
        if prompt.len() >= ctx {
            let msg = format!(
                "the prompt is {} tokens; the context holds {ctx} (--ctx) with room for at least one more",
                prompt.len()
            );
            eprintln!("ds4 serve: #{} {}: refused: {msg}", job.id, job.path);
            let _ = job.tx.send(Out::Error(ApiError::bad(msg)));
            continue;
        }
        let reused = engine.reusable(&prompt);
        if job.client.stopped().is_some() || job.tx.send(Out::Start { prompt_tokens: prompt.len(), reused }).is_err() {
            eprintln!("ds4 serve: #{} {}: the client left while queued", job.id, job.path);
            continue;
        }
        let mut first_token = None;
        let r = engine.generate(&prompt, &job.params, |ev| match ev {
            Event::Token { id, text } => {
                first_token.get_or_insert_with(|| job.arrived.elapsed());
                job.client.sampled_one() && job.tx.send(Out::Token { id, text: text.to_string() }).is_ok()
            }
            // A long prompt is not fed for a client that left.
            Event::Prefill { .. } => job.client.stopped().is_none(),
            Event::Logits(_) => true,
        });
        match r {
            Ok(stats) => {
                let _ = job.tx.send(Out::Done { stop: stats.stop, tail: stats.tail });
                let how = match (stats.stop, job.client.stopped()) {
                    (StopReason::Eos, _) => "end of sentence".to_string(),
                    (StopReason::Length, _) => "length".to_string(),
                    (StopReason::Callback, Some((n, true))) => format!("the client left after {n} tokens"),
                    (StopReason::Callback, Some((n, false))) => {
                        format!("stopped by the handler after {n} tokens (a stop string or the end of the tool calls)")
                    }
                    (StopReason::Callback, None) => "the handler is gone".to_string(),
                };
                eprintln!(
                    "ds4 serve: #{} {}: prompt {} tokens (reused {}, prefilled {}), generated {}, first token after {:.3} s, {how}, {:.3} s in all",
                    job.id,
                    job.path,
                    stats.prompt_tokens,
                    stats.reused,
                    stats.prefilled,
                    stats.generated,
                    first_token.map_or(0.0, |d| d.as_secs_f64()),
                    job.arrived.elapsed().as_secs_f64(),
                );
            }
            Err(e) => {
                eprintln!("ds4 serve: #{} {}: failed: {e}", job.id, job.path);
                let status = match e {
                    EngineError::PromptTooLong { .. } | EngineError::EmptyPrompt | EngineError::Sampler(_) => {
                        StatusCode::BAD_REQUEST
                    }
                    _ => StatusCode::INTERNAL_SERVER_ERROR,
                };
                let _ = job.tx.send(Out::Error(ApiError { status, msg: e.to_string() }));
            }
        }
        for w in engine.take_warnings() {
            eprintln!("ds4 serve: {w}");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Requests

/// A request checked and ready to queue, from either API.
struct Parsed {
    conversation: Conversation,
    think: ThinkMode,
    params: GenParams,
    stops: Vec<String>,
    stream: bool,
}

impl Parsed {
    /// Tool calls are looked for in the answer only when tools were offered.
    fn tools(&self) -> bool {
        !self.conversation.tools.is_empty()
    }
}

/// Text of a message `content`: a string, or an array of `{"type": "text", "text": ...}` parts
/// (joined as they are). Other parts (images) are refused: this server does not support them.
fn content_text(content: &Value, what: &str) -> Result<String, ApiError> {
    match content {
        Value::String(s) => Ok(s.clone()),
        Value::Null => Ok(String::new()),
        Value::Array(parts) => {
            let mut out = String::new();
            for p in parts {
                match part_type(p, what)? {
                    "text" => out.push_str(part_text(p, what)?),
                    // Earlier reasoning of an assistant turn comes apart (see the callers).
                    "thinking" | "redacted_thinking" => {}
                    other => return Err(ApiError::bad(format!("{what}: content of type '{other}' is not supported"))),
                }
            }
            Ok(out)
        }
        _ => Err(ApiError::bad(format!("{what}: `content` must be a string or an array of parts"))),
    }
}

fn part_type<'a>(p: &'a Value, what: &str) -> Result<&'a str, ApiError> {
    p.get("type")
        .and_then(Value::as_str)
        .ok_or_else(|| ApiError::bad(format!("{what}: each content part needs a `type`")))
}

fn part_text<'a>(p: &'a Value, what: &str) -> Result<&'a str, ApiError> {
    p.get("text")
        .and_then(Value::as_str)
        .ok_or_else(|| ApiError::bad(format!("{what}: a text part needs a string `text`")))
}

/// A tool result's text: a string, or parts whose texts are joined by a blank line, other parts
/// standing as `[Unsupported TYPE]` (as DeepSeek's renderer does).
fn tool_result_text(content: &Value, what: &str) -> Result<String, ApiError> {
    match content {
        Value::String(s) => Ok(s.clone()),
        Value::Null => Ok(String::new()),
        Value::Array(parts) => {
            let mut texts = Vec::new();
            for p in parts {
                match part_type(p, what)? {
                    "text" => texts.push(part_text(p, what)?.to_string()),
                    other => texts.push(format!("[Unsupported {other}]")),
                }
            }
            Ok(texts.join("\n\n"))
        }
        _ => Err(ApiError::bad(format!("{what}: a tool result's content must be a string or an array of parts"))),
    }
}

fn check_model(model: &str) -> Result<(), ApiError> {
    if model == MODEL_ID {
        Ok(())
    } else {
        Err(ApiError {
            status: StatusCode::NOT_FOUND,
            msg: format!("model '{model}' does not exist (this server has '{MODEL_ID}')"),
        })
    }
}

/// `stop` / `stop_sequences`: a string or an array of non-empty strings.
fn parse_stops(v: Option<&Value>, field: &str) -> Result<Vec<String>, ApiError> {
    let stops: Vec<String> = match v {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .map(|s| s.as_str().map(str::to_string))
            .collect::<Option<_>>()
            .ok_or_else(|| ApiError::bad(format!("`{field}` must be a string or an array of strings")))?,
        Some(_) => return Err(ApiError::bad(format!("`{field}` must be a string or an array of strings"))),
    };
    if stops.iter().any(String::is_empty) {
        return Err(ApiError::bad(format!("`{field}`: a stop string must not be empty")));
    }
    Ok(stops)
}

/// `thinking`: a bool, or `{"type": "enabled" | "adaptive" | "disabled"}` (DeepSeek's and
/// Anthropic's forms).
fn parse_thinking(v: &Value) -> Result<bool, ApiError> {
    match v {
        Value::Bool(b) => Ok(*b),
        Value::Object(o) => match o.get("type").and_then(Value::as_str) {
            Some("enabled" | "adaptive") => Ok(true),
            Some("disabled") => Ok(false),
            _ => Err(ApiError::bad("`thinking.type` must be \"enabled\", \"adaptive\" or \"disabled\"")),
        },
        _ => Err(ApiError::bad("`thinking` must be a bool or {\"type\": \"enabled\" | \"disabled\"}")),
    }
}

/// What `tool_choice` asks. The model cannot be forced to call a tool (that would need
/// constrained decoding), so "required"/"any" and a named tool are served as "auto": the tools
/// are offered and the model decides. "none" leaves the tools out of the prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ToolChoice {
    Auto,
    None,
}

/// A tool's name: non-empty, and without the quote that would end DSML's `name="..."`.
fn check_tool_name(name: Option<&str>, what: &str) -> Result<String, ApiError> {
    match name {
        Some(n) if !n.is_empty() && !n.contains('"') => Ok(n.to_string()),
        Some(_) => Err(ApiError::bad(format!("{what}: a tool name must be non-empty and contain no '\"'"))),
        None => Err(ApiError::bad(format!("{what}: a tool needs a string `name`"))),
    }
}

/// The `tools` array of either API (absent or null: none).
fn tool_list(tools: Option<&Value>) -> Result<&[Value], ApiError> {
    match tools {
        None | Some(Value::Null) => Ok(&[]),
        Some(Value::Array(a)) => Ok(a),
        Some(_) => Err(ApiError::bad("`tools` must be an array")),
    }
}

/// OpenAI `tools`: `[{"type": "function", "function": {"name", "description", "parameters"}}]`;
/// the function objects are what the prompt shows.
fn openai_tools(tools: Option<&Value>) -> Result<Vec<Value>, ApiError> {
    let list = tool_list(tools)?;
    let mut out = Vec::new();
    for (i, t) in list.iter().enumerate() {
        let what = format!("tools[{i}]");
        if t.get("type").and_then(Value::as_str) != Some("function") {
            return Err(ApiError::bad(format!("{what}: only tools of type \"function\" are supported")));
        }
        let f = t
            .get("function")
            .filter(|f| f.is_object())
            .ok_or_else(|| ApiError::bad(format!("{what}: a function tool needs a `function` object")))?;
        check_tool_name(f.get("name").and_then(Value::as_str), &what)?;
        out.push(f.clone());
    }
    Ok(out)
}

fn tool_names(tools: &[Value]) -> Vec<&str> {
    tools.iter().filter_map(|t| t.get("name").and_then(Value::as_str)).collect()
}

/// OpenAI `tool_choice`: "none" | "auto" | "required" | `{"type": "function", "function": {"name"}}`.
fn openai_tool_choice(v: Option<&Value>, tools: &[Value]) -> Result<ToolChoice, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(ToolChoice::Auto),
        Some(Value::String(s)) => match s.as_str() {
            "none" => Ok(ToolChoice::None),
            "auto" | "required" => Ok(ToolChoice::Auto),
            other => Err(ApiError::bad(format!("`tool_choice` \"{other}\" is not one of none, auto, required"))),
        },
        Some(o @ Value::Object(_)) => {
            let name = o.pointer("/function/name").and_then(Value::as_str);
            match name {
                Some(n) if tool_names(tools).contains(&n) => Ok(ToolChoice::Auto),
                Some(n) => Err(ApiError::bad(format!("`tool_choice` names '{n}', which is not in `tools`"))),
                None => Err(ApiError::bad(
                    "`tool_choice` must name a function: {\"type\": \"function\", \"function\": {\"name\": ...}}",
                )),
            }
        }
        Some(_) => Err(ApiError::bad("`tool_choice` must be a string or an object")),
    }
}

/// An assistant message's OpenAI `tool_calls`: `[{"id", "type": "function", "function": {"name",
/// "arguments"}}]`, arguments a JSON text (an object is taken too).
fn openai_tool_calls(v: Option<&Value>, what: &str) -> Result<Vec<ToolCall>, ApiError> {
    let list = match v {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(a)) => a,
        Some(_) => return Err(ApiError::bad(format!("{what}: `tool_calls` must be an array"))),
    };
    let mut out = Vec::new();
    for (i, c) in list.iter().enumerate() {
        let what = format!("{what}.tool_calls[{i}]");
        let id =
            c.get("id").and_then(Value::as_str).ok_or_else(|| ApiError::bad(format!("{what}: needs a string `id`")))?;
        let name = check_tool_name(c.pointer("/function/name").and_then(Value::as_str), &what)?;
        let arguments = match c.pointer("/function/arguments") {
            Some(Value::String(s)) => s.clone(),
            Some(o @ Value::Object(_)) => chat::python_json(o),
            None | Some(Value::Null) => "{}".to_string(),
            Some(_) => return Err(ApiError::bad(format!("{what}: `function.arguments` must be a JSON text"))),
        };
        out.push(ToolCall { id: id.to_string(), name, arguments });
    }
    Ok(out)
}

/// A tool result must answer a call of the assistant turn before it.
fn check_result_id(c: &Conversation, id: &str, what: &str) -> Result<(), ApiError> {
    if c.last_call_ids().contains(&id) {
        Ok(())
    } else {
        Err(ApiError::bad(format!("{what}: tool call id '{id}' is not a call of the assistant message before it")))
    }
}

#[allow(clippy::too_many_arguments)]
fn gen_params(
    max_tokens: Option<u64>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<u64>,
    min_p: Option<f32>,
    seed: Option<u64>,
) -> Result<GenParams, ApiError> {
    if max_tokens == Some(0) {
        return Err(ApiError::bad("`max_tokens` must be at least 1"));
    }
    let sampler = SamplerConfig {
        temperature: temperature.unwrap_or(DEFAULT_TEMPERATURE),
        top_k: top_k.unwrap_or(0).try_into().unwrap_or(usize::MAX),
        top_p: top_p.unwrap_or(1.0),
        min_p: min_p.unwrap_or(DEFAULT_MIN_P),
        seed: seed.unwrap_or(DEFAULT_SEED),
    };
    sampler.validate().map_err(|e| ApiError::bad(e.to_string()))?;
    Ok(GenParams {
        sampler,
        // No limit given: up to the end of the context.
        max_tokens: max_tokens.map_or(usize::MAX, |n| n.try_into().unwrap_or(usize::MAX)),
        ignore_eos: false,
        logits: false,
    })
}

fn parse_json<T: for<'de> Deserialize<'de>>(body: Result<Bytes, BytesRejection>) -> Result<T, ApiError> {
    let body = body.map_err(|e| match e.status() {
        StatusCode::PAYLOAD_TOO_LARGE => ApiError {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            msg: format!("the request body is larger than the limit of {} MiB", BODY_LIMIT >> 20),
        },
        status => ApiError { status, msg: e.body_text() },
    })?;
    serde_json::from_slice(&body).map_err(|e| ApiError::bad(format!("the body is not a valid request: {e}")))
}

#[derive(Deserialize)]
struct ChatRequest {
    model: String,
    messages: Vec<ChatMessage>,
    #[serde(default)]
    stream: bool,
    max_tokens: Option<u64>,
    max_completion_tokens: Option<u64>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<u64>,
    min_p: Option<f32>,
    seed: Option<u64>,
    stop: Option<Value>,
    n: Option<u64>,
    /// Thinking on or off: a bool or `{"type": "enabled" | "disabled"}`; `enable_thinking` too.
    thinking: Option<Value>,
    enable_thinking: Option<bool>,
    tools: Option<Value>,
    tool_choice: Option<Value>,
}

#[derive(Deserialize)]
struct ChatMessage {
    role: String,
    #[serde(default)]
    content: Value,
    /// OpenAI: an assistant's calls, and the call a tool message answers.
    tool_calls: Option<Value>,
    tool_call_id: Option<String>,
    /// DeepSeek's API: an assistant turn's reasoning, sent back in tool-call conversations.
    reasoning_content: Option<String>,
}

fn parse_chat(r: ChatRequest) -> Result<Parsed, ApiError> {
    check_model(&r.model)?;
    if r.n.is_some_and(|n| n != 1) {
        return Err(ApiError::bad("only `n` = 1 is supported"));
    }
    let mut tools = openai_tools(r.tools.as_ref())?;
    if openai_tool_choice(r.tool_choice.as_ref(), &tools)? == ToolChoice::None {
        tools.clear();
    }
    let mut system = Vec::new();
    let mut c = Conversation { tools, ..Conversation::default() };
    for (i, m) in r.messages.iter().enumerate() {
        let what = format!("messages[{i}]");
        match m.role.as_str() {
            "system" | "developer" => system.push(content_text(&m.content, &what)?),
            "user" => c.push_user(UserPart::Text(content_text(&m.content, &what)?)),
            "assistant" => {
                let content = content_text(&m.content, &what)?;
                let calls = openai_tool_calls(m.tool_calls.as_ref(), &what)?;
                c.push_assistant(m.reasoning_content.clone().unwrap_or_default(), content, calls);
            }
            "tool" => {
                let id = m
                    .tool_call_id
                    .as_deref()
                    .ok_or_else(|| ApiError::bad(format!("{what}: a tool message needs `tool_call_id`")))?;
                check_result_id(&c, id, &what)?;
                let content = tool_result_text(&m.content, &what)?;
                c.push_user(UserPart::ToolResult { call_id: id.to_string(), content });
            }
            other => return Err(ApiError::bad(format!("{what}: role '{other}' is not supported"))),
        }
    }
    c.system = system.join("\n\n");
    let think = match (&r.thinking, r.enable_thinking) {
        (Some(v), _) => parse_thinking(v)?,
        (None, Some(b)) => b,
        (None, None) => true,
    };
    check_ends_with_user(&c)?;
    Ok(Parsed {
        conversation: c,
        think: if think { ThinkMode::Think } else { ThinkMode::NoThink },
        params: gen_params(r.max_completion_tokens.or(r.max_tokens), r.temperature, r.top_p, r.top_k, r.min_p, r.seed)?,
        stops: parse_stops(r.stop.as_ref(), "stop")?,
        stream: r.stream,
    })
}

fn check_ends_with_user(c: &Conversation) -> Result<(), ApiError> {
    match c.messages.last() {
        Some(Message::User(_)) => Ok(()),
        Some(_) => Err(ApiError::bad(
            "the last message must be the user's or a tool result (continuing an assistant message is not supported)",
        )),
        None => Err(ApiError::bad("`messages` needs at least one user message")),
    }
}

#[derive(Deserialize)]
struct MessagesRequest {
    model: String,
    /// Required by /v1/messages, not by count_tokens.
    max_tokens: Option<u64>,
    messages: Vec<ChatMessage>,
    system: Option<Value>,
    #[serde(default)]
    stream: bool,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<u64>,
    min_p: Option<f32>,
    seed: Option<u64>,
    stop_sequences: Option<Value>,
    thinking: Option<Value>,
    tools: Option<Value>,
    tool_choice: Option<Value>,
}

/// Anthropic `tools`: `[{"name", "description", "input_schema"}]` (client tools; `type`
/// "custom" or absent), shown to the model as functions with `parameters`.
fn anthropic_tools(tools: Option<&Value>) -> Result<Vec<Value>, ApiError> {
    let list = tool_list(tools)?;
    let mut out = Vec::new();
    for (i, t) in list.iter().enumerate() {
        let what = format!("tools[{i}]");
        match t.get("type").and_then(Value::as_str) {
            None | Some("custom") => {}
            Some(other) => {
                return Err(ApiError::bad(format!(
                    "{what}: tool type '{other}' is not supported (only client tools with an `input_schema`)"
                )))
            }
        }
        let name = check_tool_name(t.get("name").and_then(Value::as_str), &what)?;
        let schema = t
            .get("input_schema")
            .filter(|s| s.is_object())
            .ok_or_else(|| ApiError::bad(format!("{what}: a tool needs an `input_schema` object")))?;
        let mut f = serde_json::Map::new();
        f.insert("name".into(), json!(name));
        if let Some(d) = t.get("description").filter(|d| !d.is_null()) {
            f.insert("description".into(), d.clone());
        }
        f.insert("parameters".into(), schema.clone());
        out.push(Value::Object(f));
    }
    Ok(out)
}

/// Anthropic `tool_choice`: `{"type": "auto" | "any" | "tool" | "none", "name"}`.
fn anthropic_tool_choice(v: Option<&Value>, tools: &[Value]) -> Result<ToolChoice, ApiError> {
    let Some(v) = v.filter(|v| !v.is_null()) else { return Ok(ToolChoice::Auto) };
    match v.get("type").and_then(Value::as_str) {
        Some("none") => Ok(ToolChoice::None),
        Some("auto" | "any") => Ok(ToolChoice::Auto),
        Some("tool") => match v.get("name").and_then(Value::as_str) {
            Some(n) if tool_names(tools).contains(&n) => Ok(ToolChoice::Auto),
            Some(n) => Err(ApiError::bad(format!("`tool_choice` names '{n}', which is not in `tools`"))),
            None => Err(ApiError::bad("`tool_choice` of type \"tool\" needs a `name`")),
        },
        _ => Err(ApiError::bad("`tool_choice.type` must be one of auto, any, tool, none")),
    }
}

/// One Anthropic message into the conversation: user text and `tool_result` blocks; assistant
/// text, `thinking` and `tool_use` blocks.
fn anthropic_message(c: &mut Conversation, m: &ChatMessage, what: &str) -> Result<(), ApiError> {
    let blocks = match &m.content {
        Value::Array(a) => a.clone(),
        other => vec![json!({"type": "text", "text": content_text(other, what)?})],
    };
    match m.role.as_str() {
        "user" => {
            for b in &blocks {
                match part_type(b, what)? {
                    "text" => c.push_user(UserPart::Text(part_text(b, what)?.to_string())),
                    "tool_result" => {
                        let id = b.get("tool_use_id").and_then(Value::as_str).ok_or_else(|| {
                            ApiError::bad(format!("{what}: a tool_result needs a string `tool_use_id`"))
                        })?;
                        check_result_id(c, id, what)?;
                        let content = tool_result_text(b.get("content").unwrap_or(&Value::Null), what)?;
                        c.push_user(UserPart::ToolResult { call_id: id.to_string(), content });
                    }
                    other => return Err(ApiError::bad(format!("{what}: content of type '{other}' is not supported"))),
                }
            }
        }
        "assistant" => {
            let (mut reasoning, mut content, mut calls) = (String::new(), String::new(), Vec::new());
            for b in &blocks {
                match part_type(b, what)? {
                    "text" => content.push_str(part_text(b, what)?),
                    "thinking" => reasoning.push_str(b.get("thinking").and_then(Value::as_str).unwrap_or("")),
                    "redacted_thinking" => {}
                    "tool_use" => {
                        let id = b
                            .get("id")
                            .and_then(Value::as_str)
                            .ok_or_else(|| ApiError::bad(format!("{what}: a tool_use block needs a string `id`")))?;
                        let name = check_tool_name(b.get("name").and_then(Value::as_str), what)?;
                        let input = b.get("input").cloned().unwrap_or(json!({}));
                        calls.push(ToolCall { id: id.to_string(), name, arguments: chat::python_json(&input) });
                    }
                    other => return Err(ApiError::bad(format!("{what}: content of type '{other}' is not supported"))),
                }
            }
            c.push_assistant(reasoning, content, calls);
        }
        other => return Err(ApiError::bad(format!("{what}: role '{other}' is not supported (user or assistant)"))),
    }
    Ok(())
}

/// The conversation and thinking mode of an Anthropic request (also what count_tokens counts).
fn anthropic_conversation(r: &MessagesRequest) -> Result<(Conversation, ThinkMode), ApiError> {
    check_model(&r.model)?;
    let mut tools = anthropic_tools(r.tools.as_ref())?;
    if anthropic_tool_choice(r.tool_choice.as_ref(), &tools)? == ToolChoice::None {
        tools.clear();
    }
    let system = match &r.system {
        Some(v) => content_text(v, "system")?,
        None => String::new(),
    };
    let mut c = Conversation { system, tools, messages: Vec::new() };
    for (i, m) in r.messages.iter().enumerate() {
        anthropic_message(&mut c, m, &format!("messages[{i}]"))?;
    }
    // Anthropic's default: no thinking unless asked for.
    let think = match &r.thinking {
        Some(v) => parse_thinking(v)?,
        None => false,
    };
    Ok((c, if think { ThinkMode::Think } else { ThinkMode::NoThink }))
}

fn parse_messages(r: MessagesRequest) -> Result<Parsed, ApiError> {
    let (conversation, think) = anthropic_conversation(&r)?;
    let max_tokens = r.max_tokens.ok_or_else(|| ApiError::bad("`max_tokens` is required"))?;
    check_ends_with_user(&conversation)?;
    Ok(Parsed {
        conversation,
        think,
        params: gen_params(Some(max_tokens), r.temperature, r.top_p, r.top_k, r.min_p, r.seed)?,
        stops: parse_stops(r.stop_sequences.as_ref(), "stop_sequences")?,
        stream: r.stream,
    })
}

// ---------------------------------------------------------------------------------------------
// Generation, shared by both APIs

/// Splits the token stream into reasoning, answer text and tool calls, and cuts the answer at a
/// stop string. Answer text that could be the start of a stop string or of a tool-call block is
/// held back until it is not.
struct Assembler {
    ids: Ids,
    /// Inside `<think>`: tokens are reasoning until `</think>`.
    thinking: bool,
    stops: Vec<String>,
    /// Tools were offered: a tool-call block in the answer is read as calls.
    tools: bool,
    /// The answer text (up to a tool-call block).
    content: String,
    /// Bytes of `content` already handed out.
    emitted: usize,
    reasoning: String,
    stop_hit: Option<String>,
    /// The tool-call block's text from its start tag, once one began, and the whitespace before
    /// it (not part of the answer text).
    block: Option<(String, String)>,
    calls: Vec<ParsedCall>,
    /// The block's closing tag was read: the answer is complete.
    block_done: bool,
}

/// A piece of output.
#[derive(Debug, Clone, PartialEq)]
enum Piece {
    Reasoning(String),
    Content(String),
    /// The `n`th tool call of the answer, complete.
    ToolCall(usize, ParsedCall),
}

impl Assembler {
    fn new(ids: Ids, think: ThinkMode, stops: Vec<String>, tools: bool) -> Assembler {
        Assembler {
            ids,
            thinking: think == ThinkMode::Think,
            stops,
            tools,
            content: String::new(),
            emitted: 0,
            reasoning: String::new(),
            stop_hit: None,
            block: None,
            calls: Vec::new(),
            block_done: false,
        }
    }

    /// The handler has the whole answer: a stop string or the end of the tool calls was read.
    fn complete(&self) -> bool {
        self.stop_hit.is_some() || self.block_done
    }

    fn push(&mut self, id: u32, text: &str) -> Vec<Piece> {
        if self.complete() || id == self.ids.eos {
            return Vec::new();
        }
        if self.thinking {
            if id == self.ids.think_end {
                self.thinking = false;
                return Vec::new();
            }
            if id == self.ids.think || text.is_empty() {
                return Vec::new();
            }
            self.reasoning.push_str(text);
            return vec![Piece::Reasoning(text.to_string())];
        }
        if let Some((block, _)) = &mut self.block {
            block.push_str(text);
            // Only a tag's closing '>' can complete a call or the block (or break the format).
            return if text.contains('>') { self.read_block(false) } else { Vec::new() };
        }
        self.content.push_str(text);
        self.release(false)
    }

    /// Everything still held, at the end of the generation.
    fn finish(&mut self) -> Vec<Piece> {
        let mut out = Vec::new();
        if self.block.is_some() && !self.block_done {
            out = self.read_block(true);
        }
        out.extend(self.release(true));
        out
    }

    /// Hands out the answer text that is safe to show; `end`: all of it.
    fn release(&mut self, end: bool) -> Vec<Piece> {
        if self.complete() && self.emitted == self.content.len() {
            return Vec::new();
        }
        // A stop string or a block may start in text already held back, never in text handed out.
        let from = self.emitted;
        let stop = self
            .stops
            .iter()
            .filter_map(|s| self.content[from..].find(s.as_str()).map(|at| (from + at, s.clone())))
            .min_by_key(|(at, _)| *at);
        let block_at =
            if self.tools { self.content[from..].find(chat::TOOL_CALLS_START).map(|at| from + at) } else { None };
        let mut block_began = false;
        let upto = match (stop, block_at) {
            (Some((at, s)), b) if b.is_none_or(|b| at < b) => {
                self.stop_hit = Some(s);
                self.content.truncate(at);
                at
            }
            (_, Some(at)) => {
                // The blank line before the block is the template's (DeepSeek's renderer writes
                // answer text + "\n\n" + block), not the answer's: a call sent back renders the same.
                let blank = if self.content[..at].ends_with("\n\n") { 2 } else { 0 };
                let text_end = (at - blank).max(from);
                let gap = self.content[text_end..at].to_string();
                self.block = Some((self.content[at..].to_string(), gap));
                self.content.truncate(text_end);
                block_began = true;
                text_end
            }
            _ if end => self.content.len(),
            _ => self.content.len() - self.held_back(from),
        };
        let mut out = Vec::new();
        if upto > self.emitted {
            out.push(Piece::Content(self.content[self.emitted..upto].to_string()));
            self.emitted = upto;
        }
        if block_began {
            out.extend(self.read_block(end));
        }
        out
    }

    /// How many bytes at the end of `content[from..]` might begin a stop string or a block.
    fn held_back(&self, from: usize) -> usize {
        let tail = &self.content[from..];
        // The longest tail that is a proper prefix of `s`.
        let prefix_of = |s: &str| {
            (1..s.len()).rev().filter(|&n| s.is_char_boundary(n)).find(|&n| tail.ends_with(&s[..n])).unwrap_or(0)
        };
        let stops = self.stops.iter().map(|s| prefix_of(s)).max().unwrap_or(0);
        if !self.tools {
            return stops;
        }
        // A block start, and the whitespace that may come before it.
        let mark = prefix_of(chat::TOOL_CALLS_START);
        let before = &tail[..tail.len() - mark];
        let ws = before.len() - before.trim_end().len();
        stops.max(mark + ws)
    }

    /// Reads the tool-call block so far: new complete calls come out. A block that breaks the
    /// format (or is cut short at `end`) is not calls: the rest of it is answer text.
    fn read_block(&mut self, end: bool) -> Vec<Piece> {
        let Some((block, gap)) = &self.block else { return Vec::new() };
        let parsed = chat::parse_tool_calls(block);
        let mut out = Vec::new();
        for call in &parsed.calls[self.calls.len()..] {
            out.push(Piece::ToolCall(self.calls.len(), call.clone()));
            self.calls.push(call.clone());
        }
        match parsed.state {
            BlockState::Complete => self.block_done = true,
            BlockState::Partial if !end => {}
            BlockState::Partial | BlockState::Malformed(_) => {
                let rest = &block[parsed.consumed..];
                let text = if parsed.calls.is_empty() { format!("{gap}{rest}") } else { rest.to_string() };
                self.block = None;
                self.tools = false;
                self.content.push_str(&text);
                out.extend(self.release(end));
            }
        }
        out
    }
}

/// How a generation ended.
struct Outcome {
    completion_tokens: usize,
    /// None: it failed with `error`, or the client left.
    stop: Option<StopReason>,
    error: Option<ApiError>,
}

/// Reads the worker's tokens, hands each piece to `emit` (false: the client is gone) and says how
/// it ended; `gone` resolves when the client is gone. Returning drops `rx`; the caller's `watch`
/// tells the worker to stop, at the next token.
async fn drive(
    mut rx: mpsc::UnboundedReceiver<Out>,
    asm: &mut Assembler,
    watch: &mut Watch,
    gone: impl Future<Output = ()>,
    mut emit: impl FnMut(Piece) -> bool,
) -> Outcome {
    let mut out = Outcome { completion_tokens: 0, stop: None, error: None };
    tokio::pin!(gone);
    loop {
        let msg = tokio::select! {
            biased;
            () = &mut gone => return out,
            msg = rx.recv() => msg,
        };
        match msg {
            Some(Out::Token { id, text }) => {
                out.completion_tokens += 1;
                for p in asm.push(id, &text) {
                    if !emit(p) {
                        return out;
                    }
                }
                if asm.complete() {
                    watch.stop();
                    out.stop = Some(StopReason::Eos);
                    return out;
                }
            }
            Some(Out::Done { stop, tail }) => {
                watch.finished();
                let mut pieces = if tail.is_empty() { Vec::new() } else { asm.push(u32::MAX, &tail) };
                pieces.extend(asm.finish());
                for p in pieces {
                    if !emit(p) {
                        return out;
                    }
                }
                out.stop = Some(if asm.complete() { StopReason::Eos } else { stop });
                return out;
            }
            Some(Out::Error(e)) => {
                watch.finished();
                out.error = Some(e);
                return out;
            }
            Some(Out::Start { .. }) | None => {
                watch.finished();
                out.error = Some(ApiError {
                    status: StatusCode::INTERNAL_SERVER_ERROR,
                    msg: "the engine stopped answering".into(),
                });
                return out;
            }
        }
    }
}

/// A queued request: its token receiver, its watch, its number, its prompt size and the reused
/// prefix.
struct Submitted {
    rx: mpsc::UnboundedReceiver<Out>,
    watch: Watch,
    n: u64,
    prompt_tokens: usize,
    reused: usize,
}

/// Renders a request's prompt, queues it and waits for the worker to take it.
async fn submit(st: &AppState, p: &Parsed, path: &'static str) -> Result<Submitted, ApiError> {
    let prompt = chat::render(&st.tok, &p.conversation, p.think);
    let (tx, mut rx) = mpsc::unbounded_channel();
    let n = st.next_id.fetch_add(1, Ordering::Relaxed);
    let client = Arc::new(Client::default());
    let job = Job { id: n, prompt, params: p.params, arrived: Instant::now(), path, tx, client: client.clone() };
    let mut watch = Watch { client, done: false };
    let gone = || ApiError { status: StatusCode::SERVICE_UNAVAILABLE, msg: "the engine is not running".into() };
    st.jobs.send(job).map_err(|_| gone())?;
    match rx.recv().await {
        Some(Out::Start { prompt_tokens, reused }) => Ok(Submitted { rx, watch, n, prompt_tokens, reused }),
        Some(Out::Error(e)) => {
            watch.finished();
            Err(e)
        }
        _ => {
            watch.finished();
            Err(gone())
        }
    }
}

fn now_secs() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

fn sse_stream(rx: mpsc::UnboundedReceiver<Result<SseEvent, Infallible>>) -> Response {
    Sse::new(UnboundedReceiverStream::new(rx)).keep_alive(KeepAlive::default()).into_response()
}

// ---------------------------------------------------------------------------------------------
// OpenAI: /v1/chat/completions

fn openai_usage(prompt: usize, reused: usize, completion: usize) -> Value {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": reused},
    })
}

fn openai_finish(stop: StopReason, asm: &Assembler) -> &'static str {
    match stop {
        StopReason::Length => "length",
        _ if !asm.calls.is_empty() => "tool_calls",
        _ => "stop",
    }
}

async fn chat_completions(State(st): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    match chat_inner(st, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(Api::OpenAi),
    }
}

async fn chat_inner(st: Arc<AppState>, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let p = parse_chat(parse_json(body)?)?;
    let Submitted { rx, mut watch, n, prompt_tokens, reused } = submit(&st, &p, "/v1/chat/completions").await?;
    let mut asm = Assembler::new(st.ids, p.think, p.stops.clone(), p.tools());
    let id = format!("chatcmpl-{n}");
    let call_id = move |i: usize| format!("call_{:x}_{n}_{i}", st.boot);
    let created = now_secs();
    if !p.stream {
        let out = drive(rx, &mut asm, &mut watch, std::future::pending(), |_| true).await;
        if let Some(e) = out.error {
            return Err(e);
        }
        let stop = out.stop.unwrap_or(StopReason::Eos);
        let content = if asm.content.is_empty() && !asm.calls.is_empty() { Value::Null } else { json!(asm.content) };
        let mut message = json!({"role": "assistant", "content": content});
        if p.think == ThinkMode::Think {
            message["reasoning_content"] = json!(asm.reasoning);
        }
        if !asm.calls.is_empty() {
            let calls: Vec<Value> = asm
                .calls
                .iter()
                .enumerate()
                .map(|(i, c)| json!({"id": call_id(i), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}))
                .collect();
            message["tool_calls"] = json!(calls);
        }
        return Ok(Json(json!({
            "id": id,
            "object": "chat.completion",
            "created": created,
            "model": MODEL_ID,
            "choices": [{"index": 0, "message": message, "finish_reason": openai_finish(stop, &asm)}],
            "usage": openai_usage(prompt_tokens, reused, out.completion_tokens),
        }))
        .into_response());
    }
    let (tx, events) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        let chunk = |delta: Value, finish: Value| {
            json!({
                "id": id, "object": "chat.completion.chunk", "created": created, "model": MODEL_ID,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            })
        };
        let send = |v: Value| tx.send(Ok(SseEvent::default().data(v.to_string()))).is_ok();
        if !send(chunk(json!({"role": "assistant", "content": ""}), Value::Null)) {
            return;
        }
        let out = drive(rx, &mut asm, &mut watch, tx.closed(), |piece| match piece {
            Piece::Reasoning(t) => send(chunk(json!({"reasoning_content": t}), Value::Null)),
            Piece::Content(t) => send(chunk(json!({"content": t}), Value::Null)),
            // A call comes whole: its id and name first, then its arguments.
            Piece::ToolCall(i, c) => {
                let head = json!({"tool_calls": [{"index": i, "id": call_id(i), "type": "function",
                                                  "function": {"name": c.name, "arguments": ""}}]});
                let args = json!({"tool_calls": [{"index": i, "function": {"arguments": c.arguments}}]});
                send(chunk(head, Value::Null)) && send(chunk(args, Value::Null))
            }
        })
        .await;
        if let Some(e) = out.error {
            let _ = send(json!({"error": {"message": e.msg, "type": "server_error", "param": null, "code": null}}));
        } else if let Some(stop) = out.stop {
            let mut last = chunk(json!({}), json!(openai_finish(stop, &asm)));
            last["usage"] = openai_usage(prompt_tokens, reused, out.completion_tokens);
            let _ = send(last);
        } else {
            return;
        }
        let _ = tx.send(Ok(SseEvent::default().data("[DONE]")));
    });
    Ok(sse_stream(events))
}

// ---------------------------------------------------------------------------------------------
// Anthropic: /v1/messages

fn anthropic_stop(stop: StopReason, asm: &Assembler) -> (&'static str, Value) {
    match (&asm.stop_hit, stop) {
        (Some(s), _) => ("stop_sequence", json!(s)),
        (None, StopReason::Length) => ("max_tokens", Value::Null),
        (None, _) if !asm.calls.is_empty() => ("tool_use", Value::Null),
        (None, _) => ("end_turn", Value::Null),
    }
}

async fn messages(State(st): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    match messages_inner(st, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(Api::Anthropic),
    }
}

/// `/v1/messages/count_tokens`: the prompt tokens the request would take.
async fn count_tokens(State(st): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    let counted = parse_json::<MessagesRequest>(body)
        .and_then(|r| anthropic_conversation(&r))
        .map(|(c, think)| chat::render(&st.tok, &c, think).len());
    match counted {
        Ok(n) => Json(json!({"input_tokens": n})).into_response(),
        Err(e) => e.into_response(Api::Anthropic),
    }
}

async fn messages_inner(st: Arc<AppState>, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let p = parse_messages(parse_json(body)?)?;
    let Submitted { rx, mut watch, n, prompt_tokens, reused } = submit(&st, &p, "/v1/messages").await?;
    let mut asm = Assembler::new(st.ids, p.think, p.stops.clone(), p.tools());
    let id = format!("msg_{n}");
    let call_id = move |i: usize| format!("toolu_{:x}_{n}_{i}", st.boot);
    let usage = move |output: usize| json!({"input_tokens": prompt_tokens - reused, "output_tokens": output, "cache_read_input_tokens": reused, "cache_creation_input_tokens": 0});
    if !p.stream {
        let out = drive(rx, &mut asm, &mut watch, std::future::pending(), |_| true).await;
        if let Some(e) = out.error {
            return Err(e);
        }
        let (reason, seq) = anthropic_stop(out.stop.unwrap_or(StopReason::Eos), &asm);
        let mut content = Vec::new();
        if p.think == ThinkMode::Think {
            content.push(json!({"type": "thinking", "thinking": asm.reasoning, "signature": ""}));
        }
        // Every message has a text block, unless it is only tool calls.
        if !asm.content.is_empty() || asm.calls.is_empty() {
            content.push(json!({"type": "text", "text": asm.content}));
        }
        for (i, c) in asm.calls.iter().enumerate() {
            content.push(json!({"type": "tool_use", "id": call_id(i), "name": c.name, "input": c.input()}));
        }
        return Ok(Json(json!({
            "id": id, "type": "message", "role": "assistant", "model": MODEL_ID,
            "content": content, "stop_reason": reason, "stop_sequence": seq,
            "usage": usage(out.completion_tokens),
        }))
        .into_response());
    }
    let (tx, events) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        let send = |name: &str, v: Value| tx.send(Ok(SseEvent::default().event(name).data(v.to_string()))).is_ok();
        let start = json!({"type": "message_start", "message": {
            "id": id, "type": "message", "role": "assistant", "model": MODEL_ID, "content": [],
            "stop_reason": null, "stop_sequence": null, "usage": usage(0),
        }});
        if !send("message_start", start) {
            return;
        }
        let mut blocks = Blocks { open: None, next: 0 };
        let out = drive(rx, &mut asm, &mut watch, tx.closed(), |piece| {
            let (kind, delta) = match piece {
                Piece::Reasoning(t) => ("thinking", json!({"type": "thinking_delta", "thinking": t})),
                Piece::Content(t) => ("text", json!({"type": "text_delta", "text": t})),
                // A tool_use block comes whole: opened, its input in one delta, closed.
                Piece::ToolCall(i, c) => {
                    if !blocks.close(&send) {
                        return false;
                    }
                    let block = json!({"type": "tool_use", "id": call_id(i), "name": c.name, "input": {}});
                    let Some(b) = blocks.start(block, &send) else { return false };
                    let delta = json!({"type": "input_json_delta", "partial_json": c.arguments});
                    return send(
                        "content_block_delta",
                        json!({"type": "content_block_delta", "index": b, "delta": delta}),
                    ) && send("content_block_stop", json!({"type": "content_block_stop", "index": b}));
                }
            };
            match blocks.switch_to(kind, &send) {
                Some(i) => {
                    send("content_block_delta", json!({"type": "content_block_delta", "index": i, "delta": delta}))
                }
                None => false,
            }
        })
        .await;
        if let Some(e) = out.error {
            let _ =
                send("error", json!({"type": "error", "error": {"type": anthropic_kind(e.status), "message": e.msg}}));
            return;
        }
        let Some(stop) = out.stop else { return };
        // Every message has a text block, unless it is only tool calls.
        if asm.calls.is_empty() && blocks.switch_to("text", &send).is_none() {
            return;
        }
        if !blocks.close(&send) {
            return;
        }
        let (reason, seq) = anthropic_stop(stop, &asm);
        let _ = send(
            "message_delta",
            json!({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq}, "usage": usage(out.completion_tokens)}),
        );
        let _ = send("message_stop", json!({"type": "message_stop"}));
    });
    Ok(sse_stream(events))
}

/// The content blocks of an Anthropic stream: the open one (its index and kind, "thinking" or
/// "text") and the next index.
struct Blocks {
    open: Option<(usize, &'static str)>,
    next: usize,
}

impl Blocks {
    /// Closes the open block; false: the client is gone.
    fn close(&mut self, send: &impl Fn(&str, Value) -> bool) -> bool {
        match self.open.take() {
            Some((i, _)) => send("content_block_stop", json!({"type": "content_block_stop", "index": i})),
            None => true,
        }
    }

    fn start(&mut self, block: Value, send: &impl Fn(&str, Value) -> bool) -> Option<usize> {
        let i = self.next;
        self.next += 1;
        send("content_block_start", json!({"type": "content_block_start", "index": i, "content_block": block}))
            .then_some(i)
    }

    /// The index of an open block of `kind`, opened now if need be.
    fn switch_to(&mut self, kind: &'static str, send: &impl Fn(&str, Value) -> bool) -> Option<usize> {
        if let Some((i, k)) = self.open {
            if k == kind {
                return Some(i);
            }
        }
        if !self.close(send) {
            return None;
        }
        let block = if kind == "thinking" {
            json!({"type": "thinking", "thinking": ""})
        } else {
            json!({"type": "text", "text": ""})
        };
        let i = self.start(block, send)?;
        self.open = Some((i, kind));
        Some(i)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const IDS: Ids = Ids { think: 1, think_end: 2, eos: 3 };
    const TEXT: u32 = 100;
    const CALL: &str = "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n\
        <｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>";

    /// Feeds `chunks` as tokens, then ends: the pieces, and whether the answer was complete
    /// before the end.
    fn feed(asm: &mut Assembler, chunks: &[&str]) -> (Vec<Piece>, bool) {
        let mut out = Vec::new();
        for c in chunks {
            if asm.complete() {
                break;
            }
            out.extend(asm.push(TEXT, c));
        }
        let complete = asm.complete();
        out.extend(asm.finish());
        (out, complete)
    }

    fn content(pieces: &[Piece]) -> String {
        pieces.iter().filter_map(|p| if let Piece::Content(t) = p { Some(t.as_str()) } else { None }).collect()
    }

    fn calls(pieces: &[Piece]) -> Vec<(usize, String, String)> {
        pieces
            .iter()
            .filter_map(|p| {
                if let Piece::ToolCall(i, c) = p {
                    Some((*i, c.name.clone(), c.arguments.clone()))
                } else {
                    None
                }
            })
            .collect()
    }

    /// Every split of `text` into three tokens (at char boundaries).
    fn splits(text: &str) -> Vec<[&str; 3]> {
        let cuts: Vec<usize> = text.char_indices().map(|(i, _)| i).chain([text.len()]).collect();
        let mut out = Vec::new();
        for (n, &a) in cuts.iter().enumerate() {
            for &b in &cuts[n..] {
                out.push([&text[..a], &text[a..b], &text[b..]]);
            }
        }
        out
    }

    #[test]
    fn a_tool_call_after_text_comes_out_as_a_call_however_the_tokens_split() {
        let text = format!("I will check.\n\n{CALL}");
        let want_call = vec![(0, "get_weather".to_string(), r#"{"city": "Paris"}"#.to_string())];
        for chunks in splits(&text) {
            let mut asm = Assembler::new(IDS, ThinkMode::NoThink, Vec::new(), true);
            let (pieces, complete) = feed(&mut asm, &chunks);
            assert_eq!(content(&pieces), "I will check.", "{chunks:?}");
            assert_eq!(calls(&pieces), want_call, "{chunks:?}");
            assert!(complete, "the closing tag completes the answer: {chunks:?}");
            // No markup ever reaches the answer text.
            assert!(!asm.content.contains('｜') && asm.content == "I will check.");
        }
    }

    #[test]
    fn only_the_templates_blank_line_before_a_block_is_dropped() {
        for (text, want) in [("a \n\n", "a "), ("a\n", "a\n"), ("a\n\n\n", "a\n"), ("", "")] {
            let mut asm = Assembler::new(IDS, ThinkMode::NoThink, Vec::new(), true);
            let (pieces, complete) = feed(&mut asm, &[text, CALL]);
            assert!(complete);
            assert_eq!(content(&pieces), want, "{text:?}");
        }
    }

    #[test]
    fn without_tools_the_markup_is_plain_text() {
        let text = format!("I will check.\n\n{CALL}");
        let mut asm = Assembler::new(IDS, ThinkMode::NoThink, Vec::new(), false);
        let (pieces, _) = feed(&mut asm, &[&text[..20], &text[20..]]);
        assert_eq!(content(&pieces), text);
        assert!(calls(&pieces).is_empty());
    }

    #[test]
    fn text_that_only_looked_like_a_block_start_is_released() {
        for text in ["Done.\n\n", "a <｜DSML｜tool", "x\n<｜DSML｜other> y"] {
            for chunks in splits(text) {
                let mut asm = Assembler::new(IDS, ThinkMode::NoThink, Vec::new(), true);
                let (pieces, complete) = feed(&mut asm, &chunks);
                assert_eq!(content(&pieces), text, "{chunks:?}");
                assert!(calls(&pieces).is_empty() && !complete);
            }
        }
    }

    #[test]
    fn a_malformed_or_cut_block_is_answer_text() {
        // Broken: no call, all of it (the blank line too) is text.
        let broken = "Hm.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\nnonsense";
        let mut asm = Assembler::new(IDS, ThinkMode::NoThink, Vec::new(), true);
        let (pieces, _) = feed(&mut asm, &[broken]);
        assert_eq!(content(&pieces), broken);
        assert!(calls(&pieces).is_empty());
        // Cut short after one complete call: the call, then the rest as text.
        let second = "<｜DSML｜invoke name=\"g\">\n<｜DSML｜param";
        let cut = CALL.replace("</｜DSML｜tool_calls>", second);
        let mut asm = Assembler::new(IDS, ThinkMode::NoThink, Vec::new(), true);
        let (pieces, complete) = feed(&mut asm, &[&cut]);
        assert!(!complete);
        assert_eq!(calls(&pieces).len(), 1);
        assert_eq!(content(&pieces), format!("\n{second}"));
    }

    #[test]
    fn stop_strings_and_blocks_whichever_comes_first() {
        let text = format!("Look: {CALL}");
        // A stop string before the block: no call.
        let mut asm = Assembler::new(IDS, ThinkMode::NoThink, vec!["Look".into()], true);
        let (pieces, complete) = feed(&mut asm, &[&text]);
        assert!(complete && calls(&pieces).is_empty() && content(&pieces).is_empty());
        assert_eq!(asm.stop_hit.as_deref(), Some("Look"));
        // A stop string inside the block does not cut it.
        let mut asm = Assembler::new(IDS, ThinkMode::NoThink, vec!["Paris".into()], true);
        let (pieces, complete) = feed(&mut asm, &[&text]);
        assert!(complete && asm.stop_hit.is_none());
        assert_eq!(content(&pieces), "Look: ");
        assert_eq!(calls(&pieces).len(), 1);
    }

    #[test]
    fn reasoning_then_a_call() {
        let mut asm = Assembler::new(IDS, ThinkMode::Think, Vec::new(), true);
        let mut pieces = asm.push(TEXT, "Need weather.");
        pieces.extend(asm.push(IDS.think_end, ""));
        pieces.extend(asm.push(TEXT, &format!("\n\n{CALL}")));
        assert!(asm.complete());
        // The end-of-sentence token after the block adds nothing.
        assert!(asm.push(IDS.eos, "").is_empty());
        assert_eq!(pieces[0], Piece::Reasoning("Need weather.".into()));
        assert_eq!(content(&pieces), "");
        assert_eq!(calls(&pieces).len(), 1);
    }
}
