//! muser-engine: generation on top of a loaded model. The sampling chain (llama.cpp's order),
//! stop strings, and the slot scheduler with continuous batching and chunked prefill. It knows
//! no model internals: it talks to `muser-model` through `Model::forward` over a `Batch` and
//! one shared `KvCache` pool (one sequence per slot).

pub mod constraint;
mod detok;
mod engine;
mod image;
pub mod kvpack_bridge;
pub mod prompt_cache;
mod rng;
pub mod sampling;
mod scheduler;
mod sleep;
pub mod stop;

pub use constraint::{Constraint, Expr, Grammar, JsonKind, Matcher, Member, Vocab};
pub use engine::{
    Engine, EngineConfig, EngineError, EngineStats, Event, FinishReason, GenerateRequest, Pooling,
    Prefilled, Progress, SlotInfo, SlotKv, SubmitError, Timings,
};
pub use image::{place_images, MediaMarkers, PlaceError, PromptImage, IMAGE_ID_BASE};
pub use kvpack_bridge::{KvPackContext, PackError, SlotExport};
pub use muser_model::KvType;
pub use muser_spec::{SpecConfig, SpecError, SpecMode, SpecOverride, DRAFT_MAX_LIMIT};
pub use prompt_cache::{PromptCache, PromptCacheConfig, PromptCacheStats};
pub use sampling::{Sampled, Sampler, SamplingError, SamplingParams, TokenLogprobs, TokenProb};
pub use sleep::{ModelLoader, SleepConfig};
pub use stop::StopMatcher;
