//! Codepoint classes exactly as llama.cpp's pre-tokenizers see them (its own tables, generated
//! into `unicode_tables.rs`), and GPT-2's byte-to-character map.

use std::sync::OnceLock;

use crate::unicode_tables::{CATEGORY_RANGES, LOWERCASE_TO_ASCII, WHITESPACE};

const MAX_CODEPOINT: u32 = 0x11_0000;

/// Category bits of one codepoint (llama.cpp's `unicode_cpt_flags` layout) plus whitespace.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Flags(u16);

impl Flags {
    pub const UNDEFINED: u16 = 0x0001;
    pub const NUMBER: u16 = 0x0002;
    pub const LETTER: u16 = 0x0004;
    pub const WHITESPACE: u16 = 0x0100;

    /// Flags of a position outside the current fragment: none at all.
    pub const NONE: Flags = Flags(0);

    pub fn is_letter(self) -> bool {
        self.0 & Self::LETTER != 0
    }
    pub fn is_number(self) -> bool {
        self.0 & Self::NUMBER != 0
    }
    pub fn is_whitespace(self) -> bool {
        self.0 & Self::WHITESPACE != 0
    }
    /// True for every real codepoint (each has a category, if only "undefined").
    pub fn any(self) -> bool {
        self.0 != 0
    }
}

fn table() -> &'static [u16] {
    static TABLE: OnceLock<Box<[u16]>> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut t = vec![Flags::UNDEFINED; MAX_CODEPOINT as usize].into_boxed_slice();
        for w in CATEGORY_RANGES.windows(2) {
            let (start, flags) = w[0];
            let end = w[1].0;
            t[start as usize..end as usize].fill(u16::from(flags));
        }
        for &c in WHITESPACE.iter() {
            t[c as usize] |= Flags::WHITESPACE;
        }
        t
    })
}

/// The flags of codepoint `c`.
pub(crate) fn flags(c: u32) -> Flags {
    match table().get(c as usize) {
        Some(&f) => Flags(f),
        None => Flags(Flags::UNDEFINED),
    }
}

/// llama.cpp's `unicode_tolower`, reduced to what the contraction matchers compare against
/// (ASCII letters): returns the ASCII lowercase of `c`, or `c` itself.
pub(crate) fn to_lower_ascii(c: u32) -> u32 {
    match LOWERCASE_TO_ASCII.binary_search_by_key(&c, |&(k, _)| k) {
        Ok(i) => u32::from(LOWERCASE_TO_ASCII[i].1),
        Err(_) => c,
    }
}

/// GPT-2's printable stand-in for each byte: `!`..`~`, `¡`..`¬`, `®`..`ÿ` stand for themselves,
/// the other 68 bytes map to U+0100.. in increasing byte order.
pub(crate) fn byte_to_char_table() -> &'static [char; 256] {
    static TABLE: OnceLock<[char; 256]> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut t = ['\0'; 256];
        let mut n = 0u32;
        for (b, slot) in t.iter_mut().enumerate() {
            let b = b as u32;
            let printable = (0x21..=0x7E).contains(&b)
                || (0xA1..=0xAC).contains(&b)
                || (0xAE..=0xFF).contains(&b);
            let c = if printable {
                b
            } else {
                n += 1;
                0x100 + n - 1
            };
            *slot = char::from_u32(c).unwrap_or('\u{FFFD}');
        }
        t
    })
}

/// The byte that a GPT-2 stand-in character encodes, if it is one.
pub(crate) fn char_to_byte(c: char) -> Option<u8> {
    static INVERSE: OnceLock<std::collections::HashMap<char, u8>> = OnceLock::new();
    let inv = INVERSE.get_or_init(|| {
        byte_to_char_table()
            .iter()
            .enumerate()
            .map(|(b, &c)| (c, b as u8))
            .collect()
    });
    inv.get(&c).copied()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_follow_llama_tables() {
        assert!(flags('a' as u32).is_letter());
        assert!(flags('7' as u32).is_number());
        assert!(flags(0x0663).is_number()); // ARABIC-INDIC DIGIT THREE
        assert!(flags(0x4E2D).is_letter()); // 中
        assert!(flags(' ' as u32).is_whitespace());
        assert!(flags(0x3000).is_whitespace()); // ideographic space
        assert!(!flags(0x200D).is_whitespace()); // ZWJ is not \s
        assert!(flags(0x10FFFF).any());
        assert!(!Flags::NONE.any());
    }

    #[test]
    fn gpt2_byte_map() {
        let t = byte_to_char_table();
        assert_eq!(t[b' ' as usize], 'Ġ');
        assert_eq!(t[b'\n' as usize], 'Ċ');
        assert_eq!(t[b'a' as usize], 'a');
        for b in 0..=255u8 {
            assert_eq!(char_to_byte(t[b as usize]), Some(b));
        }
        assert_eq!(to_lower_ascii('S' as u32), 's' as u32);
        assert_eq!(to_lower_ascii(0x212A), 'k' as u32);
    }
}
