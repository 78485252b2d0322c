//! DeepSeek V4's chat format with tools: a conversation (system text, tool schemas, user turns
//! with tool results, assistant turns with reasoning and tool calls) rendered into prompt tokens,
//! and the model's tool calls (DSML markup) parsed back.
//!
//! The format follows DeepSeek's own renderer, `encoding/encoding_dsv4.py` in the
//! DeepSeek-V4-Flash model repository (the release ships no Jinja template):
//!
//! - The tool schemas go after the system text: `system + "\n\n" + TOOLS_SECTION`, each schema
//!   one line of JSON in Python's `json.dumps` style (`", "` and `": "`, non-ASCII kept).
//!   DeepSeek's renderer attaches tools to a system message; with no system text this gives the
//!   section after an empty system text (it starts with the two newlines).
//! - There is no tool role: tool results are user content, `<tool_result>…</tool_result>`, the
//!   parts of one user turn (texts and results) joined by a blank line, results ordered as the
//!   calls of the assistant turn before them. Consecutive user messages merge into one turn.
//! - An assistant turn is `{reasoning}</think>` (when kept), its text, then its tool calls as
//!   `"\n\n<｜DSML｜tool_calls>\n" + invokes joined by "\n" + "\n</｜DSML｜tool_calls>"`, then
//!   the end-of-sentence token. An invoke is `<｜DSML｜invoke name="N">\n` + parameters joined
//!   by "\n" + `\n</｜DSML｜invoke>`; a parameter is
//!   `<｜DSML｜parameter name="K" string="true">V</｜DSML｜parameter>` with a string's raw text,
//!   or `string="false"` with any other value as JSON.
//! - A user turn followed by an assistant turn (or ending the conversation) is followed by
//!   `<｜Assistant｜>` and `<think>` (thinking) or `</think>`. Earlier reasoning is dropped, as
//!   [`crate::tokenizer::Tokenizer::render_conversation`] does, except when tools are given: then
//!   every assistant turn keeps its reasoning and every user turn opens with `<think>`.
//!
//! Two choices are ours: text that comes from the request (system, messages, schemas, tool
//! results, argument values) is tokenized as plain text, so a special string inside it never
//! becomes a control token (DeepSeek's renderer tokenizes the whole string); and the parser
//! accepts any whitespace between tags (DeepSeek's wants exactly one newline). Like DeepSeek's
//! renderer, nothing is escaped: an argument value containing `</｜DSML｜parameter>`, or a tool
//! result containing `</tool_result>`, ends its wrapper early.

use serde_json::{Map, Value};

use crate::tokenizer::{ThinkMode, Tokenizer};

/// The DSML marker: one special token, `｜DSML｜`, the tags are built around it.
pub const DSML: &str = "｜DSML｜";
const THINK: &str = "<think>";
const THINK_END: &str = "</think>";

/// The start of a tool-call block in the model's output.
pub const TOOL_CALLS_START: &str = "<｜DSML｜tool_calls>";
const TOOL_CALLS_END: &str = "</｜DSML｜tool_calls>";
const INVOKE_START: &str = "<｜DSML｜invoke name=\"";
const INVOKE_END: &str = "</｜DSML｜invoke>";
const PARAM_START: &str = "<｜DSML｜parameter name=\"";
const PARAM_END: &str = "</｜DSML｜parameter>";

/// The tools section of the system text, from DeepSeek's renderer (`TOOLS_TEMPLATE`); the
/// schemas replace `{tool_schemas}`.
const TOOLS_SECTION: &str = "## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a \"<｜DSML｜tool_calls>\" block like the following:

<｜DSML｜tool_calls>
<｜DSML｜invoke name=\"$TOOL_NAME\">
<｜DSML｜parameter name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</｜DSML｜parameter>
...
</｜DSML｜invoke>
<｜DSML｜invoke name=\"$TOOL_NAME2\">
...
</｜DSML｜invoke>
</｜DSML｜tool_calls>

String parameters should be specified as is and set `string=\"true\"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string=\"false\"`.

If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool calls or final response.

Otherwise, output directly after </think> with tool calls or final response.

### Available Tool Schemas

{tool_schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
";

/// A tool call of an assistant turn: `arguments` is a JSON object's text, as the OpenAI API
/// carries it.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    pub arguments: String,
}

/// A part of a user turn.
#[derive(Debug, Clone, PartialEq)]
pub enum UserPart {
    Text(String),
    /// The result of the call with this id.
    ToolResult {
        call_id: String,
        content: String,
    },
}

#[derive(Debug, Clone, PartialEq)]
pub enum Message {
    User(Vec<UserPart>),
    Assistant { reasoning: String, content: String, tool_calls: Vec<ToolCall> },
}

/// What a request asks the model to continue.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Conversation {
    pub system: String,
    /// Function schemas (`name`, `description`, `parameters`), rendered as given.
    pub tools: Vec<Value>,
    pub messages: Vec<Message>,
}

impl Conversation {
    /// Adds a user part, to the user turn before it if the last message is one.
    pub fn push_user(&mut self, part: UserPart) {
        match self.messages.last_mut() {
            Some(Message::User(parts)) => parts.push(part),
            _ => self.messages.push(Message::User(vec![part])),
        }
    }

    pub fn push_assistant(&mut self, reasoning: String, content: String, tool_calls: Vec<ToolCall>) {
        self.messages.push(Message::Assistant { reasoning, content, tool_calls });
    }

    /// The ids of the calls of the last assistant turn (none when there is none): the calls a
    /// tool result added now can answer.
    pub fn last_call_ids(&self) -> Vec<&str> {
        match self.messages.iter().rev().find(|m| matches!(m, Message::Assistant { .. })) {
            Some(Message::Assistant { tool_calls, .. }) => tool_calls.iter().map(|c| c.id.as_str()).collect(),
            _ => Vec::new(),
        }
    }
}

/// Serializes JSON as Python's `json.dumps(v, ensure_ascii=False)` does: `", "` between items,
/// `": "` after keys, non-ASCII text kept. Key order is kept as given. (Floats with an exponent
/// differ: Python writes `1e+100`, this `1e100`.)
pub fn python_json(v: &Value) -> String {
    struct PythonStyle;
    impl serde_json::ser::Formatter for PythonStyle {
        fn begin_array_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
            if first {
                Ok(())
            } else {
                w.write_all(b", ")
            }
        }
        fn begin_object_key<W: ?Sized + std::io::Write>(&mut self, w: &mut W, first: bool) -> std::io::Result<()> {
            if first {
                Ok(())
            } else {
                w.write_all(b", ")
            }
        }
        fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
            w.write_all(b": ")
        }
    }
    let mut out = Vec::new();
    let mut ser = serde_json::Serializer::with_formatter(&mut out, PythonStyle);
    // Serializing a Value into memory cannot fail.
    let _ = serde::Serialize::serialize(v, &mut ser);
    String::from_utf8(out).unwrap_or_default()
}

/// Prompt tokens built from pieces: request text (plain), markup (its special strings become
/// special tokens) and special tokens. Adjacent text is tokenized together, as one string would be.
struct Prompt<'t> {
    tok: &'t Tokenizer,
    ids: Vec<u32>,
    text: String,
}

impl Prompt<'_> {
    fn special(&mut self, id: u32) {
        self.flush();
        self.ids.push(id);
    }

    fn text(&mut self, s: &str) {
        self.text.push_str(s);
    }

    /// Our own markup: `｜DSML｜`, `<think>` and `</think>` in it are special tokens.
    fn markup(&mut self, mut s: &str) {
        let sp = *self.tok.specials();
        let marks = [(DSML, sp.dsml), (THINK_END, sp.think_end), (THINK, sp.think)];
        while !s.is_empty() {
            let next = marks.iter().filter_map(|&(m, id)| s.find(m).map(|at| (at, m, id))).min_by_key(|&(at, ..)| at);
            match next {
                Some((at, m, id)) => {
                    self.text(&s[..at]);
                    self.special(id);
                    s = &s[at + m.len()..];
                }
                None => {
                    self.text(s);
                    s = "";
                }
            }
        }
    }

    fn flush(&mut self) {
        if !self.text.is_empty() {
            self.ids.extend(self.tok.encode(&self.text));
            self.text.clear();
        }
    }

    fn finish(mut self) -> Vec<u32> {
        self.flush();
        self.ids
    }
}

/// The schemas as the tools section lists them: one line of JSON each.
fn tool_schemas(tools: &[Value]) -> String {
    tools.iter().map(python_json).collect::<Vec<_>>().join("\n")
}

/// The tools section for these schemas, as text (its special strings are special tokens in a
/// prompt).
pub fn tools_section(tools: &[Value]) -> String {
    TOOLS_SECTION.replace("{tool_schemas}", &tool_schemas(tools))
}

/// The DSML text of one call's arguments: one parameter per key, in the object's order. Arguments
/// that are not a JSON object become one string parameter `arguments`, as in DeepSeek's renderer.
fn push_arguments(p: &mut Prompt, arguments: &str) {
    let object = match serde_json::from_str::<Value>(arguments) {
        Ok(Value::Object(o)) => o,
        _ => Map::from_iter([("arguments".to_string(), Value::String(arguments.to_string()))]),
    };
    for (i, (k, v)) in object.iter().enumerate() {
        if i > 0 {
            p.text("\n");
        }
        p.markup(PARAM_START);
        p.text(k);
        match v {
            Value::String(s) => {
                p.markup("\" string=\"true\">");
                p.text(s);
            }
            other => {
                p.markup("\" string=\"false\">");
                p.text(&python_json(other));
            }
        }
        p.markup(PARAM_END);
    }
}

fn push_tool_calls(p: &mut Prompt, calls: &[ToolCall]) {
    p.markup("\n\n");
    p.markup(TOOL_CALLS_START);
    p.markup("\n");
    for (i, c) in calls.iter().enumerate() {
        if i > 0 {
            p.markup("\n");
        }
        p.markup(INVOKE_START);
        p.text(&c.name);
        p.markup("\">\n");
        push_arguments(p, &c.arguments);
        p.markup("\n");
        p.markup(INVOKE_END);
    }
    p.markup("\n");
    p.markup(TOOL_CALLS_END);
}

/// The prompt tokens of a conversation, ending with the opening of the assistant's answer.
pub fn render(tok: &Tokenizer, c: &Conversation, think: ThinkMode) -> Vec<u32> {
    let sp = *tok.specials();
    let thinking = think == ThinkMode::Think;
    // With tools, DeepSeek's renderer keeps every turn's reasoning.
    let keep_reasoning = !c.tools.is_empty();
    let last_user = c.messages.iter().rposition(|m| matches!(m, Message::User(_)));
    let mut p = Prompt { tok, ids: vec![sp.bos], text: String::new() };
    p.text(&c.system);
    if !c.tools.is_empty() {
        // The schemas are request text; only the section around them is markup.
        let (before, after) = TOOLS_SECTION.split_once("{tool_schemas}").unwrap_or((TOOLS_SECTION, ""));
        p.text("\n\n");
        p.markup(before);
        p.text(&tool_schemas(&c.tools));
        p.markup(after);
    }
    // The call order of the last assistant turn with calls, for ordering results.
    let mut call_order: Vec<&str> = Vec::new();
    for (i, m) in c.messages.iter().enumerate() {
        match m {
            Message::User(parts) => {
                p.special(sp.user);
                let rank = |part: &UserPart| match part {
                    UserPart::ToolResult { call_id, .. } => call_order.iter().position(|id| id == call_id).unwrap_or(0),
                    UserPart::Text(_) => 0,
                };
                // Results take the places results had, in call order; texts stay where they are.
                let mut results: Vec<&UserPart> =
                    parts.iter().filter(|x| matches!(x, UserPart::ToolResult { .. })).collect();
                results.sort_by_key(|x| rank(x));
                let mut results = results.into_iter();
                for (j, part) in parts.iter().enumerate() {
                    if j > 0 {
                        p.text("\n\n");
                    }
                    let part = match part {
                        UserPart::ToolResult { .. } => results.next().unwrap_or(part),
                        UserPart::Text(_) => part,
                    };
                    match part {
                        UserPart::Text(t) => p.text(t),
                        UserPart::ToolResult { content, .. } => {
                            p.text("<tool_result>");
                            p.text(content);
                            p.text("</tool_result>");
                        }
                    }
                }
                let answer_follows = matches!(c.messages.get(i + 1), None | Some(Message::Assistant { .. }));
                if answer_follows {
                    p.special(sp.assistant);
                    let open = thinking && (keep_reasoning || Some(i) >= last_user);
                    p.special(if open { sp.think } else { sp.think_end });
                }
            }
            Message::Assistant { reasoning, content, tool_calls } => {
                if thinking && (keep_reasoning || Some(i) > last_user) {
                    p.text(reasoning);
                    p.special(sp.think_end);
                }
                p.text(content);
                if !tool_calls.is_empty() {
                    push_tool_calls(&mut p, tool_calls);
                    call_order = tool_calls.iter().map(|t| t.id.as_str()).collect();
                }
                p.special(sp.eos);
            }
        }
    }
    p.finish()
}

/// A tool call parsed from the model's output: `arguments` is a JSON object's text, in the
/// style DeepSeek's renderer writes it back (so a call sent back renders as it was sampled).
#[derive(Debug, Clone, PartialEq)]
pub struct ParsedCall {
    pub name: String,
    pub arguments: String,
}

impl ParsedCall {
    /// The arguments as a JSON value (an object).
    pub fn input(&self) -> Value {
        serde_json::from_str(&self.arguments).unwrap_or(Value::Object(Map::new()))
    }
}

/// How far a tool-call block could be read.
#[derive(Debug, Clone, PartialEq)]
pub enum BlockState {
    /// The closing `</｜DSML｜tool_calls>` was read.
    Complete,
    /// The text ends inside the block: more may come.
    Partial,
    /// The text breaks the format here.
    Malformed(String),
}

/// What [`parse_tool_calls`] read.
#[derive(Debug, Clone, PartialEq)]
pub struct ParsedBlock {
    /// The calls whose `</｜DSML｜invoke>` was read.
    pub calls: Vec<ParsedCall>,
    /// Bytes of the text those calls (and the closing tag, when complete) span.
    pub consumed: usize,
    pub state: BlockState,
}

/// Reads a tool-call block: `text` starts with [`TOOL_CALLS_START`]. Whitespace between tags is
/// allowed (DeepSeek's parser wants exactly one newline); a parameter's value is its raw text up
/// to `</｜DSML｜parameter>`; a `string="false"` value that is not valid JSON is kept as a string.
pub fn parse_tool_calls(text: &str) -> ParsedBlock {
    let mut block = ParsedBlock { calls: Vec::new(), consumed: 0, state: BlockState::Partial };
    let mut r = Reader { s: text, at: 0 };
    let result = (|| -> Result<(), Step> {
        r.expect(TOOL_CALLS_START)?;
        loop {
            r.skip_ws();
            if r.eat(TOOL_CALLS_END)? {
                block.consumed = r.at;
                block.state = BlockState::Complete;
                return Ok(());
            }
            r.expect(INVOKE_START)?;
            let name = r.until("\"")?.to_string();
            r.expect(">")?;
            let mut args = Map::new();
            loop {
                r.skip_ws();
                if r.eat(INVOKE_END)? {
                    break;
                }
                r.expect(PARAM_START)?;
                let key = r.until("\"")?.to_string();
                r.expect(" string=\"")?;
                let is_string = match r.until("\"")? {
                    "true" => true,
                    "false" => false,
                    other => return Err(Step::Bad(format!("string=\"{other}\" is neither true nor false"))),
                };
                r.expect(">")?;
                let raw = r.until(PARAM_END)?;
                let value = if is_string {
                    Value::String(raw.to_string())
                } else {
                    serde_json::from_str(raw).unwrap_or_else(|_| Value::String(raw.to_string()))
                };
                if args.insert(key.clone(), value).is_some() {
                    return Err(Step::Bad(format!("parameter '{key}' given twice")));
                }
            }
            if name.is_empty() {
                return Err(Step::Bad("an invoke without a name".into()));
            }
            block.calls.push(ParsedCall { name, arguments: python_json(&Value::Object(args)) });
            block.consumed = r.at;
        }
    })();
    match result {
        Ok(()) | Err(Step::More) => {}
        Err(Step::Bad(msg)) => block.state = BlockState::Malformed(msg),
    }
    block
}

enum Step {
    /// The text ended before the next piece was complete.
    More,
    Bad(String),
}

struct Reader<'a> {
    s: &'a str,
    at: usize,
}

impl<'a> Reader<'a> {
    fn rest(&self) -> &'a str {
        &self.s[self.at..]
    }

    fn skip_ws(&mut self) {
        let rest = self.rest();
        self.at += rest.len() - rest.trim_start().len();
    }

    /// Eats `tag` if the text continues with it; `More` if the text is a proper prefix of it.
    fn eat(&mut self, tag: &str) -> Result<bool, Step> {
        let rest = self.rest();
        if rest.starts_with(tag) {
            self.at += tag.len();
            Ok(true)
        } else if tag.starts_with(rest) {
            Err(Step::More)
        } else {
            Ok(false)
        }
    }

    fn expect(&mut self, tag: &str) -> Result<(), Step> {
        if self.eat(tag)? {
            Ok(())
        } else {
            let got: String = self.rest().chars().take(40).collect();
            Err(Step::Bad(format!("expected {tag:?}, found {got:?}")))
        }
    }

    /// The text up to `end`, eating both.
    fn until(&mut self, end: &str) -> Result<&'a str, Step> {
        let rest = self.rest();
        match rest.find(end) {
            Some(n) => {
                self.at += n + end.len();
                Ok(&rest[..n])
            }
            None => Err(Step::More),
        }
    }
}
