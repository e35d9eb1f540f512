//! Chat templates rendered the way llama-server b11434 renders them (`/apply-template`):
//! minijinja configured like llama.cpp's jinja engine (trim/lstrip blocks, one trailing newline
//! of the source dropped, Python string and dict methods), llama.cpp's globals
//! (`raise_exception`, `strftime_now`, `tojson` with `", "`/`": "` separators), its message and
//! tool normalization, and its rule that strips a leading BOS text when the tokenizer adds BOS.

use minijinja::value::{Kwargs, Value as JValue, ValueKind};
use minijinja::{Environment, Error as JError, ErrorKind};
use serde_json::{Map, Value};

use crate::error::{Result, TextError};
use crate::tokenizer::Tokenizer;

/// llama.cpp's fallback when a model has no template.
pub const CHATML_TEMPLATE: &str = "{%- for message in messages -%}\n  {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}\n{%- endfor -%}\n{%- if add_generation_prompt -%}\n  {{- '<|im_start|>assistant\\n' -}}\n{%- endif -%}";

/// llama.cpp's built-in Llama 3 format (`--chat-template llama3`): every message under its role
/// header, its content trimmed, closed by `<|eot_id|>`.
pub const LLAMA3_TEMPLATE: &str = "{%- for message in messages -%}\n  {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + (message.content | trim) + '<|eot_id|>' -}}\n{%- endfor -%}\n{%- if add_generation_prompt -%}\n  {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}\n{%- endif -%}";

/// llama.cpp's built-in Command R format (`--chat-template command-r`): system, user and
/// assistant turns with their tokens, contents trimmed; other roles are left out.
pub const COMMAND_R_TEMPLATE: &str = "{%- set tokens = {'system': '<|SYSTEM_TOKEN|>', 'user': '<|USER_TOKEN|>', 'assistant': '<|CHATBOT_TOKEN|>'} -%}\n{%- for message in messages if message.role in tokens -%}\n  {{- '<|START_OF_TURN_TOKEN|>' + tokens[message.role] + (message.content | trim) + '<|END_OF_TURN_TOKEN|>' -}}\n{%- endfor -%}\n{%- if add_generation_prompt -%}\n  {{- '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>' -}}\n{%- endif -%}";

/// The template names `--chat-template` takes besides Jinja source, as llama-server names
/// its built-in formats.
pub const BUILTIN_TEMPLATES: &[(&str, &str)] = &[
    ("chatml", CHATML_TEMPLATE),
    ("llama3", LLAMA3_TEMPLATE),
    ("command-r", COMMAND_R_TEMPLATE),
];

/// The source of the built-in template called `name`, if there is one.
pub fn builtin_template(name: &str) -> Option<&'static str> {
    BUILTIN_TEMPLATES
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, src)| *src)
}

/// What to render: an OpenAI-style conversation plus template switches.
#[derive(Clone, Debug, Default)]
pub struct ChatRequest {
    /// `[{"role": ..., "content": ...}, ...]` as in the OpenAI chat API.
    pub messages: Vec<Value>,
    /// OpenAI `tools` (`[{"type": "function", "function": {...}}]`), if any.
    pub tools: Option<Value>,
    pub add_generation_prompt: bool,
    /// Extra template variables (llama.cpp's `chat_template_kwargs`), e.g. `current_date`.
    /// `reasoning_effort` here also sets `reasoning_strength`, as llama.cpp does.
    pub extra: Map<String, Value>,
    /// The time `strftime_now` formats, as Unix seconds (UTC); `None` means the clock.
    pub now_unix_s: Option<i64>,
}

impl ChatRequest {
    /// Reads a conversation file: either a bare messages array or
    /// `{"messages": [...], "tools": [...]?, "add_generation_prompt": bool? (default true),
    /// "reasoning_effort": str?, "chat_template_kwargs": {...}?}`.
    pub fn from_json_str(text: &str) -> Result<ChatRequest> {
        let bad = |m: &str| TextError::Template(format!("conversation: {m}"));
        let v: Value = serde_json::from_str(text).map_err(|e| bad(&e.to_string()))?;
        let mut req = ChatRequest {
            add_generation_prompt: true,
            ..Default::default()
        };
        let obj = match v {
            Value::Array(messages) => {
                req.messages = messages;
                return Ok(req);
            }
            Value::Object(o) => o,
            _ => return Err(bad("expected a messages array or an object")),
        };
        for (k, v) in obj {
            match (k.as_str(), v) {
                ("messages", Value::Array(m)) => req.messages = m,
                ("tools", t @ Value::Array(_)) => req.tools = Some(t),
                ("add_generation_prompt", Value::Bool(b)) => req.add_generation_prompt = b,
                ("reasoning_effort", Value::String(e)) => {
                    if e != "none" {
                        req.extra
                            .insert("reasoning_effort".into(), Value::String(e));
                    }
                }
                ("chat_template_kwargs", Value::Object(kw)) => req.extra.extend(kw),
                (k, _) => return Err(bad(&format!("unknown or mistyped field `{k}`"))),
            }
        }
        if req.messages.is_empty() {
            return Err(bad("`messages` is required"));
        }
        Ok(req)
    }
}

/// A compiled chat template with the BOS/EOS texts it is rendered with.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: String,
    eos_token: String,
    add_bos: bool,
    add_eos: bool,
}

impl ChatTemplate {
    /// The template in `tokenizer.chat_template`, or `None` when the file has none (llama.cpp
    /// then falls back to ChatML: [`ChatTemplate::chatml`]).
    pub fn from_gguf(gguf: &muser_gguf::GgufFile, tok: &Tokenizer) -> Result<Option<ChatTemplate>> {
        match gguf.get("tokenizer.chat_template") {
            None => Ok(None),
            Some(muser_gguf::Value::String(s)) => Ok(Some(Self::new(s, tok)?)),
            Some(v) => Err(TextError::WrongType {
                key: "tokenizer.chat_template".into(),
                expected: "string",
                found: v.type_desc(),
            }),
        }
    }

    /// The model's template, or llama.cpp's ChatML fallback when it has none.
    pub fn from_gguf_or_chatml(
        gguf: &muser_gguf::GgufFile,
        tok: &Tokenizer,
    ) -> Result<ChatTemplate> {
        match Self::from_gguf(gguf, tok)? {
            Some(t) => Ok(t),
            None => Self::chatml(tok),
        }
    }

    /// llama.cpp's ChatML fallback template.
    pub fn chatml(tok: &Tokenizer) -> Result<ChatTemplate> {
        Self::new(CHATML_TEMPLATE, tok)
    }

    /// Compiles `source` with the BOS/EOS texts and add-BOS/EOS flags of `tok`.
    pub fn new(source: &str, tok: &Tokenizer) -> Result<ChatTemplate> {
        let piece = |id: Option<u32>| {
            id.map(|i| String::from_utf8_lossy(tok.token_to_piece(i, true)).into_owned())
                .unwrap_or_default()
        };
        Self::with_tokens(
            source,
            &piece(tok.bos()),
            &piece(tok.eos()),
            tok.add_bos(),
            tok.add_eos(),
        )
    }

    /// Compiles `source` with explicit BOS/EOS texts.
    pub fn with_tokens(
        source: &str,
        bos: &str,
        eos: &str,
        add_bos: bool,
        add_eos: bool,
    ) -> Result<ChatTemplate> {
        // llama.cpp normalizes line endings and drops one trailing newline of the source.
        let mut src = source.replace("\r\n", "\n").replace('\r', "\n");
        if src.ends_with('\n') {
            src.pop();
        }
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_formatter(format_value);
        env.add_filter("tojson", tojson_filter);
        env.add_function("raise_exception", raise_exception);
        env.add_template_owned("chat", src.clone())
            .map_err(|e| TextError::Template(e.to_string()))?;
        Ok(ChatTemplate {
            env,
            source: src,
            bos_token: bos.to_string(),
            eos_token: eos.to_string(),
            add_bos,
            add_eos,
        })
    }

    /// The template source (after line-ending normalization).
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Whether this is a Muse Glimmer template (llama.cpp's detection rule).
    pub fn is_muse(&self) -> bool {
        self.source.contains("<atem:function_calls>") && self.source.contains("<|eom|>")
    }

    /// Renders the conversation to the prompt text llama-server would produce.
    ///
    /// As in llama-server (`prefill_assistant`, on by default), a conversation that ends with
    /// an assistant message without tool calls is continued rather than closed: the earlier
    /// messages are rendered, then the assistant header and that message's text, so generation
    /// picks up where it stops.
    pub fn render(&self, req: &ChatRequest) -> Result<String> {
        let typed_content = self.source.contains("type");
        let messages: Vec<Value> = req
            .messages
            .iter()
            .map(|m| normalize_message(m, typed_content))
            .collect();
        let last = messages.last().filter(|m| {
            m.get("role").and_then(Value::as_str) == Some("assistant")
                && m.get("tool_calls").is_none()
        });
        let Some(last) = last.cloned() else {
            return self.render_messages(req, messages, req.add_generation_prompt);
        };
        let earlier = messages[..messages.len() - 1].to_vec();
        let base = self.render_messages(req, earlier.clone(), false)?;
        let text = |k: &str| {
            last.get(k)
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string()
        };
        let content = match last.get("content") {
            Some(Value::Array(parts)) => concat_text_parts(parts),
            _ => text("content"),
        };
        let reasoning = text("reasoning_content");
        let continue_content = !content.is_empty() || reasoning.is_empty();
        let tail = if self.is_muse() {
            let mut t = format!("<|start|>assistant to=self<|message|>{reasoning}");
            if continue_content {
                t.push_str("<|eom|><|start|>assistant to=user<|message|>");
                t.push_str(&content);
            }
            t
        } else {
            let with_prompt = self.render_messages(req, earlier, true)?;
            let common = base
                .bytes()
                .zip(with_prompt.bytes())
                .take_while(|(a, b)| a == b)
                .count();
            let mut t = with_prompt.get(common..).unwrap_or("").to_string();
            if continue_content {
                t.push_str(&content);
            }
            t
        };
        Ok(base + &tail)
    }

    fn render_messages(
        &self,
        req: &ChatRequest,
        messages: Vec<Value>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        let mut ctx = Map::new();
        ctx.insert("messages".into(), Value::Array(messages));
        ctx.insert("bos_token".into(), Value::String(self.bos_token.clone()));
        ctx.insert("eos_token".into(), Value::String(self.eos_token.clone()));
        ctx.insert("enable_thinking".into(), Value::Bool(true));
        if let Some(tools) = req.tools.as_ref().and_then(normalize_tools) {
            ctx.insert("tools".into(), tools);
        }
        for (k, v) in &req.extra {
            ctx.insert(k.clone(), v.clone());
        }
        if add_generation_prompt {
            ctx.insert("add_generation_prompt".into(), Value::Bool(true));
        }
        if let Some(Value::String(effort)) = req.extra.get("reasoning_effort") {
            if !effort.is_empty() {
                ctx.insert("reasoning_effort".into(), Value::String(effort.clone()));
                ctx.insert("reasoning_strength".into(), Value::String(effort.clone()));
            }
        }
        let now = req.now_unix_s.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs() as i64)
        });
        let tmpl = self
            .env
            .get_template("chat")
            .map_err(|e| TextError::Template(e.to_string()))?;
        let mut vars = JValue::from_serialize(&ctx);
        let strftime = JValue::from_function(move |fmt: String| -> Result<String, JError> {
            Ok(strftime_utc(&fmt, now))
        });
        vars = minijinja::context! { strftime_now => strftime, ..vars };
        let mut out = tmpl
            .render(vars)
            .map_err(|e| TextError::Template(format!("{e:#}")))?;
        if self.add_bos && !self.bos_token.is_empty() && out.starts_with(&self.bos_token) {
            out.drain(..self.bos_token.len());
        }
        if self.add_eos && !self.eos_token.is_empty() && out.ends_with(&self.eos_token) {
            out.truncate(out.len() - self.eos_token.len());
        }
        Ok(out)
    }
}

/// llama-server's message normalization: only the fields it knows, `content` always present
/// (`""` when empty), tool-call arguments given as a JSON string parsed into an object.
fn normalize_message(m: &Value, typed_content: bool) -> Value {
    let mut out = Map::new();
    let get = |k: &str| m.get(k);
    out.insert(
        "role".into(),
        get("role").cloned().unwrap_or(Value::String(String::new())),
    );
    let content = match get("content") {
        Some(Value::String(s)) => Value::String(s.clone()),
        Some(Value::Array(parts)) if !typed_content => Value::String(concat_text_parts(parts)),
        Some(Value::Array(parts)) if !parts.is_empty() => Value::Array(parts.clone()),
        _ => Value::String(String::new()),
    };
    out.insert("content".into(), content);
    for key in ["reasoning_content", "name", "tool_call_id"] {
        if let Some(Value::String(s)) = get(key) {
            if !s.is_empty() {
                out.insert(key.into(), Value::String(s.clone()));
            }
        }
    }
    if let Some(Value::Array(calls)) = get("tool_calls") {
        if !calls.is_empty() {
            let calls = calls.iter().map(normalize_tool_call).collect();
            out.insert("tool_calls".into(), Value::Array(calls));
        }
    }
    Value::Object(out)
}

fn normalize_tool_call(tc: &Value) -> Value {
    let f = tc.get("function").cloned().unwrap_or(Value::Null);
    let name = f
        .get("name")
        .cloned()
        .unwrap_or(Value::String(String::new()));
    let args = match f.get("arguments") {
        Some(Value::String(s)) => serde_json::from_str::<Value>(s)
            .ok()
            .filter(Value::is_object)
            .unwrap_or(Value::String(s.clone())),
        Some(v) => v.clone(),
        None => Value::Object(Map::new()),
    };
    let mut func = Map::new();
    func.insert("name".into(), name);
    func.insert("arguments".into(), args);
    let mut out = Map::new();
    out.insert("type".into(), Value::String("function".into()));
    out.insert("function".into(), Value::Object(func));
    if let Some(Value::String(id)) = tc.get("id") {
        if !id.is_empty() {
            out.insert("id".into(), Value::String(id.clone()));
        }
    }
    Value::Object(out)
}

/// Text parts joined with newlines (llama.cpp's rule for string-only templates).
fn concat_text_parts(parts: &[Value]) -> String {
    let mut text = String::new();
    for p in parts {
        if p.get("type").and_then(Value::as_str) != Some("text") {
            continue;
        }
        if !text.is_empty() {
            text.push('\n');
        }
        text.push_str(p.get("text").and_then(Value::as_str).unwrap_or(""));
    }
    text
}

/// Tools as llama.cpp passes them to templates: `{type, function: {name, description,
/// parameters}}`, description defaulting to `""` and parameters to `{}`. Empty → absent.
fn normalize_tools(tools: &Value) -> Option<Value> {
    let list = tools.as_array()?;
    if list.is_empty() {
        return None;
    }
    let out = list
        .iter()
        .map(|t| {
            let f = t.get("function").unwrap_or(t);
            let mut func = Map::new();
            func.insert(
                "name".into(),
                f.get("name")
                    .cloned()
                    .unwrap_or(Value::String(String::new())),
            );
            func.insert(
                "description".into(),
                f.get("description")
                    .cloned()
                    .unwrap_or(Value::String(String::new())),
            );
            func.insert(
                "parameters".into(),
                f.get("parameters")
                    .cloned()
                    .unwrap_or(Value::Object(Map::new())),
            );
            let mut o = Map::new();
            o.insert("type".into(), Value::String("function".into()));
            o.insert("function".into(), Value::Object(func));
            Value::Object(o)
        })
        .collect();
    Some(Value::Array(out))
}

fn raise_exception(msg: String) -> Result<String, JError> {
    Err(JError::new(
        ErrorKind::InvalidOperation,
        format!("Jinja Exception: {msg}"),
    ))
}

/// Output formatting of values: floats as llama.cpp prints them (`std::to_string`, trailing
/// zeros removed, at least one decimal), everything else as minijinja does.
fn format_value(
    out: &mut minijinja::Output<'_>,
    state: &minijinja::State<'_, '_>,
    value: &JValue,
) -> Result<(), JError> {
    if let Some(f) = as_float(value) {
        return out
            .write_str(&float_to_string(f))
            .map_err(|_| JError::new(ErrorKind::WriteFailure, "write failed"));
    }
    minijinja::escape_formatter(out, state, value)
}

fn as_float(v: &JValue) -> Option<f64> {
    if v.kind() != ValueKind::Number || v.is_integer() {
        return None;
    }
    f64::try_from(v.clone()).ok()
}

fn float_to_string(f: f64) -> String {
    let mut s = format!("{f:.6}");
    if s.contains('.') {
        while s.ends_with('0') {
            s.pop();
        }
        if s.ends_with('.') {
            s.push('0');
        }
    }
    s
}

/// `tojson` as llama.cpp's engine writes it: `", "` and `": "` separators (or the given
/// `separators`), optional `indent`, object keys in insertion order, non-ASCII kept as is.
fn tojson_filter(v: JValue, kwargs: Kwargs) -> Result<String, JError> {
    let indent: Option<i64> = kwargs.get("indent")?;
    let seps: Option<Vec<String>> = kwargs.get("separators")?;
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let indent = indent.unwrap_or(-1);
    let item_sep = seps
        .as_ref()
        .and_then(|s| s.first().cloned())
        .unwrap_or_else(|| if indent < 0 { ", ".into() } else { ",".into() });
    let key_sep = seps
        .as_ref()
        .and_then(|s| s.get(1).cloned())
        .unwrap_or_else(|| ": ".into());
    let mut out = String::new();
    write_json(&mut out, &v, 0, indent, &item_sep, &key_sep)?;
    Ok(out)
}

fn write_json(
    out: &mut String,
    v: &JValue,
    level: usize,
    indent: i64,
    item_sep: &str,
    key_sep: &str,
) -> Result<(), JError> {
    let pad = |n: usize| {
        if indent > 0 {
            " ".repeat(n * indent as usize)
        } else {
            String::new()
        }
    };
    let nl = if indent >= 0 { "\n" } else { "" };
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => match as_float(v) {
            Some(f) => out.push_str(&float_g6(f)),
            None => out.push_str(&v.to_string()),
        },
        ValueKind::String => write_json_str(out, v.as_str().unwrap_or("")),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<JValue> = v.try_iter()?.collect();
            out.push('[');
            if !items.is_empty() {
                out.push_str(nl);
                for (i, item) in items.iter().enumerate() {
                    out.push_str(&pad(level + 1));
                    write_json(out, item, level + 1, indent, item_sep, key_sep)?;
                    if i + 1 < items.len() {
                        out.push_str(item_sep);
                    }
                    out.push_str(nl);
                }
                out.push_str(&pad(level));
            }
            out.push(']');
        }
        ValueKind::Map => {
            let keys: Vec<JValue> = v.try_iter()?.collect();
            out.push('{');
            if !keys.is_empty() {
                out.push_str(nl);
                for (i, k) in keys.iter().enumerate() {
                    out.push_str(&pad(level + 1));
                    write_json_str(out, &k.to_string());
                    out.push_str(key_sep);
                    write_json(out, &v.get_item(k)?, level + 1, indent, item_sep, key_sep)?;
                    if i + 1 < keys.len() {
                        out.push_str(item_sep);
                    }
                    out.push_str(nl);
                }
                out.push_str(&pad(level));
            }
            out.push('}');
        }
        _ => out.push_str("null"),
    }
    Ok(())
}

fn write_json_str(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

/// A float as C++ `ostream << double` writes it (`%g` with 6 significant digits).
fn float_g6(f: f64) -> String {
    if f == 0.0 {
        return if f.is_sign_negative() {
            "-0".into()
        } else {
            "0".into()
        };
    }
    if !f.is_finite() {
        return if f.is_nan() {
            "nan".into()
        } else if f > 0.0 {
            "inf".into()
        } else {
            "-inf".into()
        };
    }
    let exp = f.abs().log10().floor() as i32;
    // Round to 6 significant digits first; the exponent may move (9.999995 -> 10).
    let sci = format!("{f:.5e}");
    let (mant, e) = sci.split_once('e').unwrap_or((&sci, "0"));
    let e: i32 = e.parse().unwrap_or(exp);
    if (-4..6).contains(&e) {
        let decimals = (5 - e).max(0) as usize;
        let mut s = format!("{f:.decimals$}");
        if s.contains('.') {
            while s.ends_with('0') {
                s.pop();
            }
            if s.ends_with('.') {
                s.pop();
            }
        }
        s
    } else {
        let mut m = mant.to_string();
        if m.contains('.') {
            while m.ends_with('0') {
                m.pop();
            }
            if m.ends_with('.') {
                m.pop();
            }
        }
        let sign = if e < 0 { '-' } else { '+' };
        format!("{m}e{sign}{:02}", e.abs())
    }
}

/// `strftime` for a UTC time: `%Y %m %d %H %M %S %y %j %e %a %A %b %B %p %%`; other
/// conversions are copied through.
fn strftime_utc(fmt: &str, unix_s: i64) -> String {
    const DAYS: [&str; 7] = [
        "Sunday",
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
    ];
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let days = unix_s.div_euclid(86_400);
    let secs = unix_s.rem_euclid(86_400);
    let (y, m, d) = civil_from_days(days);
    let (hh, mm, ss) = (secs / 3600, secs / 60 % 60, secs % 60);
    let weekday = (days + 4).rem_euclid(7) as usize;
    let yday = days - days_from_civil(y, 1, 1) + 1;
    let mut out = String::new();
    let mut it = fmt.chars();
    while let Some(c) = it.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match it.next() {
            Some('Y') => out.push_str(&y.to_string()),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('e') => out.push_str(&format!("{d:2}")),
            Some('H') => out.push_str(&format!("{hh:02}")),
            Some('M') => out.push_str(&format!("{mm:02}")),
            Some('S') => out.push_str(&format!("{ss:02}")),
            Some('y') => out.push_str(&format!("{:02}", y.rem_euclid(100))),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('a') => out.push_str(&DAYS[weekday][..3]),
            Some('A') => out.push_str(DAYS[weekday]),
            Some('b') => out.push_str(&MONTHS[(m - 1) as usize][..3]),
            Some('B') => out.push_str(MONTHS[(m - 1) as usize]),
            Some('p') => out.push_str(if hh < 12 { "AM" } else { "PM" }),
            Some('%') => out.push('%'),
            Some(o) => {
                out.push('%');
                out.push(o);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Days since 1970-01-01 to (year, month, day), proleptic Gregorian.
fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = if m > 2 { m - 3 } else { m + 9 };
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Unix seconds of a `YYYY-MM-DD` date at midnight UTC.
pub fn unix_from_date(date: &str) -> Option<i64> {
    let mut it = date.split('-');
    let y: i64 = it.next()?.parse().ok()?;
    let m: i64 = it.next()?.parse().ok()?;
    let d: i64 = it.next()?.parse().ok()?;
    if it.next().is_some() || !(1..=12).contains(&m) || !(1..=31).contains(&d) {
        return None;
    }
    Some(days_from_civil(y, m, d) * 86_400)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_print_like_llama_cpp() {
        assert_eq!(float_to_string(2.0), "2.0");
        assert_eq!(float_to_string(1.23456789), "1.234568");
        assert_eq!(float_g6(0.5), "0.5");
        assert_eq!(float_g6(2.0), "2");
        assert_eq!(float_g6(1.23456789), "1.23457");
        assert_eq!(float_g6(1e20), "1e+20");
        assert_eq!(float_g6(0.0001), "0.0001");
        assert_eq!(float_g6(0.00001), "1e-05");
    }

    #[test]
    fn dates() {
        let t = unix_from_date("2026-11-30").unwrap() + 3600 * 13 + 61;
        assert_eq!(
            strftime_utc("%Y-%m-%d %H:%M:%S %a %b %j", t),
            "2026-11-30 13:01:01 Mon Nov 334"
        );
        assert_eq!(unix_from_date("1970-01-01"), Some(0));
    }

    /// The built-ins against renderings written out from llama.cpp's `llm_chat_apply_template`
    /// (src/llama-chat.cpp, b11434) for the same conversation: contents trimmed, roles as
    /// given (llama3) or mapped to tokens with other roles left out (command-r).
    #[test]
    fn builtin_templates_render_as_llama_cpp_builtins() {
        let req = ChatRequest {
            messages: vec![
                serde_json::json!({"role": "system", "content": " You are a test.\n"}),
                serde_json::json!({"role": "user", "content": "Hi there"}),
                serde_json::json!({"role": "assistant", "content": "Hello "}),
                serde_json::json!({"role": "tool", "content": "42"}),
                serde_json::json!({"role": "user", "content": "Again"}),
            ],
            add_generation_prompt: true,
            ..Default::default()
        };
        let render = |name: &str| {
            let src = builtin_template(name).unwrap();
            ChatTemplate::with_tokens(src, "<s>", "</s>", false, false)
                .unwrap()
                .render(&req)
                .unwrap()
        };
        assert_eq!(
            render("llama3"),
            "<|start_header_id|>system<|end_header_id|>\n\nYou are a test.<|eot_id|>\
             <|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>\
             <|start_header_id|>assistant<|end_header_id|>\n\nHello<|eot_id|>\
             <|start_header_id|>tool<|end_header_id|>\n\n42<|eot_id|>\
             <|start_header_id|>user<|end_header_id|>\n\nAgain<|eot_id|>\
             <|start_header_id|>assistant<|end_header_id|>\n\n"
        );
        assert_eq!(
            render("command-r"),
            "<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>You are a test.<|END_OF_TURN_TOKEN|>\
             <|START_OF_TURN_TOKEN|><|USER_TOKEN|>Hi there<|END_OF_TURN_TOKEN|>\
             <|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>Hello<|END_OF_TURN_TOKEN|>\
             <|START_OF_TURN_TOKEN|><|USER_TOKEN|>Again<|END_OF_TURN_TOKEN|>\
             <|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>"
        );
        assert_eq!(
            render("chatml"),
            "<|im_start|>system\n You are a test.\n<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n\
             <|im_start|>assistant\nHello <|im_end|>\n<|im_start|>tool\n42<|im_end|>\n\
             <|im_start|>user\nAgain<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(builtin_template("llama2"), None);
    }

    #[test]
    fn tojson_separators() {
        let t = ChatTemplate::with_tokens("{{ x | tojson }}", "", "", false, false).unwrap();
        let mut extra = Map::new();
        extra.insert(
            "x".into(),
            serde_json::json!({"b": [1, 2.5, "é\n"], "a": null}),
        );
        let req = ChatRequest {
            extra,
            ..Default::default()
        };
        assert_eq!(
            t.render(&req).unwrap(),
            r#"{"b": [1, 2.5, "é\n"], "a": null}"#
        );
    }
}
