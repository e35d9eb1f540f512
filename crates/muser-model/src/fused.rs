//! The fused seam: [`FusedForward`], a device's whole forward pass behind `Model::with_fused`.

use muser_gguf::{GgmlType, GgufFile};

use crate::executor::{Executor, Net};
use crate::models::{Capture, Prepared};
use crate::{Batch, KvCache, KvLayout, KvStore, ModelError, ModelInfo, Placement, Weight};

/// A device that runs a model's whole forward pass itself (fused kernels) instead of the model
/// files op by op on a [`Backend`]. [`Model::with_fused`] validates every batch and places its
/// K/V cells (by position: [`Placement::Positional`]) before calling it, so an implementation
/// sees only well-formed batches whose positions continue their sequences.
pub trait FusedForward: Send + Sync {
    /// Runs `batch` with its K/V rows in `kv` (made by [`FusedForward::new_kv_store`]).
    /// `groups` lists per sequence its batch indices in position order; returns the logits of
    /// `out_rows` and, when `batch.embeddings`, their final-norm hidden states, on the host;
    /// rows marked in `batch.argmax_only` may come back as their argmax token instead.
    fn forward(
        &self,
        kv: &mut KvCache,
        batch: &Batch,
        groups: &[(u32, Vec<usize>)],
        out_rows: &[usize],
    ) -> Result<FusedOutput, ModelError>;

    /// Storage for the K/V rows of a pool (as [`Backend::new_kv_store`]).
    fn new_kv_store(
        &self,
        layout: &KvLayout,
        cells: &[usize],
        n_seq: usize,
    ) -> Result<Box<dyn KvStore>, ModelError>;

    /// Whether `kv` can run here (its rows in a store this forward made), checked before a
    /// batch changes anything.
    fn accepts(&self, kv: &KvCache) -> Result<(), ModelError>;

    /// Names the numerics of this forward ([`Backend::numerics`]).
    fn numerics(&self) -> String;

    /// Whether [`FusedForward::forward`] takes rows given as embeddings
    /// ([`Batch::input_embd`]: an image's rows); a batch with them is refused where not.
    fn takes_input_embd(&self) -> bool {
        false
    }
}

/// What a whole forward pass returns ([`FusedForward::forward`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FusedOutput {
    /// `rows.len() × n_vocab`.
    pub logits: Vec<f32>,
    /// `rows.len() × n_embd` when the batch asked for embeddings, else empty.
    pub hidden: Vec<f32>,
    /// Batch indices of the logits rows, ascending.
    pub rows: Vec<usize>,
    /// (batch index, token) of the output rows answered by their argmax instead; the batch's
    /// output rows are exactly `rows` and these.
    pub argmax: Vec<(usize, u32)>,
}

/// A [`FusedForward`] as an executor: the model files are not run.
pub(crate) struct Fused(pub(crate) Box<dyn FusedForward>);

impl Executor for Fused {
    fn forward(
        &self,
        _net: &Net,
        _g: &GgufFile,
        _info: &ModelInfo,
        kv: &mut KvCache,
        prep: &Prepared,
        batch: &Batch,
        _cap: &mut Capture,
    ) -> Result<FusedOutput, ModelError> {
        if !batch.capture_layers.is_empty() {
            return Err(ModelError::BadBatch(
                "layer inputs (a DFlash drafter's features) are captured on the op-by-op \
                 backends only"
                    .into(),
            ));
        }
        self.0.forward(kv, batch, &prep.groups, &prep.out_rows)
    }

    fn threads(&self) -> usize {
        1
    }

    fn takes_input_embd(&self) -> bool {
        self.0.takes_input_embd()
    }

    fn numerics(&self) -> String {
        self.0.numerics()
    }

    fn supports(&self, _ty: GgmlType) -> bool {
        true
    }

    fn prepare_weight(&self, _w: &Weight) -> Result<(), ModelError> {
        Ok(())
    }

    fn new_kv_store(
        &self,
        layout: &KvLayout,
        cells: &[usize],
        n_seq: usize,
    ) -> Result<Box<dyn KvStore>, ModelError> {
        self.0.new_kv_store(layout, cells, n_seq)
    }

    fn placement(&self) -> Placement {
        Placement::Positional
    }

    fn accepts(&self, kv: &KvCache) -> Result<(), ModelError> {
        if kv.placement() != Placement::Positional {
            return Err(ModelError::BadBatch(
                "this model runs on caches that place cells by position (Model::new_kv)".into(),
            ));
        }
        self.0.accepts(kv)
    }
}
