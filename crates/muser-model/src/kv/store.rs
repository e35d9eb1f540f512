//! Where a cache's K and V rows live: the [`KvStore`] trait a backend implements (host
//! memory here, device memory in muser-cuda), the [`RowMap`] from (layer, sequence, cell) to
//! byte ranges that every store shares, and the host store [`HostKv`].

use super::KvLayout;
use crate::error::ModelError;
use std::any::Any;
use std::ops::Range;

/// Groups `(cell, row)` pairs into runs `(first cell, first row, length)` where both advance by
/// one, so a copy of consecutive rows into consecutive cells is one transfer.
pub fn runs(pairs: impl IntoIterator<Item = (usize, usize)>) -> Vec<(usize, usize, usize)> {
    let mut out: Vec<(usize, usize, usize)> = Vec::new();
    for (c, r) in pairs {
        match out.last_mut() {
            Some((c0, r0, n)) if *c0 + *n == c && *r0 + *n == r => *n += 1,
            _ => out.push((c, r, 1)),
        }
    }
    out
}

/// Storage of the K and V rows of a [`KvCache`]: per layer, `[n_seq][cells][row]` with rows of
/// [`KvLayout::row_bytes`] (head-major, in the layout's element type), wherever the backend
/// keeps them. The cache's bookkeeping (which position sits in which cell) stays on the host;
/// export and import move rows through this trait, so a snapshot is the same from any device.
/// The backend that made a store downcasts it (`as_any`) to reach its memory directly.
pub trait KvStore: Send + Sync + Any {
    /// Copies the rows of `cells` of sequence `seq` in layer `il` into `k_out` and `v_out`
    /// (each `cells.len()` rows long).
    fn read_rows(
        &self,
        il: usize,
        seq: u32,
        cells: Range<usize>,
        k_out: &mut [u8],
        v_out: &mut [u8],
    ) -> Result<(), ModelError>;
    /// Writes whole rows `k` and `v` (the same length) into consecutive cells from `first_cell`.
    fn write_rows(
        &mut self,
        il: usize,
        seq: u32,
        first_cell: usize,
        k: &[u8],
        v: &[u8],
    ) -> Result<(), ModelError>;
    /// [`KvStore::read_rows`] for several ranges of sequence `seq`, in any order (the
    /// outputs are disjoint): a device store moves them in one transfer.
    fn read_many(&self, seq: u32, reads: &mut [RowRead<'_>]) -> Result<(), ModelError> {
        for r in reads {
            self.read_rows(r.layer, seq, r.cells.clone(), r.k, r.v)?;
        }
        Ok(())
    }
    /// [`KvStore::write_rows`] for several ranges of sequence `seq`, applied in order (a
    /// later write may overwrite an earlier one's cells, as a sliding window's ring does).
    fn write_many(&mut self, seq: u32, writes: &[RowWrite<'_>]) -> Result<(), ModelError> {
        for w in writes {
            self.write_rows(w.layer, seq, w.first_cell, w.k, w.v)?;
        }
        Ok(())
    }
    /// Bytes held by the K and V buffers.
    fn bytes(&self) -> usize;
    fn as_any(&self) -> &dyn Any;
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

/// One range of a [`KvStore::read_many`]: layer `layer`'s rows of `cells` into `k` and `v`.
pub struct RowRead<'a> {
    pub layer: usize,
    pub cells: Range<usize>,
    pub k: &'a mut [u8],
    pub v: &'a mut [u8],
}

/// One range of a [`KvStore::write_many`]: rows `k` and `v` into layer `layer`'s cells from
/// `first_cell`.
pub struct RowWrite<'a> {
    pub layer: usize,
    pub first_cell: usize,
    pub k: &'a [u8],
    pub v: &'a [u8],
}

impl std::fmt::Debug for dyn KvStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "KvStore({} bytes)", self.bytes())
    }
}

/// Where rows live in a `[n_seq][cells][row]` buffer, shared by every store with that layout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RowMap {
    /// Bytes per row.
    pub row: usize,
    /// Cells per sequence, per layer.
    pub cells: Vec<usize>,
    pub n_seq: usize,
}

impl RowMap {
    /// Checks that the buffers of this shape fit in memory.
    pub fn new(layout: &KvLayout, cells: &[usize], n_seq: usize) -> Result<RowMap, ModelError> {
        let map = RowMap {
            row: layout.row_bytes(),
            cells: cells.to_vec(),
            n_seq,
        };
        if cells.len() != layout.n_layer {
            return Err(ModelError::Kv(format!(
                "{} cell counts for {} layers",
                cells.len(),
                layout.n_layer
            )));
        }
        for &c in cells {
            c.checked_mul(map.row)
                .and_then(|b| b.checked_mul(n_seq))
                .and_then(|b| b.checked_mul(2))
                .ok_or_else(|| ModelError::Kv("cache size overflows".into()))?;
        }
        Ok(map)
    }

    /// Bytes of layer `il`'s K (or V) buffer.
    pub fn layer_bytes(&self, il: usize) -> usize {
        self.cells[il] * self.row * self.n_seq
    }

    /// Byte range of `n` rows from `first_cell` of `seq` in layer `il`'s buffer, checked.
    pub fn range(
        &self,
        il: usize,
        seq: u32,
        first_cell: usize,
        n: usize,
    ) -> Result<Range<usize>, ModelError> {
        let cells = *self
            .cells
            .get(il)
            .ok_or_else(|| ModelError::Kv(format!("layer {il} is outside the cache")))?;
        if seq as usize >= self.n_seq || first_cell > cells || n > cells - first_cell {
            return Err(ModelError::Kv(format!(
                "rows {first_cell}..{} of seq {seq} are outside the {cells} cells of layer {il}",
                first_cell + n
            )));
        }
        let start = (seq as usize * cells + first_cell) * self.row;
        Ok(start..start + n * self.row)
    }

    /// The row count of `bytes`, which must be whole rows.
    /// The byte range a [`KvStore::read_rows`] of `cells` reads, checked against the output
    /// buffers' lengths (`k_len`, `v_len`).
    pub fn read_range(
        &self,
        il: usize,
        seq: u32,
        cells: &Range<usize>,
        k_len: usize,
        v_len: usize,
    ) -> Result<Range<usize>, ModelError> {
        let r = self.range(il, seq, cells.start, cells.len())?;
        if k_len != r.len() || v_len != r.len() {
            return Err(ModelError::Kv(format!(
                "read of {} bytes into buffers of {k_len} and {v_len}",
                r.len()
            )));
        }
        Ok(r)
    }

    /// The byte range a [`KvStore::write_rows`] from `first_cell` writes, for K and V rows of
    /// `k_len` and `v_len` bytes (equal, whole rows).
    pub fn write_range(
        &self,
        il: usize,
        seq: u32,
        first_cell: usize,
        k_len: usize,
        v_len: usize,
    ) -> Result<Range<usize>, ModelError> {
        if k_len != v_len {
            return Err(ModelError::Kv("K and V rows differ in length".into()));
        }
        self.range(il, seq, first_cell, self.rows_in(k_len)?)
    }

    pub fn rows_in(&self, bytes: usize) -> Result<usize, ModelError> {
        if self.row == 0 || !bytes.is_multiple_of(self.row) {
            return Err(ModelError::Kv(format!(
                "{bytes} bytes is not a whole number of {}-byte rows",
                self.row
            )));
        }
        Ok(bytes / self.row)
    }
}

/// K and V rows in host memory: per layer one `Vec<u8>` each.
#[derive(Debug)]
pub struct HostKv {
    map: RowMap,
    k: Vec<Vec<u8>>,
    v: Vec<Vec<u8>>,
}

impl HostKv {
    pub fn new(layout: &KvLayout, cells: &[usize], n_seq: usize) -> Result<HostKv, ModelError> {
        let map = RowMap::new(layout, cells, n_seq)?;
        let k = (0..cells.len())
            .map(|il| vec![0u8; map.layer_bytes(il)])
            .collect();
        let v = (0..cells.len())
            .map(|il| vec![0u8; map.layer_bytes(il)])
            .collect();
        Ok(HostKv { map, k, v })
    }

    fn stream(&self, seq: u32, il: usize) -> Range<usize> {
        let n = self.map.cells[il] * self.map.row;
        seq as usize * n..(seq as usize + 1) * n
    }

    /// K and V rows of `seq` in layer `il` — `[cells][row]`.
    pub fn layer(&self, seq: u32, il: usize) -> (&[u8], &[u8]) {
        let r = self.stream(seq, il);
        (&self.k[il][r.clone()], &self.v[il][r])
    }

    /// [`HostKv::layer`], mutable (for stores).
    pub fn layer_mut(&mut self, seq: u32, il: usize) -> (&mut [u8], &mut [u8]) {
        let r = self.stream(seq, il);
        (&mut self.k[il][r.clone()], &mut self.v[il][r])
    }
}

impl KvStore for HostKv {
    fn read_rows(
        &self,
        il: usize,
        seq: u32,
        cells: Range<usize>,
        k_out: &mut [u8],
        v_out: &mut [u8],
    ) -> Result<(), ModelError> {
        let r = self
            .map
            .read_range(il, seq, &cells, k_out.len(), v_out.len())?;
        k_out.copy_from_slice(&self.k[il][r.clone()]);
        v_out.copy_from_slice(&self.v[il][r]);
        Ok(())
    }

    fn write_rows(
        &mut self,
        il: usize,
        seq: u32,
        first_cell: usize,
        k: &[u8],
        v: &[u8],
    ) -> Result<(), ModelError> {
        let r = self
            .map
            .write_range(il, seq, first_cell, k.len(), v.len())?;
        self.k[il][r.clone()].copy_from_slice(k);
        self.v[il][r].copy_from_slice(v);
        Ok(())
    }

    fn bytes(&self) -> usize {
        self.k.iter().chain(&self.v).map(Vec::len).sum()
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::KvType;

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

    #[test]
    fn runs_merge_consecutive_cells_and_rows() {
        assert_eq!(
            runs([(4, 0), (5, 1), (6, 2), (0, 3), (1, 4), (3, 6)]),
            vec![(4, 0, 3), (0, 3, 2), (3, 6, 1)]
        );
        assert!(runs([]).is_empty());
    }

    #[test]
    fn host_store_checks_bounds_and_whole_rows() {
        let l = layout();
        let mut h = HostKv::new(&l, &[8, 4], 2).unwrap();
        assert_eq!(h.bytes(), 2 * 2 * (8 + 4) * 16);
        let row: Vec<u8> = (0..32).collect();
        h.write_rows(1, 1, 2, &row, &row).unwrap();
        let (mut k, mut v) = (vec![0u8; 32], vec![0u8; 32]);
        h.read_rows(1, 1, 2..4, &mut k, &mut v).unwrap();
        assert_eq!((k.as_slice(), v.as_slice()), (&row[..], &row[..]));
        // Seq 0 and layer 0 are untouched.
        h.read_rows(1, 0, 2..4, &mut k, &mut v).unwrap();
        assert!(k.iter().all(|&b| b == 0));
        assert!(h.write_rows(1, 1, 3, &row, &row).is_err(), "past the cells");
        assert!(
            h.write_rows(1, 2, 0, &row, &row).is_err(),
            "seq out of range"
        );
        assert!(
            h.write_rows(2, 0, 0, &row, &row).is_err(),
            "layer out of range"
        );
        assert!(
            h.write_rows(0, 0, 0, &row[..5], &row[..5]).is_err(),
            "partial row"
        );
        assert!(
            h.read_rows(0, 0, 0..1, &mut k, &mut v).is_err(),
            "buffer size"
        );
    }
}
