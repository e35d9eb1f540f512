//! What a `Model` runs on: the model files bound to a [`Backend`] ([`On`]), or a fused forward.

use muser_gguf::{GgmlType, GgufFile};

use crate::models::{llama::Llama, muse_glimmer::MuseGlimmer, Capture, Prepared};
use crate::{
    Backend, Batch, FusedOutput, KvCache, KvLayout, KvStore, ModelError, ModelInfo, Placement,
    Weight,
};

pub(crate) enum Net {
    MuseGlimmer(MuseGlimmer),
    Llama(Llama),
}

/// A backend with the model code bound to it, behind an object-safe face so that [`Model`]
/// holds any backend. [`On`] implements it for every [`Backend`] by calling the same model
/// files with that backend.
pub(crate) trait Executor: Send + Sync {
    /// Runs a validated batch; returns the logits and (when asked) the final hidden states of
    /// the output rows, on the host (some `argmax_only` rows possibly as their argmax), and
    /// fills `cap` with the layer inputs the batch asked for.
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        net: &Net,
        g: &GgufFile,
        info: &ModelInfo,
        kv: &mut KvCache,
        prep: &Prepared,
        batch: &Batch,
        cap: &mut Capture,
    ) -> Result<FusedOutput, ModelError>;
    fn threads(&self) -> usize;
    /// See [`Backend::numerics_tag`].
    fn numerics_tag(&self) -> Option<String> {
        None
    }
    fn numerics(&self) -> String;
    fn supports(&self, ty: GgmlType) -> bool;
    /// See [`Backend::computes_rows_alone`].
    fn computes_rows_alone(&self) -> bool {
        false
    }
    /// Whether batches may give rows as embeddings ([`Batch::input_embd`]); the model files
    /// take them on every backend.
    fn takes_input_embd(&self) -> bool {
        true
    }
    fn prepare_weight(&self, w: &Weight) -> Result<(), ModelError>;
    fn new_kv_store(
        &self,
        layout: &KvLayout,
        cells: &[usize],
        n_seq: usize,
    ) -> Result<Box<dyn KvStore>, ModelError>;
    /// How caches for this executor place cells.
    fn placement(&self) -> Placement {
        Placement::LlamaCpp
    }
    /// Refuses a cache this executor cannot run (before anything is placed).
    fn accepts(&self, _kv: &KvCache) -> Result<(), ModelError> {
        Ok(())
    }
}

/// The model code run on backend `B`.
pub(crate) struct On<B>(pub(crate) B);

impl<B: Backend> Executor for On<B> {
    fn forward(
        &self,
        net: &Net,
        g: &GgufFile,
        i: &ModelInfo,
        kv: &mut KvCache,
        prep: &Prepared,
        batch: &Batch,
        cap: &mut Capture,
    ) -> Result<FusedOutput, ModelError> {
        let be = &self.0;
        let (tokens, pos) = (&batch.tokens[..], &batch.pos[..]);
        let embd = &batch.input_embd;
        let (hidden, logits) = be.run(|| match net {
            Net::MuseGlimmer(m) => m.forward(be, g, i, kv, prep, tokens, embd, pos, cap),
            Net::Llama(m) => m.forward(be, g, i, kv, prep, tokens, embd, pos, cap),
        })?;
        let embeddings = if batch.embeddings {
            be.download(&hidden)?
        } else {
            Vec::new()
        };
        Ok(FusedOutput {
            logits: be.download(&logits)?,
            hidden: embeddings,
            rows: prep.out_rows.clone(),
            argmax: Vec::new(),
        })
    }

    fn numerics(&self) -> String {
        self.0.numerics()
    }

    fn threads(&self) -> usize {
        self.0.threads()
    }

    fn numerics_tag(&self) -> Option<String> {
        self.0.numerics_tag()
    }

    fn supports(&self, ty: GgmlType) -> bool {
        self.0.supports(ty)
    }

    fn computes_rows_alone(&self) -> bool {
        self.0.computes_rows_alone()
    }

    fn prepare_weight(&self, w: &Weight) -> Result<(), ModelError> {
        self.0.prepare_weight(w)
    }

    fn new_kv_store(
        &self,
        layout: &KvLayout,
        cells: &[usize],
        n_seq: usize,
    ) -> Result<Box<dyn KvStore>, ModelError> {
        self.0.new_kv_store(layout, cells, n_seq)
    }
}
