//! Structured output, enforced by grammar-constrained sampling (`muser_engine::constraint`):
//! `response_format` `json_object` / `json_schema`, llama.cpp's GBNF `grammar`, and tool
//! calls forced by `tool_choice` `required` or a named function.
//!
//! - JSON: the content is exactly one JSON value of the requested shape (whitespace as
//!   llama.cpp's `json.gbnf` allows it), then end of generation. A schema is compiled into
//!   the grammar when it uses only `type`, `properties`, `required`, `items`, `enum`,
//!   `const`, `anyOf`/`oneOf` and annotations; objects are written with their declared
//!   properties in order, optional ones may be left out, no others added. Any other keyword
//!   is a 400 naming it.
//! - GBNF: the content is a sentence of the grammar's `root` (`constraint::gbnf`), then end
//!   of generation; a grammar that does not parse, or is left-recursive, is a 400 naming
//!   the line and column or the rule.
//! - Tool calls, Muse models: optional reasoning messages (` to=self<|message|>…<|eom|>`),
//!   then one ATEM call to an offered tool (` to=NAME<|message|><atem:function_calls>…`),
//!   which `MuseParser` reads back as `tool_calls`.
//! - Tool calls, other models (a generic format, like llama.cpp's for templates without tool
//!   syntax): one JSON object `{"name": NAME, "arguments": {...}}` with the arguments shaped
//!   by the tool's `parameters` schema when it compiles, else any object. Templates that do
//!   not render tools get a system message that lists them and states the format.

use crate::error::{ApiError, ApiResult};
use crate::state::AppState;
use crate::wire::openai::{ChatCompletionRequest, ResponseFormat, Tool, ToolChoice};
use muser_engine::constraint::gbnf::Gbnf;
use muser_engine::constraint::{json_quote, Constraint, Expr, Grammar, JsonKind, Member, Vocab};
use muser_text::Tokenizer;
use serde_json::{json, Map, Value};
use std::sync::{Arc, Mutex, Weak};

/// Deepest schema nesting compiled.
const MAX_SCHEMA_DEPTH: usize = 16;
/// Longest free text in a Muse message or ATEM parameter value, in bytes.
const MAX_TEXT: u32 = 1 << 20;

/// The vocabulary as a stream with `special` rendering shows it, built once per tokenizer.
pub fn vocab(tok: &Arc<Tokenizer>, special: bool) -> Arc<Vocab> {
    type Cache = Mutex<Vec<(Weak<Tokenizer>, bool, Arc<Vocab>)>>;
    static CACHE: Cache = Mutex::new(Vec::new());
    let mut cache = CACHE.lock().unwrap_or_else(|e| e.into_inner());
    cache.retain(|(w, _, _)| w.strong_count() > 0);
    let me = Arc::downgrade(tok);
    if let Some((_, _, v)) = cache
        .iter()
        .find(|(w, s, _)| *s == special && Weak::ptr_eq(w, &me))
    {
        return v.clone();
    }
    let v = Arc::new(Vocab::from_tokenizer(tok, special));
    cache.push((me, special, v.clone()));
    v
}

/// What a chat request asks the output to be.
#[derive(Debug, Default)]
pub struct Plan {
    pub constraint: Option<Constraint>,
    /// The output is a generic JSON tool call to parse into `tool_calls`.
    pub generic_tool_call: bool,
}

/// The forced tool choice of a request: `None` unless `required` or named (with tools).
fn forced_tools(req: &ChatCompletionRequest) -> ApiResult<Option<Vec<&Tool>>> {
    let named = match &req.tool_choice {
        Some(ToolChoice::Required) => None,
        Some(ToolChoice::Named(n)) => Some(n),
        _ => return Ok(None),
    };
    let tools = req.tools.as_deref().unwrap_or_default();
    if tools.is_empty() {
        return Err(ApiError::bad_request(
            "tool_choice `required` or a named function needs a non-empty `tools` list",
        ));
    }
    let chosen: Vec<&Tool> = tools
        .iter()
        .filter(|t| named.is_none_or(|n| &t.function.name == n))
        .collect();
    match named {
        Some(n) if chosen.is_empty() => Err(ApiError::bad_request(format!(
            "tool_choice names `{n}`, which is not in tools"
        ))),
        _ => Ok(Some(chosen)),
    }
}

/// Whether the model's own template lays out the offered tools.
fn template_renders_tools(state: &AppState) -> bool {
    state.model.is_muse
        || state
            .model
            .chat_template
            .as_deref()
            .is_some_and(|t| t.contains("tools"))
}

/// The grammar and parsing a chat request needs.
pub fn plan_chat(state: &AppState, req: &ChatCompletionRequest) -> ApiResult<Plan> {
    let is_muse = state.model.is_muse;
    let schema = |s: &Value, field: &str| {
        schema_expr(s, 0).map_err(|e| ApiError::bad_request(format!("{field}: {e}")))
    };
    let json = match (&req.response_format, &req.json_schema) {
        (Some(ResponseFormat::JsonObject { .. } | ResponseFormat::JsonSchema { .. }), Some(_)) => {
            return Err(ApiError::bad_request(
                "give response_format or json_schema, not both",
            ))
        }
        (_, Some(s)) => Some(schema(s, "json_schema")?),
        (None | Some(ResponseFormat::Text), None) => None,
        (Some(ResponseFormat::JsonObject { schema: None }), None) => {
            Some(Expr::Json(JsonKind::Object))
        }
        (Some(ResponseFormat::JsonObject { schema: Some(s) }), None) => {
            Some(schema(s, "response_format.schema")?)
        }
        (Some(ResponseFormat::JsonSchema { json_schema }), None) => {
            Some(match &json_schema.schema {
                None => Expr::Json(JsonKind::Object),
                Some(s) => schema(s, "response_format.json_schema")?,
            })
        }
    };
    let tools = forced_tools(req)?;
    let grammar = req.grammar.as_deref().filter(|g| !g.is_empty());
    if grammar.is_some() && (json.is_some() || tools.is_some()) {
        return Err(ApiError::bad_request(
            "grammar cannot be combined with response_format or a forced tool_choice",
        ));
    }
    let unstructured = json.is_none() && tools.is_none();
    if let Some(src) = grammar.or(default_grammar(state).filter(|_| unstructured)) {
        return Ok(Plan {
            constraint: Some(gbnf(state, src, is_muse)?),
            generic_tool_call: false,
        });
    }
    let (expr, generic) = match (json, tools) {
        (None, None) => return Ok(Plan::default()),
        (Some(_), Some(_)) => return Err(ApiError::bad_request(
            "response_format json_object/json_schema cannot be combined with a forced tool_choice",
        )),
        (Some(value), None) => (json_reply(is_muse, value), false),
        (None, Some(tools)) if is_muse => (muse_tool_call(&tools), false),
        (None, Some(tools)) => (generic_tool_call(&tools), true),
    };
    // the chat output is rendered with control tokens exactly when the model is Muse
    Ok(Plan {
        constraint: Some(compile(state, &expr, is_muse)?),
        generic_tool_call: generic,
    })
}

/// The constraint of an Ollama `format` (`"json"`: any object; an object: a JSON schema), for
/// a reply that follows the chat template (`templated`) or a raw prompt.
pub fn plan_format(
    state: &AppState,
    format: Option<&Value>,
    templated: bool,
) -> ApiResult<Option<Constraint>> {
    let value = match format {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::String(s)) if s.is_empty() => return Ok(None),
        Some(Value::String(s)) if s == "json" => Expr::Json(JsonKind::Object),
        Some(schema @ Value::Object(_)) => {
            schema_expr(schema, 0).map_err(|e| ApiError::bad_request(format!("format: {e}")))?
        }
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "format must be \"json\" or a JSON schema, got {other}"
            )))
        }
    };
    let expr = json_reply(state.model.is_muse && templated, value);
    compile(state, &expr, state.model.is_muse).map(Some)
}

/// The constraint of llama.cpp's `json_schema` or GBNF `grammar` (not both; an empty
/// grammar is none) on raw completion text (rendered without control tokens).
pub fn plan_completion(
    state: &AppState,
    schema: Option<&Value>,
    grammar: Option<&str>,
) -> ApiResult<Option<Constraint>> {
    match (schema, grammar.filter(|g| !g.is_empty())) {
        (None, None) => default_grammar(state)
            .map(|src| gbnf(state, src, false))
            .transpose(),
        (Some(_), Some(_)) => Err(ApiError::bad_request(
            "give json_schema or grammar, not both",
        )),
        (None, Some(src)) => gbnf(state, src, false).map(Some),
        (Some(schema), None) => {
            let value = schema_expr(schema, 0)
                .map_err(|e| ApiError::bad_request(format!("json_schema: {e}")))?;
            compile(state, &json_reply(false, value), false).map(Some)
        }
    }
}

/// The server's `--grammar`, for requests that ask for no structure.
fn default_grammar(state: &AppState) -> Option<&str> {
    state.options.grammar.as_deref()
}

/// A GBNF grammar's `root` as the whole reply; for Muse chat (`muse`), after optional
/// reasoning and the header of the user-facing message.
fn gbnf(state: &AppState, src: &str, muse: bool) -> ApiResult<Constraint> {
    let bad = |e: muser_engine::constraint::gbnf::GbnfError| ApiError::bad_request(e.to_string());
    let g = Gbnf::parse(src).map_err(bad)?;
    let grammar = g.compile(&reply(muse, g.root())).map_err(bad)?;
    Ok(Constraint {
        grammar: Arc::new(grammar),
        vocab: vocab(&state.tokenizer, muse),
    })
}

/// A reply whose content is `value` (with surrounding whitespace); for Muse, after optional
/// reasoning and the header of the user-facing message.
fn json_reply(is_muse: bool, value: Expr) -> Expr {
    reply(is_muse, Expr::Seq(vec![Expr::Ws, value, Expr::Ws]))
}

/// A reply whose content is `body`; for Muse, after optional reasoning and the header of the
/// user-facing message.
fn reply(is_muse: bool, body: Expr) -> Expr {
    if !is_muse {
        return body;
    }
    Expr::Seq(vec![
        muse_reasoning(),
        Expr::Choice(vec![
            Expr::lit(" to=user<|message|>"),
            Expr::lit("<|message|>"),
        ]),
        body,
    ])
}

/// `expr` over the vocabulary as the output stream renders it (`special`: with control tokens).
fn compile(state: &AppState, expr: &Expr, special: bool) -> ApiResult<Constraint> {
    let grammar = Grammar::compile(expr)
        .map_err(|e| ApiError::bad_request(format!("structured output: {e}")))?;
    Ok(Constraint {
        grammar: Arc::new(grammar),
        vocab: vocab(&state.tokenizer, special),
    })
}

/// Zero or more Muse reasoning messages, each ending where the next message starts.
fn muse_reasoning() -> Expr {
    Expr::Star(Box::new(Expr::Seq(vec![
        Expr::lit(" to=self<|message|>"),
        Expr::Until {
            stop: b"<|eom|>".to_vec(),
            max_len: MAX_TEXT,
        },
        Expr::lit("<|start|>assistant"),
    ])))
}

/// One ATEM call to one of `tools`, after optional reasoning.
fn muse_tool_call(tools: &[&Tool]) -> Expr {
    let param = Expr::Seq(vec![
        Expr::lit("<atem:parameter name=\""),
        Expr::Until {
            stop: b"\">".to_vec(),
            max_len: 256,
        },
        Expr::Until {
            stop: b"</atem:parameter>".to_vec(),
            max_len: MAX_TEXT,
        },
        Expr::Ws,
    ]);
    let calls = tools
        .iter()
        .map(|t| {
            let name = &t.function.name;
            Expr::Seq(vec![
                Expr::lit(&format!(" to={name}<|message|><atem:function_calls>")),
                Expr::Ws,
                Expr::lit(&format!("<atem:invoke name=\"{name}\">")),
                Expr::Ws,
                Expr::Star(Box::new(param.clone())),
                Expr::lit("</atem:invoke>"),
                Expr::Ws,
                Expr::lit("</atem:function_calls>"),
            ])
        })
        .collect();
    Expr::Seq(vec![muse_reasoning(), Expr::Choice(calls)])
}

/// `{"name": NAME, "arguments": ARGS}` for one of `tools`.
fn generic_tool_call(tools: &[&Tool]) -> Expr {
    let calls = tools
        .iter()
        .map(|t| {
            Expr::Seq(vec![
                Expr::lit(&format!(
                    "{{\"name\": {}, \"arguments\": ",
                    json_quote(&t.function.name)
                )),
                arguments_expr(t),
                Expr::lit("}"),
            ])
        })
        .collect();
    Expr::Seq(vec![Expr::Ws, Expr::Choice(calls), Expr::Ws])
}

/// The tool's parameter schema as a grammar when it is an object schema that compiles;
/// otherwise any JSON object.
fn arguments_expr(t: &Tool) -> Expr {
    match t.function.parameters.as_ref().map(|s| schema_expr(s, 0)) {
        Some(Ok(e @ (Expr::Object(_) | Expr::Json(JsonKind::Object)))) => e,
        _ => Expr::Json(JsonKind::Object),
    }
}

const ANNOTATIONS: &[&str] = &[
    "description",
    "title",
    "default",
    "examples",
    "$schema",
    "$id",
    "$comment",
    "additionalProperties",
    "strict",
];

/// A JSON schema as a grammar expression, or what it uses that is not supported.
pub fn schema_expr(schema: &Value, depth: usize) -> Result<Expr, String> {
    if depth > MAX_SCHEMA_DEPTH {
        return Err(format!("schemas nested deeper than {MAX_SCHEMA_DEPTH}"));
    }
    if depth == 0 {
        crate::limits::check_schema("the schema", schema).map_err(|e| e.message)?;
    }
    let m = match schema {
        Value::Bool(true) => return Ok(Expr::Json(JsonKind::Value)),
        Value::Object(m) => m,
        _ => return Err("a schema is an object (or true)".into()),
    };
    for k in m.keys() {
        let known = [
            "type",
            "properties",
            "required",
            "items",
            "enum",
            "const",
            "anyOf",
            "oneOf",
        ];
        if !known.contains(&k.as_str()) && !ANNOTATIONS.contains(&k.as_str()) {
            return Err(format!("the keyword `{k}` is not supported"));
        }
    }
    if let Some(v) = m.get("additionalProperties") {
        if !matches!(v, Value::Bool(_) | Value::Object(_)) {
            return Err("additionalProperties must be a boolean or a schema".into());
        }
    }
    if let Some(c) = m.get("const") {
        return Ok(Expr::Lit(c.to_string().into_bytes()));
    }
    if let Some(e) = m.get("enum") {
        let vals = e
            .as_array()
            .filter(|a| !a.is_empty())
            .ok_or("enum must be a non-empty array")?;
        return Ok(Expr::Choice(
            vals.iter()
                .map(|v| Expr::Lit(v.to_string().into_bytes()))
                .collect(),
        ));
    }
    for key in ["anyOf", "oneOf"] {
        if let Some(alts) = m.get(key) {
            if m.contains_key("type") {
                return Err(format!("`{key}` next to `type` is not supported"));
            }
            let alts = alts
                .as_array()
                .filter(|a| !a.is_empty())
                .ok_or(format!("{key} must be a non-empty array"))?;
            return alts
                .iter()
                .map(|a| schema_expr(a, depth + 1))
                .collect::<Result<Vec<_>, _>>()
                .map(Expr::Choice);
        }
    }
    let types: Vec<&str> = match m.get("type") {
        None if m.contains_key("properties") => vec!["object"],
        None if m.contains_key("items") => vec!["array"],
        None => return Ok(Expr::Json(JsonKind::Value)),
        Some(Value::String(t)) => vec![t.as_str()],
        Some(Value::Array(ts)) if !ts.is_empty() => ts
            .iter()
            .map(|t| t.as_str().ok_or("type names are strings"))
            .collect::<Result<_, _>>()?,
        Some(_) => return Err("type must be a string or a non-empty array of strings".into()),
    };
    let mut alts = Vec::new();
    for t in types {
        alts.push(match t {
            "string" => Expr::Json(JsonKind::String),
            "integer" => Expr::Json(JsonKind::Integer),
            "number" => Expr::Json(JsonKind::Number),
            "boolean" => Expr::Choice(vec![Expr::lit("true"), Expr::lit("false")]),
            "null" => Expr::lit("null"),
            "object" => object_expr(m, depth)?,
            "array" => match m.get("items") {
                None => Expr::Json(JsonKind::Array),
                Some(Value::Array(tuple)) => tuple_expr(tuple, depth)?,
                Some(items) => Expr::Array(Box::new(schema_expr(items, depth + 1)?)),
            },
            other => return Err(format!("unknown type `{other}`")),
        });
    }
    Ok(if alts.len() == 1 {
        alts.remove(0)
    } else {
        Expr::Choice(alts)
    })
}

/// `items` as a list of schemas (draft 4's tuple form): exactly those items, in order.
fn tuple_expr(items: &[Value], depth: usize) -> Result<Expr, String> {
    let mut seq = vec![Expr::lit("["), Expr::Ws];
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            seq.extend([Expr::lit(","), Expr::Ws]);
        }
        seq.extend([schema_expr(item, depth + 1)?, Expr::Ws]);
    }
    seq.push(Expr::lit("]"));
    Ok(Expr::Seq(seq))
}

fn object_expr(m: &Map<String, Value>, depth: usize) -> Result<Expr, String> {
    let Some(props) = m.get("properties") else {
        return Ok(Expr::Json(JsonKind::Object));
    };
    let props = props.as_object().ok_or("properties must be an object")?;
    let required: Vec<&str> = match m.get("required") {
        None => Vec::new(),
        Some(Value::Array(r)) => r
            .iter()
            .map(|v| v.as_str().ok_or("required lists property names"))
            .collect::<Result<_, _>>()?,
        Some(_) => return Err("required must be an array of names".into()),
    };
    if let Some(r) = required.iter().find(|r| !props.contains_key(**r)) {
        return Err(format!("required names `{r}`, which is not in properties"));
    }
    let members = props
        .iter()
        .map(|(k, s)| {
            Ok(Member {
                key: k.clone(),
                value: schema_expr(s, depth + 1)?,
                required: required.contains(&k.as_str()),
            })
        })
        .collect::<Result<Vec<_>, String>>()?;
    Ok(Expr::Object(members))
}

/// The system text that tells a model whose template has no tool syntax what it may call
/// and how (the generic format).
pub fn tools_instruction(tools: &[&Tool]) -> String {
    let mut s = String::from(
        "You can call the following tools. Answer with one JSON object of the form \
         {\"name\": <tool name>, \"arguments\": <object of arguments>} and nothing else.\nTools:\n",
    );
    for t in tools {
        let f = &t.function;
        let mut d = json!({ "name": f.name });
        if let Some(desc) = &f.description {
            d["description"] = json!(desc);
        }
        if let Some(p) = &f.parameters {
            d["parameters"] = p.clone();
        }
        s.push_str(&d.to_string());
        s.push('\n');
    }
    s
}

/// Adds the generic tool instructions to the conversation when the request forces a tool call
/// on a model whose template does not render tools.
pub fn add_tool_instructions(
    state: &AppState,
    req: &ChatCompletionRequest,
    messages: &mut Vec<Value>,
) -> ApiResult<()> {
    let Some(tools) = forced_tools(req)? else {
        return Ok(());
    };
    if template_renders_tools(state) {
        return Ok(());
    }
    let text = tools_instruction(&tools);
    match messages.first_mut() {
        Some(m) if m["role"] == "system" => {
            let old = m["content"].as_str().unwrap_or_default().to_string();
            m["content"] = json!(if old.is_empty() {
                text
            } else {
                format!("{old}\n\n{text}")
            });
        }
        _ => messages.insert(0, json!({ "role": "system", "content": text })),
    }
    Ok(())
}

/// Reads a generic tool call back: `(name, arguments as JSON text)`, if `text` is one.
pub fn parse_generic_tool_call(text: &str) -> Option<(String, String)> {
    let v: Value = serde_json::from_str(text.trim()).ok()?;
    let name = v.get("name")?.as_str()?.to_string();
    let args = v.get("arguments")?;
    if !args.is_object() || v.as_object()?.len() != 2 {
        return None;
    }
    Some((name, args.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use muser_engine::constraint::Matcher;

    fn accepts(e: &Expr, text: &str) -> bool {
        let mut m = Matcher::new(Arc::new(Grammar::compile(e).unwrap()));
        m.advance(text.as_bytes()) && m.is_complete()
    }

    #[test]
    fn schemas_compile_to_grammars_that_accept_their_instances() {
        let s = json!({
            "type": "object",
            "properties": {
                "name": {"type": "string", "description": "who"},
                "age": {"type": "integer"},
                "tags": {"type": "array", "items": {"enum": ["a", "b"]}},
                "kind": {"anyOf": [{"const": 1}, {"type": "null"}]},
                "ok": {"type": ["boolean", "null"]}
            },
            "required": ["name", "age"],
            "additionalProperties": false
        });
        let e = schema_expr(&s, 0).unwrap();
        assert!(accepts(&e, r#"{"name": "Ann", "age": 30}"#));
        assert!(accepts(
            &e,
            r#"{"name": "Ann", "age": -3, "tags": ["a", "b", "a"], "kind": null, "ok": true}"#
        ));
        assert!(accepts(&e, r#"{"name": "A", "age": 1, "kind": 1}"#));
        assert!(!accepts(&e, r#"{"name": "Ann"}"#));
        assert!(!accepts(&e, r#"{"name": "Ann", "age": 1.5}"#));
        assert!(!accepts(&e, r#"{"name": "Ann", "age": 1, "tags": ["c"]}"#));
        assert!(!accepts(&e, r#"{"name": "Ann", "age": 1, "extra": 1}"#));
        // `items` as a list: a tuple
        let t = schema_expr(&json!({"items": [{"type": "integer"}, {"const": "x"}]}), 0).unwrap();
        assert!(accepts(&t, r#"[ -3000, "x" ]"#) && accepts(&t, r#"[1,"x"]"#));
        assert!(
            !accepts(&t, "[1]") && !accepts(&t, r#"[1, "x", 2]"#) && !accepts(&t, r#"["x", 1]"#)
        );
        for bad in [
            json!({"type": "string", "pattern": "^a"}),
            json!({"$ref": "#/$defs/x"}),
            json!({"type": "object", "properties": {"a": {}}, "required": ["b"]}),
            json!({"type": "date"}),
        ] {
            assert!(schema_expr(&bad, 0).is_err(), "{bad}");
        }
        assert!(matches!(
            schema_expr(&json!({}), 0),
            Ok(Expr::Json(JsonKind::Value))
        ));
    }

    #[test]
    fn generic_tool_calls_round_trip() {
        let tool: Tool = serde_json::from_value(json!({"type": "function", "function": {
            "name": "get_weather", "parameters": {"type": "object",
            "properties": {"city": {"type": "string"}}, "required": ["city"]}}}))
        .unwrap();
        let other: Tool =
            serde_json::from_value(json!({"type": "function", "function": {"name": "now"}}))
                .unwrap();
        let e = generic_tool_call(&[&tool, &other]);
        let text = r#"{"name": "get_weather", "arguments": {"city": "Paris"}}"#;
        assert!(accepts(&e, text));
        assert!(accepts(&e, r#"{"name": "now", "arguments": {"any": [1]}}"#));
        assert!(!accepts(&e, r#"{"name": "get_weather", "arguments": {}}"#));
        assert!(!accepts(&e, r#"{"name": "later", "arguments": {}}"#));
        assert_eq!(
            parse_generic_tool_call(text),
            Some(("get_weather".into(), r#"{"city":"Paris"}"#.into()))
        );
        assert_eq!(parse_generic_tool_call(r#"{"name": "x"}"#), None);
    }

    #[test]
    fn muse_tool_calls_are_what_the_muse_parser_reads() {
        let tool: Tool = serde_json::from_value(json!({"type": "function", "function": {
            "name": "get_weather", "parameters": {"type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}))
        .unwrap();
        let e = muse_tool_call(&[&tool]);
        let text = " to=self<|message|>Need the weather.<|eom|><|start|>assistant to=get_weather<|message|><atem:function_calls>\n<atem:invoke name=\"get_weather\">\n<atem:parameter name=\"city\">Paris</atem:parameter>\n<atem:parameter name=\"days\">3</atem:parameter>\n</atem:invoke>\n</atem:function_calls>";
        assert!(accepts(&e, text));
        let tools = serde_json::to_value([&tool]).unwrap();
        let m = muser_text::muse::parse_full(&format!("{text}<|eot|>"), Some(&tools));
        assert_eq!(m.tool_calls.len(), 1);
        assert_eq!(
            m.tool_calls[0].arguments_json,
            r#"{"city":"Paris","days":3}"#
        );
        assert_eq!(m.reasoning, "Need the weather.");
        // no answer to the user instead of the call, no other tool, no markup in values
        assert!(!accepts(&e, " to=user<|message|>Hi<|eot|>"));
        assert!(!accepts(
            &e,
            " to=other<|message|><atem:function_calls></atem:function_calls>"
        ));
        let mut m = Matcher::new(Arc::new(Grammar::compile(&e).unwrap()));
        assert!(!m.advance(b" to=get_weather<|message|><atem:function_calls><atem:invoke name=\"get_weather\"><atem:parameter name=\"city\">P<|eot|>"));
    }
}
