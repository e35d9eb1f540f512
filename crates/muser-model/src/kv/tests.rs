//! The cache's bookkeeping against llama.cpp's, exports, imports, marks and rollbacks.

use super::*;
use std::any::Any;

fn layout() -> KvLayout {
    KvLayout {
        n_layer: 2,
        is_swa: vec![false, true],
        n_head_kv: 1,
        head_dim: 4,
        n_swa: 4,
        dtype: KvType::F32,
    }
}

fn fill(kv: &mut KvCache, seq: u32, range: Range<u32>, chunk: usize) {
    let all: Vec<u32> = range.collect();
    for c in all.chunks(chunk) {
        kv.place(&[(seq, (0..c.len()).collect())], c, &[]).unwrap();
    }
}

/// Places `positions` of `seq` as one batch and writes each position's number into its
/// rows, as a forward pass would write its K/V.
fn put(kv: &mut KvCache, seq: u32, positions: Range<u32>) {
    let pos: Vec<u32> = positions.collect();
    let plan = kv
        .place(&[(seq, (0..pos.len()).collect())], &pos, &[])
        .unwrap();
    let row = kv.layout.row_bytes();
    for il in 0..kv.layout.n_layer {
        let cells = if kv.layout.is_swa[il] {
            &plan.swa_cell
        } else {
            &plan.base_cell
        };
        for (&p, &c) in pos.iter().zip(cells) {
            let bytes = vec![(p % 251) as u8 + il as u8; row];
            kv.store
                .write_rows(il, seq, c as usize, &bytes, &bytes)
                .unwrap();
        }
    }
}

/// Everything of `seq` a later step can observe: bookkeeping and the rows of held cells.
fn observe(kv: &KvCache, seq: u32) -> (String, Vec<Vec<u8>>) {
    let row = kv.layout.row_bytes();
    let rows = (0..kv.layout.n_layer)
        .flat_map(|il| {
            let cells = kv.cell_pos(seq, il);
            let n = cells.len();
            let (mut k, mut v) = (vec![0u8; n * row], vec![0u8; n * row]);
            kv.store.read_rows(il, seq, 0..n, &mut k, &mut v).unwrap();
            (0..n)
                .filter(|&c| cells[c] != EMPTY)
                .map(|c| [&k[c * row..(c + 1) * row], &v[c * row..(c + 1) * row]].concat())
                .collect::<Vec<_>>()
        })
        .collect();
    (format!("{:?}", kv.streams[seq as usize]), rows)
}

/// A verification batch rolled back to its accepted prefix leaves exactly what one-token
/// steps over that prefix leave, ring wraps included (the batch reuses ring cells whose old
/// rows come back).
#[test]
fn rollback_after_a_verification_batch_equals_one_token_steps() {
    for placement in [Placement::LlamaCpp, Placement::Positional] {
        for start in [0u32, 5, 250, 253, 600] {
            for keep in 1..=8u32 {
                let fresh = || {
                    let mut kv = KvCache::new(layout(), 1024, 1, 8)
                        .unwrap()
                        .with_placement(placement);
                    let mut p = 0;
                    while p < start {
                        let e = (p + 7).min(start);
                        put(&mut kv, 0, p..e);
                        p = e;
                    }
                    kv
                };
                let mut plain = fresh();
                for p in start..start + keep {
                    put(&mut plain, 0, p..p + 1);
                }
                let mut spec = fresh();
                let mark = spec.mark(0, 8).unwrap();
                put(&mut spec, 0, start..start + 8);
                spec.rollback(mark, keep).unwrap();
                assert!(
                    observe(&spec, 0) == observe(&plain, 0),
                    "{placement:?} start {start} keep {keep}"
                );
                // and both go on the same way
                put(&mut plain, 0, start + keep..start + keep + 3);
                put(&mut spec, 0, start + keep..start + keep + 3);
                assert!(
                    observe(&spec, 0) == observe(&plain, 0),
                    "then {start} {keep}"
                );
            }
        }
    }
}

#[test]
fn a_rollback_that_does_not_match_the_cache_is_refused() {
    let mut kv = KvCache::new(layout(), 64, 1, 8).unwrap();
    put(&mut kv, 0, 0..4);
    assert!(kv.mark(0, 61).is_err());
    let mark = kv.mark(0, 4).unwrap();
    put(&mut kv, 0, 4..6);
    assert!(kv.rollback(mark, 2).is_err());
    assert_eq!(kv.seq_len(0), 6);
}

#[test]
fn base_cells_fill_in_order_and_swa_ring_reuses_old_cells() {
    let mut kv = KvCache::new(layout(), 1024, 1, 8).unwrap();
    assert_eq!(kv.cell_pos(0, 1).len(), 256);
    fill(&mut kv, 0, 0..300, 1);
    assert_eq!(kv.seq_len(0), 300);
    let base = kv.cell_pos(0, 0);
    assert!((0..300).all(|i| base[i] == i as i32));
    // The ring wrapped: every SWA cell is in use, and the newest 4 positions are present.
    let swa = kv.cell_pos(0, 1);
    for p in 296..300 {
        assert!(swa.contains(&p));
    }
    assert_eq!(kv.streams[0].base.n_kv(), 512);
    assert_eq!(kv.streams[0].swa.n_kv(), 256);
}

#[test]
fn positional_placement_equals_llama_cpp_in_order_and_keeps_positions_after_a_wrapped_truncation() {
    for chunk in [1, 3, 8] {
        let mut a = KvCache::new(layout(), 1024, 1, 8).unwrap();
        let mut b = KvCache::new(layout(), 1024, 1, 8)
            .unwrap()
            .with_placement(Placement::Positional);
        assert_eq!(b.placement(), Placement::Positional);
        fill(&mut a, 0, 0..700, chunk);
        fill(&mut b, 0, 0..700, chunk);
        for il in 0..2 {
            assert_eq!(
                a.cell_pos(0, il),
                b.cell_pos(0, il),
                "chunk {chunk} layer {il}"
            );
        }
    }
    // Positions 250..260 sit in ring cells 250..255 and 0..3; dropping them makes
    // llama.cpp's search restart at cell 0, while the positional cache keeps p % 256.
    let mut a = KvCache::new(layout(), 1024, 1, 8).unwrap();
    let mut b = KvCache::new(layout(), 1024, 1, 8)
        .unwrap()
        .with_placement(Placement::Positional);
    for kv in [&mut a, &mut b] {
        fill(kv, 0, 0..260, 4);
        kv.truncate(0, 250);
        assert_eq!(kv.seq_len(0), 250);
        fill(kv, 0, 250..300, 5);
        assert!(kv.holds(0, 296..300));
    }
    assert_ne!(a.cell_pos(0, 1), b.cell_pos(0, 1));
    let ring = b.cell_pos(0, 1);
    assert!((250..300).all(|p| ring[p % 256] == p as i32));
    assert!((0..300).all(|p| b.cell_pos(0, 0)[p] == p as i32));
}

#[test]
fn positional_placement_never_overwrites_a_key_still_in_the_window() {
    let lay = KvLayout {
        n_swa: 252,
        ..layout()
    };
    // n_ubatch 4: a ring of 256 cells.
    let mut kv = KvCache::new(lay, 1024, 1, 4)
        .unwrap()
        .with_placement(Placement::Positional);
    fill(&mut kv, 0, 0..300, 4);
    let before: Vec<Vec<i32>> = (0..2).map(|il| kv.cell_pos(0, il).to_vec()).collect();
    // 8 tokens at 300..308 would land on cells holding 44..51, of which 49..51 are still
    // within 252 positions of the sequence's end.
    let pos: Vec<u32> = (300..308).collect();
    let e = kv.place(&[(0, (0..8).collect())], &pos, &[]).unwrap_err();
    assert!(matches!(e, ModelError::KvFull { seq: 0, .. }), "{e}");
    for (il, b) in before.iter().enumerate() {
        assert_eq!(kv.cell_pos(0, il), &b[..]);
    }
    assert_eq!(kv.seq_len(0), 300);
}

/// The kept largest position and used-cell bound equal a scan of the cells after any mix
/// of batches, truncations and clears, in both placements.
#[test]
fn cached_cell_bounds_follow_every_change() {
    let mut rng = 0x9e3779b97f4a7c15u64;
    let mut next = |n: u32| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        (rng % n as u64) as u32
    };
    for placement in [Placement::LlamaCpp, Placement::Positional] {
        let mut kv = KvCache::new(layout(), 300, 2, 8)
            .unwrap()
            .with_placement(placement);
        for _ in 0..3000 {
            let seq = next(2);
            match next(20) {
                0 => kv.clear(seq),
                1 => {
                    let len = kv.seq_len(seq);
                    kv.truncate(seq, next(len + 1));
                }
                _ => {
                    let p0 = kv.seq_len(seq);
                    let n = 1 + next(8);
                    if p0 + n <= 300 {
                        let pos: Vec<u32> = (p0..p0 + n).collect();
                        kv.place(&[(seq, (0..n as usize).collect())], &pos, &[])
                            .unwrap();
                    } else {
                        kv.clear(seq);
                    }
                }
            }
            for s in &kv.streams {
                for c in [&s.base, &s.swa] {
                    let mut scanned = c.clone();
                    scanned.rescan();
                    assert_eq!((c.max, c.hi), (scanned.max, scanned.hi), "{placement:?}");
                }
            }
        }
    }
}

#[test]
fn truncate_rolls_back_and_reuses_cells() {
    let mut kv = KvCache::new(layout(), 64, 2, 8).unwrap();
    fill(&mut kv, 1, 0..20, 7);
    kv.truncate(1, 10);
    assert_eq!(kv.seq_len(1), 10);
    assert_eq!(kv.seq_len(0), 0);
    fill(&mut kv, 1, 10..12, 2);
    assert_eq!(kv.cell_pos(1, 0)[10], 10);
    kv.clear(1);
    assert_eq!(kv.seq_len(1), 0);
}

#[test]
fn cells_of_maps_each_position_to_its_first_cell() {
    // cells hold positions 7, 5, empty, 6, 5 (a duplicate); want 4..8
    let at = cells_of(&[7, 5, EMPTY, 6, 5], &(4..8));
    assert_eq!(at, vec![usize::MAX, 1, 3, 0]);
    assert!(cells_of(&[], &(0..0)).is_empty());
}

#[test]
fn export_import_round_trip_keeps_window_rows() {
    let mut kv = KvCache::new(layout(), 64, 2, 8).unwrap();
    fill(&mut kv, 0, 0..10, 3);
    for il in 0..2 {
        let cells = kv.cell_pos(0, il).to_vec();
        let host = kv
            .store_mut()
            .as_any_mut()
            .downcast_mut::<HostKv>()
            .unwrap();
        let (k, v) = host.layer_mut(0, il);
        for (c, &p) in cells.iter().enumerate() {
            if p >= 0 {
                k[c * 16..c * 16 + 4].copy_from_slice(&(p as f32).to_le_bytes());
                v[c * 16..c * 16 + 4].copy_from_slice(&(-(p as f32)).to_le_bytes());
            }
        }
    }
    let snap = kv.export(0, 0..10).unwrap();
    assert_eq!(snap.layers[0].k.len(), 10 * 16);
    assert_eq!(snap.layer_positions(1), 6..10);
    assert_eq!(snap.layers[1].k.len(), 4 * 16);
    kv.import(1, &snap).unwrap();
    assert_eq!(kv.seq_len(1), 10);
    assert_eq!(kv.export(1, 0..10).unwrap(), snap);
    assert!(
        kv.import(1, &snap).is_err(),
        "a second import must start at position 10"
    );
}

/// A store that keeps rows elsewhere (as a device would): export and import go through
/// the trait, so the snapshot equals the host cache's.
#[derive(Debug)]
struct Boxed(HostKv, usize);

impl KvStore for Boxed {
    fn read_rows(
        &self,
        il: usize,
        seq: u32,
        cells: Range<usize>,
        k: &mut [u8],
        v: &mut [u8],
    ) -> Result<(), ModelError> {
        self.0.read_rows(il, seq, cells, k, v)
    }
    fn write_rows(
        &mut self,
        il: usize,
        seq: u32,
        first: usize,
        k: &[u8],
        v: &[u8],
    ) -> Result<(), ModelError> {
        self.1 += 1;
        self.0.write_rows(il, seq, first, k, v)
    }
    fn bytes(&self) -> usize {
        self.0.bytes()
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

#[test]
fn snapshot_moves_between_stores() {
    let mut host = KvCache::new(layout(), 64, 1, 8).unwrap();
    fill(&mut host, 0, 0..10, 3);
    let mut x = 1u8;
    for il in 0..2 {
        let h = host
            .store_mut()
            .as_any_mut()
            .downcast_mut::<HostKv>()
            .unwrap();
        let (k, v) = h.layer_mut(0, il);
        k.iter_mut().chain(v.iter_mut()).for_each(|b| {
            x = x.wrapping_mul(31).wrapping_add(7);
            *b = x;
        });
    }
    let snap = host.export(0, 0..10).unwrap();
    let mut other = KvCache::with_store(layout(), 64, 2, 8, |l, c, n| {
        Ok(Box::new(Boxed(HostKv::new(l, c, n)?, 0)))
    })
    .unwrap();
    other.import(1, &snap).unwrap();
    let writes = other.store().as_any().downcast_ref::<Boxed>().unwrap().1;
    // Two ubatch steps of consecutive cells: one write per layer per step.
    assert_eq!(writes, 4);
    assert_eq!(other.export(1, 0..10).unwrap(), snap);
    assert_eq!(
        other.export(1, 6..10).unwrap(),
        host.export(0, 6..10).unwrap()
    );
}

#[test]
fn a_cut_resumes_only_where_the_ring_still_holds_the_window_before_it() {
    // window 4, ring of 256 cells: after 700 positions the ring holds about the last 256
    let mut kv = KvCache::new(layout(), 1024, 1, 8).unwrap();
    fill(&mut kv, 0, 0..700, 8);
    assert!(kv.holds_window(0, 700));
    assert!(kv.holds_window(0, 600));
    // the window before 256 left the ring long ago: a slot cut back there cannot resume
    assert!(!kv.holds_window(0, 256));
    // no sliding layer: any cut resumes
    let full = KvLayout {
        is_swa: vec![false, false],
        ..layout()
    };
    let mut kv = KvCache::new(full, 1024, 1, 8).unwrap();
    fill(&mut kv, 0, 0..700, 8);
    assert!(kv.holds_window(0, 256));
}
