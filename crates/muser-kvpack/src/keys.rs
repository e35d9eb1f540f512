//! The operator key and the sub-keys derived from it.
//!
//! One 32-byte operator key is the only secret. Each use gets its own key through BLAKE3's
//! key derivation with a distinct context string, so a value computed for one purpose (a
//! prefix id, say) can never be presented as another (a manifest seal).

use crate::error::{KvpackError, Result};

pub const KEY_BYTES: usize = 32;

/// Keys derived from one operator key. Zeroed on drop (best effort).
pub struct Keys {
    pub(crate) identity: [u8; 32],
    pub(crate) prefix: [u8; 32],
    pub(crate) seal: [u8; 32],
    pub(crate) ledger: [u8; 32],
}

/// A copy for a second owner (a store next to the context that seals its packs); each copy
/// is zeroed on its own drop.
impl Clone for Keys {
    fn clone(&self) -> Keys {
        Keys {
            identity: self.identity,
            prefix: self.prefix,
            seal: self.seal,
            ledger: self.ledger,
        }
    }
}

impl Keys {
    /// Derives every sub-key from the 32-byte operator key.
    pub fn derive(operator_key: &[u8; KEY_BYTES]) -> Keys {
        let d = |ctx: &str| blake3::derive_key(ctx, operator_key);
        Keys {
            identity: d("muser-kvpack v1 identity"),
            prefix: d("muser-kvpack v1 prefix chain"),
            seal: d("muser-kvpack v1 manifest seal"),
            ledger: d("muser-kvpack v1 replay ledger"),
        }
    }

    /// Reads a key given as 32 raw bytes or 64 hex digits (surrounding whitespace ignored).
    pub fn from_key_material(bytes: &[u8]) -> Result<Keys> {
        let mut key = parse_operator_key(bytes)?;
        let keys = Keys::derive(&key);
        key.fill(0);
        Ok(keys)
    }
}

/// The operator key from its file's bytes: 32 raw bytes or 64 hex digits (surrounding
/// whitespace ignored). Other owners of the key (session bundles) derive their own keys from
/// it with their own context strings.
pub fn parse_operator_key(bytes: &[u8]) -> Result<[u8; KEY_BYTES]> {
    let bad =
        || KvpackError::InvalidState("operator key must be 32 raw bytes or 64 hex digits".into());
    if let Ok(key) = <[u8; KEY_BYTES]>::try_from(bytes) {
        return Ok(key);
    }
    let text = std::str::from_utf8(bytes).map_err(|_| bad())?.trim();
    if text.len() != 2 * KEY_BYTES {
        return Err(bad());
    }
    let mut key = [0u8; KEY_BYTES];
    for (i, k) in key.iter_mut().enumerate() {
        *k = u8::from_str_radix(text.get(2 * i..2 * i + 2).ok_or_else(bad)?, 16)
            .map_err(|_| bad())?;
    }
    Ok(key)
}

impl Drop for Keys {
    fn drop(&mut self) {
        for k in [
            &mut self.identity,
            &mut self.prefix,
            &mut self.seal,
            &mut self.ledger,
        ] {
            k.fill(0);
            std::hint::black_box(k);
        }
    }
}

impl std::fmt::Debug for Keys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Keys(..)")
    }
}

/// Constant-time equality of two digests.
pub(crate) fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}
