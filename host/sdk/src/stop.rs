//! Stop strings over streamed text: text is released only once it cannot be the start of a
//! stop string, so a client never receives part of one.

/// Watches generated text for the request's stop strings.
#[derive(Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    /// Text not yet released: a suffix that may begin a stop string.
    held: String,
    /// The stop string reached, once reached.
    matched: Option<usize>,
}

impl StopMatcher {
    /// A matcher for `stops` (non-empty strings).
    pub fn new(stops: Vec<String>) -> Self {
        StopMatcher {
            stops,
            held: String::new(),
            matched: None,
        }
    }

    /// Adds `piece`; returns the text that can be released and whether a stop string was
    /// reached (the text is then everything before it, and generation ends).
    pub fn push(&mut self, piece: &str) -> (String, bool) {
        self.held.push_str(piece);
        let first = self
            .stops
            .iter()
            .enumerate()
            .filter_map(|(k, s)| Some((self.held.find(s.as_str())?, k)))
            .min();
        if let Some((at, k)) = first {
            self.matched = Some(k);
            let out = self.held[..at].to_string();
            self.held.clear();
            return (out, true);
        }
        let keep = self.partial_suffix();
        let out = self.held[..self.held.len() - keep].to_string();
        self.held.drain(..self.held.len() - keep);
        (out, false)
    }

    /// The stop string that ended the text, if one did.
    pub fn matched(&self) -> Option<&str> {
        self.matched.map(|k| self.stops[k].as_str())
    }

    /// The held text, at the end of generation (it did not become a stop string).
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// Length of the longest suffix of `held` that is a proper prefix of a stop string.
    fn partial_suffix(&self) -> usize {
        let h = &self.held;
        (1..=h.len())
            .rev()
            .filter(|&n| h.is_char_boundary(h.len() - n))
            .find(|&n| {
                let tail = &h[h.len() - n..];
                self.stops
                    .iter()
                    .any(|s| s.len() > n && s.starts_with(tail))
            })
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `pieces`; returns the released text and whether it stopped.
    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for p in pieces {
            let (text, stop) = m.push(p);
            out += &text;
            if stop {
                return (out, true);
            }
        }
        out += &m.flush();
        (out, false)
    }

    #[test]
    fn text_is_cut_before_a_stop_string_split_across_pieces() {
        assert_eq!(
            run(&["END"], &["ab", "cE", "N", "Dxyz"]),
            ("abc".into(), true)
        );
        assert_eq!(
            run(&["\n\n", "###"], &["one\n", "two", "#", "##"]),
            ("one\ntwo".into(), true)
        );
        // The earliest stop wins, whichever is listed first.
        assert_eq!(run(&["b", "a"], &["xab"]), ("x".into(), true));
    }

    #[test]
    fn a_partial_match_is_held_back_then_released() {
        let mut m = StopMatcher::new(vec!["END".into()]);
        assert_eq!(m.push("abE"), ("ab".into(), false));
        assert_eq!(m.push("N"), (String::new(), false));
        assert_eq!(m.push("x"), ("ENx".into(), false));
        assert_eq!(run(&["END"], &["a", "EN"]), ("aEN".into(), false));
        assert_eq!(run(&[], &["plain", " text"]), ("plain text".into(), false));
    }

    #[test]
    fn multibyte_text_is_split_on_character_boundaries() {
        assert_eq!(run(&["é!"], &["caf", "é", "?"]), ("café?".into(), false));
        assert_eq!(run(&["é!"], &["café", "!"]), ("caf".into(), true));
    }
}
