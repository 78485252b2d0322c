//! `ds4 serve`: an OpenAI- and Anthropic-compatible HTTP server over one [`Engine`].
//!
//! One worker thread owns the engine (one session: the weights are uploaded once per process)
//! and takes jobs from a queue in arrival order, one sequence at a time. HTTP handlers parse and
//! check a request, queue it, and turn the worker's token events into a JSON body or server-sent
//! events. A handler that stops listening (a client gone, a stop string found) drops its
//! receiver; the worker's next send fails and it stops generating within one token.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
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

use ds4::engine::{Engine, EngineError, Event, GenParams, StopReason};
use ds4::sample::SamplerConfig;
use ds4::tokenizer::{Role, ThinkMode};

/// The model id clients name in `model`.
pub const MODEL_ID: &str = "ds4";
/// Largest request body accepted.
const BODY_LIMIT: usize = 8 << 20;

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
    system: String,
    turns: Vec<(Role, String)>,
    think: ThinkMode,
    params: GenParams,
    arrived: Instant,
    path: &'static str,
    tx: mpsc::UnboundedSender<Out>,
}

/// What the worker reports for a job, in order: `Start`, then `Token`s, then `Done`; or `Error`.
enum Out {
    Start { prompt_tokens: usize, reused: usize },
    Token { id: u32, text: String },
    Done { stop: StopReason, tail: String },
    Error(ApiError),
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
}

/// Starts the worker (which calls `make_engine` on its own thread: a session stays on the thread
/// that made it), binds `host:port`, prints the URL and serves until interrupted.
pub fn run(make_engine: Box<dyn FnOnce() -> Result<Engine> + Send>, host: &str, port: u16) -> Result<()> {
    // Bound before the model loads, so a taken port fails at once.
    let listener = std::net::TcpListener::bind((host, port))
        .with_context(|| format!("--host {host} --port {port}: cannot listen there"))?;
    listener.set_nonblocking(true)?;
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<Ids>>();
    let (jobs_tx, jobs_rx) = mpsc::unbounded_channel::<Job>();
    std::thread::Builder::new()
        .name("ds4-engine".into())
        .spawn(move || match make_engine() {
            Ok(engine) => {
                let s = *engine.tokenizer().specials();
                let _ = ready_tx.send(Ok(Ids { think: s.think, think_end: s.think_end, eos: s.eos }));
                worker(engine, jobs_rx);
            }
            Err(e) => {
                let _ = ready_tx.send(Err(e));
            }
        })
        .context("cannot start the engine thread")?;
    let ids = ready_rx.recv().context("the engine thread ended while loading")??;

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
        let state = Arc::new(AppState { jobs: jobs_tx, next_id: AtomicU64::new(1), ids });
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
        let turns: Vec<(Role, &str)> = job.turns.iter().map(|(r, t)| (*r, t.as_str())).collect();
        let prompt = engine.tokenizer().render_conversation(&job.system, &turns, job.think);
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
        if job.tx.send(Out::Start { prompt_tokens: prompt.len(), reused }).is_err() {
            eprintln!("ds4 serve: #{} {}: the client left while queued", job.id, job.path);
            continue;
        }
        let mut first_token = None;
        let r = engine.generate(&prompt, &job.params, |ev| match ev {
            Event::Token { id, text } => {
                first_token.get_or_insert_with(|| job.arrived.elapsed());
                job.tx.send(Out::Token { id, text: text.to_string() }).is_ok()
            }
            _ => true,
        });
        match r {
            Ok(stats) => {
                let left = stats.stop == StopReason::Callback;
                let _ = job.tx.send(Out::Done { stop: stats.stop, tail: stats.tail });
                eprintln!(
                    "ds4 serve: #{} {}: prompt {} tokens (reused {}, prefilled {}), generated {}, first token after {:.3} s, {} in {:.3} s{}",
                    job.id,
                    job.path,
                    stats.prompt_tokens,
                    stats.reused,
                    stats.prefilled,
                    stats.generated,
                    first_token.map_or(0.0, |d| d.as_secs_f64()),
                    match stats.stop {
                        StopReason::Eos => "end of sentence",
                        StopReason::Length => "length",
                        StopReason::Callback => "stopped by the handler",
                    },
                    job.arrived.elapsed().as_secs_f64(),
                    if left { " (stop string or client gone)" } else { "" }
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
    system: String,
    turns: Vec<(Role, String)>,
    think: ThinkMode,
    params: GenParams,
    stops: Vec<String>,
    stream: bool,
}

/// Text of a message `content`: a string, or an array of `{"type": "text", "text": ...}` parts.
/// Other parts (images, tool calls) are refused: this server does not support them yet.
fn content_text(content: &Value, what: &str) -> Result<String, ApiError> {
    match content {
        Value::String(s) => Ok(s.clone()),
        Value::Null => Ok(String::new()),
        Value::Array(parts) => {
            let mut out = String::new();
            for p in parts {
                match p.get("type").and_then(Value::as_str) {
                    Some("text") => match p.get("text").and_then(Value::as_str) {
                        Some(t) => out.push_str(t),
                        None => return Err(ApiError::bad(format!("{what}: a text part needs a string `text`"))),
                    },
                    // Earlier reasoning is not part of the template (see render_conversation).
                    Some("thinking" | "redacted_thinking") => {}
                    Some(other) => {
                        return Err(ApiError::bad(format!("{what}: content of type '{other}' is not supported")))
                    }
                    None => return Err(ApiError::bad(format!("{what}: each content part needs a `type`"))),
                }
            }
            Ok(out)
        }
        _ => Err(ApiError::bad(format!("{what}: `content` must be a string or an array of parts"))),
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

/// `thinking`: a bool, or `{"type": "enabled" | "disabled"}` (DeepSeek's and Anthropic's form).
fn parse_thinking(v: &Value) -> Result<bool, ApiError> {
    match v {
        Value::Bool(b) => Ok(*b),
        Value::Object(o) => match o.get("type").and_then(Value::as_str) {
            Some("enabled") => Ok(true),
            Some("disabled") => Ok(false),
            _ => Err(ApiError::bad("`thinking.type` must be \"enabled\" or \"disabled\"")),
        },
        _ => Err(ApiError::bad("`thinking` must be a bool or {\"type\": \"enabled\" | \"disabled\"}")),
    }
}

fn refuse_tools(tools: &Option<Value>) -> Result<(), ApiError> {
    match tools {
        Some(Value::Array(a)) if !a.is_empty() => Err(ApiError::bad("tools are not supported by this server yet")),
        _ => Ok(()),
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
}

#[derive(Deserialize)]
struct ChatMessage {
    role: String,
    #[serde(default)]
    content: Value,
}

fn parse_chat(r: ChatRequest) -> Result<Parsed, ApiError> {
    check_model(&r.model)?;
    refuse_tools(&r.tools)?;
    if r.n.is_some_and(|n| n != 1) {
        return Err(ApiError::bad("only `n` = 1 is supported"));
    }
    let mut system = Vec::new();
    let mut turns = Vec::new();
    for (i, m) in r.messages.iter().enumerate() {
        let what = format!("messages[{i}]");
        let text = content_text(&m.content, &what)?;
        match m.role.as_str() {
            "system" | "developer" => system.push(text),
            "user" => turns.push((Role::User, text)),
            "assistant" => turns.push((Role::Assistant, text)),
            other => return Err(ApiError::bad(format!("{what}: role '{other}' is not supported"))),
        }
    }
    let think = match (&r.thinking, r.enable_thinking) {
        (Some(v), _) => parse_thinking(v)?,
        (None, Some(b)) => b,
        (None, None) => true,
    };
    Ok(Parsed {
        system: system.join("\n\n"),
        turns: check_turns(turns)?,
        think: if think { ThinkMode::Think } else { ThinkMode::NoThink },
        params: gen_params(r.max_completion_tokens.or(r.max_tokens), r.temperature, r.top_p, r.top_k, r.min_p, r.seed)?,
        stops: parse_stops(r.stop.as_ref(), "stop")?,
        stream: r.stream,
    })
}

fn check_turns(turns: Vec<(Role, String)>) -> Result<Vec<(Role, String)>, ApiError> {
    match turns.last() {
        Some((Role::User, _)) => Ok(turns),
        Some(_) => {
            Err(ApiError::bad("the last message must be the user's (continuing an assistant message is not supported)"))
        }
        None => Err(ApiError::bad("`messages` needs at least one user message")),
    }
}

#[derive(Deserialize)]
struct MessagesRequest {
    model: String,
    max_tokens: u64,
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
}

fn parse_messages(r: MessagesRequest) -> Result<Parsed, ApiError> {
    check_model(&r.model)?;
    refuse_tools(&r.tools)?;
    let system = match &r.system {
        Some(v) => content_text(v, "system")?,
        None => String::new(),
    };
    let mut turns = Vec::new();
    for (i, m) in r.messages.iter().enumerate() {
        let what = format!("messages[{i}]");
        let text = content_text(&m.content, &what)?;
        match m.role.as_str() {
            "user" => turns.push((Role::User, text)),
            "assistant" => turns.push((Role::Assistant, text)),
            other => return Err(ApiError::bad(format!("{what}: role '{other}' is not supported (user or assistant)"))),
        }
    }
    // Anthropic's default: no thinking unless asked for.
    let think = match &r.thinking {
        Some(v) => parse_thinking(v)?,
        None => false,
    };
    Ok(Parsed {
        system,
        turns: check_turns(turns)?,
        think: if think { ThinkMode::Think } else { ThinkMode::NoThink },
        params: gen_params(Some(r.max_tokens), r.temperature, r.top_p, r.top_k, r.min_p, r.seed)?,
        stops: parse_stops(r.stop_sequences.as_ref(), "stop_sequences")?,
        stream: r.stream,
    })
}

// ---------------------------------------------------------------------------------------------
// Generation, shared by both APIs

/// Splits the token stream into reasoning and answer, and cuts the answer at a stop string.
/// Answer text that could be the start of a stop string is held back until it is not.
struct Assembler {
    ids: Ids,
    /// Inside `<think>`: tokens are reasoning until `</think>`.
    thinking: bool,
    stops: Vec<String>,
    content: String,
    /// Bytes of `content` already handed out.
    emitted: usize,
    reasoning: String,
    stop_hit: Option<String>,
}

/// A piece of output.
enum Piece {
    Reasoning(String),
    Content(String),
}

impl Assembler {
    fn new(ids: Ids, think: ThinkMode, stops: Vec<String>) -> Assembler {
        Assembler {
            ids,
            thinking: think == ThinkMode::Think,
            stops,
            content: String::new(),
            emitted: 0,
            reasoning: String::new(),
            stop_hit: None,
        }
    }

    fn push(&mut self, id: u32, text: &str) -> Option<Piece> {
        if self.stop_hit.is_some() || id == self.ids.eos {
            return None;
        }
        if self.thinking {
            if id == self.ids.think_end {
                self.thinking = false;
                return None;
            }
            if id == self.ids.think {
                return None;
            }
            self.reasoning.push_str(text);
            return (!text.is_empty()).then(|| Piece::Reasoning(text.to_string()));
        }
        self.content.push_str(text);
        self.release(false)
    }

    /// Hands out the answer text that is safe to show; `end`: all of it.
    fn release(&mut self, end: bool) -> Option<Piece> {
        // A stop string may start in text already held back, never in text handed out.
        let from = self.emitted;
        let hit = self
            .stops
            .iter()
            .filter_map(|s| self.content[from..].find(s.as_str()).map(|at| (from + at, s)))
            .min_by_key(|(at, _)| *at);
        let upto = if let Some((at, s)) = hit {
            self.stop_hit = Some(s.clone());
            self.content.truncate(at);
            at
        } else if end {
            self.content.len()
        } else {
            // Hold back the longest tail that is a proper prefix of a stop string.
            let held = self
                .stops
                .iter()
                .flat_map(|s| (1..s.len()).filter(|&n| s.is_char_boundary(n)).map(move |n| &s[..n]))
                .filter(|p| self.content[from..].ends_with(p))
                .map(str::len)
                .max()
                .unwrap_or(0);
            self.content.len() - held
        };
        if upto <= self.emitted {
            return None;
        }
        let piece = self.content[self.emitted..upto].to_string();
        self.emitted = upto;
        Some(Piece::Content(piece))
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
/// it ended. Returning drops `rx`, which stops the worker within one token.
async fn drive(
    mut rx: mpsc::UnboundedReceiver<Out>,
    asm: &mut Assembler,
    mut emit: impl FnMut(Piece) -> bool,
) -> Outcome {
    let mut out = Outcome { completion_tokens: 0, stop: None, error: None };
    loop {
        match rx.recv().await {
            Some(Out::Token { id, text }) => {
                out.completion_tokens += 1;
                if let Some(p) = asm.push(id, &text) {
                    if !emit(p) {
                        return out;
                    }
                }
                if asm.stop_hit.is_some() {
                    out.stop = Some(StopReason::Eos);
                    return out;
                }
            }
            Some(Out::Done { stop, tail }) => {
                let tail_piece = if tail.is_empty() { None } else { asm.push(u32::MAX, &tail) };
                for p in tail_piece.into_iter().chain(asm.release(true)) {
                    if !emit(p) {
                        return out;
                    }
                }
                out.stop = Some(if asm.stop_hit.is_some() { StopReason::Eos } else { stop });
                return out;
            }
            Some(Out::Error(e)) => {
                out.error = Some(e);
                return out;
            }
            Some(Out::Start { .. }) | None => {
                out.error = Some(ApiError {
                    status: StatusCode::INTERNAL_SERVER_ERROR,
                    msg: "the engine stopped answering".into(),
                });
                return out;
            }
        }
    }
}

/// The token receiver of a queued request, its id, its prompt size and the reused prefix.
type Submitted = (mpsc::UnboundedReceiver<Out>, u64, usize, usize);

/// Queues a request and waits for the worker to take it.
async fn submit(st: &AppState, p: &Parsed, path: &'static str) -> Result<Submitted, ApiError> {
    let (tx, mut rx) = mpsc::unbounded_channel();
    let id = st.next_id.fetch_add(1, Ordering::Relaxed);
    let job = Job {
        id,
        system: p.system.clone(),
        turns: p.turns.clone(),
        think: p.think,
        params: p.params,
        arrived: Instant::now(),
        path,
        tx,
    };
    let gone = || ApiError { status: StatusCode::SERVICE_UNAVAILABLE, msg: "the engine is not running".into() };
    st.jobs.send(job).map_err(|_| gone())?;
    match rx.recv().await {
        Some(Out::Start { prompt_tokens, reused }) => Ok((rx, id, prompt_tokens, reused)),
        Some(Out::Error(e)) => Err(e),
        _ => Err(gone()),
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

fn openai_finish(stop: StopReason) -> &'static str {
    match stop {
        StopReason::Length => "length",
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
    let (rx, n, prompt_tokens, reused) = submit(&st, &p, "/v1/chat/completions").await?;
    let mut asm = Assembler::new(st.ids, p.think, p.stops.clone());
    let id = format!("chatcmpl-{n}");
    let created = now_secs();
    if !p.stream {
        let out = drive(rx, &mut asm, |_| true).await;
        if let Some(e) = out.error {
            return Err(e);
        }
        let finish = openai_finish(out.stop.unwrap_or(StopReason::Eos));
        let mut message = json!({"role": "assistant", "content": asm.content});
        if p.think == ThinkMode::Think {
            message["reasoning_content"] = json!(asm.reasoning);
        }
        return Ok(Json(json!({
            "id": id,
            "object": "chat.completion",
            "created": created,
            "model": MODEL_ID,
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
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
        let out = drive(rx, &mut asm, |piece| {
            let delta = match piece {
                Piece::Reasoning(t) => json!({"reasoning_content": t}),
                Piece::Content(t) => json!({"content": t}),
            };
            send(chunk(delta, Value::Null))
        })
        .await;
        if let Some(e) = out.error {
            let _ = send(json!({"error": {"message": e.msg, "type": "server_error", "param": null, "code": null}}));
        } else if let Some(stop) = out.stop {
            let mut last = chunk(json!({}), json!(openai_finish(stop)));
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
        (None, _) => ("end_turn", Value::Null),
    }
}

async fn messages(State(st): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    match messages_inner(st, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(Api::Anthropic),
    }
}

async fn messages_inner(st: Arc<AppState>, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let p = parse_messages(parse_json(body)?)?;
    let (rx, n, prompt_tokens, reused) = submit(&st, &p, "/v1/messages").await?;
    let mut asm = Assembler::new(st.ids, p.think, p.stops.clone());
    let id = format!("msg_{n}");
    let usage = move |output: usize| json!({"input_tokens": prompt_tokens - reused, "output_tokens": output, "cache_read_input_tokens": reused, "cache_creation_input_tokens": 0});
    if !p.stream {
        let out = drive(rx, &mut asm, |_| true).await;
        if let Some(e) = out.error {
            return Err(e);
        }
        let (reason, seq) = anthropic_stop(out.stop.unwrap_or(StopReason::Eos), &asm);
        let mut content = Vec::new();
        if p.think == ThinkMode::Think {
            content.push(json!({"type": "thinking", "thinking": asm.reasoning, "signature": ""}));
        }
        content.push(json!({"type": "text", "text": asm.content}));
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
        // The open content block: its index and kind ("thinking" or "text").
        let mut open: Option<(usize, &'static str)> = None;
        let mut next_index = 0;
        let mut switch_to = |kind: &'static str, open: &mut Option<(usize, &'static str)>| -> Option<usize> {
            if let Some((i, k)) = *open {
                if k == kind {
                    return Some(i);
                }
                if !send("content_block_stop", json!({"type": "content_block_stop", "index": i})) {
                    return None;
                }
            }
            let i = next_index;
            next_index += 1;
            let block = if kind == "thinking" {
                json!({"type": "thinking", "thinking": ""})
            } else {
                json!({"type": "text", "text": ""})
            };
            *open = Some((i, kind));
            send("content_block_start", json!({"type": "content_block_start", "index": i, "content_block": block}))
                .then_some(i)
        };
        let out = drive(rx, &mut asm, |piece| {
            let (kind, delta) = match piece {
                Piece::Reasoning(t) => ("thinking", json!({"type": "thinking_delta", "thinking": t})),
                Piece::Content(t) => ("text", json!({"type": "text_delta", "text": t})),
            };
            match switch_to(kind, &mut open) {
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
        // Every message has a text block, even an empty one.
        if switch_to("text", &mut open).is_none() {
            return;
        }
        if let Some((i, _)) = open {
            if !send("content_block_stop", json!({"type": "content_block_stop", "index": i})) {
                return;
            }
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
