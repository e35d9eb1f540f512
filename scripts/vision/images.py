#!/usr/bin/env python3
"""Writes the test images of muser-vision's goldens (deterministic PNGs, standard library only):
sizes and aspect ratios that make mtmd downsample, upsample, resize the position grid and use
several attention windows; RGB, grayscale and RGBA (alpha is dropped, as stb_image does).
`images.py DIR` writes the test set, `images.py --bench FILE [SIDE]` one SIDE x SIDE image
(default 1024)."""
import struct, sys, zlib, os

def png(path, w, h, color_type, pixel):
    ch = {0: 1, 2: 3, 6: 4}[color_type]
    raw = b"".join(b"\x00" + bytes(v for x in range(w) for v in pixel(x, y)[:ch]) for y in range(h))
    def chunk(t, d):
        return struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d) & 0xFFFFFFFF)
    data = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, color_type, 0, 0, 0))
    data += chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")
    open(path, "wb").write(data)

def noise(x, y, s):
    v = (x * 73856093) ^ (y * 19349663) ^ (s * 83492791)
    return (v ^ (v >> 13)) * 1274126177 & 0xFF

if sys.argv[1] == "--bench":  # one square RGB image (side 1024 or argv[3]) for scripts/vision-bench.sh
    side = int(sys.argv[3]) if len(sys.argv) > 3 else 1024
    png(sys.argv[2], side, side, 2, lambda x, y: (noise(x, y, 5), (x ^ y) & 255, (x + 2 * y) & 255))
    sys.exit(0)
out = sys.argv[1]
os.makedirs(out, exist_ok=True)
png(f"{out}/rgb-37x23.png", 37, 23, 2, lambda x, y: ((x * 7) & 255, (y * 11) & 255, noise(x, y, 1)))
png(f"{out}/gray-20x52.png", 20, 52, 0, lambda x, y: ((x * 13 + y * 5) & 255,))
png(f"{out}/rgba-10x9.png", 10, 9, 6, lambda x, y: (noise(x, y, 2), 255 - x * 20, y * 25, noise(x, y, 3)))
png(f"{out}/rgb-100x70.png", 100, 70, 2, lambda x, y: (noise(x, y, 4), (x + y) & 255, (x * y) & 255))
