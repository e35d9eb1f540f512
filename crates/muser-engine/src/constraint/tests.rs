use super::*;

fn accepts(g: &Grammar, text: &[u8]) -> (bool, bool) {
    let mut m = Matcher::new(Arc::new(g.clone()));
    let ok = m.advance(text);
    (ok, ok && m.is_complete())
}

fn whole(g: &Grammar, text: &str) -> bool {
    accepts(g, text.as_bytes()).1
}

fn prefix(g: &Grammar, text: &str) -> bool {
    accepts(g, text.as_bytes()).0
}

#[test]
fn json_objects_and_their_prefixes() {
    let g = Grammar::json_object();
    for ok in [
        "{}",
        "{\"a\": 1}",
        " {\"a\":[1, -2.5e+3, true, false, null, {\"b\": \"c\\n\\u00e9\"}]}",
        "{\n  \"k\": \"ü 你好 🌞\",\n  \"n\": 0\n}\n",
        "{\"a\": [], \"b\": {}, \"c\": -0, \"d\": 1E5}",
    ] {
        assert!(whole(&g, ok), "{ok}");
        let v: serde_like::Check = serde_like::parse(ok);
        assert!(v.0, "{ok}");
        // every prefix is a valid prefix, and only the whole text is complete
        let b = ok.as_bytes();
        for cut in 0..b.len() {
            let (p, c) = accepts(&g, &b[..cut]);
            assert!(p, "prefix {:?}", &ok[..cut.min(ok.len())]);
            let trimmed = ok.trim_end();
            if cut < trimmed.len() {
                assert!(!c, "complete too early at {cut} in {ok}");
            }
        }
    }
    for bad in [
        "[]",
        "\"x\"",
        "{,}",
        "{\"a\" 1}",
        "{\"a\": 01}",
        "{\"a\": 1.}",
        "{\"a\": tru}",
        "{\"a\": \"\x01\"}",
        "{\"a\": \"\x7f\"}",
        "{\"a\": [1,]}",
        "{\"a\": 1,}",
        "{}}",
        "{}x",
        "{\"a\":  1}",
        "{\"a\":\n                      1}",
        "{\"a\": 12345678901234567}",
        "{\"a\": \"\\x\"}",
        "{\"a\": \"\u{0}\"}",
        "{\"\\ud83d\": 1}",
    ] {
        let (_, c) = accepts(&g, bad.as_bytes());
        assert!(!c, "{bad:?} must not be accepted");
    }
    // prefixes that cannot continue
    assert!(!prefix(&g, "x"));
    assert!(!prefix(&g, "{\"a\": 1]"));
    assert!(
        !prefix(&g, "{\"a\":\t1}"),
        "a tab is only allowed after a newline"
    );
    assert!(prefix(&g, "{\"a\":\n\t1}"));
    // invalid UTF-8 inside a string
    assert!(!accepts(&g, b"{\"a\": \"\xc3\x28\"}").0);
    assert!(!accepts(&g, b"{\"a\": \"\xed\xa0\x80\"}").0);
    assert!(!accepts(&g, b"{\"a\": \"\xf5\"}").0);
    assert!(
        accepts(&g, b"{\"a\": \"\xc3").0,
        "an open character is a valid prefix"
    );
}

#[test]
fn nesting_is_bounded() {
    let g = Grammar::json_object();
    let deep = |n: usize| format!("{{\"a\":{}1{}}}", "[".repeat(n), "]".repeat(n));
    assert!(whole(&g, &deep(MAX_DEPTH as usize - 1)));
    assert!(!prefix(&g, &deep(MAX_DEPTH as usize)));
}

#[test]
fn choices_objects_arrays_and_until() {
    let names = ["get_weather", "get_weather_forecast", "search"];
    let e = Expr::Seq(vec![
        Expr::lit("{\"name\": "),
        Expr::Choice(names.iter().map(|n| Expr::json_string(n)).collect()),
        Expr::lit(", \"arguments\": "),
        Expr::Object(vec![
            Member {
                key: "city".into(),
                value: Expr::Json(JsonKind::String),
                required: true,
            },
            Member {
                key: "days".into(),
                value: Expr::Json(JsonKind::Integer),
                required: false,
            },
            Member {
                key: "tags".into(),
                value: Expr::Array(Box::new(Expr::Json(JsonKind::String))),
                required: false,
            },
        ]),
        Expr::lit("}"),
    ]);
    let g = Grammar::compile(&e).unwrap();
    assert!(whole(
        &g,
        r#"{"name": "get_weather", "arguments": {"city": "Paris"}}"#
    ));
    assert!(whole(
        &g,
        r#"{"name": "get_weather_forecast", "arguments": {"city": "P", "days": 3}}"#
    ));
    assert!(whole(
        &g,
        r#"{"name": "search", "arguments": {"city": "P", "tags": ["a", "b"]}}"#
    ));
    assert!(whole(
        &g,
        r#"{"name": "search", "arguments": {"city": "P", "days": -1, "tags": []}}"#
    ));
    assert!(!whole(
        &g,
        r#"{"name": "get_weather", "arguments": {"days": 3}}"#
    ));
    assert!(!whole(
        &g,
        r#"{"name": "get_weather", "arguments": {"city": "P", "days": 1.5}}"#
    ));
    assert!(!whole(
        &g,
        r#"{"name": "get_weather", "arguments": {"days": 3, "city": "P"}}"#
    ));
    assert!(!prefix(&g, r#"{"name": "get_w_"#));
    assert!(!prefix(&g, r#"{"name": "other""#));
    // optional members only, none given
    let g = Grammar::compile(&Expr::Object(vec![Member {
        key: "x".into(),
        value: Expr::Json(JsonKind::Number),
        required: false,
    }]))
    .unwrap();
    assert!(whole(&g, "{}"));
    assert!(whole(&g, "{\"x\": 1.5e3 }"));
    assert!(!whole(&g, "{,\"x\": 1}"));

    let g = Grammar::compile(&Expr::Seq(vec![
        Expr::lit("<a>"),
        Expr::Until {
            stop: b"</a>".to_vec(),
            max_len: 32,
        },
        Expr::lit("!"),
    ]))
    .unwrap();
    assert!(whole(&g, "<a>x </ a<</a>!"));
    assert!(!prefix(&g, "<a>x</a>y"), "the first stop ends the text");
    assert!(!prefix(&g, "<a><|x"), "control markup inside the text");
    assert!(!prefix(&g, &format!("<a>{}", "x".repeat(40))));
    let g = Grammar::compile(&Expr::Seq(vec![
        Expr::Until {
            stop: b"<|eom|>".to_vec(),
            max_len: 100,
        },
        Expr::lit("."),
    ]))
    .unwrap();
    assert!(whole(&g, "a <b <|eom|>."));
    assert!(!prefix(&g, "a <|eot|>"));
    assert!(prefix(&g, "a <|eo"));
}

#[test]
fn top_level_numbers_end_where_the_next_expression_starts() {
    let g = Grammar::compile(&Expr::Seq(vec![
        Expr::Json(JsonKind::Number),
        Expr::lit(";"),
    ]))
    .unwrap();
    assert!(whole(&g, "12;"));
    assert!(whole(&g, "-0.5e7;"));
    assert!(!prefix(&g, "12.;"));
    let g = Grammar::compile(&Expr::Json(JsonKind::Integer)).unwrap();
    assert!(whole(&g, "-12"));
    assert!(!prefix(&g, "1.5"));
}

#[test]
fn mask_matches_token_by_token_checks() {
    let words: Vec<&[u8]> = vec![
        b"{",
        b"}",
        b"{\"",
        b"\"",
        b"a",
        b"ab",
        b"\":",
        b" ",
        b"\n",
        b"  ",
        b"1",
        b"12",
        b"\",",
        b"true",
        b"tr",
        b"x",
        b"",
        b"{}",
        b"\xc3",
        b"\xa9",
        b"\xc3\xa9",
        b"]",
    ];
    let eog = words.len() as u32 - 1;
    let vocab = Vocab::new(&words, |i| i == eog);
    let mut m = Matcher::new(Arc::new(Grammar::json_object()));
    let mut mask = Vec::new();
    for step in [
        b"{\"".as_slice(),
        b"a",
        b"\xc3",
        b"\xa9",
        b"\":",
        b" ",
        b"12",
        b"}",
    ] {
        m.fill_mask(&vocab, &mut mask);
        for id in 0..vocab.len() as u32 {
            assert_eq!(mask[id as usize], m.allows_token(&vocab, id), "token {id}");
        }
        assert!(m.advance(step));
    }
    assert!(m.is_complete());
    m.fill_mask(&vocab, &mut mask);
    assert!(mask[eog as usize]);
    assert!(mask[7], "a trailing space is allowed");
    assert!(!mask[1]);
}

/// A tiny JSON well-formedness check for the tests, independent of the matcher.
mod serde_like {
    pub struct Check(pub bool);
    pub fn parse(s: &str) -> Check {
        Check(json_ok(s.trim()))
    }
    fn json_ok(s: &str) -> bool {
        // balanced brackets outside strings: enough as a sanity check next to the matcher
        let mut depth = 0i32;
        let mut in_str = false;
        let mut esc = false;
        for c in s.chars() {
            if in_str {
                if esc {
                    esc = false;
                } else if c == '\\' {
                    esc = true;
                } else if c == '"' {
                    in_str = false;
                }
                continue;
            }
            match c {
                '"' => in_str = true,
                '{' | '[' => depth += 1,
                '}' | ']' => depth -= 1,
                _ => {}
            }
            if depth < 0 {
                return false;
            }
        }
        depth == 0 && !in_str
    }
}
