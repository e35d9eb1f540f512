//! Scalar number formats used inside blocks: IEEE half, bfloat16, E8M0 and UE4M3 scales, the
//! doubled E2M1 table, and ggml's `nearest_int`.

use half::{bf16, f16};

/// Doubled E2M1 values (`kvalues_fp4`): 2 × {0, .5, 1, 1.5, 2, 3, 4, 6}, sign in bit 3.
pub const KVALUES_FP4: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

#[inline]
pub fn f16_to_f32(bits: u16) -> f32 {
    f16::from_bits(bits).to_f32()
}

/// Round to nearest even, as ggml's `GGML_FP32_TO_FP16` (software and F16C agree).
#[inline]
pub fn f32_to_f16(x: f32) -> u16 {
    f16::from_f32(x).to_bits()
}

/// Exact IEEE half → f32 by bit manipulation (usable in constants).
pub const fn f16_bits_to_f32(h: u16) -> f32 {
    let sign = ((h as u32) & 0x8000) << 16;
    let exp = ((h >> 10) & 31) as u32;
    let man = (h & 0x3FF) as u32;
    let bits = if exp == 31 {
        sign | 0x7F80_0000 | (man << 13)
    } else if exp != 0 {
        sign | ((exp + 112) << 23) | (man << 13)
    } else if man == 0 {
        sign
    } else {
        // subnormal half: normalize the mantissa
        let mut e = 113u32;
        let mut m = man;
        while m & 0x400 == 0 {
            m <<= 1;
            e -= 1;
        }
        sign | (e << 23) | ((m & 0x3FF) << 13)
    };
    f32::from_bits(bits)
}

/// Every half's f32 value (256 KiB), as ggml's CPU build keeps in `ggml_table_f32_f16`: one
/// load per scale in the dot kernels.
pub static F16_TABLE: [f32; 65536] = {
    let mut t = [0.0f32; 65536];
    let mut i = 0;
    while i < 65536 {
        t[i] = f16_bits_to_f32(i as u16);
        i += 1;
    }
    t
};

#[inline]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// ggml's `ggml_compute_fp32_to_bf16`: NaN becomes a quiet NaN, everything else rounds to
/// nearest even.
#[inline]
pub fn f32_to_bf16(x: f32) -> u16 {
    bf16::from_f32(x).to_bits()
}

#[inline]
pub fn read_f16(b: &[u8], at: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[at], b[at + 1]]))
}

#[inline]
pub fn write_f16(b: &mut [u8], at: usize, x: f32) {
    b[at..at + 2].copy_from_slice(&f32_to_f16(x).to_le_bytes());
}

/// E8M0 scale divided by two (`ggml_e8m0_to_fp32_half`): 2^(e-128).
#[inline]
pub const fn e8m0_half(e: u8) -> f32 {
    let bits = if e < 2 {
        0x0020_0000u32 << e
    } else {
        ((e as u32) - 1) << 23
    };
    f32::from_bits(bits)
}

/// UE4M3 scale divided by two (`ggml_ue4m3_to_fp32`); 0 and 0x7F (NaN) decode to 0.
#[inline]
pub const fn ue4m3_half(x: u8) -> f32 {
    if x == 0 || x == 0x7F {
        return 0.0;
    }
    let e = ((x >> 3) & 15) as i32;
    let m = (x & 7) as f32;
    let raw = if e == 0 {
        m * (1.0 / 512.0)
    } else {
        (1.0 + m / 8.0) * pow2(e - 7)
    };
    raw * 0.5
}

/// `ggml_fp32_to_ue4m3`: round half up on the fourth mantissa bit, no subnormal carry,
/// everything from 248 up saturates to 0x7E (448).
pub fn f32_to_ue4m3(x: f32) -> u8 {
    if x.is_nan() || x <= 0.0 {
        return 0;
    }
    let x = if x > 448.0 { 448.0 } else { x };
    let bits = x.to_bits();
    let exp = ((bits >> 23) & 0xFF) as i32 - 127 + 7;
    if exp <= 0 {
        let m = ((x * 512.0 + 0.5) as i32).min(7);
        return if m < 1 { 0 } else { m as u8 };
    }
    if exp >= 15 {
        return 0x7E;
    }
    let mut man = ((bits >> 20) & 7) as i32 + ((bits >> 19) & 1) as i32;
    let mut exp = exp;
    if man > 7 {
        man = 0;
        exp += 1;
        if exp >= 15 {
            return 0x7E;
        }
    }
    ((exp << 3) | man) as u8
}

const fn pow2(e: i32) -> f32 {
    f32::from_bits(((e + 127) as u32) << 23)
}

/// ggml's `nearest_int`: round half to even through the 1.5·2^23 trick (valid for |x| < 2^22).
#[inline]
pub fn nearest_int(x: f32) -> i32 {
    let v = x + 12_582_912.0;
    (v.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ue4m3_round_trip_and_edges() {
        for code in 1u8..0x7F {
            let v = ue4m3_half(code) * 2.0;
            // 256..416 are never produced: from 248 up everything saturates to 448 (0x7E)
            let want = if code >= 0x78 { 0x7E } else { code };
            assert_eq!(f32_to_ue4m3(v), want, "code {code:#x} value {v}");
        }
        assert_eq!(f32_to_ue4m3(240.0), 0x77);
        assert_eq!(f32_to_ue4m3(247.9), 0x77);
        assert_eq!(f32_to_ue4m3(248.0), 0x7E);
        assert_eq!(f32_to_ue4m3(1e9), 0x7E);
        assert_eq!(f32_to_ue4m3(-1.0), 0);
        assert_eq!(ue4m3_half(0x7F), 0.0);
    }

    #[test]
    fn f16_table_is_exact() {
        for h in 0..=u16::MAX {
            let (a, b) = (F16_TABLE[h as usize], f16_to_f32(h));
            assert!(
                a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
                "{h:#x}: {a} vs {b}"
            );
        }
    }

    #[test]
    fn e8m0_half_is_two_to_e_minus_128() {
        assert_eq!(e8m0_half(128), 1.0);
        assert_eq!(e8m0_half(127), 0.5);
        assert_eq!(e8m0_half(0), 2f32.powi(-128));
        assert_eq!(e8m0_half(1), 2f32.powi(-127));
    }

    #[test]
    fn nearest_int_rounds_half_to_even() {
        assert_eq!(nearest_int(2.5), 2);
        assert_eq!(nearest_int(3.5), 4);
        assert_eq!(nearest_int(-2.5), -2);
        assert_eq!(nearest_int(-0.4), 0);
    }
}
