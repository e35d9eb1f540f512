//! Deterministic random tensor rows: normal samples encoded through muser-quant's reference
//! quantizers, or (for presets too large for that) cheap random bytes laid out as valid
//! blocks with small fixed scales.
//!
//! Every row has its own generator seeded from (seed, tensor name, row index), so the output
//! does not depend on the number of threads or the order rows are produced in.

use half::f16;
use muser_gguf::GgmlType;

use super::presets::Init;
use super::SynthError;

/// splitmix64: small, fast, and good enough for weights.
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix(self.0)
    }

    /// Uniform in (0, 1].
    fn unit(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 + 1.0) * (1.0 / (1u64 << 24) as f32)
    }

    /// Two independent N(0, 1) samples (Box-Muller).
    fn normal_pair(&mut self) -> (f32, f32) {
        let r = (-2.0 * self.unit().ln()).sqrt();
        let (s, c) = (std::f32::consts::TAU * self.unit()).sin_cos();
        (r * c, r * s)
    }

    fn fill_bytes(&mut self, out: &mut [u8]) {
        let mut chunks = out.chunks_exact_mut(8);
        for c in &mut chunks {
            c.copy_from_slice(&self.next_u64().to_le_bytes());
        }
        let rest = chunks.into_remainder();
        let last = self.next_u64().to_le_bytes();
        rest.copy_from_slice(&last[..rest.len()]);
    }
}

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The generator of one row.
pub(crate) fn row_rng(seed: u64, tensor: &str, row: u64) -> Rng {
    let name = tensor.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    });
    Rng::new(mix(seed ^ mix(name ^ mix(row))))
}

/// Draws the values of row `row` of tensor `tensor` under `seed`: the same generator as this
/// writer's rows, for other synthetic writers (the vision projector's).
pub fn random_row(seed: u64, tensor: &str, row: u64, init: Init, out: &mut [f32]) {
    fill_values(init, &mut row_rng(seed, tensor, row), out);
}

/// A tensor of random rows for a small synthetic writer (the DFlash drafter, the vision
/// projector): F32 or F16, each row drawn by [`random_row`].
pub struct RandomTensor {
    pub name: String,
    pub dims: Vec<u64>,
    pub init: Init,
    pub ty: GgmlType,
}

/// Declares `list`'s tensors on `w` (its metadata already added), writes the header and
/// each tensor's rows under `seed` (rows drawn in parallel, same seed same bytes), and
/// finishes the file.
pub fn write_random_tensors<W: std::io::Write>(
    mut w: muser_gguf::GgufWriter<W>,
    list: &[RandomTensor],
    seed: u64,
) -> Result<W, muser_gguf::Error> {
    use rayon::prelude::*;
    for t in list {
        w.add_tensor_info(&t.name, &t.dims, t.ty)?;
    }
    w.write_header()?;
    for t in list {
        let row = t.dims[0] as usize;
        let n_rows = t.dims[1..].iter().product::<u64>() as usize;
        let bytes: Vec<u8> = (0..n_rows)
            .into_par_iter()
            .flat_map_iter(|r| {
                let mut v = vec![0f32; row];
                random_row(seed, &t.name, r as u64, t.init, &mut v);
                match t.ty {
                    GgmlType::F16 => v
                        .iter()
                        .flat_map(|&x| f16::from_f32(x).to_le_bytes())
                        .collect::<Vec<u8>>(),
                    _ => v.iter().flat_map(|&x| x.to_le_bytes()).collect(),
                }
            })
            .collect();
        w.write_tensor_data(&t.name, &bytes)?;
    }
    w.finish()
}

/// Draws the values of one row.
fn fill_values(init: Init, rng: &mut Rng, out: &mut [f32]) {
    match init {
        Init::Constant(c) => out.fill(c),
        Init::NearOne | Init::Normal { .. } => {
            let (mean, std) = match init {
                Init::Normal { std } => (0.0, std),
                _ => (1.0, 0.1),
            };
            for pair in out.chunks_mut(2) {
                let (a, b) = rng.normal_pair();
                pair[0] = mean + std * a;
                if let Some(x) = pair.get_mut(1) {
                    *x = mean + std * b;
                }
            }
        }
    }
}

/// Uniform values with the given standard deviation (cheap; for raw mode float tensors).
fn fill_uniform(std: f32, rng: &mut Rng, out: &mut [f32]) {
    let half_width = std * 3f32.sqrt();
    for x in out {
        *x = (2.0 * rng.unit() - 1.0) * half_width;
    }
}

/// Encodes one row of `values.len()` normal samples as `ty` into `out`.
pub(crate) fn quantized_row(
    ty: GgmlType,
    init: Init,
    rng: &mut Rng,
    scratch: &mut Vec<f32>,
    n: usize,
    out: &mut [u8],
) -> Result<(), SynthError> {
    scratch.resize(n, 0.0);
    fill_values(init, rng, scratch);
    muser_quant::quantize_row(ty, scratch, out)?;
    Ok(())
}

/// Where a block keeps its scales, for writing random-but-valid blocks: f16 fields as
/// (byte offset, multiple of the base scale d), and NVFP4's four UE4M3 bytes.
struct RawLayout {
    f16_fields: &'static [(usize, f32)],
    ue4m3_bytes: usize,
    /// Standard deviation of a block's values for d = 1 with uniform random quant bits.
    unit_std: f32,
}

fn raw_layout(ty: GgmlType) -> Option<RawLayout> {
    let l = |f16_fields, ue4m3_bytes, unit_std| {
        Some(RawLayout {
            f16_fields,
            ue4m3_bytes,
            unit_std,
        })
    };
    match ty {
        // (q - 8)·d, q uniform in 0..16.
        GgmlType::Q4_0 => l(&[(0, 1.0)], 0, 4.6),
        // (q - 16)·d, q uniform in 0..32.
        GgmlType::Q5_0 => l(&[(0, 1.0)], 0, 9.2),
        // q·d, q uniform i8.
        GgmlType::Q8_0 => l(&[(0, 1.0)], 0, 73.9),
        // d·sc·q − dmin·m with 6-bit sc, m and 4-bit q; dmin = 7.5·d centres the values.
        GgmlType::Q4_K => l(&[(0, 1.0), (2, 7.5)], 0, 255.0),
        // d·sc·(q − 32), i8 sc, 6-bit q; d is the last field.
        GgmlType::Q6_K => l(&[(208, 1.0)], 0, 1370.0),
        // E2M1 × UE4M3/2 per 16 values; the scale byte is chosen per tensor.
        GgmlType::NVFP4 => l(&[], 4, 5.85 / 2.0),
        _ => None,
    }
}

/// The UE4M3 byte (0..=0x7e) whose value is nearest to `x`.
fn ue4m3_nearest(x: f32) -> u8 {
    let value = |b: u8| {
        let (e, m) = (i32::from((b >> 3) & 15), f32::from(b & 7));
        if e == 0 {
            m * (-9f32).exp2()
        } else {
            (1.0 + m / 8.0) * ((e - 7) as f32).exp2()
        }
    };
    (1..=0x7e)
        .min_by(|&a, &b| (value(a) - x).abs().total_cmp(&(value(b) - x).abs()))
        .unwrap_or(1)
}

/// Fills one row with cheap random data of the right scale: random quant bits with fixed
/// scales for block types, uniform values for float types, exact values for norms.
pub(crate) fn raw_row(
    ty: GgmlType,
    init: Init,
    rng: &mut Rng,
    scratch: &mut Vec<f32>,
    n: usize,
    out: &mut [u8],
) -> Result<(), SynthError> {
    let std = match init {
        Init::Normal { std } => std,
        _ => return quantized_row(ty, init, rng, scratch, n, out),
    };
    let Some(layout) = raw_layout(ty) else {
        scratch.resize(n, 0.0);
        fill_uniform(std, rng, scratch);
        muser_quant::quantize_row(ty, scratch, out)?;
        return Ok(());
    };
    rng.fill_bytes(out);
    let d = std / layout.unit_std;
    let scale_byte = ue4m3_nearest(d);
    for block in out.chunks_exact_mut(ty.type_size()) {
        for &(offset, k) in layout.f16_fields {
            block[offset..offset + 2].copy_from_slice(&f16::from_f32(d * k).to_le_bytes());
        }
        block[..layout.ue4m3_bytes].fill(scale_byte);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats(v: &[f32]) -> (f32, f32) {
        let mean = v.iter().sum::<f32>() / v.len() as f32;
        let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f32>() / v.len() as f32;
        (mean, var.sqrt())
    }

    #[test]
    fn normal_samples_have_the_asked_scale() {
        let mut v = vec![0.0; 1 << 16];
        fill_values(Init::Normal { std: 0.02 }, &mut Rng::new(1), &mut v);
        let (mean, std) = stats(&v);
        assert!(
            mean.abs() < 1e-3 && (std - 0.02).abs() < 1e-3,
            "{mean} {std}"
        );
    }

    #[test]
    fn raw_blocks_decode_to_the_asked_scale() {
        let n = 256 * 64;
        for ty in [
            GgmlType::Q4_0,
            GgmlType::Q5_0,
            GgmlType::Q8_0,
            GgmlType::Q4_K,
            GgmlType::Q6_K,
            GgmlType::NVFP4,
        ] {
            let mut bytes = vec![0u8; ty.row_bytes(n).unwrap()];
            let init = Init::Normal { std: 0.0125 };
            raw_row(ty, init, &mut Rng::new(7), &mut Vec::new(), n, &mut bytes).unwrap();
            let mut v = vec![0.0; n];
            muser_quant::dequantize_row(ty, &bytes, &mut v).unwrap();
            let (mean, std) = stats(&v);
            assert!(v.iter().all(|x| x.is_finite()), "{ty}");
            assert!(
                mean.abs() < 0.003 && std > 0.006 && std < 0.025,
                "{ty}: mean {mean} std {std}"
            );
        }
    }

    #[test]
    fn rows_are_deterministic_and_distinct() {
        let a = row_rng(5, "blk.0.attn_q.weight", 3).next_u64();
        assert_eq!(a, row_rng(5, "blk.0.attn_q.weight", 3).next_u64());
        assert_ne!(a, row_rng(5, "blk.1.attn_q.weight", 3).next_u64());
        assert_ne!(a, row_rng(5, "blk.0.attn_q.weight", 4).next_u64());
        assert_ne!(a, row_rng(6, "blk.0.attn_q.weight", 3).next_u64());
    }
}
