//! The checks a grammar with rules passes before it compiles: every [`Expr::Rule`] names a
//! rule, and no rule reaches itself before reading a byte (left recursion, which a matcher
//! could only follow by calling forever).

use super::{ConstraintError, Expr};

pub(super) fn check(start: &Expr, rules: &[Expr]) -> Result<(), ConstraintError> {
    let n = rules.len() as u32;
    let mut unknown = None;
    for e in std::iter::once(start).chain(rules) {
        visit_rules(e, &mut |i| {
            if i >= n {
                unknown.get_or_insert(i);
            }
        });
    }
    if let Some(i) = unknown {
        return Err(ConstraintError::UnknownRule(i));
    }
    let empty = nullable_rules(rules);
    // the rules each rule may call before reading a byte, then a search for a cycle
    let left: Vec<Vec<u32>> = rules
        .iter()
        .map(|r| {
            let mut out = Vec::new();
            left_calls(r, &empty, &mut out);
            out
        })
        .collect();
    // peel off rules whose left calls all end (Kahn's algorithm on the call graph): every
    // rule that remains calls another that remains, so a walk among them finds a cycle
    let mut pending: Vec<usize> = left.iter().map(Vec::len).collect();
    let mut callers = vec![Vec::new(); rules.len()];
    for (i, calls) in left.iter().enumerate() {
        for &c in calls {
            callers[c as usize].push(i);
        }
    }
    let mut free: Vec<usize> = (0..rules.len()).filter(|&i| pending[i] == 0).collect();
    while let Some(c) = free.pop() {
        for &i in &callers[c] {
            pending[i] -= 1;
            if pending[i] == 0 {
                free.push(i);
            }
        }
    }
    let Some(mut at) = (0..rules.len()).find(|&i| pending[i] > 0) else {
        return Ok(());
    };
    let mut seen = vec![false; rules.len()];
    while !seen[at] {
        seen[at] = true;
        at = left[at]
            .iter()
            .map(|&c| c as usize)
            .find(|&c| pending[c] > 0)
            .unwrap_or(at);
    }
    Err(ConstraintError::LeftRecursion(at as u32))
}

/// Which rules can match the empty text: the least fixed point, in time linear in the
/// grammar's size. Every expression that matters becomes a node needing some of its children
/// to be nullable (a sequence all, a choice one, a reference its rule's body); a node that
/// turns nullable tells its parent once, and a rule's body every reference to the rule.
fn nullable_rules(rules: &[Expr]) -> Vec<bool> {
    struct Graph {
        need: Vec<u32>,
        parent: Vec<u32>,
        /// per rule, the reference nodes waiting for its body
        refs: Vec<Vec<u32>>,
        ready: Vec<u32>,
    }
    const NONE: u32 = u32::MAX;
    impl Graph {
        fn node(&mut self, e: &Expr, parent: u32) -> u32 {
            let id = self.need.len() as u32;
            self.parent.push(parent);
            let need = match e {
                Expr::Ws | Expr::Star(_) | Expr::Opt(_) => 0,
                Expr::Repeat { min: 0, .. } => 0,
                Expr::Lit(b) if b.is_empty() => 0,
                Expr::Lit(_) | Expr::Json(_) | Expr::Until { .. } => NONE,
                Expr::Object(_) | Expr::Array(_) | Expr::Class { .. } => NONE,
                Expr::Seq(items) => items.len() as u32,
                Expr::Choice(alts) if alts.is_empty() => NONE,
                Expr::Choice(_) | Expr::Repeat { .. } | Expr::Rule(_) => 1,
            };
            self.need.push(need);
            if need == 0 {
                self.ready.push(id);
            }
            match e {
                Expr::Seq(items) | Expr::Choice(items) => {
                    for i in items {
                        self.node(i, id);
                    }
                }
                Expr::Repeat { inner, min, .. } if *min > 0 => {
                    self.node(inner, id);
                }
                Expr::Rule(r) => self.refs[*r as usize].push(id),
                _ => {}
            }
            id
        }

        /// One child of `n` turned nullable.
        fn tell(&mut self, n: u32) {
            let need = &mut self.need[n as usize];
            if *need != NONE && *need > 0 {
                *need -= 1;
                if *need == 0 {
                    self.ready.push(n);
                }
            }
        }
    }
    let mut g = Graph {
        need: Vec::new(),
        parent: Vec::new(),
        refs: vec![Vec::new(); rules.len()],
        ready: Vec::new(),
    };
    let bodies: Vec<u32> = rules.iter().map(|r| g.node(r, NONE)).collect();
    let mut rule_of = vec![NONE; g.need.len()];
    for (i, &b) in bodies.iter().enumerate() {
        rule_of[b as usize] = i as u32;
    }
    let mut empty = vec![false; rules.len()];
    while let Some(n) = g.ready.pop() {
        let parent = g.parent[n as usize];
        if parent != NONE {
            g.tell(parent);
        }
        let rule = rule_of[n as usize];
        if rule != NONE {
            empty[rule as usize] = true;
            for k in std::mem::take(&mut g.refs[rule as usize]) {
                g.tell(k);
            }
        }
    }
    empty
}

/// Calls `f` with every rule `e` refers to.
fn visit_rules(e: &Expr, f: &mut impl FnMut(u32)) {
    match e {
        Expr::Rule(i) => f(*i),
        Expr::Seq(items) | Expr::Choice(items) => items.iter().for_each(|i| visit_rules(i, f)),
        Expr::Star(inner) | Expr::Opt(inner) | Expr::Array(inner) => visit_rules(inner, f),
        Expr::Repeat { inner, .. } => visit_rules(inner, f),
        Expr::Object(members) => members.iter().for_each(|m| visit_rules(&m.value, f)),
        Expr::Lit(_) | Expr::Ws | Expr::Json(_) | Expr::Until { .. } | Expr::Class { .. } => {}
    }
}

/// Whether `e` can match the empty text, given which rules can.
fn nullable(e: &Expr, empty: &[bool]) -> bool {
    match e {
        Expr::Lit(b) => b.is_empty(),
        Expr::Ws | Expr::Star(_) | Expr::Opt(_) => true,
        Expr::Json(_) | Expr::Until { .. } | Expr::Object(_) | Expr::Array(_) => false,
        Expr::Class { .. } => false,
        Expr::Seq(items) => items.iter().all(|i| nullable(i, empty)),
        Expr::Choice(alts) => alts.iter().any(|a| nullable(a, empty)),
        Expr::Repeat { inner, min, .. } => *min == 0 || nullable(inner, empty),
        Expr::Rule(i) => empty[*i as usize],
    }
}

/// The rules `e` may call before reading a byte.
fn left_calls(e: &Expr, empty: &[bool], out: &mut Vec<u32>) {
    match e {
        Expr::Rule(i) => out.push(*i),
        Expr::Seq(items) => {
            for i in items {
                left_calls(i, empty, out);
                if !nullable(i, empty) {
                    break;
                }
            }
        }
        Expr::Choice(alts) => alts.iter().for_each(|a| left_calls(a, empty, out)),
        Expr::Star(inner) | Expr::Opt(inner) => left_calls(inner, empty, out),
        Expr::Repeat { inner, .. } => left_calls(inner, empty, out),
        Expr::Lit(_) | Expr::Ws | Expr::Json(_) | Expr::Until { .. } | Expr::Class { .. } => {}
        // their first byte is a bracket
        Expr::Object(_) | Expr::Array(_) => {}
    }
}
