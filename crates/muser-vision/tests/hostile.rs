//! Bad images get a clear error before any pixel buffer is made: truncated files, headers
//! claiming huge sizes, formats other than PNG/JPEG/WebP, empty input.

use std::path::Path;

use muser_vision::{decode, Limits, VisionError};

fn png_header(w: u32, h: u32) -> Vec<u8> {
    let mut ihdr = b"IHDR".to_vec();
    ihdr.extend_from_slice(&w.to_be_bytes());
    ihdr.extend_from_slice(&h.to_be_bytes());
    ihdr.extend_from_slice(&[8, 2, 0, 0, 0]);
    let mut out = b"\x89PNG\r\n\x1a\n".to_vec();
    out.extend_from_slice(&13u32.to_be_bytes());
    out.extend_from_slice(&ihdr);
    out.extend_from_slice(&crc32(&ihdr).to_be_bytes());
    // an empty IDAT (the decoder reads the header up to the first one) and the end
    for chunk in [&b"IDAT"[..], &b"IEND"[..]] {
        out.extend_from_slice(&0u32.to_be_bytes());
        out.extend_from_slice(chunk);
        out.extend_from_slice(&crc32(chunk).to_be_bytes());
    }
    out
}

fn crc32(data: &[u8]) -> u32 {
    let mut c = !0u32;
    for &b in data {
        c ^= u32::from(b);
        for _ in 0..8 {
            c = if c & 1 != 0 {
                0xEDB8_8320 ^ (c >> 1)
            } else {
                c >> 1
            };
        }
    }
    !c
}

#[test]
fn bad_images_are_refused_cleanly() {
    let l = Limits::default();
    let good =
        std::fs::read(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/rgb-100x70.png"))
            .unwrap();
    assert!(decode(&good, &l).is_ok());
    // truncated in the middle of the pixel data
    assert!(matches!(
        decode(&good[..good.len() / 2], &l),
        Err(VisionError::Image(_))
    ));
    // a header claiming 100000 x 100000 pixels: refused from the header
    assert!(matches!(
        decode(&png_header(100_000, 100_000), &l),
        Err(VisionError::TooLarge(_))
    ));
    // 20000 x 20000 is past the pixel limit, 1 x 17000 past the side limit
    assert!(matches!(
        decode(&png_header(20_000, 20_000), &l),
        Err(VisionError::TooLarge(_))
    ));
    assert!(matches!(
        decode(&png_header(1, 17_000), &l),
        Err(VisionError::TooLarge(_))
    ));
    // another format, and nothing at all
    assert!(matches!(
        decode(b"GIF89a\x01\x00\x01\x00\x00\x00\x00;", &l),
        Err(VisionError::Image(_))
    ));
    assert!(matches!(decode(b"", &l), Err(VisionError::Image(_))));
    // over the byte limit
    let small = Limits {
        max_bytes: 100,
        ..l
    };
    assert!(matches!(
        decode(&good, &small),
        Err(VisionError::TooLarge(_))
    ));
}
