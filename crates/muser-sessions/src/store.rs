//! The session store: one bundle file per session in a directory (`<id>.bundle`, 0600),
//! written whole (temporary file, fsync, rename, directory fsync) under one lock, so a
//! reader sees the old bundle or the new one, never half of either, and two writers of one
//! session cannot both succeed from the same revision.

use crate::bundle::{self, BundleKey, Contents, Header};
use crate::SessionError;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// Most sessions one store keeps.
pub const MAX_SESSIONS: usize = 256;
/// Most bytes of a conversation (the messages) in one bundle.
pub const MAX_MESSAGES_BYTES: usize = 4 << 20;

/// A write of a session: the conversation, the slot image and its token count.
pub struct SessionWrite {
    pub messages: Vec<u8>,
    pub n_messages: u32,
    pub slot: Vec<u8>,
    pub n_tokens: u32,
}

pub struct SessionStore {
    dir: PathBuf,
    key: BundleKey,
    model: [u8; 32],
    max_bundle_bytes: u64,
    /// Serializes every change (check of the revision, write, rename).
    write_lock: Mutex<()>,
}

impl SessionStore {
    /// Opens (creating, mode 0700) the directory. `model` is the serving model's identity
    /// digest; `max_bundle_bytes` bounds every bundle read or written (a full slot's image
    /// plus [`MAX_MESSAGES_BYTES`]).
    pub fn open(
        dir: &Path,
        operator_key: &[u8; 32],
        model: [u8; 32],
        max_bundle_bytes: u64,
    ) -> Result<SessionStore, SessionError> {
        let mut b = std::fs::DirBuilder::new();
        b.recursive(true);
        #[cfg(unix)]
        std::os::unix::fs::DirBuilderExt::mode(&mut b, 0o700);
        b.create(dir).map_err(|e| io(dir, e))?;
        Ok(SessionStore {
            dir: dir.to_path_buf(),
            key: BundleKey::derive(operator_key),
            model,
            max_bundle_bytes,
            write_lock: Mutex::new(()),
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn path(&self, id: &str) -> Result<PathBuf, SessionError> {
        bundle::check_id(id)?;
        Ok(self.dir.join(format!("{id}.bundle")))
    }

    /// The headers of every bundle, newest first (read, not decrypted: listing only).
    pub fn list(&self) -> Result<Vec<Header>, SessionError> {
        let mut out = Vec::new();
        let entries = std::fs::read_dir(&self.dir).map_err(|e| io(&self.dir, e))?;
        for entry in entries.flatten().take(4 * MAX_SESSIONS) {
            let name = entry.file_name();
            let Some(id) = name.to_str().and_then(|n| n.strip_suffix(".bundle")) else {
                continue;
            };
            if bundle::check_id(id).is_err() {
                continue;
            }
            if let Ok(h) = self.read_head(id) {
                out.push(h);
            }
        }
        out.sort_by(|a, b| b.saved_unix_s.cmp(&a.saved_unix_s).then(a.id.cmp(&b.id)));
        Ok(out)
    }

    /// The bundle's bytes as stored (for export), at most `max_bundle_bytes`.
    pub fn read_raw(&self, id: &str) -> Result<Vec<u8>, SessionError> {
        let path = self.path(id)?;
        let file = std::fs::File::open(&path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => SessionError::NotFound(id.to_string()),
            _ => io(&path, e),
        })?;
        let mut bytes = Vec::new();
        file.take(self.max_bundle_bytes + 1)
            .read_to_end(&mut bytes)
            .map_err(|e| io(&path, e))?;
        if bytes.len() as u64 > self.max_bundle_bytes {
            return Err(SessionError::TooLarge(format!("bundle {id}")));
        }
        Ok(bytes)
    }

    /// Decrypts and checks a bundle: authentic under this store's key, for this model.
    pub fn verify(&self, bytes: &[u8]) -> Result<(Header, Contents), SessionError> {
        if bytes.len() as u64 > self.max_bundle_bytes {
            return Err(SessionError::TooLarge("the bundle".into()));
        }
        let (header, contents) = bundle::open(&self.key, bytes)?;
        if header.model != self.model {
            return Err(SessionError::ForeignModel);
        }
        Ok((header, contents))
    }

    /// A session, decrypted and verified.
    pub fn get(&self, id: &str) -> Result<(Header, Contents), SessionError> {
        let (header, contents) = self.verify(&self.read_raw(id)?)?;
        if header.id != id {
            return Err(SessionError::Malformed("the bundle names another session"));
        }
        Ok((header, contents))
    }

    /// A bundle's header, from its first bytes only (not authenticated).
    fn read_head(&self, id: &str) -> Result<Header, SessionError> {
        let path = self.path(id)?;
        let file = std::fs::File::open(&path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => SessionError::NotFound(id.to_string()),
            _ => io(&path, e),
        })?;
        let len = file.metadata().map_err(|e| io(&path, e))?.len();
        let mut head = Vec::with_capacity(bundle::MAX_HEADER_BYTES);
        file.take(bundle::MAX_HEADER_BYTES as u64)
            .read_to_end(&mut head)
            .map_err(|e| io(&path, e))?;
        Ok(bundle::read_header(&head, len)?.0)
    }

    fn current_revision(&self, id: &str) -> Result<Option<u64>, SessionError> {
        match self.read_head(id) {
            Ok(h) => Ok(Some(h.revision)),
            Err(SessionError::NotFound(_)) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Writes a session. `expected` is the revision the writer last saw: `None` creates the
    /// session (refused when it exists), `Some(r)` replaces revision `r` (refused otherwise).
    /// The new bundle has the next revision.
    pub fn put(
        &self,
        id: &str,
        expected: Option<u64>,
        write: SessionWrite,
        now_unix_s: u64,
    ) -> Result<Header, SessionError> {
        if write.messages.len() > MAX_MESSAGES_BYTES {
            return Err(SessionError::TooLarge(format!(
                "the conversation ({} bytes; at most {MAX_MESSAGES_BYTES})",
                write.messages.len()
            )));
        }
        let path = self.path(id)?;
        let _guard = self.write_lock.lock().unwrap_or_else(|e| e.into_inner());
        let current = self.current_revision(id)?;
        if current != expected {
            return Err(SessionError::Stale {
                id: id.to_string(),
                current,
                expected,
            });
        }
        if current.is_none() && self.count()? >= MAX_SESSIONS {
            return Err(SessionError::Full(MAX_SESSIONS));
        }
        let header = Header {
            id: id.to_string(),
            revision: current.map_or(1, |r| r + 1),
            model: self.model,
            n_tokens: write.n_tokens,
            n_messages: write.n_messages,
            saved_unix_s: now_unix_s,
        };
        let contents = Contents {
            messages: write.messages,
            slot: write.slot,
        };
        let bytes = bundle::seal(&self.key, &header, &contents)?;
        if bytes.len() as u64 > self.max_bundle_bytes {
            return Err(SessionError::TooLarge(format!("bundle {id}")));
        }
        self.write_atomic(&path, &bytes)?;
        Ok(header)
    }

    /// Takes in a bundle exported by this or another Muser with the same operator key and
    /// model: verified whole first, and kept only when it is newer than the local copy.
    pub fn import(&self, bytes: &[u8]) -> Result<Header, SessionError> {
        let (header, _) = self.verify(bytes)?;
        let path = self.path(&header.id)?;
        let _guard = self.write_lock.lock().unwrap_or_else(|e| e.into_inner());
        let current = self.current_revision(&header.id)?;
        if current.is_some_and(|r| r >= header.revision) {
            return Err(SessionError::Stale {
                id: header.id.clone(),
                current,
                expected: Some(header.revision),
            });
        }
        if current.is_none() && self.count()? >= MAX_SESSIONS {
            return Err(SessionError::Full(MAX_SESSIONS));
        }
        self.write_atomic(&path, bytes)?;
        Ok(header)
    }

    /// Removes a session at revision `expected`.
    pub fn delete(&self, id: &str, expected: u64) -> Result<(), SessionError> {
        let path = self.path(id)?;
        let _guard = self.write_lock.lock().unwrap_or_else(|e| e.into_inner());
        let current = self.current_revision(id)?;
        match current {
            None => Err(SessionError::NotFound(id.to_string())),
            Some(r) if r != expected => Err(SessionError::Stale {
                id: id.to_string(),
                current,
                expected: Some(expected),
            }),
            Some(_) => {
                std::fs::remove_file(&path).map_err(|e| io(&path, e))?;
                sync_dir(&self.dir)
            }
        }
    }

    fn count(&self) -> Result<usize, SessionError> {
        Ok(std::fs::read_dir(&self.dir)
            .map_err(|e| io(&self.dir, e))?
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().ends_with(".bundle"))
            .count())
    }

    fn write_atomic(&self, path: &Path, bytes: &[u8]) -> Result<(), SessionError> {
        let mut tmp = tempfile::Builder::new()
            .prefix(".session-")
            .tempfile_in(&self.dir)
            .map_err(|e| io(&self.dir, e))?;
        tmp.write_all(bytes).map_err(|e| io(path, e))?;
        tmp.as_file().sync_all().map_err(|e| io(path, e))?;
        tmp.persist(path).map_err(|e| io(path, e.error))?;
        sync_dir(&self.dir)
    }
}

fn sync_dir(dir: &Path) -> Result<(), SessionError> {
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| io(dir, e))
}

fn io(path: &Path, source: std::io::Error) -> SessionError {
    SessionError::Io {
        path: path.to_path_buf(),
        source,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store(dir: &Path, key: u8) -> SessionStore {
        SessionStore::open(dir, &[key; 32], [9; 32], 1 << 20).unwrap()
    }

    fn write(tag: u8) -> SessionWrite {
        SessionWrite {
            messages: vec![tag; 10],
            n_messages: 1,
            slot: vec![tag; 100],
            n_tokens: 3,
        }
    }

    #[test]
    fn revisions_refuse_stale_writes() {
        let dir = tempfile::tempdir().unwrap();
        let s = store(dir.path(), 1);
        assert_eq!(s.put("a", None, write(1), 10).unwrap().revision, 1);
        assert!(matches!(
            s.put("a", None, write(2), 11),
            Err(SessionError::Stale {
                current: Some(1),
                ..
            })
        ));
        assert_eq!(s.put("a", Some(1), write(3), 12).unwrap().revision, 2);
        let before = s.read_raw("a").unwrap();
        assert!(matches!(
            s.put("a", Some(1), write(4), 13),
            Err(SessionError::Stale { .. })
        ));
        assert_eq!(
            s.read_raw("a").unwrap(),
            before,
            "a refused write changed the bundle"
        );
        assert_eq!(s.get("a").unwrap().1.slot, vec![3; 100]);
        assert!(s.delete("a", 1).is_err());
        s.delete("a", 2).unwrap();
        assert!(matches!(s.get("a"), Err(SessionError::NotFound(_))));
    }

    #[test]
    fn import_needs_the_key_the_model_and_a_newer_revision() {
        let (da, db, dc) = (
            tempfile::tempdir().unwrap(),
            tempfile::tempdir().unwrap(),
            tempfile::tempdir().unwrap(),
        );
        let a = store(da.path(), 1);
        a.put("s", None, write(1), 10).unwrap();
        let bundle = a.read_raw("s").unwrap();
        let b = store(db.path(), 1);
        assert_eq!(b.import(&bundle).unwrap().revision, 1);
        assert!(matches!(b.import(&bundle), Err(SessionError::Stale { .. })));
        let other_key = store(dc.path(), 2);
        assert!(matches!(
            other_key.import(&bundle),
            Err(SessionError::Unauthentic)
        ));
        assert!(other_key.list().unwrap().is_empty());
        let other_model = SessionStore::open(dc.path(), &[1; 32], [8; 32], 1 << 20).unwrap();
        assert!(matches!(
            other_model.import(&bundle),
            Err(SessionError::ForeignModel)
        ));
        let mut tampered = bundle.clone();
        let n = tampered.len();
        tampered[n - 20] ^= 1;
        assert!(matches!(
            b.import(&tampered),
            Err(SessionError::Unauthentic)
        ));
        assert!(matches!(
            a.import(&bundle[..40]),
            Err(SessionError::Malformed(_))
        ));
    }

    #[test]
    fn sizes_are_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let s = SessionStore::open(dir.path(), &[1; 32], [9; 32], 200).unwrap();
        let mut w = write(1);
        w.slot = vec![0; 500];
        assert!(matches!(
            s.put("big", None, w, 1),
            Err(SessionError::TooLarge(_))
        ));
        assert!(s.list().unwrap().is_empty(), "a refused write left a file");
        std::fs::write(dir.path().join("huge.bundle"), vec![0u8; 400]).unwrap();
        assert!(matches!(s.get("huge"), Err(SessionError::TooLarge(_))));
    }
}
