//! The compiler: an [`Expr`] (or GBNF's rules) into a [`Grammar`], a flat program of
//! instructions over a byte pool and a table of character ranges.

use super::*;

// ---- the program ---------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Inst {
    /// Bytes `start..start + len` of the pool.
    Lit {
        start: u32,
        len: u32,
    },
    Ws,
    Json(JsonKind),
    Until {
        start: u32,
        len: u32,
        max_len: u32,
    },
    /// One character within (or, `negated`, outside) ranges `start..start + len` of the table.
    Class {
        start: u32,
        len: u32,
        negated: bool,
    },
    Split(u32, u32),
    Jmp(u32),
    /// Enters the rule starting at this instruction (a rule index until `compile_rules` ends).
    Call(u32),
    /// Returns from a rule.
    Ret,
    Match,
}

/// A compiled grammar. Cheap to share between requests (`Arc`).
#[derive(Clone, Debug, PartialEq)]
pub struct Grammar {
    pub(super) prog: Vec<Inst>,
    pub(super) pool: Vec<u8>,
    pub(super) ranges: Vec<(u32, u32)>,
}

impl Grammar {
    /// Compiles `expr` followed by the end of the output.
    pub fn compile(expr: &Expr) -> Result<Grammar, ConstraintError> {
        Grammar::compile_rules(expr, &[])
    }

    /// Compiles `start` followed by the end of the output, where [`Expr::Rule`]`(i)` stands
    /// for `rules[i]`. Refuses a reference to no rule and left recursion.
    pub fn compile_rules(start: &Expr, rules: &[Expr]) -> Result<Grammar, ConstraintError> {
        rules::check(start, rules)?;
        let mut g = Grammar {
            prog: Vec::new(),
            pool: Vec::new(),
            ranges: Vec::new(),
        };
        g.emit(start)?;
        g.push(Inst::Match)?;
        let mut entry = Vec::with_capacity(rules.len());
        for r in rules {
            entry.push(g.here());
            g.emit(r)?;
            g.push(Inst::Ret)?;
        }
        for i in g.prog.iter_mut() {
            if let Inst::Call(rule) = i {
                *rule = entry[*rule as usize];
            }
        }
        Ok(g)
    }

    /// A grammar for one JSON object (whitespace before and after it allowed).
    pub fn json_object() -> Grammar {
        Grammar::compile(&Expr::Seq(vec![
            Expr::Ws,
            Expr::Json(JsonKind::Object),
            Expr::Ws,
        ]))
        .expect("a fixed small grammar compiles")
    }

    pub fn len(&self) -> usize {
        self.prog.len()
    }

    pub fn is_empty(&self) -> bool {
        self.prog.is_empty()
    }

    fn push(&mut self, i: Inst) -> Result<u32, ConstraintError> {
        if self.prog.len() >= MAX_PROGRAM {
            return Err(ConstraintError::TooLarge(self.prog.len() + 1));
        }
        self.prog.push(i);
        Ok(self.prog.len() as u32 - 1)
    }

    fn here(&self) -> u32 {
        self.prog.len() as u32
    }

    fn lit(&mut self, bytes: &[u8]) -> Result<(), ConstraintError> {
        if bytes.is_empty() {
            return Ok(());
        }
        if self.pool.len() + bytes.len() > u32::MAX as usize / 2 {
            return Err(ConstraintError::TooLarge(self.prog.len()));
        }
        let start = self.pool.len() as u32;
        self.pool.extend_from_slice(bytes);
        self.push(Inst::Lit {
            start,
            len: bytes.len() as u32,
        })?;
        Ok(())
    }

    fn patch(&mut self, at: u32, i: Inst) {
        self.prog[at as usize] = i;
    }

    fn emit(&mut self, e: &Expr) -> Result<(), ConstraintError> {
        match e {
            Expr::Lit(b) => self.lit(b)?,
            Expr::Ws => {
                self.push(Inst::Ws)?;
            }
            Expr::Json(k) => {
                self.push(Inst::Json(*k))?;
            }
            Expr::Until { stop, max_len } => {
                if stop.is_empty() {
                    return Err(ConstraintError::EmptyStop);
                }
                let start = self.pool.len() as u32;
                self.pool.extend_from_slice(stop);
                self.push(Inst::Until {
                    start,
                    len: stop.len() as u32,
                    max_len: *max_len,
                })?;
            }
            Expr::Seq(items) => {
                for i in items {
                    self.emit(i)?;
                }
            }
            Expr::Choice(alts) => {
                let Some((last, rest)) = alts.split_last() else {
                    return Err(ConstraintError::EmptyChoice);
                };
                let mut jumps = Vec::new();
                for a in rest {
                    let split = self.push(Inst::Split(0, 0))?;
                    self.emit(a)?;
                    jumps.push(self.push(Inst::Jmp(0))?);
                    let next = self.here();
                    self.patch(split, Inst::Split(split + 1, next));
                }
                self.emit(last)?;
                let end = self.here();
                for j in jumps {
                    self.patch(j, Inst::Jmp(end));
                }
            }
            Expr::Star(inner) => {
                let split = self.push(Inst::Split(0, 0))?;
                self.emit(inner)?;
                self.push(Inst::Jmp(split))?;
                let end = self.here();
                self.patch(split, Inst::Split(split + 1, end));
            }
            Expr::Opt(inner) => {
                let split = self.push(Inst::Split(0, 0))?;
                self.emit(inner)?;
                let end = self.here();
                self.patch(split, Inst::Split(split + 1, end));
            }
            Expr::Array(item) => {
                // "[" ws ( item ws ( "," ws item ws )* )? "]"
                self.lit(b"[")?;
                self.push(Inst::Ws)?;
                let opt = self.push(Inst::Split(0, 0))?;
                self.emit(item)?;
                self.push(Inst::Ws)?;
                let more = self.push(Inst::Split(0, 0))?;
                self.lit(b",")?;
                self.push(Inst::Ws)?;
                self.emit(item)?;
                self.push(Inst::Ws)?;
                self.push(Inst::Jmp(more))?;
                let close = self.here();
                self.patch(opt, Inst::Split(opt + 1, close));
                self.patch(more, Inst::Split(more + 1, close));
                self.lit(b"]")?;
            }
            Expr::Object(members) => self.emit_object(members)?,
            Expr::Class { ranges, negated } => {
                if let Some(&(lo, hi)) = ranges.iter().find(|(lo, hi)| lo > hi) {
                    return Err(ConstraintError::BackwardRange(lo, hi));
                }
                if self.ranges.len() + ranges.len() > MAX_PROGRAM {
                    return Err(ConstraintError::TooLarge(self.prog.len()));
                }
                let start = self.ranges.len() as u32;
                self.ranges.extend_from_slice(ranges);
                self.push(Inst::Class {
                    start,
                    len: ranges.len() as u32,
                    negated: *negated,
                })?;
            }
            Expr::Repeat { inner, min, max } => self.emit_repeat(inner, *min, *max)?,
            Expr::Rule(i) => {
                self.push(Inst::Call(*i))?;
            }
        }
        Ok(())
    }

    /// `min` copies, then either a loop or `max - min` nested optional copies. A copy that
    /// compiles to nothing ends the expansion (more copies of nothing are nothing), so the
    /// work is bounded by the program's size.
    fn emit_repeat(
        &mut self,
        inner: &Expr,
        min: u32,
        max: Option<u32>,
    ) -> Result<(), ConstraintError> {
        for _ in 0..min {
            let before = self.here();
            self.emit(inner)?;
            if self.here() == before {
                return Ok(());
            }
        }
        let Some(max) = max else {
            let split = self.push(Inst::Split(0, 0))?;
            self.emit(inner)?;
            self.push(Inst::Jmp(split))?;
            let end = self.here();
            self.patch(split, Inst::Split(split + 1, end));
            return Ok(());
        };
        let mut splits = Vec::new();
        for _ in min..max {
            let split = self.push(Inst::Split(0, 0))?;
            splits.push(split);
            self.emit(inner)?;
            if self.here() == split + 1 {
                break;
            }
        }
        let end = self.here();
        for s in splits {
            self.patch(s, Inst::Split(s + 1, end));
        }
        Ok(())
    }

    /// `{` ws then the members in order, each `key ws ":" ws value ws`, separated by `"," ws`;
    /// optional members may be skipped. Label (i, c) continues at member i, c telling whether
    /// a member was already written (so a comma comes first).
    fn emit_object(&mut self, members: &[Member]) -> Result<(), ConstraintError> {
        self.lit(b"{")?;
        self.push(Inst::Ws)?;
        let n = members.len();
        // jumps to patch: (instruction, target label (i, c))
        let mut labels = vec![[u32::MAX; 2]; n + 1];
        let mut fixups: Vec<(u32, usize, usize, bool)> = Vec::new(); // (inst, i, c, is_split_second)
                                                                     // Only labels reachable are emitted; (0, 0) is the start.
        let mut reachable = vec![[false; 2]; n + 1];
        reachable[0][0] = true;
        for i in 0..n {
            for c in 0..2 {
                if !reachable[i][c] {
                    continue;
                }
                labels[i][c] = self.here();
                let m = &members[i];
                let skip = if m.required {
                    None
                } else {
                    Some(self.push(Inst::Split(0, 0))?)
                };
                if c == 1 {
                    self.lit(b",")?;
                    self.push(Inst::Ws)?;
                }
                self.emit(&Expr::json_string(&m.key))?;
                self.push(Inst::Ws)?;
                self.lit(b":")?;
                self.push(Inst::Ws)?;
                self.emit(&m.value)?;
                self.push(Inst::Ws)?;
                let j = self.push(Inst::Jmp(0))?;
                fixups.push((j, i + 1, 1, false));
                reachable[i + 1][1] = true;
                if let Some(s) = skip {
                    fixups.push((s, i + 1, c, true));
                    reachable[i + 1][c] = true;
                }
            }
        }
        for c in 0..2 {
            if reachable[n][c] {
                labels[n][c] = self.here();
            }
        }
        // both end labels are the same code: "}"
        let end = self.here();
        self.lit(b"}")?;
        for (at, i, c, split) in fixups {
            let target = if i == n { end } else { labels[i][c] };
            if split {
                self.patch(at, Inst::Split(at + 1, target));
            } else {
                self.patch(at, Inst::Jmp(target));
            }
        }
        Ok(())
    }
}
