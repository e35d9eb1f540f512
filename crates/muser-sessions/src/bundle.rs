//! The bundle format: a conversation and its slot image, sealed with XChaCha20-Poly1305.
//!
//! ```text
//! magic "MUSER-SESSION-B1"                 16 bytes ┐
//! id length u8 | id                                 │ header: in clear, and authenticated
//! revision u64 | model identity [32]                │ as the AEAD's associated data, so a
//! n_tokens u32 | n_messages u32 | saved_unix_s u64  │ bundle cannot be renamed, rolled back
//! nonce [24] | ciphertext length u64                ┘ or moved to another model unnoticed
//! ciphertext: XChaCha20-Poly1305(messages length u32 | messages | slot image) + 16-byte tag
//! ```
//!
//! All integers are little endian. The key is derived from the operator key with BLAKE3's
//! `derive_key` under [`KEY_CONTEXT`], so it is never the key of anything else.

use crate::SessionError;
use chacha20poly1305::aead::{Aead, AeadCore, KeyInit, OsRng, Payload};
use chacha20poly1305::XChaCha20Poly1305;

pub const MAGIC: &[u8; 16] = b"MUSER-SESSION-B1";
/// BLAKE3 key-derivation context of the bundle key.
pub const KEY_CONTEXT: &str = "muser sessions v1 bundle key";
const NONCE_BYTES: usize = 24;
const TAG_BYTES: usize = 16;
/// Longest session id.
pub const MAX_ID_BYTES: usize = 64;

/// The part of a bundle in clear (and authenticated).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    pub id: String,
    /// Rises by one with every write of the session; a write naming an older one is refused.
    pub revision: u64,
    /// The serving model's identity digest; a bundle restores only where it matches.
    pub model: [u8; 32],
    /// Tokens whose K/V the slot image holds.
    pub n_tokens: u32,
    pub n_messages: u32,
    pub saved_unix_s: u64,
}

/// What the ciphertext holds: the conversation (opaque bytes to this crate) and the slot
/// image (tokens and their K/V as the engine exports them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Contents {
    pub messages: Vec<u8>,
    pub slot: Vec<u8>,
}

/// The bundle key of one operator key.
pub struct BundleKey([u8; 32]);

impl BundleKey {
    pub fn derive(operator_key: &[u8; 32]) -> BundleKey {
        BundleKey(blake3::derive_key(KEY_CONTEXT, operator_key))
    }

    fn cipher(&self) -> XChaCha20Poly1305 {
        XChaCha20Poly1305::new((&self.0).into())
    }
}

impl Drop for BundleKey {
    fn drop(&mut self) {
        self.0.fill(0);
        std::hint::black_box(&mut self.0);
    }
}

/// A session id: 1 to 64 of `[A-Za-z0-9_-]` (it names a file).
pub fn check_id(id: &str) -> Result<(), SessionError> {
    let ok = !id.is_empty()
        && id.len() <= MAX_ID_BYTES
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    match ok {
        true => Ok(()),
        false => Err(SessionError::BadId(id.chars().take(80).collect())),
    }
}

fn encode_header(h: &Header, nonce: &[u8; NONCE_BYTES], ct_len: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(MAGIC.len() + 1 + h.id.len() + 96);
    out.extend_from_slice(MAGIC);
    out.push(h.id.len() as u8);
    out.extend_from_slice(h.id.as_bytes());
    out.extend_from_slice(&h.revision.to_le_bytes());
    out.extend_from_slice(&h.model);
    out.extend_from_slice(&h.n_tokens.to_le_bytes());
    out.extend_from_slice(&h.n_messages.to_le_bytes());
    out.extend_from_slice(&h.saved_unix_s.to_le_bytes());
    out.extend_from_slice(nonce);
    out.extend_from_slice(&ct_len.to_le_bytes());
    out
}

/// Seals a bundle under a fresh random nonce.
pub fn seal(
    key: &BundleKey,
    header: &Header,
    contents: &Contents,
) -> Result<Vec<u8>, SessionError> {
    check_id(&header.id)?;
    let msg_len = u32::try_from(contents.messages.len())
        .map_err(|_| SessionError::TooLarge("the conversation".into()))?;
    let mut plain = Vec::with_capacity(4 + contents.messages.len() + contents.slot.len());
    plain.extend_from_slice(&msg_len.to_le_bytes());
    plain.extend_from_slice(&contents.messages);
    plain.extend_from_slice(&contents.slot);
    let nonce = XChaCha20Poly1305::generate_nonce(&mut OsRng);
    let nonce: [u8; NONCE_BYTES] = nonce.into();
    let ct_len = (plain.len() + TAG_BYTES) as u64;
    let mut out = encode_header(header, &nonce, ct_len);
    let ct = key
        .cipher()
        .encrypt(
            (&nonce).into(),
            Payload {
                msg: &plain,
                aad: &out,
            },
        )
        .map_err(|_| SessionError::Seal)?;
    plain.fill(0);
    out.extend_from_slice(&ct);
    Ok(out)
}

/// Most bytes a header takes (with the magic).
pub const MAX_HEADER_BYTES: usize = 16 + 1 + MAX_ID_BYTES + 8 + 32 + 4 + 4 + 8 + NONCE_BYTES + 8;

/// Reads a header from the first bytes of a bundle of `total_len` bytes, without
/// authenticating it (listing); [`open`] authenticates it. Returns where the ciphertext starts.
pub fn read_header(bytes: &[u8], total_len: u64) -> Result<(Header, usize), SessionError> {
    let mut r = Reader { bytes, at: 0 };
    if r.take(MAGIC.len())? != MAGIC {
        return Err(SessionError::Malformed("not a muser session bundle (B1)"));
    }
    let id_len = r.take(1)?[0] as usize;
    let id = std::str::from_utf8(r.take(id_len)?)
        .map_err(|_| SessionError::Malformed("the id is not UTF-8"))?
        .to_string();
    check_id(&id).map_err(|_| SessionError::Malformed("bad session id"))?;
    let header = Header {
        id,
        revision: r.u64()?,
        model: r.take(32)?.try_into().expect("32 bytes"),
        n_tokens: r.u32()?,
        n_messages: r.u32()?,
        saved_unix_s: r.u64()?,
    };
    r.take(NONCE_BYTES)?;
    let ct_len = r.u64()?;
    if Some(ct_len) != total_len.checked_sub(r.at as u64) {
        return Err(SessionError::Malformed(
            "the ciphertext length does not match the file",
        ));
    }
    Ok((header, r.at))
}

/// Authenticates and decrypts a bundle: any changed byte, or another key, is refused before
/// anything is used.
pub fn open(key: &BundleKey, bytes: &[u8]) -> Result<(Header, Contents), SessionError> {
    let (header, body_at) = read_header(bytes, bytes.len() as u64)?;
    let aad = &bytes[..body_at];
    let nonce: [u8; NONCE_BYTES] = aad[body_at - 8 - NONCE_BYTES..body_at - 8]
        .try_into()
        .expect("24 bytes");
    let mut plain = key
        .cipher()
        .decrypt(
            (&nonce).into(),
            Payload {
                msg: &bytes[body_at..],
                aad,
            },
        )
        .map_err(|_| SessionError::Unauthentic)?;
    let contents = split_plain(&plain);
    plain.fill(0);
    Ok((header, contents?))
}

fn split_plain(plain: &[u8]) -> Result<Contents, SessionError> {
    let mut r = Reader {
        bytes: plain,
        at: 0,
    };
    let n = r.u32()? as usize;
    let messages = r.take(n)?.to_vec();
    Ok(Contents {
        messages,
        slot: plain[r.at..].to_vec(),
    })
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], SessionError> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&e| e <= self.bytes.len())
            .ok_or(SessionError::Malformed("truncated"))?;
        let s = &self.bytes[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn u32(&mut self) -> Result<u32, SessionError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4")))
    }
    fn u64(&mut self) -> Result<u64, SessionError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> (Header, Contents) {
        (
            Header {
                id: "chat-1".into(),
                revision: 3,
                model: [7; 32],
                n_tokens: 2,
                n_messages: 1,
                saved_unix_s: 1_700_000_000,
            },
            Contents {
                messages: b"[{\"role\":\"user\"}]".to_vec(),
                slot: vec![1, 2, 3, 4, 5],
            },
        )
    }

    #[test]
    fn round_trip_and_every_byte_is_authenticated() {
        let key = BundleKey::derive(&[1; 32]);
        let (h, c) = sample();
        let bytes = seal(&key, &h, &c).unwrap();
        assert_eq!(open(&key, &bytes).unwrap(), (h, c));
        for i in 0..bytes.len() {
            let mut bad = bytes.clone();
            bad[i] ^= 0x20;
            assert!(open(&key, &bad).is_err(), "flipped byte {i} was accepted");
        }
        assert!(open(&key, &bytes[..bytes.len() - 1]).is_err());
    }

    #[test]
    fn another_key_is_refused() {
        let (h, c) = sample();
        let bytes = seal(&BundleKey::derive(&[1; 32]), &h, &c).unwrap();
        assert!(matches!(
            open(&BundleKey::derive(&[2; 32]), &bytes),
            Err(SessionError::Unauthentic)
        ));
    }

    #[test]
    fn ids_name_files_safely() {
        for bad in ["", "../x", "a/b", "a b", ".", &"x".repeat(65)] {
            assert!(check_id(bad).is_err(), "{bad:?}");
        }
        check_id("Chat_2-b").unwrap();
    }
}
