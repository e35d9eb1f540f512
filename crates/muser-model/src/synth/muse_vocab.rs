//! Muse's special tokens and chat template, for `Vocab::from_donor`.
//! TEMPORARY: muser-text will own these (`muser_text::muse::{SPECIAL_TOKENS, CHAT_TEMPLATE}`);
//! this copy goes away once it does.

/// Tokens the Muse template, output parser and image wrapper use (spec §3.2).
pub const SPECIAL_TOKENS: &[&str] = &[
    "<|start|>",
    "<|message|>",
    "<|eom|>",
    "<|eot|>",
    "<|patch|>",
    "<|video|>",
    "<|image_start|>",
    "<|image_end|>",
    "<|endoftext|>",
];

/// `models/templates/muse-glimmer.jinja` of llama.cpp b11434.
pub const CHAT_TEMPLATE: &str = include_str!("muse-glimmer.jinja");
