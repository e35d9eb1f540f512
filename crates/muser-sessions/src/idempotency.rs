//! Idempotency keys: a retried request with the same key and the same body gets the first
//! answer again and changes nothing; the same key with another body is refused.

use crate::SessionError;
use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

/// Keys remembered (oldest forgotten first).
pub const MAX_KEYS: usize = 1024;
/// Longest key.
pub const MAX_KEY_BYTES: usize = 128;

/// A remembered answer: status and body bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    pub status: u16,
    pub body: Vec<u8>,
}

/// What to do with a request carrying a key.
#[derive(Debug, PartialEq, Eq)]
pub enum Seen {
    /// First time: run it, then [`Idempotency::remember`] the answer.
    New,
    /// A retry of a finished request: send this answer again.
    Replay(Answer),
}

#[derive(Default)]
pub struct Idempotency {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    answers: HashMap<String, ([u8; 32], Answer)>,
    order: VecDeque<String>,
}

impl Idempotency {
    /// Checks a key (1 to 128 visible ASCII characters) against the request's body digest.
    pub fn check(&self, key: &str, body: &[u8]) -> Result<Seen, SessionError> {
        if key.is_empty() || key.len() > MAX_KEY_BYTES || !key.bytes().all(|b| b.is_ascii_graphic())
        {
            return Err(SessionError::BadIdempotencyKey);
        }
        let digest = *blake3::hash(body).as_bytes();
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        match inner.answers.get(key) {
            None => Ok(Seen::New),
            Some((d, answer)) if *d == digest => Ok(Seen::Replay(answer.clone())),
            Some(_) => Err(SessionError::IdempotencyKeyReused),
        }
    }

    /// Remembers the answer of a request that ran under `key`.
    pub fn remember(&self, key: &str, body: &[u8], answer: Answer) {
        let digest = *blake3::hash(body).as_bytes();
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if inner
            .answers
            .insert(key.to_string(), (digest, answer))
            .is_none()
        {
            inner.order.push_back(key.to_string());
        }
        while inner.order.len() > MAX_KEYS {
            if let Some(old) = inner.order.pop_front() {
                inner.answers.remove(&old);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replays_the_same_body_and_refuses_another() {
        let idem = Idempotency::default();
        assert_eq!(idem.check("k1", b"{}").unwrap(), Seen::New);
        let answer = Answer {
            status: 201,
            body: b"done".to_vec(),
        };
        idem.remember("k1", b"{}", answer.clone());
        assert_eq!(idem.check("k1", b"{}").unwrap(), Seen::Replay(answer));
        assert!(matches!(
            idem.check("k1", b"{\"x\":1}"),
            Err(SessionError::IdempotencyKeyReused)
        ));
        assert!(idem.check("", b"").is_err());
        assert!(idem.check("has space", b"").is_err());
    }

    #[test]
    fn memory_is_bounded() {
        let idem = Idempotency::default();
        for i in 0..MAX_KEYS + 10 {
            let key = format!("k{i}");
            idem.remember(
                &key,
                b"",
                Answer {
                    status: 200,
                    body: Vec::new(),
                },
            );
        }
        assert_eq!(idem.check("k0", b"x").unwrap(), Seen::New);
        assert!(idem.check(&format!("k{}", MAX_KEYS + 9), b"x").is_err());
    }
}
