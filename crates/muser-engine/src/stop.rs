//! Stop strings over streamed text.
//!
//! Text goes out as soon as it cannot be the start of a stop string. A tail that could still
//! grow into one is held back until the next piece decides it, so a stop string split over
//! several tokens is never emitted, not even in part. When a stop string appears, the text
//! before it is released and the stop string and everything after it are dropped.

/// What one piece of text released.
#[derive(Debug, PartialEq, Eq)]
pub struct Released {
    /// Text safe to emit now.
    pub text: String,
    /// A stop string matched; generation ends and `text` is the last text.
    pub stopped: bool,
}

pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
}

impl StopMatcher {
    /// Empty stop strings are ignored.
    pub fn new(stops: &[String]) -> Self {
        StopMatcher {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            held: String::new(),
        }
    }

    /// Adds a piece of generated text.
    pub fn push(&mut self, piece: &str) -> Released {
        if self.stops.is_empty() {
            return Released {
                text: piece.to_string(),
                stopped: false,
            };
        }
        self.held.push_str(piece);
        let first_stop = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min();
        if let Some(pos) = first_stop {
            self.held.truncate(pos);
            return Released {
                text: std::mem::take(&mut self.held),
                stopped: true,
            };
        }
        let keep_from = self.partial_start();
        let rest = self.held.split_off(keep_from);
        Released {
            text: std::mem::replace(&mut self.held, rest),
            stopped: false,
        }
    }

    /// Releases what is held back when generation ends for another reason.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// The earliest position from which the held text is a proper prefix of some stop string.
    fn partial_start(&self) -> usize {
        self.held
            .char_indices()
            .map(|(i, _)| i)
            .find(|&i| {
                let tail = &self.held[i..];
                self.stops.iter().any(|s| s.starts_with(tail))
            })
            .unwrap_or(self.held.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool, String) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut m = StopMatcher::new(&stops);
        let mut out = String::new();
        for p in pieces {
            let r = m.push(p);
            out.push_str(&r.text);
            if r.stopped {
                return (out, true, String::new());
            }
        }
        let tail = m.finish();
        (out, false, tail)
    }

    #[test]
    fn stop_split_over_pieces_is_never_emitted() {
        let stops = vec!["</end>".to_string()];
        let mut m = StopMatcher::new(&stops);
        assert_eq!(m.push("hello </").text, "hello ");
        let r = m.push("en");
        assert_eq!(r.text, "");
        assert!(!r.stopped);
        let r = m.push("d> more");
        assert_eq!(r.text, "");
        assert!(r.stopped);
    }

    #[test]
    fn text_before_the_stop_in_the_same_piece_is_released() {
        assert_eq!(
            run(&["STOP"], &["abc", "deSTOPxyz"]),
            ("abcde".into(), true, "".into())
        );
    }

    #[test]
    fn a_false_start_is_released_once_it_diverges() {
        let stops = vec!["abc".to_string()];
        let mut m = StopMatcher::new(&stops);
        assert_eq!(m.push("xa").text, "x");
        assert_eq!(m.push("b").text, "");
        assert_eq!(m.push("d").text, "abd");
        // overlapping retry: "aab" then "c"
        let mut m = StopMatcher::new(&stops);
        assert_eq!(m.push("aab").text, "a");
        let r = m.push("c");
        assert!(r.stopped);
        assert_eq!(r.text, "");
    }

    #[test]
    fn the_earliest_of_several_stops_wins() {
        assert_eq!(
            run(&["world", "lo w"], &["hello world"]),
            ("hel".into(), true, "".into())
        );
    }

    #[test]
    fn held_text_comes_back_at_the_end() {
        assert_eq!(
            run(&["\n\n"], &["line", "\n"]),
            ("line".into(), false, "\n".into())
        );
    }

    #[test]
    fn no_stops_passes_everything_through() {
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), false, "".into()));
        assert_eq!(run(&[""], &["a", "b"]), ("ab".into(), false, "".into()));
    }

    #[test]
    fn multibyte_text_is_split_on_char_boundaries() {
        assert_eq!(
            run(&["éx"], &["café", "!"]),
            ("café!".into(), false, "".into())
        );
        assert_eq!(
            run(&["éx"], &["café", "x"]),
            ("caf".into(), true, "".into())
        );
    }
}
