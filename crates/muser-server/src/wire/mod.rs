//! Request types of the three wire families. Every struct denies unknown fields, so a typo is
//! a 400 naming the field rather than a silently ignored option. Responses are built with
//! `serde_json::json!` next to the handlers that send them.

pub mod anthropic;
pub mod lane;
pub mod llama;
pub mod nodes;
pub mod ollama;
pub mod openai;
pub mod rerank;
pub mod responses;
pub mod sessions;

use crate::limits::PROMPT_PIECES_MAX;
use serde::de::{self, DeserializeSeed, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer};

/// llama-server's per-request speculative-decoding fields, flat with dotted names
/// (`"speculative.n_max": 4`), as its request handlers read them.
#[derive(Debug, Default, Clone, Copy)]
pub struct SpecFields<'a> {
    /// `none` turns speculation off for the request; a drafter's name turns it on.
    pub kind: Option<&'a str>,
    pub n_max: Option<i64>,
    pub n_min: Option<i64>,
    /// The least draft probability a model drafter keeps (0..=1); the n-gram drafter has no
    /// probabilities, so it is checked and has no effect (as in llama.cpp's n-gram drafters).
    pub p_min: Option<f32>,
}

/// `stop`: one string or a list of strings.
#[derive(Debug, Clone, Default)]
pub struct StopList(pub Vec<String>);

impl<'de> Deserialize<'de> for StopList {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            One(String),
            Many(Vec<String>),
        }
        match Raw::deserialize(d) {
            Ok(Raw::One(s)) => Ok(StopList(vec![s])),
            Ok(Raw::Many(v)) => Ok(StopList(v)),
            Err(_) => Err(serde::de::Error::custom(
                "expected a string or a list of strings",
            )),
        }
    }
}

/// A prompt: text, or token ids, or (llama.cpp) a mix of both, or (llama.cpp's multimodal
/// object, `/completion` only) text whose `<__media__>` markers stand for base64 images.
#[derive(Debug, Clone)]
pub enum PromptPiece {
    Text(String),
    Token(u64),
    Multimodal { text: String, images: Vec<String> },
}

#[derive(Debug, Clone)]
pub struct Prompt(pub Vec<PromptPiece>);

impl<'de> Deserialize<'de> for Prompt {
    /// Read as it streams, never through a `serde_json::Value`: a list holds at most
    /// [`PROMPT_PIECES_MAX`] pieces, and OpenAI's batch form (a list holding exactly one
    /// prompt list) nests once, so no prompt costs more than its pieces.
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(PromptVisitor { outer: true })
    }
}

const PROMPT_SHAPE: &str = "a prompt is a string or a list of strings and token ids";
const ONE_PROMPT: &str = "only one prompt per request is supported";

struct PromptVisitor {
    /// The outermost list, which may hold one inner prompt list.
    outer: bool,
}

/// One element of a prompt list.
enum Element {
    Piece(PromptPiece),
    Inner(Prompt),
}

impl<'de> Visitor<'de> for PromptVisitor {
    type Value = Prompt;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str(PROMPT_SHAPE)
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Prompt, E> {
        Ok(Prompt(vec![PromptPiece::Text(v.to_string())]))
    }
    fn visit_string<E: de::Error>(self, v: String) -> Result<Prompt, E> {
        Ok(Prompt(vec![PromptPiece::Text(v)]))
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Prompt, E> {
        Ok(Prompt(vec![PromptPiece::Token(v)]))
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Prompt, E> {
        Err(E::custom("token ids must be non-negative integers"))
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Prompt, E> {
        Err(E::custom("token ids must be non-negative integers"))
    }
    /// `{"prompt_string": TEXT, "multimodal_data": [BASE64, ...]}`.
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Prompt, A::Error> {
        let (mut text, mut images) = (None, Vec::new());
        while let Some(key) = map.next_key::<String>()? {
            match key.as_str() {
                "prompt_string" => text = Some(map.next_value::<String>()?),
                "multimodal_data" => images = map.next_value::<Vec<String>>()?,
                other => {
                    return Err(de::Error::custom(format!(
                        "unknown prompt field `{other}` (expected prompt_string, multimodal_data)"
                    )))
                }
            }
        }
        let text = text.ok_or_else(|| de::Error::custom("a prompt object needs prompt_string"))?;
        Ok(Prompt(vec![PromptPiece::Multimodal { text, images }]))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Prompt, A::Error> {
        let mut pieces = Vec::new();
        let mut inner = None;
        let seed = ElementSeed { outer: self.outer };
        while let Some(e) = seq.next_element_seed(seed)? {
            match e {
                Element::Inner(p) if inner.is_none() && pieces.is_empty() => inner = Some(p),
                Element::Piece(p) if inner.is_none() => {
                    if pieces.len() == PROMPT_PIECES_MAX {
                        return Err(de::Error::custom(format!(
                            "a prompt list holds at most {PROMPT_PIECES_MAX} pieces"
                        )));
                    }
                    pieces.push(p);
                }
                _ => return Err(de::Error::custom(ONE_PROMPT)),
            }
        }
        if let Some(p) = inner {
            return Ok(p);
        }
        if pieces.len() > 1 && pieces.iter().all(|p| matches!(p, PromptPiece::Text(_))) {
            return Err(de::Error::custom(ONE_PROMPT));
        }
        Ok(Prompt(pieces))
    }
}

#[derive(Clone, Copy)]
struct ElementSeed {
    outer: bool,
}

impl<'de> DeserializeSeed<'de> for ElementSeed {
    type Value = Element;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Element, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for ElementSeed {
    type Value = Element;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str(PROMPT_SHAPE)
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Element, E> {
        Ok(Element::Piece(PromptPiece::Text(v.to_string())))
    }
    fn visit_string<E: de::Error>(self, v: String) -> Result<Element, E> {
        Ok(Element::Piece(PromptPiece::Text(v)))
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Element, E> {
        Ok(Element::Piece(PromptPiece::Token(v)))
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Element, E> {
        Err(E::custom("token ids must be non-negative integers"))
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Element, E> {
        Err(E::custom("token ids must be non-negative integers"))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Element, A::Error> {
        if !self.outer {
            return Err(de::Error::custom(ONE_PROMPT));
        }
        PromptVisitor { outer: false }
            .visit_seq(seq)
            .map(Element::Inner)
    }
}

/// `seed`: -1 (or absent) means "draw one"; otherwise a non-negative integer.
pub fn seed_from(seed: Option<i64>) -> Result<Option<u64>, String> {
    match seed {
        None | Some(-1) => Ok(None),
        Some(s) if s >= 0 => Ok(Some(s as u64)),
        Some(s) => Err(format!(
            "seed must be -1 or a non-negative integer, got {s}"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_forms() {
        let p: Prompt = serde_json::from_str(r#""hi""#).unwrap();
        assert!(matches!(p.0.as_slice(), [PromptPiece::Text(s)] if s == "hi"));
        let p: Prompt = serde_json::from_str("[1, 2, \"x\"]").unwrap();
        assert_eq!(p.0.len(), 3);
        let p: Prompt = serde_json::from_str("[[5, 6]]").unwrap();
        assert!(matches!(
            p.0.as_slice(),
            [PromptPiece::Token(5), PromptPiece::Token(6)]
        ));
        assert!(serde_json::from_str::<Prompt>(r#"["a", "b"]"#).is_err());
        assert!(serde_json::from_str::<Prompt>("[-1]").is_err());
        assert!(serde_json::from_str::<Prompt>("{}").is_err());
        assert!(serde_json::from_str::<Prompt>("[[[1]]]").is_err());
        assert!(serde_json::from_str::<Prompt>("[[1], [2]]").is_err());
        assert!(serde_json::from_str::<Prompt>("[1, [2]]").is_err());
        assert!(serde_json::from_str::<Prompt>("[1.5]").is_err());
        let many = format!("[{}1]", "1,".repeat(crate::limits::PROMPT_PIECES_MAX));
        let err = serde_json::from_str::<Prompt>(&many).unwrap_err();
        assert!(err.to_string().contains("at most"), "{err}");
    }

    #[test]
    fn stop_forms() {
        let s: StopList = serde_json::from_str(r#""\n""#).unwrap();
        assert_eq!(s.0, vec!["\n"]);
        let s: StopList = serde_json::from_str(r#"["a","b"]"#).unwrap();
        assert_eq!(s.0.len(), 2);
        assert!(serde_json::from_str::<StopList>("3").is_err());
    }
}

#[cfg(test)]
mod strictness {
    use crate::json::parse;
    use crate::wire::{llama, ollama, openai};
    use axum::http::StatusCode;

    fn rejects<T: serde::de::DeserializeOwned>(body: &str, field: &str) {
        match parse::<T>(body.as_bytes()) {
            Ok(_) => panic!("accepted {body}"),
            Err(e) => {
                assert_eq!(e.status, StatusCode::BAD_REQUEST, "{body}");
                assert!(
                    e.message.contains(field),
                    "`{}` does not name `{field}`",
                    e.message
                );
            }
        }
    }

    #[test]
    fn every_family_denies_unknown_fields() {
        let ok = r#"{"messages":[{"role":"user","content":"hi"}],"temperature":0,"seed":3,"stream":true,
                     "stream_options":{"include_usage":true},"tools":[{"type":"function","function":{"name":"f","parameters":{}}}],
                     "tool_choice":{"type":"function","function":{"name":"f"}},"response_format":{"type":"json_object"}}"#;
        let req: openai::ChatCompletionRequest = parse(ok.as_bytes()).unwrap();
        assert_eq!(req.sampling().seed, Some(3));
        assert_eq!(req.tool_choice, Some(openai::ToolChoice::Named("f".into())));
        rejects::<openai::ChatCompletionRequest>(
            r#"{"messages":[],"tempreature":1}"#,
            "tempreature",
        );
        rejects::<openai::ChatCompletionRequest>(
            r#"{"messages":[{"role":"user","content":"x","x_extra":1}]}"#,
            "x_extra",
        );
        rejects::<openai::ChatCompletionRequest>(
            r#"{"messages":[{"role":"robot","content":"x"}]}"#,
            "robot",
        );
        rejects::<openai::ChatCompletionRequest>(
            r#"{"messages":[],"response_format":{"type":"json_schema"}}"#,
            "json_schema",
        );
        rejects::<openai::ChatCompletionRequest>(
            r#"{"messages":[],"response_format":{"type":"json_schema","json_schema":{"name":"x","shema":{}}}}"#,
            "shema",
        );
        let req: openai::ChatCompletionRequest = parse(
            br#"{"messages":[],"response_format":{"type":"json_schema","json_schema":{"name":"x","strict":true,"schema":{"type":"object"}}}}"#,
        )
        .unwrap();
        assert!(matches!(
            req.response_format,
            Some(openai::ResponseFormat::JsonSchema { .. })
        ));
        rejects::<openai::ChatCompletionRequest>(
            r#"{"messages":[],"tool_choice":"sometimes"}"#,
            "sometimes",
        );
        rejects::<openai::CompletionRequest>(r#"{"prompt":"x","top_q":1}"#, "top_q");
        rejects::<openai::EmbeddingRequest>(r#"{"input":"x","encoding_format":"hex"}"#, "hex");
        rejects::<llama::CompletionRequest>(r#"{"prompt":"x","mirostat":2}"#, "mirostat");
        rejects::<llama::DetokenizeRequest>(r#"{"tokens":[1],"special":true}"#, "special");
        rejects::<ollama::GenerateRequest>(
            r#"{"model":"m","options":{"temprature":1}}"#,
            "temprature",
        );
        rejects::<ollama::ChatRequest>(
            r#"{"model":"m","messages":[{"role":"user","content":"x","mood":1}]}"#,
            "mood",
        );
    }
}
