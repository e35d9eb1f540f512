//! The tokenizer read from GGUF metadata (`tokenizer.ggml.*`), reproducing llama.cpp b11434's
//! `llama_vocab`: token attributes, special-token ids and end-of-generation set, the
//! special-token partition, BPE and SentencePiece encoding, and detokenization.

use std::collections::{BTreeSet, HashMap};

use muser_gguf::{Array, Value};

use crate::bpe::Bpe;
use crate::error::{Result, TextError};
use crate::meta::Meta;
use crate::pretok::PreTokenizer;
use crate::spm;

/// Token attribute bits (llama.cpp's `llama_token_attr`).
pub mod attr {
    pub const UNDEFINED: u32 = 0;
    pub const UNKNOWN: u32 = 1 << 0;
    pub const UNUSED: u32 = 1 << 1;
    pub const NORMAL: u32 = 1 << 2;
    pub const CONTROL: u32 = 1 << 3;
    pub const USER_DEFINED: u32 = 1 << 4;
    pub const BYTE: u32 = 1 << 5;
}

/// Upper bound on the vocabulary size read from a file.
const MAX_VOCAB: usize = 1 << 22;

/// Which algorithm turns raw text into tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenizerKind {
    /// Byte-level BPE (`tokenizer.ggml.model = "gpt2"`) with a pre-tokenizer.
    Bpe(PreTokenizer),
    /// SentencePiece-style (`tokenizer.ggml.model = "llama"`): score-driven merges with byte
    /// fallback, spaces written as U+2581.
    Spm,
}

#[derive(Clone, Debug)]
struct TokenData {
    text: String,
    score: f32,
    attr: u32,
}

/// Text to token ids and back, exactly as llama.cpp does for the same GGUF.
pub struct Tokenizer {
    kind: TokenizerKind,
    tokens: Vec<TokenData>,
    token_to_id: HashMap<String, u32>,
    /// CONTROL, USER_DEFINED and UNKNOWN tokens, longest text first.
    specials: Vec<u32>,
    pieces: Vec<Box<[u8]>>,
    bpe: Option<Bpe>,
    bos: Option<u32>,
    eos: Option<u32>,
    eot: Option<u32>,
    eom: Option<u32>,
    eog: BTreeSet<u32>,
    fim: Fim,
    add_bos: bool,
    add_eos: bool,
    add_space_prefix: bool,
    clean_spaces: bool,
    /// The most input bytes one token can stand for (its text or piece, whichever is longer).
    max_token_bytes: usize,
}

/// Fill-in-the-middle tokens (from the GGUF's ids, else found by text as llama.cpp finds
/// them): prefix, suffix and middle mark the parts of an infill prompt; repo and file
/// separator, where present, introduce extra files.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Fim {
    pub pre: Option<u32>,
    pub suf: Option<u32>,
    pub mid: Option<u32>,
    pub rep: Option<u32>,
    pub sep: Option<u32>,
}

/// One piece of the input after the special-token partition.
#[derive(Clone, Copy, Debug)]
enum Fragment {
    Raw(usize, usize),
    Token(u32),
}

struct PreInfo {
    pre: PreTokenizer,
    clean_spaces: bool,
    ignore_merges: bool,
    add_bos: bool,
}

fn bpe_pre(name: &str) -> Option<PreInfo> {
    use PreTokenizer::*;
    let (pre, clean_spaces, ignore_merges, add_bos) = match name {
        "gpt-2" | "phi-2" | "jina-es" | "jina-de" | "gigachat" | "jina-v2-es" | "jina-v2-de"
        | "a.x-4.0" | "mellum" | "modern-bert" | "mpt" | "olmo" | "jais" | "exaone4" => {
            (Gpt2, true, false, false)
        }
        "trillion" | "granite-docling" => (Gpt2, false, false, false),
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0"
        | "lfm2" | "jina-v5-nano" => (Llama3, true, true, true),
        "dbrx" | "smaug-bpe" => (Llama3, true, false, false),
        "smollm" => (SmolLm, false, false, false),
        "starcoder" | "refact" | "codeshell" | "exaone" | "minerva-7b" | "mellum2" => {
            (SmolLm, true, false, false)
        }
        "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "hunyuan" => {
            (Qwen2, false, false, false)
        }
        "stablelm2" | "megrez" => (Qwen2, true, false, false),
        _ => return None,
    };
    Some(PreInfo {
        pre,
        clean_spaces,
        ignore_merges,
        add_bos,
    })
}

/// Token texts that llama.cpp recognises as end-of-turn when `eot_token_id` is absent.
const EOT_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
];
const EOM_TEXTS: &[&str] = &["<|eom_id|>"];
const FIM_PAD_TEXTS: &[&str] = &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"];
const FIM_REP_TEXTS: &[&str] = &[
    "<|fim_repo|>",
    "<|repo_name|>",
    "<fim-repo>",
    "<REPO>",
    "<reponame>",
];
const FIM_SEP_TEXTS: &[&str] = &["<|file_sep|>"];
const FIM_PRE_TEXTS: &[&str] = &[
    "<|fim_prefix|>",
    "<fim-prefix>",
    "<fim_prefix>",
    "<｜fim▁begin｜>",
    "<PRE>",
    "▁<PRE>",
    "<|code_prefix|>",
    "<|prefix|>",
];
const FIM_SUF_TEXTS: &[&str] = &[
    "<|fim_suffix|>",
    "<fim-suffix>",
    "<fim_suffix>",
    "<｜fim▁hole｜>",
    "<SUF>",
    "▁<SUF>",
    "<|code_suffix|>",
    "<|suffix|>",
];
const FIM_MID_TEXTS: &[&str] = &[
    "<|fim_middle|>",
    "<fim-middle>",
    "<fim_middle>",
    "<｜fim▁end｜>",
    "<MID>",
    "▁<MID>",
    "<|code_middle|>",
    "<|middle|>",
];
/// Token texts that always end generation.
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];
/// Tokens forced to USER_DEFINED (always parsed, always rendered): llama.cpp's GPT-OSS rule.
const FORCED_USER_DEFINED: &[&str] = &["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"];

impl Tokenizer {
    /// Builds the tokenizer from a GGUF file's metadata.
    pub fn from_gguf(gguf: &muser_gguf::GgufFile) -> Result<Tokenizer> {
        Self::from_metadata(gguf.metadata())
    }

    /// Builds the tokenizer from GGUF metadata pairs.
    pub fn from_metadata(pairs: &[(String, Value)]) -> Result<Tokenizer> {
        let meta = Meta::new(pairs);
        let model = meta
            .str_opt("tokenizer.ggml.model")?
            .ok_or_else(|| TextError::MissingKey("tokenizer.ggml.model".into()))?;
        let pre_name = meta.str_opt("tokenizer.ggml.pre")?.unwrap_or("");

        // Per-model defaults (llama-vocab.cpp `load`).
        let (
            kind,
            mut bos,
            mut eos,
            mut unk,
            mut add_bos,
            mut add_space_prefix,
            clean_spaces,
            ignore_merges,
        );
        match model {
            "gpt2" => {
                let info = bpe_pre(pre_name).ok_or_else(|| {
                    TextError::UnknownPreTokenizer(if pre_name.is_empty() {
                        "(missing)".into()
                    } else {
                        pre_name.into()
                    })
                })?;
                kind = TokenizerKind::Bpe(info.pre);
                bos = Some(11);
                eos = Some(11);
                unk = None;
                add_bos = info.add_bos;
                add_space_prefix = false;
                clean_spaces = info.clean_spaces;
                ignore_merges = info.ignore_merges;
            }
            "llama" => {
                kind = TokenizerKind::Spm;
                bos = Some(1);
                eos = Some(2);
                unk = Some(0);
                add_bos = true;
                add_space_prefix = true;
                clean_spaces = false;
                ignore_merges = false;
            }
            other => return Err(TextError::UnknownModel(other.to_string())),
        }
        let mut add_eos = false;
        if let Some(v) = meta.bool_opt("tokenizer.ggml.add_space_prefix")? {
            add_space_prefix = v;
        }

        let texts = meta
            .str_array_opt("tokenizer.ggml.tokens")?
            .ok_or_else(|| TextError::MissingKey("tokenizer.ggml.tokens".into()))?;
        let n = texts.len();
        if n == 0 || n > MAX_VOCAB {
            return Err(TextError::InvalidVocab(format!(
                "{n} tokens (expected 1..={MAX_VOCAB})"
            )));
        }
        let scores: Option<Vec<f32>> = match meta.array_opt("tokenizer.ggml.scores")? {
            None => None,
            Some(Array::F32(s)) => Some(s.clone()),
            Some(Array::I32(s)) => Some(s.iter().map(|&x| x as f32).collect()),
            Some(a) => {
                return Err(TextError::WrongType {
                    key: "tokenizer.ggml.scores".into(),
                    expected: "array[f32] or array[i32]",
                    found: a.type_desc(),
                })
            }
        };
        if scores.as_ref().is_some_and(|s| s.len() < n) {
            return Err(TextError::InvalidVocab("fewer scores than tokens".into()));
        }
        let types: Option<&[i32]> = match meta.array_opt("tokenizer.ggml.token_type")? {
            None => None,
            Some(Array::I32(t)) => Some(t),
            Some(a) => {
                return Err(TextError::WrongType {
                    key: "tokenizer.ggml.token_type".into(),
                    expected: "array[i32]",
                    found: a.type_desc(),
                })
            }
        };
        if types.is_some_and(|t| t.len() < n) {
            return Err(TextError::InvalidVocab(
                "fewer token types than tokens".into(),
            ));
        }

        let mut tokens = Vec::with_capacity(n);
        let mut token_to_id = HashMap::with_capacity(n);
        for (i, text) in texts.iter().enumerate() {
            let text = if text.is_empty() {
                format!("[EMPTY_{i}]")
            } else {
                text.clone()
            };
            // Later duplicates win, as in llama.cpp's map assignment.
            token_to_id.insert(text.clone(), i as u32);
            let attr = match types.map(|t| t[i]) {
                None => attr::NORMAL,
                Some(1) => attr::NORMAL,
                Some(2) => attr::UNKNOWN,
                Some(3) => attr::CONTROL,
                Some(4) => attr::USER_DEFINED,
                Some(5) => attr::UNUSED,
                Some(6) => attr::BYTE,
                Some(_) => attr::UNDEFINED,
            };
            tokens.push(TokenData {
                text,
                score: scores.as_ref().map_or(0.0, |s| s[i]),
                attr,
            });
        }

        let bpe = match kind {
            TokenizerKind::Bpe(pre) => {
                let merges = meta
                    .str_array_opt("tokenizer.ggml.merges")?
                    .ok_or_else(|| TextError::MissingKey("tokenizer.ggml.merges".into()))?;
                Some(Bpe::new(pre, ignore_merges, merges, &token_to_id))
            }
            TokenizerKind::Spm => None,
        };

        // Special token ids: defaults out of range are disabled; keys override when in range.
        let in_range = |id: Option<u32>| id.filter(|&i| (i as usize) < n);
        bos = in_range(bos);
        eos = in_range(eos);
        unk = in_range(unk);
        let read_id = |key: &str, cur: Option<u32>| -> Result<Option<u32>> {
            Ok(match meta.u32_opt(key)? {
                Some(v) if (v as usize) < n => Some(v),
                _ => cur,
            })
        };
        bos = read_id("tokenizer.ggml.bos_token_id", bos)?;
        eos = read_id("tokenizer.ggml.eos_token_id", eos)?;
        let mut eot = read_id("tokenizer.ggml.eot_token_id", None)?;
        let mut eom = read_id("tokenizer.ggml.eom_token_id", None)?;
        let _ = read_id("tokenizer.ggml.unknown_token_id", unk)?;
        let mut fim_pre = read_id("tokenizer.ggml.fim_pre_token_id", None)?;
        let mut fim_suf = read_id("tokenizer.ggml.fim_suf_token_id", None)?;
        let mut fim_mid = read_id("tokenizer.ggml.fim_mid_token_id", None)?;
        let mut fim_pad = read_id("tokenizer.ggml.fim_pad_token_id", None)?;
        let mut fim_rep = read_id("tokenizer.ggml.fim_rep_token_id", None)?;
        let mut fim_sep = read_id("tokenizer.ggml.fim_sep_token_id", None)?;
        fim_pre = read_id("tokenizer.ggml.prefix_token_id", fim_pre)?;
        fim_suf = read_id("tokenizer.ggml.suffix_token_id", fim_suf)?;
        fim_mid = read_id("tokenizer.ggml.middle_token_id", fim_mid)?;

        if let Some(v) = meta.bool_opt("tokenizer.ggml.add_bos_token")? {
            add_bos = v;
        }
        if let Some(v) = meta.bool_opt("tokenizer.ggml.add_eos_token")? {
            add_eos = v;
        }

        // Auto-detection by token text. llama.cpp walks a hash map, so when several texts of
        // one kind exist its pick is unspecified; Muser takes the lowest id, deterministically.
        let find = |list: &[&str]| -> Option<u32> {
            list.iter()
                .filter_map(|t| token_to_id.get(*t).copied())
                .min()
        };
        let mut force_control = Vec::new();
        {
            let mut detect = |slot: &mut Option<u32>, list: &[&str]| {
                if slot.is_none() {
                    if let Some(id) = find(list) {
                        *slot = Some(id);
                        force_control.push(id);
                    }
                }
            };
            detect(&mut eot, EOT_TEXTS);
            detect(&mut eom, EOM_TEXTS);
            detect(&mut fim_pre, FIM_PRE_TEXTS);
            detect(&mut fim_suf, FIM_SUF_TEXTS);
            detect(&mut fim_mid, FIM_MID_TEXTS);
            detect(&mut fim_pad, FIM_PAD_TEXTS);
            detect(&mut fim_rep, FIM_REP_TEXTS);
            detect(&mut fim_sep, FIM_SEP_TEXTS);
        }
        for id in force_control {
            tokens[id as usize].attr |= attr::CONTROL;
        }
        // Control tokens named "unused" are unused.
        for t in tokens.iter_mut() {
            if t.attr & attr::CONTROL != 0 && t.text.contains("unused") {
                t.attr |= attr::UNUSED;
            }
        }

        let mut eog = BTreeSet::new();
        eog.extend(fim_pad);
        eog.extend(fim_rep);
        eog.extend(fim_sep);
        for text in EOG_TEXTS {
            if let Some(&id) = token_to_id.get(*text) {
                eog.insert(id);
                tokens[id as usize].attr |= attr::CONTROL;
            }
        }
        for text in FORCED_USER_DEFINED {
            if let Some(&id) = token_to_id.get(*text) {
                tokens[id as usize].attr = attr::USER_DEFINED;
            }
        }
        eog.extend(eos);
        eog.extend(eot);
        eog.extend(eom);
        let mut demote = Vec::new();
        // o200k_harmony / solar-open: `<|end|>` is not end-of-generation there.
        let eog_with = |eog: &BTreeSet<u32>, t: &str| {
            eog.iter()
                .copied()
                .find(|&id| tokens[id as usize].text == t)
        };
        let has = |eog: &BTreeSet<u32>, t: &str| eog_with(eog, t).is_some();
        let harmony = has(&eog, "<|return|>") && (has(&eog, "<|call|>") || has(&eog, "<|calls|>"));
        let solar = has(&eog, "<|calls|>") && has(&eog, "<|flush|>");
        if let (true, Some(end)) = (harmony || solar, eog_with(&eog, "<|end|>")) {
            eog.remove(&end);
            demote.push((end, attr::USER_DEFINED));
        }
        // Gemma 4 and PLaMo: `</s>` is a normal token there.
        let normal_s = has(&eog, "<|tool_response>") || has(&eog, "<|plamo:eos|>");
        if let (true, Some(s)) = (normal_s, eog_with(&eog, "</s>")) {
            eog.remove(&s);
            demote.push((s, attr::NORMAL));
        }
        for (id, a) in demote {
            tokens[id as usize].attr = a;
        }

        let mut specials: Vec<u32> = (0..n as u32)
            .filter(|&id| {
                tokens[id as usize].attr & (attr::CONTROL | attr::USER_DEFINED | attr::UNKNOWN) != 0
            })
            .collect();
        specials.sort_by(|&a, &b| {
            tokens[b as usize]
                .text
                .len()
                .cmp(&tokens[a as usize].text.len())
                .then(a.cmp(&b))
        });

        let mut tok = Tokenizer {
            kind,
            tokens,
            token_to_id,
            specials,
            pieces: Vec::new(),
            bpe,
            bos,
            eos,
            eot,
            eom,
            eog,
            fim: Fim {
                pre: fim_pre,
                suf: fim_suf,
                mid: fim_mid,
                rep: fim_rep,
                sep: fim_sep,
            },
            add_bos,
            add_eos,
            add_space_prefix,
            clean_spaces,
            max_token_bytes: 1,
        };
        tok.pieces = (0..n as u32)
            .map(|id| tok.compute_piece(id).into_boxed_slice())
            .collect();
        tok.max_token_bytes = (tok.tokens.iter().map(|t| t.text.len()))
            .chain(tok.pieces.iter().map(|p| p.len()))
            .max()
            .unwrap_or(1)
            .max(1);
        Ok(tok)
    }

    /// Number of tokens in the vocabulary.
    pub fn n_vocab(&self) -> usize {
        self.tokens.len()
    }
    /// The encoding algorithm.
    pub fn kind(&self) -> TokenizerKind {
        self.kind
    }
    pub fn bos(&self) -> Option<u32> {
        self.bos
    }
    pub fn eos(&self) -> Option<u32> {
        self.eos
    }
    pub fn eot(&self) -> Option<u32> {
        self.eot
    }
    pub fn eom(&self) -> Option<u32> {
        self.eom
    }
    /// The fill-in-the-middle tokens.
    pub fn fim(&self) -> Fim {
        self.fim
    }
    /// Whether BOS is prepended when encoding with `add_special`.
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }
    /// Whether EOS is appended when encoding with `add_special`.
    pub fn add_eos(&self) -> bool {
        self.add_eos
    }
    /// Whether `id` ends generation.
    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.contains(&id)
    }
    /// The end-of-generation ids, ascending.
    pub fn eog_ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.eog.iter().copied()
    }
    /// The token's text as stored in the vocabulary ("" for an id out of range).
    pub fn token_text(&self, id: u32) -> &str {
        self.tokens.get(id as usize).map_or("", |t| t.text.as_str())
    }
    /// The token's attribute bits (see [`attr`]); 0 for an id out of range.
    pub fn token_attr(&self, id: u32) -> u32 {
        self.tokens.get(id as usize).map_or(0, |t| t.attr)
    }
    /// The id of a token by exact text.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.token_to_id.get(text).copied()
    }

    /// Encodes `text`. `add_special` adds BOS/EOS as the model asks; `parse_special` lets
    /// control tokens written in the text become their ids (user-defined tokens always do).
    pub fn encode(&self, text: &str, add_special: bool, parse_special: bool) -> Vec<u32> {
        self.encode_at_most(text, add_special, parse_special, usize::MAX)
            .unwrap_or_default()
    }

    /// [`Self::encode`], refused once the text is known to give more than `max_tokens`
    /// tokens, before the work of encoding all of it: a text longer than `max_tokens` times
    /// the longest token is refused outright, and encoding stops at the first word past the
    /// limit. `None` when refused.
    pub fn encode_at_most(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
        max_tokens: usize,
    ) -> Option<Vec<u32>> {
        // every token stands for at most `max_token_bytes` bytes of the text
        if text.len().div_ceil(self.max_token_bytes) > max_tokens {
            return None;
        }
        let fragments = self.partition(text, parse_special);
        let mut out = Vec::with_capacity((text.len() / 3 + 2).min(max_tokens.saturating_add(1)));
        if add_special && self.add_bos {
            out.extend(self.bos);
        }
        match self.kind {
            TokenizerKind::Bpe(_) => {
                let bpe = self
                    .bpe
                    .as_ref()
                    .expect("BPE tables exist for a BPE tokenizer");
                for f in fragments {
                    match f {
                        Fragment::Raw(a, b) => {
                            bpe.encode(&text[a..b], &self.token_to_id, &mut out, max_tokens)
                        }
                        Fragment::Token(id) => out.push(id),
                    }
                    if out.len() > max_tokens {
                        return None;
                    }
                }
            }
            TokenizerKind::Spm => {
                let mut prev_special = true;
                for f in fragments {
                    match f {
                        Fragment::Raw(a, b) => {
                            let mut s = String::with_capacity(b - a + 3);
                            if self.add_space_prefix && prev_special {
                                s.push(' ');
                            }
                            s.push_str(&text[a..b]);
                            let escaped = s.replace(' ', "\u{2581}");
                            spm::encode(&escaped, self, &mut out);
                            prev_special = false;
                        }
                        Fragment::Token(id) => {
                            out.push(id);
                            prev_special = true;
                        }
                    }
                    if out.len() > max_tokens {
                        return None;
                    }
                }
            }
        }
        if add_special && self.add_eos {
            out.extend(self.eos);
        }
        (out.len() <= max_tokens).then_some(out)
    }

    /// Splits out special tokens, longest text first, each at every occurrence left to right.
    fn partition(&self, text: &str, parse_special: bool) -> Vec<Fragment> {
        let mut frags = Vec::new();
        if text.is_empty() {
            return frags;
        }
        frags.push(Fragment::Raw(0, text.len()));
        for &id in &self.specials {
            let t = &self.tokens[id as usize];
            if !parse_special && t.attr & (attr::CONTROL | attr::UNKNOWN) != 0 {
                continue;
            }
            let pat = t.text.as_str();
            if !frags
                .iter()
                .any(|f| matches!(*f, Fragment::Raw(a, b) if text[a..b].contains(pat)))
            {
                continue;
            }
            let mut next = Vec::with_capacity(frags.len() + 2);
            for f in frags {
                let Fragment::Raw(mut a, b) = f else {
                    next.push(f);
                    continue;
                };
                while let Some(i) = text[a..b].find(pat) {
                    if i > 0 {
                        next.push(Fragment::Raw(a, a + i));
                    }
                    next.push(Fragment::Token(id));
                    a += i + pat.len();
                }
                if a < b {
                    next.push(Fragment::Raw(a, b));
                }
            }
            frags = next;
        }
        frags
    }

    /// The bytes a token stands for. With `special` false, control and unknown tokens give
    /// nothing; user-defined tokens always give their text.
    pub fn token_to_piece(&self, id: u32, special: bool) -> &[u8] {
        let Some(t) = self.tokens.get(id as usize) else {
            return &[];
        };
        if !special && t.attr & (attr::UNKNOWN | attr::CONTROL) != 0 {
            return &[];
        }
        &self.pieces[id as usize]
    }

    fn compute_piece(&self, id: u32) -> Vec<u8> {
        let t = &self.tokens[id as usize];
        if t.attr & (attr::UNKNOWN | attr::CONTROL | attr::USER_DEFINED) != 0 {
            return t.text.as_bytes().to_vec();
        }
        if t.attr & attr::NORMAL != 0 {
            return match self.kind {
                TokenizerKind::Spm => t.text.replace('\u{2581}', " ").into_bytes(),
                TokenizerKind::Bpe(_) => decode_gpt2_text(&t.text),
            };
        }
        if t.attr & attr::BYTE != 0 {
            return vec![byte_token_value(&t.text)];
        }
        Vec::new()
    }

    /// llama.cpp's `llama_detokenize`: concatenated pieces, optionally without the added
    /// BOS/EOS (`remove_special`), with the model's space clean-up rules.
    pub fn detokenize(&self, ids: &[u32], remove_special: bool, unparse_special: bool) -> Vec<u8> {
        let mut ids = ids;
        let mut remove_space = self.add_space_prefix;
        if remove_special && self.add_bos && !ids.is_empty() && Some(ids[0]) == self.bos {
            remove_space = false;
            ids = &ids[1..];
        }
        if remove_special && self.add_eos && !ids.is_empty() && Some(ids[ids.len() - 1]) == self.eos
        {
            ids = &ids[..ids.len() - 1];
        }
        let mut text = Vec::new();
        for &id in ids {
            let mut piece = self.token_to_piece(id, unparse_special);
            if remove_space && piece.first() == Some(&b' ') {
                piece = &piece[1..];
            }
            remove_space = false;
            text.extend_from_slice(piece);
        }
        if self.clean_spaces {
            clean_up_spaces(&mut text);
        }
        text
    }

    /// [`Tokenizer::detokenize`] without removing anything, as text (invalid UTF-8 replaced).
    pub fn decode(&self, ids: &[u32], special: bool) -> String {
        String::from_utf8_lossy(&self.detokenize(ids, false, special)).into_owned()
    }

    pub(crate) fn score(&self, id: u32) -> f32 {
        self.tokens[id as usize].score
    }
}

/// Maps GPT-2 stand-in characters back to bytes; a character outside the map is written as
/// llama.cpp does (`[UNK_BYTE_0x..` + the token text + `]`).
fn decode_gpt2_text(text: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(text.len());
    for c in text.chars() {
        match crate::unicode::char_to_byte(c) {
            Some(b) => out.push(b),
            None => {
                out.extend_from_slice(b"[UNK_BYTE_0x");
                let mut buf = [0u8; 4];
                for b in c.encode_utf8(&mut buf).bytes() {
                    out.extend_from_slice(format!("{b:02x}").as_bytes());
                }
                out.extend_from_slice(text.as_bytes());
                out.push(b']');
            }
        }
    }
    out
}

/// The byte of a `<0xXX>` token (`strtol` on the two characters after `<0x`).
fn byte_token_value(text: &str) -> u8 {
    let hex = text.get(3..5).unwrap_or("");
    let mut v: u32 = 0;
    for c in hex.chars() {
        match c.to_digit(16) {
            Some(d) => v = v * 16 + d,
            None => break,
        }
    }
    v as u8
}

/// llama.cpp's three clean-up passes: drop the space before `?!.,`, collapse ` ' ` to `'`,
/// and drop the space before `'s`, `'m`, `'re`, `'ve`.
fn clean_up_spaces(text: &mut Vec<u8>) {
    // Pass 1.
    let mut out: Vec<u8> = Vec::with_capacity(text.len());
    for (i, &x) in text.iter().enumerate() {
        if i > 0 && text[i - 1] == b' ' && matches!(x, b'?' | b'!' | b'.' | b',') {
            out.pop();
        }
        out.push(x);
    }
    // Pass 2: `a ' b` -> `a'b` (the next space is replaced by NUL then skipped over).
    let mut t2 = out;
    let mut out: Vec<u8> = Vec::with_capacity(t2.len());
    let mut i = 0;
    while i < t2.len() {
        let x = t2[i];
        if i > 0 && x == b'\'' && i + 1 < t2.len() && t2[i - 1] == b' ' && t2[i + 1] == b' ' {
            out.pop();
            t2[i + 1] = 0;
            out.push(x);
            i += 2;
            continue;
        }
        out.push(x);
        i += 1;
    }
    // Pass 3.
    let t = out;
    let mut out: Vec<u8> = Vec::with_capacity(t.len());
    for (i, &x) in t.iter().enumerate() {
        if i > 0 && t[i - 1] == b' ' && x == b'\'' && i + 1 < t.len() {
            let x1 = t[i + 1];
            let drop = match x1 {
                b's' | b'm' => true,
                b'r' | b'v' => i + 2 < t.len() && t[i + 2] == b'e',
                _ => false,
            };
            if drop {
                out.pop();
            }
        }
        out.push(x);
    }
    *text = out;
}
