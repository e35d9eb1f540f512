//! Images in requests (`--mmproj`): image bytes from the wire (OpenAI `data:` URIs, base64 for
//! Ollama and llama.cpp), their encoding by the projector, and the prompt that places their
//! rows. Remote URLs are refused: the server fetches nothing.

use std::path::Path;
use std::sync::Arc;

use base64::Engine as _;
use muser_engine::{place_images, MediaMarkers, PlaceError, PromptImage};
use muser_vision::{Device, Encoder, Limits, Projector, VisionError, IMAGE_BEGIN, IMAGE_END};

use crate::error::{ApiError, ApiResult};
use crate::state::AppState;

/// The marker of an image in a `/completion` prompt (llama.cpp's `mtmd_default_marker`).
pub const MEDIA_MARKER: &str = "<__media__>";

/// Image types a request may carry (`data:` URIs name one of them).
const MIME_TYPES: [&str; 4] = ["image/png", "image/jpeg", "image/jpg", "image/webp"];

/// The projector and what serving images needs.
pub struct Vision {
    encoder: Encoder,
    limits: Limits,
    /// Images one request may carry (`--max-images`).
    pub max_images: usize,
    /// The marker standing for an image in a rendered chat prompt: random per process, so no
    /// text a client sends can pose as an image.
    chat_marker: String,
}

impl Vision {
    /// Loads `path` for a text model `n_embd` wide whose vocabulary has the image begin and
    /// end tokens; encodes on `device` (with `threads` threads on the CPU).
    pub fn load(
        path: &Path,
        n_embd: usize,
        tokenizer: &muser_text::Tokenizer,
        (device, threads): (Device, usize),
        max_images: usize,
    ) -> Result<Vision, String> {
        let projector = Projector::open_for(path, n_embd).map_err(|e| e.to_string())?;
        for t in [IMAGE_BEGIN, IMAGE_END] {
            if tokenizer.token_id(t).is_none() {
                return Err(format!(
                    "the model's vocabulary has no {t} token, which images are wrapped in; it is not a Muse Glimmer model"
                ));
            }
        }
        let encoder = Encoder::new(projector, device, threads.max(1)).map_err(|e| e.to_string())?;
        let mut nonce = [0u8; 16];
        getrandom::getrandom(&mut nonce).map_err(|e| e.to_string())?;
        Ok(Vision {
            encoder,
            limits: Limits::default(),
            max_images,
            chat_marker: format!("<__media_{}__>", hex::encode(nonce)),
        })
    }

    /// The text an image part becomes in a chat message before the template renders it.
    pub fn chat_marker(&self) -> &str {
        &self.chat_marker
    }

    /// Decodes and encodes one image; an undecodable or oversized image is a 400.
    fn encode(&self, bytes: &[u8], index: usize) -> ApiResult<PromptImage> {
        let img = self
            .encoder
            .embed(bytes, &self.limits)
            .map_err(|e| image_error(e, index))?;
        Ok(PromptImage {
            at: 0,
            n_tokens: img.embeddings.n_tokens(),
            values: Arc::new(img.embeddings.data),
            digest: img.digest,
        })
    }

    /// Decodes one image for the tokens it takes (no rows, no digest: it is not submitted).
    fn count(&self, bytes: &[u8], index: usize) -> ApiResult<PromptImage> {
        let n_tokens = self
            .encoder
            .n_tokens(bytes, &self.limits)
            .map_err(|e| image_error(e, index))?;
        Ok(PromptImage {
            at: 0,
            n_tokens,
            values: Arc::new(Vec::new()),
            digest: [0; 32],
        })
    }
}

/// An image's failure: a 400 when the image is at fault.
fn image_error(e: VisionError, index: usize) -> ApiError {
    match e {
        VisionError::Image(_) | VisionError::TooLarge(_) => {
            ApiError::bad_request(format!("image {index}: {e}"))
        }
        other => ApiError::internal(format!("image {index}: {other}")),
    }
}

/// A 400 unless `mime` names an image type the projector's decoder reads.
pub fn check_media_type(mime: &str) -> ApiResult<()> {
    if MIME_TYPES.contains(&mime.to_ascii_lowercase().as_str()) {
        return Ok(());
    }
    Err(ApiError::bad_request(format!(
        "image type `{mime}` is not accepted; send PNG, JPEG or WebP"
    )))
}

/// An image given on the wire, not yet decoded.
pub struct WireImage(Vec<u8>);

impl WireImage {
    /// An OpenAI `image_url`: a `data:image/...;base64,` URI. Remote URLs are refused.
    pub fn from_url(url: &str) -> ApiResult<WireImage> {
        if url.starts_with("http://") || url.starts_with("https://") {
            return Err(ApiError::bad_request(
                "image URLs are not fetched; send the image inline as a data:image/...;base64, URI",
            ));
        }
        let Some((head, data)) = url.strip_prefix("data:").and_then(|u| u.split_once(',')) else {
            return Err(ApiError::bad_request(
                "image_url must be a data:image/...;base64, URI",
            ));
        };
        let Some(mime) = head.strip_suffix(";base64") else {
            return Err(ApiError::bad_request("an image data URI must be base64"));
        };
        check_media_type(mime)?;
        WireImage::from_base64(data)
    }

    /// Base64 image bytes (Ollama's `images`, llama.cpp's `multimodal_data`).
    pub fn from_base64(data: &str) -> ApiResult<WireImage> {
        base64::engine::general_purpose::STANDARD
            .decode(data.trim())
            .map(WireImage)
            .map_err(|e| ApiError::bad_request(format!("an image is not valid base64: {e}")))
    }
}

impl AppState {
    /// The projector, or a 500 naming what is missing (the server's setup, not the request, as
    /// llama-server answers it).
    pub fn vision(&self) -> ApiResult<&Vision> {
        self.vision.as_deref().ok_or_else(|| {
            ApiError::internal(
                "image input is not supported: this server has no projector (start it with --mmproj FILE)",
            )
        })
    }

    /// Checks an image count against `--max-images` before any image is decoded.
    pub fn check_image_count(&self, n: usize) -> ApiResult<()> {
        if n == 0 {
            return Ok(());
        }
        crate::limits::check_count("images", n, self.vision()?.max_images)
    }

    /// Tokenizes a rendered prompt whose `marker`s stand for `images` (in order): each image
    /// decoded, encoded and placed with its begin and end tokens. Without images the prompt is
    /// tokenized as text. Runs on the work pool.
    pub fn encode_with_images(
        &self,
        text: &str,
        add_special: bool,
        marker: &str,
        images: Vec<WireImage>,
    ) -> ApiResult<(Vec<u32>, Vec<PromptImage>)> {
        self.place(text, add_special, marker, &images, Vision::encode)
    }

    /// The token count of [`AppState::encode_with_images`]'s prompt, each image's rows counted
    /// from its decoded size without encoding it.
    pub fn count_with_images(
        &self,
        text: &str,
        add_special: bool,
        marker: &str,
        images: Vec<WireImage>,
    ) -> ApiResult<usize> {
        Ok(self
            .place(text, add_special, marker, &images, Vision::count)?
            .0
            .len())
    }

    fn place(
        &self,
        text: &str,
        add_special: bool,
        marker: &str,
        images: &[WireImage],
        image: impl Fn(&Vision, &[u8], usize) -> ApiResult<PromptImage>,
    ) -> ApiResult<(Vec<u32>, Vec<PromptImage>)> {
        if images.is_empty() {
            return Ok((self.encode_prompt(text, add_special)?, Vec::new()));
        }
        self.check_image_count(images.len())?;
        let vision = self.vision()?;
        let mut placed = images
            .iter()
            .enumerate()
            .map(|(i, img)| image(vision, &img.0, i))
            .collect::<ApiResult<Vec<_>>>()?;
        let markers = MediaMarkers {
            marker: marker.to_string(),
            begin: IMAGE_BEGIN,
            end: IMAGE_END,
        };
        let max = self.prompt_tokens_max();
        let ids = place_images(
            &self.tokenizer,
            text,
            add_special,
            &markers,
            &mut placed,
            max,
        )
        .map_err(|e| match e {
            PlaceError::TooLong(_) => ApiError::bad_request(format!(
                "the prompt, images included, has more than {max} tokens; the context per slot is {} tokens (start the server with a larger -c)",
                self.options.n_ctx
            )),
            other => ApiError::bad_request(other.to_string()),
        })?;
        Ok((ids, placed))
    }
}
