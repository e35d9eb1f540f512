//! Little-endian canonical encoding with bounded reads.

use crate::error::{KvpackError, Region, Result};

#[derive(Default)]
pub(crate) struct Enc(pub Vec<u8>);

impl Enc {
    pub fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    pub fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    pub fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    pub fn bytes(&mut self, v: &[u8]) {
        self.0.extend_from_slice(v);
    }
    /// Length-prefixed (u32) byte string.
    pub fn str(&mut self, v: &str) {
        self.u32(v.len() as u32);
        self.0.extend_from_slice(v.as_bytes());
    }
}

pub(crate) struct Dec<'a> {
    buf: &'a [u8],
    pos: usize,
    region: Region,
}

impl<'a> Dec<'a> {
    pub fn new(buf: &'a [u8], region: Region) -> Self {
        Dec {
            buf,
            pos: 0,
            region,
        }
    }

    pub fn malformed(&self, reason: &'static str) -> KvpackError {
        KvpackError::Malformed {
            region: self.region,
            reason,
        }
    }

    pub fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.buf.len() - self.pos < n {
            return Err(self.malformed("field runs past the end"));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    pub fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    pub fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap()))
    }
    pub fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }
    pub fn arr32(&mut self) -> Result<[u8; 32]> {
        Ok(self.take(32)?.try_into().unwrap())
    }
    pub fn bool(&mut self) -> Result<bool> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(self.malformed("boolean byte is not 0 or 1")),
        }
    }
    /// A u32 count bounded by `max` before anything is allocated for it.
    pub fn count(&mut self, max: u64, reason: &'static str) -> Result<usize> {
        let n = self.u32()?;
        if n as u64 > max {
            return Err(self.malformed(reason));
        }
        Ok(n as usize)
    }
    pub fn str(&mut self, max: usize) -> Result<String> {
        let n = self.count(max as u64, "string longer than its limit")?;
        let b = self.take(n)?;
        String::from_utf8(b.to_vec()).map_err(|_| self.malformed("string is not UTF-8"))
    }
    pub fn finish(&self) -> Result<()> {
        if self.pos != self.buf.len() {
            return Err(self.malformed("trailing bytes"));
        }
        Ok(())
    }
}
