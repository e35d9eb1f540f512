//! A host model of the tiled Q4_K GEMV (`gemv_q4k_tile` in kernels.cu): its fragments, its
//! super-block loop and its reduction, checked against the one-sequence GEMV's lanes and sums
//! (each (row, sequence) gets every term of every lane once, in the lane's order, and the lanes
//! and warps are added in `warp_sum`'s and `q4k_store`'s order), and its exact conversions.

use crate::layout::{
    kernel_names, q4k_shape, q4k_tile, MAX_GEMV_BATCH, Q4K_SHAPES, Q4K_SHAPE_MAX_BATCH, Q4K_TILES,
    Q4K_TILE_MIN_BATCH, Q4K_TILE_ROWS, Q4K_TILE_SEQS, Q4K_TILE_STAGES, Q4K_TILE_STAGE_BYTES,
};
use std::collections::BTreeMap;

/// A float sum as a tree: addition is commutative in IEEE arithmetic, so two sums give the same
/// bits when their trees are the same up to the order of each node's two operands.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Sum {
    Zero,
    Lane { k: usize, g: usize, j: usize },
    Add(Box<Sum>, Box<Sum>),
}

fn add(a: &Sum, b: &Sum) -> Sum {
    let (x, y) = if a <= b { (a, b) } else { (b, a) };
    Sum::Add(Box::new(x.clone()), Box::new(y.clone()))
}

/// `warp_sum` as lane 0 sees it: at distances 16, 8, 4, 2, 1 every lane adds its partner's.
fn warp_sum(mut v: Vec<Sum>) -> Sum {
    for o in [16, 8, 4, 2, 1] {
        v = (0..32).map(|l| add(&v[l], &v[l ^ o])).collect();
    }
    v.swap_remove(0)
}

/// `q4k_store` for one (row, sequence): lane 8g + j of warp k holds its own sum.
fn one_sequence_sum(wpr: usize) -> Sum {
    let warp = |k: usize| {
        warp_sum(
            (0..32)
                .map(|l| Sum::Lane {
                    k,
                    g: l >> 3,
                    j: l & 7,
                })
                .collect(),
        )
    };
    if wpr == 1 {
        return warp(0);
    }
    (0..wpr).fold(Sum::Zero, |acc, k| add(&acc, &warp(k)))
}

/// `q4k_tile_store` for one (row, sequence): warp w = 4k + g holds lane j's sum in acc[j].
fn tile_sum(wpr: usize) -> Sum {
    let per_k = |k: usize| {
        let acc = |g: usize| -> Vec<Sum> { (0..8).map(|j| Sum::Lane { k, g, j }).collect() };
        // Distance 16 (groups g, g + 2), then 8 (groups 0, 1), through shared memory.
        let g01: Vec<Vec<Sum>> = (0..2)
            .map(|g| {
                acc(g)
                    .iter()
                    .zip(acc(g + 2))
                    .map(|(a, b)| add(a, &b))
                    .collect()
            })
            .collect();
        let a: Vec<Sum> = g01[0].iter().zip(&g01[1]).map(|(a, b)| add(a, b)).collect();
        // Distances 4, 2, 1 in registers.
        add(
            &add(&add(&a[0], &a[4]), &add(&a[2], &a[6])),
            &add(&add(&a[1], &a[5]), &add(&a[3], &a[7])),
        )
    };
    if wpr == 1 {
        return per_k(0);
    }
    (0..wpr).fold(Sum::Zero, |acc, k| add(&acc, &per_k(k)))
}

/// The m16n8k16 s8 fragments as kernels.cu loads them, for lane (gid, t): A rows gid + 8i,
/// bytes 4t..4t+3 (register i); B column gid, bytes 4t..4t+3; C element e at row gid + 8 (e/2),
/// column 2t + e % 2.
fn a_frag(lane: usize, i: usize) -> Vec<(usize, usize)> {
    (0..4)
        .map(|b| ((lane >> 2) + 8 * i, 4 * (lane & 3) + b))
        .collect()
}
fn b_frag(lane: usize) -> Vec<(usize, usize)> {
    (0..4).map(|b| (4 * (lane & 3) + b, lane >> 2)).collect()
}
fn c_elem(lane: usize, e: usize) -> (usize, usize) {
    ((lane >> 2) + 8 * (e >> 1), 2 * (lane & 3) + (e & 1))
}

/// The PTX fragment layouts of mma.m16n8k16 with s8 operands (PTX ISA, "Matrix Fragments for
/// mma.m16n8k16" for .s8): A a0..a7 at row groupID (+8 from a4), column threadID_in_group * 4 +
/// (i & 3); B b0..b3 at row threadID_in_group * 4 + i, column groupID; C c0..c3 at row groupID
/// (+8 from c2), column threadID_in_group * 2 + (i & 1). The loads above must be these, and
/// cover each matrix element once.
#[test]
fn tile_fragments_are_the_ptx_layouts_and_cover_each_element_once() {
    let mut a = BTreeMap::new();
    let mut b = BTreeMap::new();
    let mut c = BTreeMap::new();
    for lane in 0..32 {
        let (group, tig) = (lane / 4, lane % 4);
        for i in 0..8 {
            let want = (group + 8 * (i / 4), tig * 4 + (i & 3));
            assert_eq!(a_frag(lane, i / 4)[i % 4], want);
            *a.entry(want).or_insert(0) += 1;
        }
        for i in 0..4 {
            let want = (tig * 4 + i, group);
            assert_eq!(b_frag(lane)[i], want);
            *b.entry(want).or_insert(0) += 1;
        }
        for i in 0..4 {
            let want = (group + 8 * (i / 2), tig * 2 + (i & 1));
            assert_eq!(c_elem(lane, i), want);
            *c.entry(want).or_insert(0) += 1;
        }
    }
    assert!(a.len() == 16 * 16 && a.values().all(|&n| n == 1));
    assert!(b.len() == 16 * 8 && b.values().all(|&n| n == 1));
    assert!(c.len() == 16 * 8 && c.values().all(|&n| n == 1));
}

/// Every (row, sequence) of a block gets, for every one-sequence lane (warp k, group g, lane j),
/// that lane's terms once each in its order (super-blocks 4k + g + 4·wpr·i ascending), from
/// the same weight bytes and activations, and its lanes and warps are added as q4k_store adds
/// them.
#[test]
fn tile_sums_every_lane_term_once_in_the_one_sequence_order() {
    let (mt, ns) = (Q4K_TILE_ROWS / 16, 1);
    assert!(include_str!("kernels.cu").contains(&format!("#define Q4K_TILE_MT {mt}\n")));
    for &wpr in &Q4K_TILES {
        let wpr = wpr as usize;
        let nw = 4 * wpr;
        for nsb in [1, 3, 16, 26, 78, 101] {
            // (row, seq, k, g, j) -> super-blocks in the order the thread adds them.
            let mut seen: BTreeMap<(usize, usize, usize, usize, usize), Vec<usize>> =
                BTreeMap::new();
            // Warp W of the block: group n = W / nw over sequences 8n.., warp w = W % nw.
            for warp in 0..ns * nw {
                let (n, w) = (warp / nw, warp % nw);
                for lane in 0..32 {
                    for s in (w..nsb).step_by(nw) {
                        for c in 0..4 {
                            for h in 0..2 {
                                let j = 2 * c + h;
                                // Lane j's 16 bytes at 16 + 16j of the super-block: word t.
                                for (r, byte) in a_frag(lane, 0).into_iter().chain(a_frag(lane, 1))
                                {
                                    assert!(r < 16 && byte < 16);
                                }
                                for (kk, _) in b_frag(lane) {
                                    // gemv_q4k: lane j's low nibbles meet x[16 (4c + h) + e],
                                    // its high ones x[16 (4c + h + 2) + e].
                                    let (lo, hi) =
                                        (16 * (4 * c + h) + kk, 16 * (4 * c + h + 2) + kk);
                                    assert_eq!(
                                        (lo, hi),
                                        (64 * c + 16 * h + kk, 64 * c + 32 + 16 * h + kk)
                                    );
                                }
                                for m in 0..mt {
                                    for e in 0..4 {
                                        let (r, q) = c_elem(lane, e);
                                        let key =
                                            (16 * m + r, Q4K_TILE_SEQS * n + q, w / 4, w % 4, j);
                                        seen.entry(key).or_default().push(s);
                                    }
                                }
                            }
                        }
                    }
                }
            }
            for row in 0..16 * mt {
                for seq in 0..Q4K_TILE_SEQS * ns {
                    for k in 0..wpr {
                        for g in 0..4 {
                            for j in 0..8 {
                                // gemv_q4k: warp % WPR = k, lane >> 3 = g: s_first = 4k + g,
                                // STEP = 4 WPR.
                                let want: Vec<usize> = (4 * k + g..nsb).step_by(4 * wpr).collect();
                                let got = seen.remove(&(row, seq, k, g, j)).unwrap_or_default();
                                assert_eq!(got, want, "{wpr}x{mt}x{ns} nsb {nsb} row {row} seq {seq} lane {k}.{g}.{j}");
                            }
                        }
                    }
                }
            }
            assert!(
                seen.is_empty(),
                "{wpr}x{mt}x{ns} nsb {nsb}: terms of no lane"
            );
        }
        assert_eq!(tile_sum(wpr), one_sequence_sum(wpr), "wpr {wpr}");
    }
}

/// i2f_exact and i2f16_exact (kernels.cu) give (float)v and (float)(16 v) over the whole range
/// of a group's integer sum times its scale.
#[test]
fn tile_conversions_are_exact_over_the_sums_range() {
    let src = include_str!("kernels.cu");
    assert!(src.contains("__int_as_float(0x4B400000 + v) - 12582912.f"));
    assert!(src.contains("__int_as_float(0x4D400000 + v) - 201326592.f"));
    let lim: i32 = 16 * 15 * 128 * 63;
    assert!(lim < 1 << 21);
    for v in -lim..=lim {
        let f = f32::from_bits((0x4B40_0000 + v) as u32) - 12_582_912.0;
        assert_eq!(f.to_bits(), (v as f32).to_bits(), "{v}");
        let f = f32::from_bits((0x4D40_0000 + v) as u32) - 201_326_592.0;
        assert_eq!(f.to_bits(), ((16 * v) as f32).to_bits(), "16 x {v}");
    }
}

/// Batches from Q4K_TILE_MIN_BATCH take a tiled kernel for every row split the GEMV may use,
/// and those kernels are in the source.
#[test]
fn tiled_gemv_covers_every_row_split() {
    const { assert!(Q4K_TILE_MIN_BATCH > Q4K_SHAPE_MAX_BATCH && Q4K_TILE_MIN_BATCH <= MAX_GEMV_BATCH) };
    let names = kernel_names();
    for nsb in 1..200 {
        for wpr in std::iter::once(q4k_shape(nsb).0).chain(Q4K_SHAPES.iter().map(|s| s.0)) {
            let l = q4k_tile(wpr).expect("a tile kernel");
            assert!(names.contains(&l.name), "{}", l.name);
            assert_eq!(l.threads, 128 * wpr);
        }
    }
    assert_eq!(q4k_tile(3), None);
    assert_eq!(q4k_tile(4).unwrap().name, "gemv_q4k_tile_w4");
}

/// A value of `#define NAME value` in kernels.cu.
fn cu_define(name: &str) -> u32 {
    let src = include_str!("kernels.cu");
    let line = src
        .lines()
        .find_map(|l| l.strip_prefix(&format!("#define {name} ")))
        .unwrap_or_else(|| panic!("#define {name}"));
    line.trim()
        .parse()
        .unwrap_or_else(|_| panic!("{name}: {line}"))
}

/// The staging constants of kernels.cu as the host states them, and the shared memory of every
/// tiled kernel within a block's limit (227 KiB on sm_80 and sm_90) and above the reduction's.
#[test]
fn tile_stages_fit_and_match_the_kernels() {
    let (mt, wrow, arow, srow) = (
        cu_define("Q4K_TILE_MT"),
        cu_define("TILE_WROW"),
        cu_define("TILE_AROW"),
        cu_define("TILE_SROW"),
    );
    assert_eq!(cu_define("TILE_STAGES"), Q4K_TILE_STAGES);
    assert_eq!(16 * mt as usize, Q4K_TILE_ROWS);
    assert_eq!(
        16 * mt * wrow + 8 * arow + 2 * 8 * srow,
        Q4K_TILE_STAGE_BYTES
    );
    for w in Q4K_TILES {
        let t = q4k_tile(w).unwrap();
        assert!(t.smem <= 227 * 1024, "{}: {}", t.name, t.smem);
        assert!(
            t.smem >= 2 * w * 32 * 32 * 4,
            "{}: the reduction's slots",
            t.name
        );
        assert_eq!(t.smem % 16, 0);
    }
}

/// Bank (of 32 four-byte banks) of each word of a 16-byte shared-memory access at `addr`.
fn banks16(addr: usize) -> Vec<usize> {
    (0..4).map(|i| (addr / 4 + i) % 32).collect()
}

/// The cp.async copies of a unit (half super-block hf of super-block s) fill each byte of a
/// stage once, from the byte the kernel's fragments then read there: ldmatrix gives lane
/// (gid, t) the A words of gemv_q4k_tile's rows gid, gid + 8 and lane chunk j = 2c + h (bytes
/// 16 + 16j + 4t of the super-block), the B words of groups 4c + h and 4c + h + 2 of sequence gid,
/// and the scales of groups 4c .. 4c + 3 of sequences 2t + q; every phase of 8 row addresses
/// (and the header and scale loads) hits distinct banks.
#[test]
fn tile_stage_copies_feed_the_fragments_without_bank_conflicts() {
    let mt = Q4K_TILE_ROWS / 16;
    let (wrow, arow, srow) = (80usize, 144usize, 48usize);
    let (wb, ab, sb) = (16 * mt * wrow, 8 * arow, 8 * srow);
    assert_eq!(wb + ab + 2 * sb, Q4K_TILE_STAGE_BYTES as usize);
    for hf in 0..2 {
        // Stage byte -> what it holds: weights (row, super-block byte), activations (sequence,
        // index within the super-block's 256), scales (array, sequence, group).
        #[derive(Clone, Copy, Debug, PartialEq)]
        enum Src {
            W(usize, usize),
            X(usize, usize),
            S(usize, usize, usize),
        }
        let mut stage: Vec<Option<Src>> = vec![None; wb + ab + 2 * sb];
        let mut put = |dst: usize, f: &dyn Fn(usize) -> Src| {
            for b in 0..16 {
                assert!(stage[dst + b].is_none(), "byte {} copied twice", dst + b);
                stage[dst + b] = Some(f(b));
            }
        };
        for lane in 0..32 {
            // q4k_tile_stage_w
            for i in 0..5 * mt / 2 {
                let k = lane + 32 * i;
                let (r, p) = (k / 5, k % 5);
                let off = if p > 0 { 64 * hf + 16 * p } else { 0 };
                put(r * wrow + 16 * p, &|b| Src::W(r, off + b));
            }
            // q4k_tile_stage_x
            for i in 0..2 {
                let k = lane + 32 * i;
                let (q, p) = (k >> 3, k & 7);
                put(wb + q * arow + 16 * p, &|b| {
                    Src::X(q, 128 * hf + 16 * p + b)
                });
            }
            let (q, p, a) = ((lane >> 1) & 7, lane & 1, lane >> 4);
            put(wb + ab + a * sb + q * srow + 16 * p, &|b| {
                Src::S(a, q, 8 * hf + 4 * p + b / 4)
            });
        }
        // Every byte the kernel reads was copied: the weights' rows, activations and scales.
        let at = |o: usize| stage[o].unwrap_or_else(|| panic!("byte {o} never copied"));
        for cc in 0..2 {
            let c = 2 * hf + cc;
            // B: ldsm_x4 at sa + (lane & 7) * arow + 16 (4cc + lane >> 3).
            let addr_b = |l: usize| wb + (l & 7) * arow + 16 * (4 * cc + (l >> 3));
            for m in 0..mt {
                let addr_a = |l: usize| {
                    (16 * m + (l & 7) + 8 * ((l >> 3) & 1)) * wrow + 16 + 32 * cc + 16 * (l >> 4)
                };
                for (addr, rows) in [
                    (&addr_a as &dyn Fn(usize) -> usize, true),
                    (&addr_b as &dyn Fn(usize) -> usize, false),
                ] {
                    for k in 0..4 {
                        let banks: std::collections::BTreeSet<usize> =
                            (8 * k..8 * k + 8).flat_map(|l| banks16(addr(l))).collect();
                        assert_eq!(banks.len(), 32, "hf {hf} cc {cc} matrix {k}: bank conflict");
                        for lane in 0..32 {
                            let (gid, t) = (lane >> 2, lane & 3);
                            // Register k of lane (gid, t): bytes 4t.. of row gid of matrix k.
                            let o = addr(8 * k + gid) + 4 * t;
                            for b in 0..4 {
                                let h = k >> 1;
                                let want = if rows {
                                    Src::W(
                                        16 * m + gid + 8 * (k & 1),
                                        16 + 16 * (2 * c + h) + 4 * t + b,
                                    )
                                } else {
                                    // k = h: low nibbles' group 4c + h; k = 2 + h: high ones'.
                                    Src::X(gid, 16 * (4 * c + k) + 4 * t + b)
                                };
                                assert_eq!(
                                    at(o + b),
                                    want,
                                    "hf {hf} cc {cc} m {m} k {k} lane {lane}"
                                );
                            }
                        }
                    }
                }
            }
            // Scales: float4 at (2t + q) * srow + 16 cc of each array, 4 addresses per warp.
            for a in 0..2 {
                for q in 0..2 {
                    let banks: std::collections::BTreeSet<usize> = (0..4)
                        .flat_map(|t| banks16(wb + ab + a * sb + (2 * t + q) * srow + 16 * cc))
                        .collect();
                    assert_eq!(banks.len(), 16);
                    for t in 0..4 {
                        for e in 0..4 {
                            let o = wb + ab + a * sb + (2 * t + q) * srow + 16 * cc + 4 * e;
                            assert_eq!(at(o), Src::S(a, 2 * t + q, 4 * c + e));
                        }
                    }
                }
            }
        }
        // Headers: rows 16m + gid + 8i at row * wrow, 8 distinct rows per load.
        for m in 0..mt {
            for i in 0..2 {
                let banks: std::collections::BTreeSet<usize> = (0..8)
                    .flat_map(|gid| banks16((16 * m + gid + 8 * i) * wrow))
                    .collect();
                assert_eq!(banks.len(), 32);
                for gid in 0..8 {
                    for b in 0..16 {
                        assert_eq!(
                            at((16 * m + gid + 8 * i) * wrow + b),
                            Src::W(16 * m + gid + 8 * i, b)
                        );
                    }
                }
            }
        }
    }
}

/// The pipeline of gemv_q4k_tile as a warp runs it: units (super-block w + 4·wpr·(u / 2), half
/// u % 2) copied TILE_STAGES - 1 ahead into stage u % TILE_STAGES, each commit a group, each
/// unit computed after waiting until at most TILE_STAGES - 1 groups are pending. Every unit's
/// stage holds that unit, complete, when it is computed; no copy overwrites a stage before its
/// unit is computed; each lane chunk j gets super-blocks w, w + 4·wpr, ... once each, ascending.
#[test]
fn tile_pipeline_consumes_each_half_once_in_order() {
    let stages = Q4K_TILE_STAGES as usize;
    for &wpr in &Q4K_TILES {
        let nw = 4 * wpr as usize;
        for nsb in [1, 2, 3, 5, 16, 26, 78, 101] {
            for w in 0..nw {
                let nu = if w < nsb {
                    2 * ((nsb - 1 - w) / nw + 1)
                } else {
                    0
                };
                let unit = |u: usize| (w + nw * (u >> 1), u & 1);
                // Per stage: the unit copied into it and whether it has been computed.
                let mut buf: Vec<Option<(usize, bool)>> = vec![None; stages];
                let mut groups: Vec<Vec<usize>> = Vec::new(); // units per committed group
                let mut open: Vec<usize> = Vec::new();
                let mut complete = 0usize; // groups known complete
                let copy =
                    |u: usize, buf: &mut Vec<Option<(usize, bool)>>, open: &mut Vec<usize>| {
                        let b = u % stages;
                        if let Some((prev, done)) = buf[b] {
                            assert!(
                                done,
                                "wpr {wpr} nsb {nsb} warp {w}: unit {u} overwrites unit {prev}"
                            );
                        }
                        buf[b] = Some((u, false));
                        open.push(u);
                    };
                for u in 0..stages - 1 {
                    if u < nu {
                        copy(u, &mut buf, &mut open);
                    }
                    groups.push(std::mem::take(&mut open));
                }
                let mut chunks: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
                for u in 0..nu {
                    let un = u + stages - 1;
                    if un < nu {
                        copy(un, &mut buf, &mut open);
                    }
                    groups.push(std::mem::take(&mut open));
                    complete = complete.max(groups.len() - (stages - 1));
                    let landed = groups[..complete].iter().any(|g| g.contains(&u));
                    assert!(
                        landed,
                        "wpr {wpr} nsb {nsb} warp {w}: unit {u} used before it landed"
                    );
                    let b = u % stages;
                    assert_eq!(buf[b], Some((u, false)));
                    buf[b] = Some((u, true));
                    let (s, hf) = unit(u);
                    for cc in 0..2 {
                        for h in 0..2 {
                            chunks.entry(2 * (2 * hf + cc) + h).or_default().push(s);
                        }
                    }
                }
                let want: Vec<usize> = (w..nsb).step_by(nw).collect();
                for j in 0..8 {
                    assert_eq!(
                        chunks.remove(&j).unwrap_or_default(),
                        want,
                        "wpr {wpr} nsb {nsb} warp {w} lane {j}"
                    );
                }
            }
        }
    }
}
