//! muser-engine: generation on top of a loaded model. The sampling chain (llama.cpp's order),
//! stop strings, and the slot scheduler with continuous batching. It knows no model internals:
//! it talks to `muser-model` through `Model::forward` over a `Batch` and a shared `KvCache`.

mod rng;
pub mod sampling;
pub mod stop;

pub use sampling::{Sampled, Sampler, SamplingError, SamplingParams, TokenLogprobs, TokenProb};
pub use stop::StopMatcher;
