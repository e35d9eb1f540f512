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
    // which rules may read nothing: grows to a fixed point (at most one pass per rule)
    let mut empty = vec![false; rules.len()];
    loop {
        let next: Vec<bool> = rules.iter().map(|r| nullable(r, &empty)).collect();
        if next == empty {
            break;
        }
        empty = next;
    }
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
