//! From image bytes to the encoder's input, as mtmd does it: stb_image's 8-bit RGB, the
//! aspect-preserving grid of `mtmd_image_preprocessor_muse_glimmer`, Pillow's fixed-point
//! Lanczos resize (`img_tool::resize_pillow`), then `/255`, `-mean`, `/std` in f32.

use std::io::Cursor;

use image::{DynamicImage, ImageFormat, ImageReader};

use crate::VisionError;

/// Bounds on an image before and while it is decoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Encoded bytes of one image.
    pub max_bytes: usize,
    /// Width and height each.
    pub max_side: u32,
    /// Width × height.
    pub max_pixels: u64,
}

impl Default for Limits {
    /// 20 MiB, 16384 px a side, 40 megapixels (a 120 MB RGB buffer at most).
    fn default() -> Limits {
        Limits {
            max_bytes: 20 << 20,
            max_side: 16384,
            max_pixels: 40_000_000,
        }
    }
}

/// An 8-bit RGB image, row-major, 3 bytes a pixel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rgb8 {
    pub width: u32,
    pub height: u32,
    pub data: Vec<u8>,
}

impl Rgb8 {
    /// BLAKE3 of the sides and the pixels: two images with the same digest give the same
    /// embeddings under one projector, whatever their file format.
    pub fn digest(&self) -> [u8; 32] {
        let mut h = blake3::Hasher::new();
        h.update(&self.width.to_le_bytes());
        h.update(&self.height.to_le_bytes());
        h.update(&self.data);
        *h.finalize().as_bytes()
    }
}

/// The encoder's input: `width × height` pixels of normalized RGB, interleaved, row-major.
#[derive(Clone, Debug, PartialEq)]
pub struct Pixels {
    pub width: u32,
    pub height: u32,
    pub data: Vec<f32>,
}

/// Decodes PNG, JPEG or WebP bytes to 8-bit RGB as stb_image's `stbi_load(.., 3)` does:
/// alpha dropped (not composited), gray replicated, 16-bit samples cut to their high byte.
/// Anything else, or an image past `limits`, is an error and nothing is allocated for it.
pub fn decode(bytes: &[u8], limits: &Limits) -> Result<Rgb8, VisionError> {
    if bytes.len() > limits.max_bytes {
        return Err(VisionError::TooLarge(format!(
            "{} bytes (limit {})",
            bytes.len(),
            limits.max_bytes
        )));
    }
    let reader = ImageReader::new(Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| VisionError::Image(e.to_string()))?;
    match reader.format() {
        Some(ImageFormat::Png | ImageFormat::Jpeg | ImageFormat::WebP) => {}
        Some(f) => {
            return Err(VisionError::Image(format!(
                "{f:?} is not accepted (PNG, JPEG or WebP)"
            )))
        }
        None => return Err(VisionError::Image("not a PNG, JPEG or WebP image".into())),
    }
    let (w, h) = reader
        .into_dimensions()
        .map_err(|e| VisionError::Image(e.to_string()))?;
    check_size(w, h, limits)?;
    let mut reader = ImageReader::new(Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| VisionError::Image(e.to_string()))?;
    let mut lim = image::Limits::default();
    lim.max_image_width = Some(limits.max_side);
    lim.max_image_height = Some(limits.max_side);
    // the decoder's own buffers: 16-bit RGBA at most
    lim.max_alloc = Some(limits.max_pixels.saturating_mul(8) + (1 << 20));
    reader.limits(lim);
    let img = reader
        .decode()
        .map_err(|e| VisionError::Image(e.to_string()))?;
    Ok(to_rgb8_stb(img))
}

fn check_size(w: u32, h: u32, limits: &Limits) -> Result<(), VisionError> {
    if w == 0 || h == 0 {
        return Err(VisionError::Image(format!("empty image ({w}x{h})")));
    }
    if w > limits.max_side || h > limits.max_side || u64::from(w) * u64::from(h) > limits.max_pixels
    {
        return Err(VisionError::TooLarge(format!(
            "{w}x{h} (limits: {} a side, {} pixels)",
            limits.max_side, limits.max_pixels
        )));
    }
    Ok(())
}

/// stb_image's channel conversion to 3 channels.
fn to_rgb8_stb(img: DynamicImage) -> Rgb8 {
    let (width, height) = (img.width(), img.height());
    let n = width as usize * height as usize;
    let mut data = Vec::with_capacity(n * 3);
    let mut push = |v: [u8; 3]| data.extend_from_slice(&v);
    match img {
        DynamicImage::ImageLuma8(b) => b.pixels().for_each(|p| push([p[0]; 3])),
        DynamicImage::ImageLumaA8(b) => b.pixels().for_each(|p| push([p[0]; 3])),
        DynamicImage::ImageRgb8(b) => b.pixels().for_each(|p| push(p.0)),
        DynamicImage::ImageRgba8(b) => b.pixels().for_each(|p| push([p[0], p[1], p[2]])),
        DynamicImage::ImageLuma16(b) => b.pixels().for_each(|p| push([(p[0] >> 8) as u8; 3])),
        DynamicImage::ImageLumaA16(b) => b.pixels().for_each(|p| push([(p[0] >> 8) as u8; 3])),
        DynamicImage::ImageRgb16(b) => b
            .pixels()
            .for_each(|p| push([(p[0] >> 8) as u8, (p[1] >> 8) as u8, (p[2] >> 8) as u8])),
        DynamicImage::ImageRgba16(b) => b
            .pixels()
            .for_each(|p| push([(p[0] >> 8) as u8, (p[1] >> 8) as u8, (p[2] >> 8) as u8])),
        other => {
            let rgb = other.to_rgb8();
            data = rgb.into_raw();
        }
    }
    Rgb8 {
        width,
        height,
        data,
    }
}

/// The resized image's size: transformers' `get_aspect_ratio_preserving_size` as mtmd ports it
/// (`muse_glimmer_grid_size`), in cells of `cell` pixels, at most `max_tokens` cells.
pub fn grid_size(img_w: u32, img_h: u32, cell: u32, max_tokens: u32) -> (u32, u32) {
    let mut nph = f64::from(img_h) / f64::from(cell);
    let mut npw = f64::from(img_w) / f64::from(cell);
    let ratio = if nph > 0.0 { npw / nph } else { 1.0 };
    if nph * npw > f64::from(max_tokens) {
        nph = (f64::from(max_tokens) / ratio).sqrt();
        npw = nph * ratio;
    }
    let hs = [nph.floor() as i64, nph.ceil() as i64];
    let ws = [npw.floor() as i64, npw.ceil() as i64];
    let target_ar = f64::from(img_h) / f64::from(img_w);
    let (mut best_h, mut best_w, mut best_d) = (-1i64, -1i64, 0.0f64);
    for &h in &hs {
        for &w in &ws {
            if h < 1 || w < 1 || h * w > i64::from(max_tokens) {
                continue;
            }
            let d = (h as f64 / w as f64 - target_ar).abs();
            if best_h < 0 || d < best_d || (d == best_d && h * w > best_h * best_w) {
                (best_h, best_w, best_d) = (h, w, d);
            }
        }
    }
    if best_h < 0 {
        best_h = (nph.round() as i64).max(1);
        best_w = (npw.round() as i64).max(1);
    }
    (best_w as u32 * cell, best_h as u32 * cell)
}

/// The encoder input for `img`: resized to [`grid_size`] with Lanczos and normalized.
pub fn preprocess(img: &Rgb8, cell: u32, max_tokens: u32, mean: [f32; 3], std: [f32; 3]) -> Pixels {
    let (w, h) = grid_size(img.width, img.height, cell, max_tokens);
    let resized = resize_lanczos(img, w, h);
    let data = resized
        .data
        .chunks_exact(3)
        .flat_map(|p| (0..3).map(move |c| (f32::from(p[c]) / 255.0 - mean[c]) / std[c]))
        .collect();
    Pixels {
        width: w,
        height: h,
        data,
    }
}

/// Fixed-point fraction bits of Pillow's resampler (32 - 8 - 2).
const PRECISION_BITS: u32 = 22;

/// Pillow's separable Lanczos-3 resize (`ImagingResample`), horizontal pass first, weights
/// rounded to 22 fractional bits, each pass rounding and clamping to 8 bits.
pub fn resize_lanczos(img: &Rgb8, target_w: u32, target_h: u32) -> Rgb8 {
    let (sw, sh) = (img.width as usize, img.height as usize);
    let (tw, th) = (target_w as usize, target_h as usize);
    let mut data = img.data.clone();
    if tw != sw {
        let (bounds, k, ksize) = weights(sw, tw);
        let mut out = vec![0u8; tw * sh * 3];
        for y in 0..sh {
            let src = &data[y * sw * 3..(y + 1) * sw * 3];
            let dst = &mut out[y * tw * 3..(y + 1) * tw * 3];
            for x in 0..tw {
                let (xmin, xcnt) = bounds[x];
                let kk = &k[x * ksize..x * ksize + xcnt];
                let mut ss = [1i32 << (PRECISION_BITS - 1); 3];
                for (i, &wt) in kk.iter().enumerate() {
                    let p = &src[(xmin + i) * 3..(xmin + i) * 3 + 3];
                    for c in 0..3 {
                        ss[c] = ss[c].wrapping_add(i32::from(p[c]).wrapping_mul(wt));
                    }
                }
                for c in 0..3 {
                    dst[x * 3 + c] = clip8(ss[c] >> PRECISION_BITS);
                }
            }
        }
        data = out;
    }
    if th != sh {
        let (bounds, k, ksize) = weights(sh, th);
        let row = tw * 3;
        let mut out = vec![0u8; row * th];
        let mut acc = vec![0i32; row];
        for y in 0..th {
            let (ymin, ycnt) = bounds[y];
            acc.fill(1 << (PRECISION_BITS - 1));
            for (i, &wt) in k[y * ksize..y * ksize + ycnt].iter().enumerate() {
                let src = &data[(ymin + i) * row..(ymin + i + 1) * row];
                for (a, &s) in acc.iter_mut().zip(src) {
                    *a = a.wrapping_add(i32::from(s).wrapping_mul(wt));
                }
            }
            for (d, &a) in out[y * row..(y + 1) * row].iter_mut().zip(&acc) {
                *d = clip8(a >> PRECISION_BITS);
            }
        }
        data = out;
    }
    Rgb8 {
        width: target_w,
        height: target_h,
        data,
    }
}

fn clip8(v: i32) -> u8 {
    v.clamp(0, 255) as u8
}

fn lanczos(x: f64) -> f64 {
    fn sinc(v: f64) -> f64 {
        if v == 0.0 {
            1.0
        } else {
            let pv = v * std::f64::consts::PI;
            pv.sin() / pv
        }
    }
    if (-3.0..3.0).contains(&x) {
        sinc(x) * sinc(x / 3.0)
    } else {
        0.0
    }
}

/// Per output pixel: (first input pixel, count), and `ksize` fixed-point weights each.
fn weights(in_size: usize, out_size: usize) -> (Vec<(usize, usize)>, Vec<i32>, usize) {
    let scale = in_size as f64 / out_size as f64;
    let filterscale = scale.max(1.0);
    let support = 3.0 * filterscale;
    let ksize = support.ceil() as usize * 2 + 1;
    let mut bounds = Vec::with_capacity(out_size);
    let mut k = vec![0i32; out_size * ksize];
    let fxp = f64::from(1u32 << PRECISION_BITS);
    let mut pre = vec![0f64; ksize];
    for xx in 0..out_size {
        let center = (xx as f64 + 0.5) * scale;
        let ss = 1.0 / filterscale;
        // C's int conversion truncates toward zero; the value is clamped at 0 after
        let xmin = ((center - support + 0.5) as i64).max(0) as usize;
        let xmax = ((center + support + 0.5) as i64).min(in_size as i64) as usize;
        let cnt = xmax - xmin;
        let mut ww = 0.0;
        pre.fill(0.0);
        for (x, p) in pre.iter_mut().enumerate().take(cnt) {
            let w = lanczos((x as f64 + xmin as f64 - center + 0.5) * ss);
            *p = w;
            ww += w;
        }
        for p in pre.iter_mut().take(cnt) {
            if ww != 0.0 {
                *p /= ww;
            }
        }
        for (x, &p) in pre.iter().enumerate() {
            let r = p * fxp + if p < 0.0 { -0.5 } else { 0.5 };
            k[xx * ksize + x] = r as i32;
        }
        bounds.push((xmin, cnt));
    }
    (bounds, k, ksize)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grid_keeps_aspect_and_caps_tokens() {
        // 1024x1024 at 28-pixel cells: 36.6 cells a side; on a tie of aspect the larger grid
        assert_eq!(grid_size(1024, 1024, 28, 4096), (37 * 28, 37 * 28));
        // 100x70 at 16: 7x5 is closest to 0.7
        assert_eq!(grid_size(100, 70, 16, 4096), (7 * 16, 5 * 16));
        // capped at max_tokens cells
        assert_eq!(grid_size(1600, 1000, 16, 64), (10 * 16, 6 * 16));
        // mtmd's fallback when no candidate fits: rounded, not capped (one row of 101)
        assert_eq!(grid_size(16000, 100, 16, 64), (101 * 16, 16));
        // tiny images get one cell
        assert_eq!(grid_size(3, 5, 16, 4096), (16, 16));
    }

    #[test]
    fn resize_to_same_size_is_a_copy_and_constant_stays_constant() {
        let img = Rgb8 {
            width: 7,
            height: 5,
            data: vec![77; 7 * 5 * 3],
        };
        assert_eq!(resize_lanczos(&img, 7, 5), img);
        let r = resize_lanczos(&img, 16, 3);
        assert_eq!((r.width, r.height), (16, 3));
        assert!(r.data.iter().all(|&v| v == 77));
    }

    #[test]
    fn bad_bytes_are_errors() {
        let l = Limits::default();
        assert!(matches!(
            decode(b"not an image", &l),
            Err(VisionError::Image(_))
        ));
        let big = Limits { max_bytes: 4, ..l };
        assert!(matches!(
            decode(&[0u8; 5], &big),
            Err(VisionError::TooLarge(_))
        ));
    }
}
