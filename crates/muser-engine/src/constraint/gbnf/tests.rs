use super::*;
use crate::constraint::{Matcher, Vocab};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// (a valid prefix, a whole sentence)
fn check(g: &Grammar, text: &str) -> (bool, bool) {
    let mut m = Matcher::new(Arc::new(g.clone()));
    let ok = m.advance(text.as_bytes());
    (ok, ok && m.is_complete())
}

fn grammar(src: &str) -> Grammar {
    compile(src).unwrap_or_else(|e| panic!("{src}: {e}"))
}

fn assert_lang(src: &str, yes: &[&str], no: &[&str]) {
    let g = grammar(src);
    for t in yes {
        assert_eq!(check(&g, t), (true, true), "{src} must accept {t:?}");
        for (cut, _) in t.char_indices() {
            assert!(check(&g, &t[..cut]).0, "{src}: {:?} is a prefix", &t[..cut]);
        }
    }
    for t in no {
        assert!(!check(&g, t).1, "{src} must refuse {t:?}");
    }
}

#[test]
fn the_suites_grammar_is_exactly_five_letters() {
    assert_lang(
        r#"root ::= "a"{5,5}"#,
        &["aaaaa"],
        &["", "aaaa", "aaaaaa", "b"],
    );
    let g = grammar(r#"root ::= "a"{5,5}"#);
    assert!(!check(&g, "aaaaaa").0, "a sixth letter is never a prefix");
}

#[test]
fn sequences_alternatives_groups_and_repetitions() {
    assert_lang(
        r#"root ::= "x" ("ab" | "c")* "y""#,
        &["xy", "xaby", "xcabcy"],
        &["x", "xay", "xabcyy"],
    );
    assert_lang(
        r#"root ::= "a"+ "b"? "c""#,
        &["ac", "aaabc"],
        &["c", "abbc"],
    );
    assert_lang(r#"root ::= "a"{2,} "b""#, &["aab", "aaaaab"], &["ab", "b"]);
    assert_lang(r#"root ::= "a"{1,3}"#, &["a", "aa", "aaa"], &["", "aaaa"]);
    assert_lang(
        r##"root ::= ("a" "b"){0,2} ".""##,
        &[".", "ab.", "abab."],
        &["ababab.", "a."],
    );
    assert_lang(r#"root ::= """#, &[""], &["a"]);
}

#[test]
fn classes_ranges_negation_any_and_escapes() {
    assert_lang(
        r#"root ::= [a-cx] [^0-9\n] ."#,
        &["ax!", "b é", "xzü"],
        &["dx!", "a5!", "a\n!", "ax"],
    );
    assert_lang(
        r#"root ::= "\x41\u00e9\U0001F600\t\"\\" [\[\]\-] "\n""#,
        &["Aé😀\t\"\\[\n", "Aé😀\t\"\\-\n"],
        &["Aé😀\t\"\\a\n"],
    );
    // a class over multi-byte characters checks the whole character
    assert_lang(r#"root ::= [à-ÿ]+"#, &["àéÿ"], &["a", "Ā"]);
    // `-` at the end of a class is itself
    assert_lang(r#"root ::= [a-]"#, &["a", "-"], &["b"]);
    // `.` takes one whole UTF-8 character, never a broken one
    let g = grammar("root ::= .");
    let mut m = Matcher::new(Arc::new(g));
    assert!(!m.advance(b"\xc3\x28"));
    assert!(m.advance("你".as_bytes()) && m.is_complete());
}

#[test]
fn comments_lines_and_recursion() {
    let src = r#"
        # arithmetic
        root ::= expr   # the start
        expr ::= term (("+" | "-") term)*
        term ::= num | "(" expr ")"
        num  ::= [0-9]+
        list ::= (
            "x" |
            "y"
        )
    "#;
    assert_lang(src, &["1", "1+2", "(1-(2+3))-4"], &["", "(1", "1+", "a"]);
    // balanced parentheses: not regular, needs the call stack
    assert_lang(
        r#"root ::= "(" root ")" | """#,
        &["", "()", "((()))"],
        &["(()", "())", ")("],
    );
    let g = grammar(r#"root ::= "(" root ")" | """#);
    assert!(check(&g, "((").0 && !check(&g, "((").1);
    assert!(!check(&g, "())").0);
}

fn err(src: &str) -> GbnfError {
    match compile(src) {
        Ok(_) => panic!("{src} must be refused"),
        Err(e) => e,
    }
}

#[test]
fn bad_grammars_are_refused_with_a_reason() {
    assert_eq!(err(r#"item ::= "a""#), GbnfError::NoRoot);
    assert_eq!(err("root ::= item"), GbnfError::Undefined("item".into()));
    assert_eq!(
        err("root ::= \"a\"\nroot ::= \"b\""),
        GbnfError::Duplicate("root".into())
    );
    assert_eq!(
        err(r#"root ::= root "a" | "b""#),
        GbnfError::LeftRecursion("root".into())
    );
    let e = err("root ::= b \"x\"\nb ::= c? d\nc ::= \"c\"\nd ::= \"\" root | \"d\"");
    assert!(matches!(e, GbnfError::LeftRecursion(_)), "{e}");
    // recursion after a character is fine
    assert!(compile("root ::= \"a\" root | \"b\"").is_ok());
    let e = err("root ::= this is (not valid GBNF");
    assert!(e.to_string().contains("expecting ')'"), "{e}");
    match err("root ::= \"a\"\n\nx ::= [b") {
        GbnfError::Syntax { line, column, .. } => assert_eq!((line, column), (3, 9)),
        e => panic!("{e}"),
    }
    for (src, want) in [
        (r#"root ::= "\q""#, "unknown escape"),
        (r#"root ::= "\x4""#, "hex digits"),
        (r#"root ::= "\uD800""#, "not a character"),
        (r#"root ::= <think>"#, "token references"),
        (r#"root ::= * "a""#, "follows nothing"),
        (r#"root ::= "a"{3,2}"#, "backwards"),
        (r#"root ::= "a"{99999}"#, "at most"),
        (r#"root ::= [z-a]"#, "backwards"),
        (r#"root ::= "a" "#, ""),
        ("root = \"a\"", "::="),
        ("root ::= \"a\" )", "end of the line"),
        ("root ::= \"abc", "unterminated"),
    ] {
        match compile(src) {
            Ok(_) if want.is_empty() => {}
            Ok(_) => panic!("{src} must be refused"),
            Err(e) => assert!(
                !want.is_empty() && e.to_string().contains(want),
                "{src}: {e}"
            ),
        }
    }
}

#[test]
fn hostile_grammars_are_bounded() {
    let t = Instant::now();
    // nesting
    let deep = format!("root ::= {}\"a\"{}", "(".repeat(40), ")".repeat(40));
    assert!(err(&deep).to_string().contains("nested"));
    // size: the text, and a program that would grow past MAX_PROGRAM
    assert!(matches!(
        err(&"#".repeat(MAX_TEXT + 1)),
        GbnfError::TooLong(_)
    ));
    let e = err(r#"root ::= (("a" "b"){4096}){4096}"#);
    assert!(
        matches!(e, GbnfError::Compile(ConstraintError::TooLarge(_))),
        "{e}"
    );
    // repetitions of nothing cost nothing
    assert_lang(r#"root ::= ((""){4096}){4096} "a""#, &["a"], &[""]);
    // many rules
    let many: String = (0..MAX_RULES + 1)
        .map(|i| format!("r{i} ::= \"a\"\n"))
        .collect();
    assert_eq!(err(&many), GbnfError::TooManyRules);
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
}

#[test]
fn matching_stays_bounded_on_ambiguous_and_deep_grammars() {
    let t = Instant::now();
    // exponentially many parses of a run of letters
    let g = grammar(
        r#"root ::= x*
x ::= "a" | "aa" | "a" "a" | y
y ::= "a"+"#,
    );
    let text = "a".repeat(2000);
    assert_eq!(check(&g, &text), (true, true));
    // nesting past the call depth is refused, not followed
    let g = grammar(r#"root ::= "(" root ")" | "x""#);
    let inside = format!("{}x{}", "(".repeat(100), ")".repeat(100));
    assert_eq!(check(&g, &inside), (true, true));
    let too_deep = "(".repeat(usize::from(crate::constraint::MAX_CALL_DEPTH) + 10);
    assert!(!check(&g, &too_deep).0);
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
}

#[test]
fn the_mask_is_what_each_token_alone_answers() {
    let pieces: Vec<&[u8]> = vec![
        b"a",
        b"b",
        b"ab",
        b"(",
        b")",
        b"((",
        b"))",
        b"1",
        b"12",
        b"+",
        b"x",
        b"",
        "é".as_bytes(),
        b"\xc3",
    ];
    let vocab = Vocab::new(&pieces, |i| i == 11);
    let g = Arc::new(grammar(
        r#"root ::= expr
expr ::= term ("+" term)*
term ::= [0-9]+ | "(" expr ")" | [a-zé]"#,
    ));
    for prefix in ["", "(", "((1", "1+", "(a)", "((é+2))"] {
        let mut m = Matcher::new(g.clone());
        assert!(m.advance(prefix.as_bytes()), "{prefix}");
        let mut mask = Vec::new();
        let n = m.fill_mask(&vocab, &mut mask);
        let want: Vec<bool> = (0..pieces.len() as u32)
            .map(|id| m.allows_token(&vocab, id))
            .collect();
        assert_eq!(mask, want, "after {prefix:?}");
        assert_eq!(n, want.iter().filter(|&&b| b).count());
    }
}

#[test]
fn the_left_recursion_check_stays_bounded_on_long_chains() {
    // a chain of rules that becomes nullable one link per pass, under a root that is costly
    // to re-check on every pass: the check is at worst rules × text, bounded by the limits
    let n = 4000;
    let mut src = String::from("root ::=");
    let alts: Vec<String> = (0..24).map(|i| format!("r{i}")).collect();
    while src.len() < MAX_TEXT - 70_000 {
        src.push_str(&format!(" ({} | \"\")", alts.join(" | ")));
    }
    src.push('\n');
    for i in 0..n - 1 {
        src.push_str(&format!("r{i} ::= r{}\n", i + 1));
    }
    src.push_str(&format!("r{} ::= \"\"\n", n - 1));
    assert!(src.len() <= MAX_TEXT);
    let t = Instant::now();
    let r = compile(&src);
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    eprintln!("{} bytes: {:?} in {:?}", src.len(), r.err(), t.elapsed());
}

#[test]
fn stacked_repetitions_are_refused_and_grouped_ones_accepted() {
    let e = err(&format!("root ::= \"a\"{}", "*".repeat(100_000)));
    assert!(e.to_string().contains("group it in parentheses"), "{e}");
    assert_lang(r#"root ::= ("a"+)? "b""#, &["b", "aab"], &["a"]);
}
