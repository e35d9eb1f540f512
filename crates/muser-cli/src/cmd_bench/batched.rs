//! `muser bench --batched`: llama-batched-bench's measurement. For each prompt size `pp`,
//! generation length `tg` and number of parallel sequences `pl` (in that nesting), a fresh
//! cache of `pl` sequences takes the `pl × pp` random prompt tokens as batches of at most
//! `--ubatch-size` rows (timed: T_PP), then `tg` steps each decode one token of every sequence
//! together in one batch of `pl` rows (timed: T_TG). Speeds as llama-batched-bench states
//! them: S_PP = pl·pp / T_PP, S_TG = pl·tg / T_TG, S = pl·(pp + tg) / (T_PP + T_TG); the
//! prompts are not shared (its default, without `-pps`).

use super::plan::{check_bound, MAX_SEQUENCES, MAX_TOKENS};
use super::Tokens;
use anyhow::bail;
use muser_model::{Batch, KvType, Model};
use serde_json::{json, Value};
use std::time::Instant;

/// One row's sizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Config {
    pub pp: usize,
    pub tg: usize,
    pub pl: usize,
}

impl Config {
    /// Cells the row's cache holds (llama-batched-bench's N_KV).
    pub fn n_kv(&self) -> usize {
        self.pl * (self.pp + self.tg)
    }
}

/// Seconds of the prompt phase and of the generation phase.
#[derive(Clone, Copy, Debug)]
pub struct Times {
    pub t_pp: f64,
    pub t_tg: f64,
}

/// What became of one row.
#[derive(Debug)]
pub enum Outcome {
    Timed(Times),
    /// The path does not run this shape (more sequences than the fused forward decodes).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Unsupported(String),
    /// The forward pass refused or failed; the run goes on with the next row.
    Failed(String),
}

pub struct Row {
    pub config: Config,
    pub outcome: Outcome,
}

/// The rows of `-npp`, `-ntg`, `-npl` in llama-batched-bench's nesting (pp, then tg, then pl).
pub fn configs(npp: &[usize], ntg: &[usize], npl: &[usize]) -> anyhow::Result<Vec<Config>> {
    check_bound("-npp", npp, MAX_TOKENS)?;
    check_bound("-ntg", ntg, MAX_TOKENS)?;
    check_bound("-npl", npl, MAX_SEQUENCES)?;
    if [npp, ntg, npl]
        .iter()
        .any(|l| l.is_empty() || l.contains(&0))
    {
        bail!("-npp, -ntg and -npl take positive sizes");
    }
    let mut out = Vec::new();
    for &pp in npp {
        for &tg in ntg {
            out.extend(npl.iter().map(|&pl| Config { pp, tg, pl }));
        }
    }
    Ok(out)
}

/// llama-batched-bench's warm-up: 16 tokens of one sequence.
pub fn warm_up(model: &Model, kv_type: KvType, rng: &mut Tokens) -> anyhow::Result<()> {
    let mut kv = model.new_kv_ubatch(16, 1, kv_type, 16)?;
    let tokens: Vec<u32> = (0..16).map(|_| rng.next(model.info().n_vocab)).collect();
    model.forward(&mut kv, &Batch::single(0, &tokens, 0, false))?;
    Ok(())
}

/// One row through the engine's model: every sequence's prompt in batches of `ubatch` rows,
/// then one batch of `pl` decode rows per step.
pub fn on_model(
    model: &Model,
    kv_type: KvType,
    ubatch: usize,
    c: Config,
    rng: &mut Tokens,
) -> anyhow::Result<Times> {
    let n_vocab = model.info().n_vocab;
    let mut kv = model.new_kv_ubatch(c.pp + c.tg, c.pl, kv_type, ubatch as u32)?;
    let mut batches = Vec::new();
    let mut b = Batch::default();
    for seq in 0..c.pl {
        for pos in 0..c.pp {
            b.push(rng.next(n_vocab), pos as u32, seq as u32, pos + 1 == c.pp);
            if b.len() == ubatch {
                batches.push(std::mem::take(&mut b));
            }
        }
    }
    if !b.is_empty() {
        batches.push(b);
    }
    let start = Instant::now();
    for b in &batches {
        model.forward(&mut kv, b)?;
    }
    let t_pp = start.elapsed().as_secs_f64();
    let start = Instant::now();
    for i in 0..c.tg {
        let mut b = Batch::default();
        for seq in 0..c.pl {
            b.push(rng.next(n_vocab), (c.pp + i) as u32, seq as u32, true);
        }
        model.forward(&mut kv, &b)?;
    }
    let t_tg = start.elapsed().as_secs_f64();
    Ok(Times { t_pp, t_tg })
}

/// llama-batched-bench's table header.
pub fn md_header() -> String {
    format!(
        "|{:>6} | {:>6} | {:>4} | {:>6} | {:>8} | {:>8} | {:>8} | {:>8} | {:>8} | {:>8} |\n\
         |{}-|-{}-|-{}-|-{}-|-{}-|-{}-|-{}-|-{}-|-{}-|-{}-|",
        "PP",
        "TG",
        "B",
        "N_KV",
        "T_PP s",
        "S_PP t/s",
        "T_TG s",
        "S_TG t/s",
        "T s",
        "S t/s",
        "-".repeat(6),
        "-".repeat(6),
        "-".repeat(4),
        "-".repeat(6),
        "-".repeat(8),
        "-".repeat(8),
        "-".repeat(8),
        "-".repeat(8),
        "-".repeat(8),
        "-".repeat(8),
    )
}

/// S_PP, S_TG and S of timed row.
fn speeds(c: Config, t: Times) -> (f64, f64, f64) {
    (
        (c.pl * c.pp) as f64 / t.t_pp,
        (c.pl * c.tg) as f64 / t.t_tg,
        c.n_kv() as f64 / (t.t_pp + t.t_tg),
    )
}

/// One row of the table, as llama-batched-bench prints it (or what stopped it).
pub fn md_row(r: &Row) -> String {
    let c = r.config;
    let head = format!(
        "|{:>6} | {:>6} | {:>4} | {:>6} |",
        c.pp,
        c.tg,
        c.pl,
        c.n_kv()
    );
    match &r.outcome {
        Outcome::Timed(t) => {
            let (s_pp, s_tg, s) = speeds(c, *t);
            format!(
                "{head} {:>8.3} | {s_pp:>8.2} | {:>8.3} | {s_tg:>8.2} | {:>8.3} | {s:>8.2} |",
                t.t_pp,
                t.t_tg,
                t.t_pp + t.t_tg
            )
        }
        Outcome::Unsupported(why) => format!("{head} not supported by this path: {why} |"),
        Outcome::Failed(why) => format!("{head} failed: {why} |"),
    }
}

/// One row as llama-batched-bench's JSONL fields (`pp`, `tg`, `pl`, `n_kv`, `t_pp`,
/// `speed_pp`, `t_tg`, `speed_tg`, `t`, `speed`), or `unsupported` / `error`.
pub fn json_row(r: &Row) -> Value {
    let c = r.config;
    let mut v = json!({"pp": c.pp, "tg": c.tg, "pl": c.pl, "n_kv": c.n_kv()});
    let extra = match &r.outcome {
        Outcome::Timed(t) => {
            let (s_pp, s_tg, s) = speeds(c, *t);
            json!({"t_pp": t.t_pp, "speed_pp": s_pp, "t_tg": t.t_tg, "speed_tg": s_tg,
                   "t": t.t_pp + t.t_tg, "speed": s})
        }
        Outcome::Unsupported(why) => json!({ "unsupported": why }),
        Outcome::Failed(why) => json!({ "error": why }),
    };
    if let (Some(o), Value::Object(e)) = (v.as_object_mut(), extra) {
        o.extend(e);
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configs_nest_pp_then_tg_then_pl() {
        let c = configs(&[128, 256], &[64], &[1, 4]).unwrap();
        let got: Vec<_> = c.iter().map(|c| (c.pp, c.tg, c.pl, c.n_kv())).collect();
        assert_eq!(
            got,
            [
                (128, 64, 1, 192),
                (128, 64, 4, 768),
                (256, 64, 1, 320),
                (256, 64, 4, 1280)
            ]
        );
        assert!(configs(&[128], &[0], &[1]).is_err());
        assert!(configs(&[128], &[1], &[MAX_SEQUENCES + 1]).is_err());
    }

    #[test]
    fn rows_state_llama_batched_bench_speeds() {
        let config = Config {
            pp: 100,
            tg: 10,
            pl: 4,
        };
        let r = Row {
            config,
            outcome: Outcome::Timed(Times {
                t_pp: 2.0,
                t_tg: 0.5,
            }),
        };
        let j = json_row(&r);
        assert_eq!(j["n_kv"], 440);
        assert_eq!(j["speed_pp"], 200.0);
        assert_eq!(j["speed_tg"], 80.0);
        assert_eq!(j["speed"], 176.0);
        assert!(md_row(&r).contains("|   200.00 |"), "{}", md_row(&r));
        let r = Row {
            config,
            outcome: Outcome::Unsupported("1..=8 sequences".into()),
        };
        assert!(md_row(&r).contains("not supported by this path: 1..=8"));
        assert_eq!(json_row(&r)["unsupported"], "1..=8 sequences");
    }
}
