//! Bulk copies between pageable host memory and the device through page-locked staging
//! memory ([`Gpu::download_many`], [`Gpu::upload_many`]): the K/V a handoff exports or
//! installs.

use std::ffi::c_void;

use cudarc::driver::result as drv;

use crate::runtime::{drv_err, Gpu};
use crate::CudaError;

type Result<T> = std::result::Result<T, CudaError>;

/// The most page-locked staging memory a bulk copy holds; larger copies go in batches.
const STAGING_MAX: usize = 256 << 20;
/// Bulk copies below this go straight through the driver's own staging.
const STAGING_MIN: usize = 1 << 20;
/// Bytes per task of the parallel host copies.
const HOST_COPY_CHUNK: usize = 2 << 20;

/// Page-locked host memory. A copy from or to pageable memory runs through the driver's
/// small bounce buffers at a fraction of the bus's rate (about 1.5 GB/s on the H200 host
/// measured); into this, the DMA runs at the bus's rate, and the host's copies between it and
/// pageable memory run on every core.
pub(crate) struct Staging {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: plain host memory, used under the Gpu's mutex only.
unsafe impl Send for Staging {}

impl Drop for Staging {
    fn drop(&mut self) {
        // SAFETY: allocated by malloc_host; every copy into or out of it was waited for
        let _ = unsafe { drv::free_host(self.ptr as *mut c_void) };
    }
}

/// Copies each `(from, to)` pair (equal lengths) on the rayon pool, in chunks.
fn par_copy(pairs: Vec<(&[u8], &mut [u8])>) {
    use rayon::prelude::*;
    let tasks: Vec<(&[u8], &mut [u8])> = pairs
        .into_iter()
        .flat_map(|(from, to)| {
            from.chunks(HOST_COPY_CHUNK)
                .zip(to.chunks_mut(HOST_COPY_CHUNK))
        })
        .collect();
    tasks
        .into_par_iter()
        .for_each(|(from, to)| to.copy_from_slice(from));
}

impl Gpu {
    /// Page-locked staging memory of at least `want` bytes (at most [`STAGING_MAX`]).
    fn staging(&self, want: usize) -> Result<std::sync::MutexGuard<'_, Option<Staging>>> {
        let mut g = self.staging.lock().unwrap_or_else(|e| e.into_inner());
        let want = want
            .clamp(STAGING_MIN, STAGING_MAX)
            .next_multiple_of(STAGING_MIN);
        if g.as_ref().is_none_or(|s| s.len < want) {
            self.bind()?;
            *g = None; // the smaller one is freed first
                       // SAFETY: a fresh allocation (flags 0: cached, read by the CPU at full speed)
            let ptr = unsafe { drv::malloc_host(want, 0) }.map_err(drv_err)? as *mut u8;
            *g = Some(Staging { ptr, len: want });
        }
        Ok(g)
    }

    /// Copies each device range `(src, dst.len() bytes)` into its `dst`, and waits: the DMAs
    /// into page-locked memory are queued together, then the host copies run in parallel.
    /// The caller passes device ranges inside live allocations.
    pub fn download_many(&self, pieces: &mut [(u64, &mut [u8])]) -> Result<()> {
        let total: usize = pieces.iter().map(|(_, d)| d.len()).sum();
        if total < STAGING_MIN {
            for (src, dst) in pieces.iter_mut() {
                self.download(*src, dst)?;
            }
            return Ok(());
        }
        let mut guard = self.staging(total)?;
        let st = guard.as_mut().expect("made by staging");
        let lens: Vec<usize> = pieces.iter().map(|(_, d)| d.len()).collect();
        for batch in crate::layout::staging_batches(&lens, st.len) {
            for (i, r, off) in &batch {
                // SAFETY: [off, off + len) lies inside the staging memory, which no other copy
                // uses until the wait below; the device range is the caller's
                let buf = unsafe { std::slice::from_raw_parts_mut(st.ptr.add(*off), r.len()) };
                let src = pieces[*i].0 + r.start as u64;
                unsafe { drv::memcpy_dtoh_async(buf, src, self.stream.cu_stream()) }
                    .map_err(drv_err)?;
            }
            self.sync()?;
            let mut rest: Vec<Option<&mut [u8]>> =
                pieces.iter_mut().map(|(_, d)| Some(&mut **d)).collect();
            let mut pairs = Vec::with_capacity(batch.len());
            for (i, r, off) in &batch {
                // a piece split across batches: this batch's part of it
                let d = rest[*i].take().expect("each piece once per batch");
                let d = &mut d[r.clone()];
                // SAFETY: the DMA into this range completed (waited for above)
                let from = unsafe { std::slice::from_raw_parts(st.ptr.add(*off), r.len()) };
                pairs.push((from, d));
            }
            par_copy(pairs);
        }
        Ok(())
    }

    /// Copies each `src` to device address `dst`, in order (a later piece may overwrite an
    /// earlier one's bytes), and waits: the host copies into page-locked memory run in
    /// parallel, then the DMAs are queued together. The caller passes device ranges inside
    /// live allocations.
    pub fn upload_many(&self, pieces: &[(u64, &[u8])]) -> Result<()> {
        let total: usize = pieces.iter().map(|(_, s)| s.len()).sum();
        if total < STAGING_MIN {
            self.bind()?;
            for (dst, src) in pieces {
                // SAFETY: the caller's device range; a pageable source is staged by the
                // driver before the call returns
                unsafe { drv::memcpy_htod_async(*dst, src, self.stream.cu_stream()) }
                    .map_err(drv_err)?;
            }
            return self.sync();
        }
        let mut guard = self.staging(total)?;
        let st = guard.as_mut().expect("made by staging");
        let lens: Vec<usize> = pieces.iter().map(|(_, s)| s.len()).collect();
        for batch in crate::layout::staging_batches(&lens, st.len) {
            let pairs = batch
                .iter()
                .map(|(i, r, off)| {
                    // SAFETY: disjoint ranges of the staging memory, idle since the last wait
                    let to = unsafe { std::slice::from_raw_parts_mut(st.ptr.add(*off), r.len()) };
                    (&pieces[*i].1[r.clone()], to)
                })
                .collect();
            par_copy(pairs);
            for (i, r, off) in &batch {
                // SAFETY: the staging range stays untouched until the wait below
                let buf = unsafe { std::slice::from_raw_parts(st.ptr.add(*off), r.len()) };
                let dst = pieces[*i].0 + r.start as u64;
                unsafe { drv::memcpy_htod_async(dst, buf, self.stream.cu_stream()) }
                    .map_err(drv_err)?;
            }
            self.sync()?;
        }
        Ok(())
    }
}
