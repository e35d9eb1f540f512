//! Images in a prompt: where an image's rows sit, what identifies them, and the tokenization
//! that places them as llama.cpp's mtmd does.
//!
//! An image occupies `n_tokens` consecutive prompt positions whose inputs are embeddings (an
//! image encoder's output), not token rows. Each such position carries an id above the
//! vocabulary ([`IMAGE_ID_BASE`] and up) derived from the image's digest under a key drawn
//! when the engine starts, so everything that compares or hashes prompt tokens (a slot's
//! reused prefix, the prompt cache's radix and packs) tells two images apart without knowing
//! about images, and nobody outside this process can make an image whose ids equal another's.

use std::sync::Arc;

use muser_text::Tokenizer;

/// Ids of image rows have this bit set; no vocabulary reaches it.
pub const IMAGE_ID_BASE: u32 = 1 << 31;

/// One image's rows in a prompt.
#[derive(Clone, Debug)]
pub struct PromptImage {
    /// Index in the prompt of the image's first row.
    pub at: usize,
    /// Rows (context positions) the image takes.
    pub n_tokens: usize,
    /// `n_tokens × n_embd` values, row by row.
    pub values: Arc<Vec<f32>>,
    /// Digest of the image's content (its decoded pixels).
    pub digest: [u8; 32],
}

impl PromptImage {
    /// The prompt positions the image takes.
    pub fn span(&self) -> std::ops::Range<usize> {
        self.at..self.at + self.n_tokens
    }
}

/// The prompt ids of an image's rows under the engine's `key`.
pub(crate) fn image_ids(key: &[u8; 32], digest: &[u8; 32], n_tokens: usize) -> Vec<u32> {
    let mut h = blake3::Hasher::new_keyed(key);
    h.update(digest);
    let mut xof = h.finalize_xof();
    (0..n_tokens)
        .map(|_| {
            let mut b = [0u8; 4];
            xof.fill(&mut b);
            IMAGE_ID_BASE | u32::from_le_bytes(b)
        })
        .collect()
}

/// How images are marked in a prompt's text and wrapped in its tokens.
#[derive(Clone, Debug)]
pub struct MediaMarkers {
    /// The text standing for one image in the prompt (llama.cpp's `<__media__>`).
    pub marker: String,
    /// Text before and after an image's rows (mtmd's `img_beg`, `img_end`).
    pub begin: &'static str,
    pub end: &'static str,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PlaceError {
    #[error("the prompt marks {markers} images but the request has {images}")]
    Markers { markers: usize, images: usize },
    #[error("the prompt has more than {0} tokens")]
    TooLong(usize),
}

/// Tokenizes `text`, each marker replaced by its image's rows (in order) wrapped in the
/// begin and end texts, as mtmd's `mtmd_tokenize` does: the text between images is tokenized
/// piece by piece with special tokens parsed, BOS (with `add_special`) on the first piece
/// only. Image rows get id 0 here and their real ids in [`crate::Engine::submit`]; each
/// image's `at` is set. Refused past `max_tokens` tokens, images included.
pub fn place_images(
    tok: &Tokenizer,
    text: &str,
    add_special: bool,
    markers: &MediaMarkers,
    images: &mut [PromptImage],
    max_tokens: usize,
) -> Result<Vec<u32>, PlaceError> {
    let pieces: Vec<&str> = text.split(markers.marker.as_str()).collect();
    if pieces.len() != images.len() + 1 {
        return Err(PlaceError::Markers {
            markers: pieces.len() - 1,
            images: images.len(),
        });
    }
    let mut ids = Vec::new();
    for (i, piece) in pieces.iter().enumerate() {
        let before = if i > 0 { markers.end } else { "" };
        let after = if i < images.len() { markers.begin } else { "" };
        let left = max_tokens.saturating_sub(ids.len());
        let more = tok
            .encode_at_most(
                &format!("{before}{piece}{after}"),
                add_special && i == 0,
                true,
                left,
            )
            .ok_or(PlaceError::TooLong(max_tokens))?;
        ids.extend(more);
        if let Some(img) = images.get_mut(i) {
            if img.n_tokens > max_tokens.saturating_sub(ids.len()) {
                return Err(PlaceError::TooLong(max_tokens));
            }
            img.at = ids.len();
            ids.resize(ids.len() + img.n_tokens, 0);
        }
    }
    Ok(ids)
}
