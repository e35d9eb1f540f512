//! The tests of one `muser bench` run, from llama-bench's lists: `-p`, `-n`, `-pg` and `-d`.

use anyhow::bail;

/// Most tokens any one list value may ask for (prompt, generation, depth, batched sizes).
pub const MAX_TOKENS: usize = 1 << 20;

/// Most parallel sequences of a batched test.
pub const MAX_SEQUENCES: usize = 512;

/// One llama-bench test: `n_depth` tokens prefilled untimed, then `n_prompt` tokens prefilled
/// and `n_gen` generated one at a time, timed together.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Test {
    pub n_prompt: usize,
    pub n_gen: usize,
    pub n_depth: usize,
}

impl Test {
    /// llama-bench's name: `pp512`, `tg128`, `pp512+tg128`, with ` @ d4096` at a depth.
    pub fn name(&self) -> String {
        let base = match (self.n_prompt, self.n_gen) {
            (p, 0) => format!("pp{p}"),
            (0, g) => format!("tg{g}"),
            (p, g) => format!("pp{p}+tg{g}"),
        };
        if self.n_depth > 0 {
            format!("{base} @ d{}", self.n_depth)
        } else {
            base
        }
    }

    /// Timed tokens (llama-bench's t/s counts these).
    pub fn n_tokens(&self) -> usize {
        self.n_prompt + self.n_gen
    }

    /// Positions the test's sequence reaches.
    pub fn n_ctx(&self) -> usize {
        self.n_depth + self.n_prompt + self.n_gen
    }
}

/// A `-pg` value: `P,G`.
pub fn parse_pair(s: &str) -> Result<(usize, usize), String> {
    let (p, g) = s
        .split_once(',')
        .ok_or_else(|| format!("{s:?} is not P,G (prompt and generated tokens)"))?;
    let num = |x: &str| {
        x.trim()
            .parse::<usize>()
            .map_err(|_| format!("{x:?} in {s:?} is not a token count"))
    };
    Ok((num(p)?, num(g)?))
}

/// Every value of a list is at most `max`.
pub fn check_bound(flag: &str, values: &[usize], max: usize) -> anyhow::Result<()> {
    if let Some(v) = values.iter().find(|&&v| v > max) {
        bail!("{flag} {v} is more than {max}");
    }
    Ok(())
}

/// llama-bench's tests in its order: for each depth, the prefill tests, the generation tests,
/// then the prompt-then-generate pairs; zero sizes are skipped.
pub fn tests(
    prompts: &[usize],
    gens: &[usize],
    pairs: &[(usize, usize)],
    depths: &[usize],
) -> anyhow::Result<Vec<Test>> {
    check_bound("-p", prompts, MAX_TOKENS)?;
    check_bound("-n", gens, MAX_TOKENS)?;
    check_bound("-d", depths, MAX_TOKENS)?;
    for &(p, g) in pairs {
        check_bound("-pg", &[p, g], MAX_TOKENS)?;
    }
    let mut out = Vec::new();
    for &n_depth in depths {
        let pp = prompts.iter().filter(|&&p| p > 0).map(|&p| (p, 0));
        let tg = gens.iter().filter(|&&g| g > 0).map(|&g| (0, g));
        let pg = pairs.iter().copied().filter(|&(p, g)| p + g > 0);
        out.extend(pp.chain(tg).chain(pg).map(|(n_prompt, n_gen)| Test {
            n_prompt,
            n_gen,
            n_depth,
        }));
    }
    if out.is_empty() {
        bail!("no test to run: every -p, -n and -pg size is 0");
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(t: &[Test]) -> Vec<String> {
        t.iter().map(Test::name).collect()
    }

    #[test]
    fn lists_give_llama_bench_tests_in_its_order() {
        let t = tests(&[512, 2048], &[128], &[], &[0]).unwrap();
        assert_eq!(names(&t), ["pp512", "pp2048", "tg128"]);
        let t = tests(&[512], &[0, 64], &[(128, 32)], &[0, 4096]).unwrap();
        assert_eq!(
            names(&t),
            [
                "pp512",
                "tg64",
                "pp128+tg32",
                "pp512 @ d4096",
                "tg64 @ d4096",
                "pp128+tg32 @ d4096"
            ]
        );
        let d = t[4];
        assert_eq!((d.n_tokens(), d.n_ctx()), (64, 4160));
    }

    #[test]
    fn empty_or_oversized_lists_are_refused() {
        let e = tests(&[0], &[0], &[], &[0]).unwrap_err().to_string();
        assert!(e.contains("no test"), "{e}");
        let e = tests(&[MAX_TOKENS + 1], &[1], &[], &[0])
            .unwrap_err()
            .to_string();
        assert!(e.contains("-p"), "{e}");
        let e = tests(&[1], &[1], &[], &[usize::MAX])
            .unwrap_err()
            .to_string();
        assert!(e.contains("-d"), "{e}");
    }

    #[test]
    fn pairs_parse_or_name_the_bad_part() {
        assert_eq!(parse_pair("512,128"), Ok((512, 128)));
        assert!(parse_pair("512").unwrap_err().contains("P,G"));
        assert!(parse_pair("512,x").unwrap_err().contains("\"x\""));
    }
}
