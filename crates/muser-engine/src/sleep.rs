//! Sleeping (`--sleep-idle-seconds`): the engine thread's cycle of run, sleep and wake.
//!
//! An idle scheduler's run ends after [`SleepConfig::idle`]; its model and K/V are dropped with
//! it, and the engine thread loads them again through the [`ModelLoader`] when work arrives.

use std::sync::Arc;
use std::time::Duration;

use muser_model::{KvCache, Model};
use muser_text::Tokenizer;

use crate::engine::{EngineConfig, Event, Shared, SharedState};
use crate::scheduler::Scheduler;

/// Longest wait between two looks at the queue while idle (queued requests can time out).
const IDLE_POLL: Duration = Duration::from_millis(250);

/// Loads the engine's model again after a sleep (from the same file, on the same device).
pub type ModelLoader = Arc<dyn Fn() -> Result<Arc<Model>, String> + Send + Sync>;

/// When the engine sleeps and how it wakes.
#[derive(Clone)]
pub struct SleepConfig {
    /// Time without a request or a running generation before the model is dropped.
    pub idle: Duration,
    /// Gives the model back on the first request after a sleep.
    pub reload: ModelLoader,
}

impl std::fmt::Debug for SleepConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SleepConfig")
            .field("idle", &self.idle)
            .finish_non_exhaustive()
    }
}

/// How the scheduler's run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Exit {
    Shutdown,
    /// Idle for [`SleepConfig::idle`]: nothing was running, queued or asked for.
    Sleep,
}

/// Runs the scheduler until shutdown. A run ends on shutdown, or asleep: its model and K/V are
/// dropped with it, and `wake` gives them back when work arrives.
pub(crate) fn serve(
    model: Arc<Model>,
    kv: KvCache,
    tok: Option<&Tokenizer>,
    cfg: &EngineConfig,
    shared: &Arc<Shared>,
) {
    let mut loaded = Some((model, kv));
    while let Some((model, kv)) = loaded.take() {
        if Scheduler::new(model, tok, kv, cfg.clone(), shared.clone()).run() == Exit::Shutdown {
            break;
        }
        loaded = wake(shared, cfg);
    }
}

/// How long an idle scheduler waits for work before it looks again; `None` when it has been
/// idle for [`SleepConfig::idle`] with nothing queued, and its run ends asleep.
pub(crate) fn idle_wait(sleep: Option<&SleepConfig>, st: &SharedState) -> Option<Duration> {
    let idle = st.last_active.map_or(Duration::ZERO, |t| t.elapsed());
    match sleep {
        Some(sleep) if st.queue.is_empty() && idle >= sleep.idle => None,
        Some(sleep) => Some(IDLE_POLL.min(sleep.idle - idle.min(sleep.idle))),
        None => Some(IDLE_POLL),
    }
}

/// Sleeps with the model dropped until work arrives, then loads it again with a fresh K/V
/// cache. `None` on shutdown. A failed load fails the requests that waited for it, each with
/// the loader's message, and sleeps again.
fn wake(shared: &Shared, cfg: &EngineConfig) -> Option<(Arc<Model>, KvCache)> {
    let sleep = cfg.sleep.as_ref()?;
    let mut st = shared.lock();
    st.sleeping = !st.has_work();
    tracing::info!(
        "idle for {:?}: the model is unloaded until the next request",
        sleep.idle
    );
    loop {
        while !st.shutdown && st.sleeping && !st.has_work() {
            st = shared.wake.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        if st.shutdown {
            return None;
        }
        drop(st);
        let loaded = (sleep.reload)().and_then(|model| {
            let n_ubatch = cfg.prefill_chunk.max(cfg.n_slots);
            let kv = model
                .new_kv_ubatch(cfg.n_ctx, cfg.n_slots, cfg.kv_type, n_ubatch as u32)
                .map_err(|e| e.to_string())?;
            Ok((model, kv))
        });
        st = shared.lock();
        match loaded {
            Ok(loaded) => {
                st.touch();
                tracing::info!("the model is loaded again");
                return Some(loaded);
            }
            Err(e) => {
                let msg = format!("loading the model after a sleep: {e}");
                tracing::error!("{msg}");
                for job in st.queue.drain(..) {
                    let _ = job.tx.send(Event::Error(msg.clone()));
                }
                st.slot_jobs.clear(); // their callers see the slot as busy
                st.sleeping = true;
            }
        }
    }
}
