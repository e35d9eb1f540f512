//! Restore from a stream: any chunking gives the state a positional restore gives; a changed,
//! missing or extra byte, a foreign identity or an engine ABI not accepted is refused; the
//! same whether segments are hashed on the caller's thread or on workers.

mod common;
use common::*;
use muser_kvpack::*;

/// Streams `bytes` in `chunk`-byte pieces, hashing here and on three worker threads: both
/// must come to the same state or the same refusal.
fn stream(bytes: &[u8], expect: Expect, chunk: usize) -> Result<Restored> {
    let keys = keys();
    let limits = ReadLimits::default();
    let run = |threads: usize| {
        let mut s = StreamRestore::new(&keys, expect, &limits, 1 << 30).hash_threads(threads);
        for c in bytes.chunks(chunk) {
            s.push(c)?;
        }
        s.finish()
    };
    let (here, pooled) = (run(1), run(3));
    match (&here, &pooled) {
        (Ok(a), Ok(b)) => assert_eq!(a.state, b.state),
        (Err(a), Err(b)) => assert_eq!(a.to_string(), b.to_string()),
        _ => panic!("hashing on workers disagrees: {here:?} / {pooled:?}"),
    }
    here
}

#[test]
fn any_chunking_restores_the_same_state() {
    let keys = keys();
    let (bytes, id, st, _) = full_pack(&keys, 900, 6, 1);
    let whole = restore(
        &bytes[..],
        &keys,
        &expect(&id),
        &ReadLimits::default(),
        &RestoreControl::default(),
    )
    .unwrap();
    assert_eq!(whole.state, st);
    for chunk in [1, 7, 128, 4096, 65_537, bytes.len()] {
        let r = stream(&bytes, expect(&id), chunk).unwrap();
        assert_eq!(r.state, st, "chunk {chunk}");
        assert_eq!(r.manifest, whole.manifest);
    }
}

#[test]
fn a_changed_byte_anywhere_is_refused() {
    let keys = keys();
    let (bytes, id, _, _) = full_pack(&keys, 600, 4, 2);
    let mut rng = Rng(7);
    for _ in 0..40 {
        let mut bad = bytes.clone();
        let at = rng.below(bad.len() as u64) as usize;
        bad[at] ^= 1 << rng.below(8);
        assert!(stream(&bad, expect(&id), 4093).is_err(), "flip at {at}");
    }
}

#[test]
fn truncated_or_extended_streams_are_refused() {
    let keys = keys();
    let (bytes, id, _, _) = full_pack(&keys, 600, 4, 3);
    for cut in [0, 1, 127, 128, 300, bytes.len() - 1] {
        assert!(matches!(
            stream(&bytes[..cut], expect(&id), 1000),
            Err(KvpackError::Truncated { .. })
        ));
    }
    let mut long = bytes.clone();
    long.push(0);
    assert!(matches!(
        stream(&long, expect(&id), 1000),
        Err(KvpackError::LengthMismatch { .. })
    ));
}

#[test]
fn other_engine_abis_only_when_accepted() {
    let keys = keys();
    let (bytes, id, st, _) = full_pack(&keys, 300, 4, 4);
    let mut own = id.clone();
    own.engine_abi = "muser-other-v1".into();
    let refuse = Expect {
        identity: &own,
        cut: None,
        other_abis: &[],
    };
    assert!(matches!(
        stream(&bytes, refuse, 999),
        Err(KvpackError::IdentityMismatch(IdentityField::EngineAbi))
    ));
    let accepted = [id.engine_abi.clone()];
    let accept = Expect {
        identity: &own,
        cut: None,
        other_abis: &accepted,
    };
    assert_eq!(stream(&bytes, accept, 999).unwrap().state, st);
    // the accepted ABI does not excuse another field
    let mut other_model = own.clone();
    other_model.model_weights[0] ^= 1;
    let foreign = Expect {
        identity: &other_model,
        cut: None,
        other_abis: &accepted,
    };
    assert!(matches!(
        stream(&bytes, foreign, 999),
        Err(KvpackError::IdentityMismatch(IdentityField::ModelWeights))
    ));
}

#[test]
fn the_budget_is_checked_before_any_kv_is_allocated() {
    let keys = keys();
    let (bytes, id, _, _) = full_pack(&keys, 600, 4, 5);
    let limits = ReadLimits::default();
    let mut s = StreamRestore::new(&keys, expect(&id), &limits, 1024);
    assert!(matches!(
        bytes.chunks(4096).try_for_each(|c| s.push(c)),
        Err(KvpackError::OverBudget { .. })
    ));
}

/// The delta pack of `st`'s positions `base..end` (a full pack for base 0), generation `gen`.
fn piece(keys: &Keys, id: &KvIdentity, toks: &[u32], base: u32, end: u32) -> Vec<u8> {
    let hasher = PrefixHasher::new(keys, &id.digest(keys));
    let chain = hasher.chain(&toks[..end as usize]);
    let st = state(&id.layout, 0..end);
    let spec = PackSpec {
        identity: id,
        chain: &chain,
        generation: 1,
        stream: None,
        base_tokens: base,
        plan: small_plan(),
        threads: 2,
    };
    PackPlan::new(&st, keys, &spec).unwrap().to_bytes()
}

/// Streams `bytes` into `asm` in `chunk`-byte pieces, hashing on two workers.
fn into(asm: Assembly, bytes: &[u8], id: &KvIdentity, chunk: usize) -> Result<Assembly> {
    let keys = keys();
    let limits = ReadLimits::default();
    let mut s = StreamRestore::new(&keys, expect(id), &limits, 1 << 30)
        .hash_threads(2)
        .into_assembly(asm);
    for c in bytes.chunks(chunk) {
        s.push(c)?;
    }
    Ok(s.finish_assembly()?.1)
}

#[test]
fn pieces_assembled_in_place_equal_one_whole_restore() {
    let keys = keys();
    let id = identity(swa_layout());
    let toks = tokens(1700, 9);
    let whole = state(&id.layout, 0..1700);
    // pieces longer and shorter than the 300-row window, ending on and off block boundaries
    for ends in [
        vec![1700],
        vec![768, 1536, 1700],
        vec![256, 512, 1024, 1280, 1700],
    ] {
        for chunk in [997, 1 << 16] {
            let mut asm = Assembly::new(KvState::prefaulted(id.layout.clone(), 0..1700, 2));
            let mut from = 0;
            for &end in &ends {
                let bytes = piece(&keys, &id, &toks, from, end);
                asm = into(asm, &bytes, &id, chunk).unwrap();
                assert_eq!(asm.filled(), end);
                from = end;
            }
            assert_eq!(asm.into_state().unwrap(), whole, "pieces {ends:?}");
        }
    }
    // an assembly with nothing written is widened for a pack that starts before it
    let asm = Assembly::new(KvState::prefaulted(id.layout.clone(), 768..1700, 1));
    let asm = into(asm, &piece(&keys, &id, &toks, 0, 1536), &id, 4096).unwrap();
    assert_eq!(asm.positions(), 0..1700);
    let asm = into(asm, &piece(&keys, &id, &toks, 1536, 1700), &id, 4096).unwrap();
    assert_eq!(asm.into_state().unwrap(), whole);
}

#[test]
fn an_assembly_refuses_a_gap_a_piece_past_its_end_and_an_early_finish() {
    let keys = keys();
    let id = identity(swa_layout());
    let toks = tokens(1700, 9);
    let fresh = || Assembly::new(KvState::prefaulted(id.layout.clone(), 0..1536, 1));
    let first = into(fresh(), &piece(&keys, &id, &toks, 0, 512), &id, 4096).unwrap();
    // a delta from 768 leaves 512..768 unwritten
    let gap = into(first, &piece(&keys, &id, &toks, 768, 1024), &id, 4096);
    assert!(matches!(gap, Err(KvpackError::DeltaBase(_))), "{gap:?}");
    // 1700 positions do not fit an assembly of 1536
    let past = into(fresh(), &piece(&keys, &id, &toks, 0, 1700), &id, 4096);
    assert!(matches!(past, Err(KvpackError::DeltaBase(_))), "{past:?}");
    // finishing as a whole state before the last piece
    let limits = ReadLimits::default();
    let mut s = StreamRestore::new(&keys, expect(&id), &limits, 1 << 30).into_assembly(fresh());
    s.push(&piece(&keys, &id, &toks, 0, 512)).unwrap();
    assert!(matches!(s.finish(), Err(KvpackError::DeltaBase(_))));
}
