//! Tests of `Model`: backends, the fused seam, embedding and argmax-only rows, positional cells.

use super::*;
use crate::backend::{AttnInput, RopeMode};
use crate::cpu::Mat;
use crate::synth::{presets::preset, random_tokens, Plan, WeightType};
use muser_gguf::GgmlType;
use std::sync::{Arc, Mutex};

/// The CPU backend seen through another type, recording the weights it is handed at load.
struct Wrapped {
    cpu: CpuBackend,
    prepared: Arc<Mutex<Vec<String>>>,
}

impl Backend for Wrapped {
    type Act = Mat;
    fn numerics(&self) -> String {
        self.cpu.numerics()
    }
    fn supports(&self, ty: GgmlType) -> bool {
        self.cpu.supports(ty)
    }
    fn prepare_weight(&self, w: &Weight) -> Result<(), ModelError> {
        self.prepared.lock().unwrap().push(w.name.to_string());
        Ok(())
    }
    fn upload(&self, r: usize, c: usize, d: Vec<f32>) -> Result<Mat, ModelError> {
        self.cpu.upload(r, c, d)
    }
    fn download(&self, a: &Mat) -> Result<Vec<f32>, ModelError> {
        self.cpu.download(a)
    }
    fn dims(&self, a: &Mat) -> (usize, usize) {
        self.cpu.dims(a)
    }
    fn get_rows(&self, t: &Weight, ids: &[u32]) -> Result<Mat, ModelError> {
        self.cpu.get_rows(t, ids)
    }
    fn matmul(&self, w: &Weight, x: &Mat) -> Result<Mat, ModelError> {
        self.cpu.matmul(w, x)
    }
    fn rms_norm(&self, x: &Mat, g: usize, eps: f32, w: Option<&[f32]>) -> Result<Mat, ModelError> {
        self.cpu.rms_norm(x, g, eps, w)
    }
    fn rms_norm_mut(
        &self,
        x: &mut Mat,
        g: usize,
        eps: f32,
        w: Option<&[f32]>,
    ) -> Result<(), ModelError> {
        self.cpu.rms_norm_mut(x, g, eps, w)
    }
    fn rope(
        &self,
        x: &mut Mat,
        hd: usize,
        n_rot: usize,
        pos: &[u32],
        base: f32,
        mode: RopeMode,
    ) -> Result<(), ModelError> {
        self.cpu.rope(x, hd, n_rot, pos, base, mode)
    }
    fn add(&self, x: &mut Mat, y: &Mat) -> Result<(), ModelError> {
        self.cpu.add(x, y)
    }
    fn add_row(&self, x: &mut Mat, b: &[f32]) -> Result<(), ModelError> {
        self.cpu.add_row(x, b)
    }
    fn mul_sigmoid(&self, x: &mut Mat, g: &Mat) -> Result<(), ModelError> {
        self.cpu.mul_sigmoid(x, g)
    }
    fn swiglu(&self, g: &mut Mat, u: &Mat) -> Result<(), ModelError> {
        self.cpu.swiglu(g, u)
    }
    fn scale(&self, x: &mut Mat, s: f32) -> Result<(), ModelError> {
        self.cpu.scale(x, s)
    }
    fn softcap(&self, x: &mut Mat, cap: f32) -> Result<(), ModelError> {
        self.cpu.softcap(x, cap)
    }
    fn select_rows(&self, x: &Mat, rows: &[usize]) -> Result<Mat, ModelError> {
        self.cpu.select_rows(x, rows)
    }
    fn attention(
        &self,
        kv: &mut KvCache,
        at: &AttnInput,
        q: &Mat,
        k: &Mat,
        v: &Mat,
    ) -> Result<Mat, ModelError> {
        self.cpu.attention(kv, at, q, k, v)
    }
}

fn tiny() -> Vec<u8> {
    Plan::new(preset("tiny").unwrap(), WeightType::Q8_0, 5, None)
        .write(Vec::new(), &mut |_| {})
        .unwrap()
}

/// A model over another backend type runs the same model code (same bits), and that
/// backend is handed every weight matrix exactly once at load.
#[test]
fn load_with_any_backend_runs_the_same_code_and_prepares_each_matrix_once() {
    let bytes = tiny();
    let cpu = Model::from_gguf(
        GgufFile::from_bytes(bytes.clone()).unwrap(),
        &LoadOptions {
            threads: 1,
            ..Default::default()
        },
    )
    .unwrap();
    let prepared = Arc::new(Mutex::new(Vec::new()));
    let wrapped = Wrapped {
        cpu: CpuBackend::new(1).unwrap(),
        prepared: prepared.clone(),
    };
    let other = Model::from_gguf_with(GgufFile::from_bytes(bytes).unwrap(), wrapped).unwrap();
    let toks = random_tokens(12, cpu.info().n_vocab, 9);
    let run = |m: &Model| {
        let mut kv = m.new_kv(64, 1, KvType::F16).unwrap();
        m.forward(&mut kv, &Batch::single(0, &toks, 0, false))
            .unwrap()
            .logits
    };
    assert_eq!(run(&cpu), run(&other));
    let mut got = prepared.lock().unwrap().clone();
    got.sort();
    let mut want: Vec<String> = cpu
        .gguf()
        .tensors()
        .iter()
        .filter(|t| t.dims.len() == 2)
        .map(|t| t.name.clone())
        .collect();
    want.sort();
    assert_eq!(got, want);
}

/// What a fused forward was handed: sequence groups, output rows, the cache's placement.
type Call = (Vec<(u32, Vec<usize>)>, Vec<usize>, Placement);

/// A whole-model forward that records what it is handed and answers with the position of
/// each output row as its logits.
struct Recorder {
    n_vocab: usize,
    seen: Arc<Mutex<Vec<Call>>>,
    /// Its answer to `takes_input_embd`.
    takes_embd: bool,
}

impl FusedForward for Recorder {
    fn numerics(&self) -> String {
        "recorder".to_string()
    }
    fn takes_input_embd(&self) -> bool {
        self.takes_embd
    }
    fn forward(
        &self,
        kv: &mut KvCache,
        batch: &Batch,
        groups: &[(u32, Vec<usize>)],
        out_rows: &[usize],
    ) -> Result<FusedOutput, ModelError> {
        self.seen
            .lock()
            .unwrap()
            .push((groups.to_vec(), out_rows.to_vec(), kv.placement()));
        // Rows asked for their argmax get the position as their token.
        let argmax_only = |r: usize| batch.argmax_only.get(r).copied().unwrap_or(false);
        let rows: Vec<usize> = out_rows
            .iter()
            .copied()
            .filter(|&r| !argmax_only(r))
            .collect();
        let logits = rows
            .iter()
            .flat_map(|&r| std::iter::repeat_n(batch.pos[r] as f32, self.n_vocab))
            .collect();
        let argmax = out_rows
            .iter()
            .filter(|&&r| argmax_only(r))
            .map(|&r| (r, batch.pos[r]))
            .collect();
        Ok(FusedOutput {
            logits,
            hidden: Vec::new(),
            rows,
            argmax,
        })
    }

    fn new_kv_store(
        &self,
        layout: &KvLayout,
        cells: &[usize],
        n_seq: usize,
    ) -> Result<Box<dyn KvStore>, ModelError> {
        Ok(Box::new(HostKv::new(layout, cells, n_seq)?))
    }

    fn accepts(&self, kv: &KvCache) -> Result<(), ModelError> {
        match kv.store().as_any().is::<HostKv>() {
            true => Ok(()),
            false => Err(ModelError::Device("not a host cache".into())),
        }
    }
}

/// `Model::with_fused` validates and places every batch before the fused forward sees it
/// (by position), hands it the sequence groups and output rows, and returns its logits.
#[test]
fn a_fused_forward_gets_validated_batches_on_a_positional_cache() {
    let bytes = tiny();
    let n_vocab = Model::from_gguf(
        GgufFile::from_bytes(bytes.clone()).unwrap(),
        &LoadOptions {
            threads: 1,
            ..Default::default()
        },
    )
    .unwrap()
    .info()
    .n_vocab;
    let seen = Arc::new(Mutex::new(Vec::new()));
    let rec = Recorder {
        n_vocab,
        seen: seen.clone(),
        takes_embd: false,
    };
    let m = Model::with_fused(GgufFile::from_bytes(bytes).unwrap(), Box::new(rec)).unwrap();
    let mut kv = m.new_kv(64, 2, KvType::F16).unwrap();
    assert_eq!(kv.placement(), Placement::Positional);
    let mut b = Batch::single(1, &[3, 4, 5], 0, true);
    b.push(7, 0, 0, true);
    let out = m.forward(&mut kv, &b).unwrap();
    assert_eq!(out.rows, vec![2, 3]);
    assert_eq!(out.row(0, n_vocab)[0], 2.0);
    assert_eq!(out.row(1, n_vocab)[0], 0.0);
    assert_eq!((kv.seq_len(0), kv.seq_len(1)), (1, 3));
    assert_eq!(kv.cell_pos(1, 0)[..3], [0, 1, 2]);
    // A position that does not continue its sequence never reaches the device, nor does
    // a cache placed another way (nothing is placed in it).
    let bad = Batch::single(0, &[1], 5, true);
    assert!(m.forward(&mut kv, &bad).is_err());
    let mut other = m
        .new_kv(64, 1, KvType::F16)
        .unwrap()
        .with_placement(Placement::LlamaCpp);
    let e = m
        .forward(&mut other, &Batch::single(0, &[1], 0, true))
        .unwrap_err();
    assert!(e.to_string().contains("by position"), "{e}");
    assert_eq!(other.seq_len(0), 0);
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].0, vec![(1, vec![0, 1, 2]), (0, vec![3])]);
    assert_eq!(seen[0].1, vec![2, 3]);
    assert_eq!(seen[0].2, Placement::Positional);
}

/// Rows given as embeddings (an image's, with ids past the vocabulary) reach a fused
/// forward that takes them, validated; one that does not is refused before anything is
/// placed in the cache.
#[test]
fn embedding_rows_reach_only_a_fused_forward_that_takes_them() {
    let bytes = tiny();
    let g = GgufFile::from_bytes(bytes.clone()).unwrap();
    let (n_vocab, n_embd) = {
        let i = Model::from_gguf(g, &LoadOptions::default())
            .unwrap()
            .info()
            .clone();
        (i.n_vocab, i.n_embd)
    };
    let mut b = Batch::single(0, &[3, n_vocab as u32 + 7, 5], 0, true);
    b.input_embd = InputEmbd {
        rows: vec![1],
        values: vec![0.5; n_embd],
    };
    for takes_embd in [false, true] {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let rec = Recorder {
            n_vocab,
            seen: seen.clone(),
            takes_embd,
        };
        let g = GgufFile::from_bytes(bytes.clone()).unwrap();
        let m = Model::with_fused(g, Box::new(rec)).unwrap();
        let mut kv = m.new_kv(64, 1, KvType::F16).unwrap();
        let got = m.forward(&mut kv, &b);
        assert_eq!(got.is_ok(), takes_embd, "{got:?}");
        assert_eq!(kv.seq_len(0), if takes_embd { 3 } else { 0 });
        assert_eq!(seen.lock().unwrap().len(), usize::from(takes_embd));
    }
}

/// Rows marked `argmax_only` may come back as tokens (a fused forward), or as logits (the
/// op-by-op path, which ignores the mark); a batch whose marks do not fit is refused, and
/// an answer that does not cover the output rows exactly is an error.
#[test]
fn argmax_only_rows_come_back_as_tokens_or_logits() {
    let bytes = tiny();
    let cpu = Model::from_gguf(
        GgufFile::from_bytes(bytes.clone()).unwrap(),
        &LoadOptions {
            threads: 1,
            ..Default::default()
        },
    )
    .unwrap();
    let n_vocab = cpu.info().n_vocab;
    let rec = Recorder {
        n_vocab,
        seen: Arc::new(Mutex::new(Vec::new())),
        takes_embd: false,
    };
    let fused = Model::with_fused(GgufFile::from_bytes(bytes).unwrap(), Box::new(rec)).unwrap();
    let mut first = Batch::default();
    first.push_argmax(9, 0, 0);
    first.push(8, 1, 0, false);
    assert_eq!(first.argmax_only, vec![true, false]);
    let mut b = Batch::single(0, &[3, 4], 0, true);
    b.push_argmax(5, 0, 1);
    b.push(6, 0, 2, true);
    assert_eq!(b.argmax_only, vec![false, false, true, false]);
    let mut kv = fused.new_kv(64, 3, KvType::F16).unwrap();
    let out = fused.forward(&mut kv, &b).unwrap();
    assert_eq!(out.rows, vec![1, 3]);
    assert_eq!(out.argmax, vec![(2, 0)]);
    assert_eq!(out.logits.len(), 2 * n_vocab);
    let mut kv = cpu.new_kv(64, 3, KvType::F16).unwrap();
    let out = cpu.forward(&mut kv, &b).unwrap();
    assert_eq!(out.rows, vec![1, 2, 3]);
    assert!(out.argmax.is_empty());
    // Marks that do not fit the batch change nothing.
    let mut kv = cpu.new_kv(64, 3, KvType::F16).unwrap();
    let mut short = b.clone();
    short.argmax_only.pop();
    assert!(cpu.forward(&mut kv, &short).is_err());
    let mut silent = b.clone();
    silent.logits[2] = false;
    assert!(cpu.forward(&mut kv, &silent).is_err());
    assert_eq!(kv.seq_len(0), 0);
    // An answer with a row twice, or an argmax nobody asked for, is refused.
    let mut a = FusedOutput {
        logits: vec![0.0; 2 * n_vocab],
        hidden: Vec::new(),
        rows: vec![1, 3],
        argmax: vec![(2, 7)],
    };
    assert!(cpu.check_answer(&b, &[1, 2, 3], &a).is_ok());
    a.argmax.push((3, 7));
    assert!(cpu.check_answer(&b, &[1, 2, 3], &a).is_err());
    a.argmax = vec![(1, 7)];
    a.rows = vec![2, 3];
    assert!(cpu.check_answer(&b, &[1, 2, 3], &a).is_err());
    a.argmax = vec![(2, n_vocab as u32)];
    a.rows = vec![1, 3];
    assert!(cpu.check_answer(&b, &[1, 2, 3], &a).is_err());
}

/// On the CPU a positional cache gives llama.cpp's logits bit for bit in order (the same
/// cells). After a truncation whose dropped tail wraps the ring it still does what a run
/// that never went past the cut does, bit for bit (llama.cpp's search restarts at cell 0
/// there, which reorders the attention's f16 sums).
#[test]
fn positional_cells_give_the_same_logits_on_the_cpu() {
    let m = Model::from_gguf(
        GgufFile::from_bytes(tiny()).unwrap(),
        &LoadOptions {
            threads: 1,
            ..Default::default()
        },
    )
    .unwrap();
    let toks = random_tokens(400, m.info().n_vocab, 3);
    let swa_layer = m.info().is_swa.iter().position(|&s| s).unwrap();
    // Chunks of 16 over `range`, last-token logits of each.
    let feed = |kv: &mut KvCache, range: std::ops::Range<usize>| -> Vec<f32> {
        let mut logits = Vec::new();
        for (c, chunk) in toks[range.clone()].chunks(16).enumerate() {
            let p0 = (range.start + 16 * c) as u32;
            logits.extend(
                m.forward(kv, &Batch::single(0, chunk, p0, true))
                    .unwrap()
                    .logits,
            );
        }
        logits
    };
    let new = |placement| {
        m.new_kv_ubatch(512, 1, KvType::F16, 16)
            .unwrap()
            .with_placement(placement)
    };
    let (mut a, mut b) = (new(Placement::LlamaCpp), new(Placement::Positional));
    let ring = a.cell_pos(0, swa_layer).len();
    assert!(ring + 10 < 400);
    assert_eq!(feed(&mut a, 0..ring + 10), feed(&mut b, 0..ring + 10));
    // Back to a cut whose dropped positions sit in the ring's last and first cells.
    let cut = ring - 6;
    b.truncate(0, cut as u32);
    let after_cut = feed(&mut b, cut..cut + 60);
    let mut fresh = new(Placement::LlamaCpp);
    feed(&mut fresh, 0..cut);
    assert_eq!(after_cut, feed(&mut fresh, cut..cut + 60));
}
