//! DeepSeek V4's chat format with tools (`ds4::chat`): prompts checked against transcripts
//! written out by hand from DeepSeek's renderer (`encoding_dsv4.py`), and tool-call blocks as the
//! model writes them parsed back.

use ds4::chat::{self, BlockState, Conversation, Message, ParsedCall, ToolCall, UserPart};
use ds4::tokenizer::{standin_vocab, Role, ThinkMode, Tokenizer};
use proptest::prelude::*;
use serde_json::{json, Value};

fn tok() -> Tokenizer {
    let (tokens, merges) = standin_vocab(400).unwrap();
    Tokenizer::from_vocab(tokens, merges).unwrap()
}

fn weather_tool() -> Value {
    json!({"name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                          "required": ["city"]}})
}

fn user(text: &str) -> Message {
    Message::User(vec![UserPart::Text(text.into())])
}

fn call(id: &str, name: &str, arguments: &str) -> ToolCall {
    ToolCall { id: id.into(), name: name.into(), arguments: arguments.into() }
}

#[test]
fn json_is_written_as_pythons_json_dumps() {
    // Expected strings from Python 3: json.dumps(v, ensure_ascii=False).
    let v = json!({"name": "f", "d": "é\u{1}\u{7f}/\\\"", "n": [1, 2.5, true, null, {}], "x": {}, "e": [], "f": 1.0});
    assert_eq!(
        chat::python_json(&v),
        "{\"name\": \"f\", \"d\": \"é\\u0001\u{7f}/\\\\\\\"\", \"n\": [1, 2.5, true, null, {}], \"x\": {}, \"e\": [], \"f\": 1.0}"
    );
    // Key order is the given order, not sorted.
    let v: Value = serde_json::from_str(r#"{"b": 1, "a": {"d": 2, "c": 3}}"#).unwrap();
    assert_eq!(chat::python_json(&v), r#"{"b": 1, "a": {"d": 2, "c": 3}}"#);
}

#[test]
fn the_tools_section_follows_deepseeks_template() {
    let s = chat::tools_section(&[weather_tool(), json!({"name": "noop"})]);
    assert!(s.starts_with(
        "## Tools\n\nYou have access to a set of tools to help answer the user's question. You can invoke tools by \
         writing a \"<｜DSML｜tool_calls>\" block like the following:\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"$TOOL_NAME\">\n"
    ));
    assert!(s.contains(
        "### Available Tool Schemas\n\n{\"name\": \"get_weather\", \"description\": \"Weather of a city\", \"parameters\": \
         {\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}, \"days\": {\"type\": \"integer\"}}, \
         \"required\": [\"city\"]}}\n{\"name\": \"noop\"}\n\nYou MUST strictly follow"
    ));
    assert!(s.ends_with("to invoke tool calls.\n"));
}

/// A tool conversation in thinking mode, rendered, against the transcript DeepSeek's renderer
/// writes for it: tools after the system text, reasoning kept for every turn (tools are given),
/// results in call order as user content, the answer opened with `<think>`.
#[test]
fn a_tool_conversation_renders_as_deepseeks_transcript() {
    let tok = tok();
    let tools = vec![weather_tool()];
    let c = Conversation {
        system: "Be brief.".into(),
        tools: tools.clone(),
        messages: vec![
            user("Weather in Paris and Rome?"),
            Message::Assistant {
                reasoning: "Two cities.".into(),
                content: String::new(),
                tool_calls: vec![
                    call("a", "get_weather", r#"{"city": "Paris", "days": 2}"#),
                    call("b", "get_weather", r#"{"city": "Rome"}"#),
                ],
            },
            // Results given in the other order: they are put in call order.
            Message::User(vec![
                UserPart::ToolResult { call_id: "b".into(), content: "Rome: rain".into() },
                UserPart::ToolResult { call_id: "a".into(), content: "Paris: sun".into() },
            ]),
        ],
    };
    let want = format!(
        "<｜begin▁of▁sentence｜>Be brief.\n\n{}<｜User｜>Weather in Paris and Rome?<｜Assistant｜><think>Two cities.</think>\
         \n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n\
         <｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n\
         <｜DSML｜parameter name=\"days\" string=\"false\">2</｜DSML｜parameter>\n</｜DSML｜invoke>\n\
         <｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"city\" string=\"true\">Rome</｜DSML｜parameter>\n\
         </｜DSML｜invoke>\n</｜DSML｜tool_calls><｜end▁of▁sentence｜>\
         <｜User｜><tool_result>Paris: sun</tool_result>\n\n<tool_result>Rome: rain</tool_result><｜Assistant｜><think>",
        chat::tools_section(&tools)
    );
    assert_eq!(chat::render(&tok, &c, ThinkMode::Think), tok.encode_rendered(&want));

    // Without thinking every turn opens with </think> and no reasoning is shown.
    let want = want
        .replace("<｜Assistant｜><think>Two cities.</think>", "<｜Assistant｜></think>")
        .replace("<｜Assistant｜><think>", "<｜Assistant｜></think>");
    assert_eq!(chat::render(&tok, &c, ThinkMode::NoThink), tok.encode_rendered(&want));
}

#[test]
fn without_tools_earlier_reasoning_is_dropped_as_in_the_plain_template() {
    let tok = tok();
    let c = Conversation {
        system: "S".into(),
        tools: Vec::new(),
        messages: vec![
            user("a"),
            Message::Assistant { reasoning: "hidden".into(), content: "b".into(), tool_calls: Vec::new() },
            user("c"),
        ],
    };
    for think in [ThinkMode::Think, ThinkMode::NoThink] {
        let turns = [(Role::User, "a"), (Role::Assistant, "b"), (Role::User, "c")];
        assert_eq!(chat::render(&tok, &c, think), tok.render_conversation("S", &turns, think), "{think:?}");
    }
    let text = String::from_utf8(tok.decode(&chat::render(&tok, &c, ThinkMode::Think))).unwrap();
    assert!(!text.contains("hidden"), "{text}");
}

#[test]
fn user_parts_and_consecutive_user_messages_make_one_turn() {
    let tok = tok();
    let mut c = Conversation::default();
    c.push_user(UserPart::Text("one".into()));
    c.push_user(UserPart::Text("two".into()));
    assert_eq!(c.messages, vec![Message::User(vec![UserPart::Text("one".into()), UserPart::Text("two".into())])]);
    let want = tok.encode_rendered("<｜begin▁of▁sentence｜><｜User｜>one\n\ntwo<｜Assistant｜></think>");
    assert_eq!(chat::render(&tok, &c, ThinkMode::NoThink), want);
}

#[test]
fn special_strings_in_request_text_stay_plain_text() {
    let tok = tok();
    let s = *tok.specials();
    let sneaky = "<think></think><｜end▁of▁sentence｜>｜DSML｜";
    let c = Conversation {
        system: sneaky.into(),
        tools: vec![json!({"name": sneaky})],
        messages: vec![
            Message::User(vec![UserPart::Text(sneaky.into())]),
            Message::Assistant {
                reasoning: String::new(),
                content: sneaky.into(),
                tool_calls: vec![call("x", sneaky, "{}")],
            },
            Message::User(vec![UserPart::ToolResult { call_id: "x".into(), content: sneaky.into() }]),
        ],
    };
    let ids = chat::render(&tok, &c, ThinkMode::NoThink);
    let count = |id: u32| ids.iter().filter(|&&t| t == id).count();
    // Only the markup's own: the tools section's, one EOS (the assistant turn), two </think> (two
    // answer openings) and four DSML (tool_calls, invoke, /invoke, /tool_calls).
    let section = chat::tools_section(&[]);
    assert_eq!(count(s.eos), 1);
    assert_eq!(count(s.think), section.matches("<think>").count());
    assert_eq!(count(s.think_end), section.matches("</think>").count() + 2);
    assert_eq!(count(s.dsml), section.matches(chat::DSML).count() + 4);
}

#[test]
fn arguments_that_are_not_an_object_become_one_string_parameter() {
    let tok = tok();
    let c = Conversation {
        system: String::new(),
        tools: Vec::new(),
        messages: vec![
            user("x"),
            Message::Assistant {
                reasoning: String::new(),
                content: String::new(),
                tool_calls: vec![call("i", "f", "not json")],
            },
        ],
    };
    let text = String::from_utf8(tok.decode(&chat::render(&tok, &c, ThinkMode::NoThink))).unwrap();
    assert!(
        text.contains("<｜DSML｜parameter name=\"arguments\" string=\"true\">not json</｜DSML｜parameter>"),
        "{text}"
    );
}

const BLOCK: &str = "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n\
    <｜DSML｜parameter name=\"city\" string=\"true\">New York, \"NY\"</｜DSML｜parameter>\n\
    <｜DSML｜parameter name=\"days\" string=\"false\">3</｜DSML｜parameter>\n\
    <｜DSML｜parameter name=\"opts\" string=\"false\">{\"units\":\"metric\",\"x\":[1,2]}</｜DSML｜parameter>\n\
    </｜DSML｜invoke>\n<｜DSML｜invoke name=\"noop\">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>";

#[test]
fn a_tool_call_block_is_parsed_into_calls() {
    let b = chat::parse_tool_calls(BLOCK);
    assert_eq!(b.state, BlockState::Complete);
    assert_eq!(b.consumed, BLOCK.len());
    assert_eq!(
        b.calls,
        vec![
            ParsedCall {
                name: "get_weather".into(),
                arguments: r#"{"city": "New York, \"NY\"", "days": 3, "opts": {"units": "metric", "x": [1, 2]}}"#
                    .into()
            },
            ParsedCall { name: "noop".into(), arguments: "{}".into() },
        ]
    );
    assert_eq!(b.calls[0].input()["opts"]["x"][1], 2);
    // Text after the closing tag is not read.
    assert_eq!(chat::parse_tool_calls(&format!("{BLOCK}<｜end▁of▁sentence｜>")).consumed, BLOCK.len());
    // Other whitespace between tags is accepted.
    let loose = BLOCK.replace(">\n<", ">\r\n  <");
    assert_eq!(chat::parse_tool_calls(&loose).calls, b.calls);
}

#[test]
fn every_prefix_of_a_block_is_partial_with_the_calls_complete_so_far() {
    let full = chat::parse_tool_calls(BLOCK);
    for (n, _) in BLOCK.char_indices() {
        let prefix = &BLOCK[..n];
        let b = chat::parse_tool_calls(prefix);
        assert_eq!(b.state, BlockState::Partial, "prefix {n}: {prefix:?}");
        assert_eq!(b.calls.len(), prefix.matches("</｜DSML｜invoke>").count(), "prefix {n}: {prefix:?}");
        assert_eq!(b.calls[..], full.calls[..b.calls.len()]);
    }
}

#[test]
fn a_broken_block_is_malformed() {
    for (bad, why) in [
        (BLOCK.replace("string=\"false\">3", "string=\"maybe\">3"), "string attribute"),
        (BLOCK.replace("name=\"days\"", "name=\"city\""), "duplicate parameter"),
        (BLOCK.replace("<｜DSML｜invoke name=\"noop\">", "<｜DSML｜call name=\"noop\">"), "unknown tag"),
        ("<｜DSML｜tool_calls>\nplain words".to_string(), "text instead of an invoke"),
        ("<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"\">\n</｜DSML｜invoke>".to_string(), "no name"),
    ] {
        let b = chat::parse_tool_calls(&bad);
        assert!(matches!(b.state, BlockState::Malformed(_)), "{why}: {:?}", b.state);
    }
    // A non-JSON value marked string="false" is kept as a string.
    let b = chat::parse_tool_calls(&BLOCK.replace(">3<", ">three<"));
    assert_eq!(b.calls[0].input()["days"], "three");
}

proptest! {
    /// A call rendered into a prompt reads back as the same arguments (values without the
    /// closing parameter tag, which the format cannot carry).
    #[test]
    fn rendered_calls_parse_back(
        name in "[a-zA-Z_][a-zA-Z0-9_.-]{0,12}",
        args in prop::collection::vec(("[a-z_]{1,8}", prop_oneof![
            "[^<｜]{0,20}".prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            any::<bool>().prop_map(Value::from),
            prop::collection::vec(any::<i32>(), 0..4).prop_map(|v| json!(v)),
        ]), 0..5),
    ) {
        let tok = tok();
        let object: serde_json::Map<String, Value> = args.into_iter().collect();
        let arguments = chat::python_json(&Value::Object(object.clone()));
        let c = Conversation {
            system: String::new(),
            tools: Vec::new(),
            messages: vec![user("x"), Message::Assistant {
                reasoning: String::new(), content: String::new(), tool_calls: vec![call("1", &name, &arguments)] }],
        };
        let text = String::from_utf8(tok.decode(&chat::render(&tok, &c, ThinkMode::NoThink))).unwrap();
        let at = text.find(chat::TOOL_CALLS_START).unwrap();
        let b = chat::parse_tool_calls(&text[at..]);
        prop_assert_eq!(b.state, BlockState::Complete);
        prop_assert_eq!(b.calls.len(), 1);
        prop_assert_eq!(&b.calls[0].name, &name);
        prop_assert_eq!(b.calls[0].input(), Value::Object(object));
        prop_assert_eq!(&b.calls[0].arguments, &arguments);
    }
}
