//! A small order-preserving parallel map over scoped threads (no thread pool dependency).

/// Default worker count for hashing: the available parallelism, at most 4.
pub fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get().min(4))
}

/// Maps `f` over `items` on up to `threads` scoped threads (item i goes to worker
/// i mod threads); results come back in input order.
pub(crate) fn par_map<T: Send, R: Send>(
    items: Vec<T>,
    threads: usize,
    f: impl Fn(usize, T) -> R + Sync,
) -> Vec<R> {
    let n = items.len();
    let threads = threads.clamp(1, n.max(1));
    if threads == 1 {
        return items
            .into_iter()
            .enumerate()
            .map(|(i, t)| f(i, t))
            .collect();
    }
    let mut buckets: Vec<Vec<(usize, T)>> = (0..threads).map(|_| Vec::new()).collect();
    for (i, t) in items.into_iter().enumerate() {
        buckets[i % threads].push((i, t));
    }
    let f = &f;
    let mut out: Vec<Option<R>> = (0..n).map(|_| None).collect();
    std::thread::scope(|s| {
        let handles: Vec<_> = buckets
            .into_iter()
            .map(|b| s.spawn(move || b.into_iter().map(|(i, t)| (i, f(i, t))).collect::<Vec<_>>()))
            .collect();
        for h in handles {
            match h.join() {
                Ok(results) => results.into_iter().for_each(|(i, r)| out[i] = Some(r)),
                Err(panic) => std::panic::resume_unwind(panic),
            }
        }
    });
    out.into_iter()
        .map(|r| r.expect("every item is mapped"))
        .collect()
}
