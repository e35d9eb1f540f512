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

use crate::limits::{PROMPTS_MAX, PROMPT_PIECES_MAX};
use serde::de::{self, DeserializeSeed, SeqAccess, Visitor};
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
    /// llama.cpp's `{"prompt_string": TEXT, "multimodal_data": [BASE64, ...]}`: text whose
    /// media markers stand for the images, in order.
    Multimodal {
        text: String,
        images: Vec<String>,
    },
}

#[derive(Debug, Clone)]
pub struct Prompt(pub Vec<PromptPiece>);

/// One prompt or several, as llama-server reads `prompt`, `input` and `content`: a string, a
/// list of token ids, or a mixed list of strings and ids is one prompt; a list of strings, of
/// token lists, or of prompt objects (`{"prompt_string": ...}` or `{"content": [text parts]}`)
/// is several. Read as it streams, never through a `serde_json::Value`: at most
/// [`PROMPTS_MAX`] prompts of at most [`PROMPT_PIECES_MAX`] pieces in all, so no request
/// costs more than its pieces.
#[derive(Debug, Clone)]
pub struct Prompts(pub Vec<Prompt>);

impl<'de> Deserialize<'de> for Prompts {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(PromptVisitor { outer: true })
            .map(|e| match e {
                Element::Piece(p) => Prompts(vec![Prompt(vec![p])]),
                Element::One(p) => Prompts(vec![p]),
                Element::Many(ps) => Prompts(ps),
            })
    }
}

impl<'de> Deserialize<'de> for Prompt {
    /// Exactly one prompt (the routes that take one).
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let mut ps = Prompts::deserialize(d)?.0;
        match ps.len() {
            1 => Ok(ps.remove(0)),
            _ => Err(de::Error::custom(ONE_PROMPT)),
        }
    }
}

const PROMPT_SHAPE: &str =
    "a prompt is a string, a list of strings and token ids, or a prompt object; several prompts are a list of those";
const ONE_PROMPT: &str = "only one prompt is supported here";

/// A value read where a prompt may stand.
enum Element {
    /// A string or a token id.
    Piece(PromptPiece),
    /// A prompt list or a prompt object.
    One(Prompt),
    /// Several prompts (only at the outermost level).
    Many(Vec<Prompt>),
}

/// `{"prompt_string": "...", "multimodal_data": [...]}` or `{"content": [{"type": "text",
/// "text": "..."}, ...]}`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PromptObject {
    #[serde(default)]
    prompt_string: Option<String>,
    #[serde(default)]
    multimodal_data: Option<Vec<String>>,
    #[serde(default)]
    content: Option<Vec<TextPart>>,
}

#[derive(Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
enum TextPart {
    Text { text: String },
}

struct PromptVisitor {
    /// The outermost value, which may be a list of prompts.
    outer: bool,
}

impl<'de> Visitor<'de> for PromptVisitor {
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
    fn visit_map<A: de::MapAccess<'de>>(self, map: A) -> Result<Element, A::Error> {
        let obj = PromptObject::deserialize(de::value::MapAccessDeserializer::new(map))?;
        if let Some(images) = obj.multimodal_data {
            let (Some(text), None) = (obj.prompt_string, obj.content) else {
                return Err(de::Error::custom(
                    "`multimodal_data` goes with `prompt_string`, the text its markers are in",
                ));
            };
            return Ok(Element::One(Prompt(vec![PromptPiece::Multimodal {
                text,
                images,
            }])));
        }
        let text = match (obj.prompt_string, obj.content) {
            (Some(s), None) => s,
            (None, Some(parts)) => parts
                .into_iter()
                .map(|TextPart::Text { text }| text)
                .collect(),
            _ => {
                return Err(de::Error::custom(
                    "a prompt object has `prompt_string` or `content` (a list of text parts)",
                ))
            }
        };
        Ok(Element::One(Prompt(vec![PromptPiece::Text(text)])))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Element, A::Error> {
        let mut elements = Vec::new();
        let mut pieces = 0usize;
        while let Some(e) = seq.next_element_seed(PromptSeed { outer: false })? {
            if !self.outer && !matches!(e, Element::Piece(_)) {
                return Err(de::Error::custom(
                    "a prompt list holds strings and token ids only",
                ));
            }
            pieces += match &e {
                Element::One(p) => p.0.len(),
                _ => 1,
            };
            if pieces > PROMPT_PIECES_MAX {
                return Err(de::Error::custom(format!(
                    "a prompt list holds at most {PROMPT_PIECES_MAX} pieces"
                )));
            }
            elements.push(e);
        }
        let all_pieces = elements.iter().all(|e| matches!(e, Element::Piece(_)));
        let any_token = elements
            .iter()
            .any(|e| matches!(e, Element::Piece(PromptPiece::Token(_))));
        if !self.outer || (all_pieces && any_token) || elements.len() == 1 && all_pieces {
            // token ids, or strings mixed with them: one prompt
            let pieces = elements.into_iter().filter_map(|e| match e {
                Element::Piece(p) => Some(p),
                _ => None,
            });
            return Ok(Element::One(Prompt(pieces.collect())));
        }
        if elements.is_empty() {
            return Err(de::Error::custom("the list of prompts is empty"));
        }
        if elements.len() > PROMPTS_MAX {
            return Err(de::Error::custom(format!(
                "at most {PROMPTS_MAX} prompts per request, got {}",
                elements.len()
            )));
        }
        elements
            .into_iter()
            .map(|e| match e {
                Element::Piece(PromptPiece::Text(s)) => Ok(Prompt(vec![PromptPiece::Text(s)])),
                Element::One(p) => Ok(p),
                _ => Err(de::Error::custom(
                    "a list of prompts holds strings, token lists or prompt objects, not bare token ids",
                )),
            })
            .collect::<Result<_, _>>()
            .map(Element::Many)
    }
}

#[derive(Clone, Copy)]
struct PromptSeed {
    outer: bool,
}

impl<'de> DeserializeSeed<'de> for PromptSeed {
    type Value = Element;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Element, D::Error> {
        d.deserialize_any(PromptVisitor { outer: self.outer })
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

    /// llama-server's rules for one prompt against several (its test_embedding's cases).
    #[test]
    fn several_prompts() {
        let n = |json: &str| serde_json::from_str::<Prompts>(json).map(|p| p.0.len());
        for (json, count) in [
            (r#""""#, 1),
            (r#""string""#, 1),
            ("[12, 34, 56]", 1),
            (r#"[12, 34, "string", 56, 78]"#, 1),
            (r#"["string"]"#, 1),
            (r#"["string1", "string2"]"#, 2),
            (r#"["string1", [12, 34, 56]]"#, 2),
            ("[[12, 34, 56], [12, 34, 56]]", 2),
            (r#"[[12, 34, 56], [12, "string", 34, 56]]"#, 2),
            (r#"{"prompt_string": "string"}"#, 1),
            (r#"{"content": [{"type": "text", "text": "string"}]}"#, 1),
            (
                r#"["s1", {"prompt_string": "s2"}, {"content": [{"type": "text", "text": "s3"}]}]"#,
                3,
            ),
        ] {
            assert_eq!(n(json).unwrap(), count, "{json}");
        }
        let p: Prompts = serde_json::from_str(
            r#"{"content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "world"}]}"#,
        )
        .unwrap();
        assert!(matches!(p.0[0].0.as_slice(), [PromptPiece::Text(s)] if s == "hello world"));
        for bad in [
            "[]",
            "true",
            r#"{"content": "string"}"#,
            r#"{"content": [{"type": "unknown"}]}"#,
            r#"{"content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}"#,
            r#"{"prompt_string": "a", "content": []}"#,
            r#"{"other": 1}"#,
            r#"[1, "a", [2]]"#,
            r#"[[{"prompt_string": "a"}]]"#,
            "[[[1]]]",
        ] {
            assert!(n(bad).is_err(), "{bad}");
        }
        let many = format!("[{}\"x\"]", "\"x\",".repeat(crate::limits::PROMPTS_MAX));
        let err = n(&many).unwrap_err();
        assert!(err.to_string().contains("prompts per request"), "{err}");
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
