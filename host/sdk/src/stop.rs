//! Stop strings over streamed text: text is released only once it cannot be the start of a
//! stop string, so a client never receives part of one.

/// Watches generated text for the request's stop strings.
#[derive(Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    /// Text not yet released: a suffix that may begin a stop string.
    held: String,
    /// Where in `held` each piece wholly held starts (a piece partly released is not
    /// listed; an empty piece is held until text after it is released).
    starts: Vec<usize>,
    /// The stop string reached, once reached.
    matched: Option<usize>,
}

impl StopMatcher {
    /// A matcher for `stops` (non-empty strings).
    pub fn new(stops: Vec<String>) -> Self {
        StopMatcher {
            stops,
            held: String::new(),
            starts: Vec::new(),
            matched: None,
        }
    }

    /// Adds `piece`; returns the text that can be released and whether a stop string was
    /// reached (the text is then everything before it, and generation ends).
    pub fn push(&mut self, piece: &str) -> (String, bool) {
        self.starts.push(self.held.len());
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
            // The pieces from the stop string on are never released.
            self.starts.retain(|&s| s >= at);
            return (out, true);
        }
        let cut = self.held.len() - self.partial_suffix();
        let out = self.held[..cut].to_string();
        self.held.drain(..cut);
        if cut > 0 {
            self.starts.retain(|&s| s >= cut);
            self.starts.iter_mut().for_each(|s| *s -= cut);
        }
        (out, false)
    }

    /// How many of the latest pieces (those pushed last) have none of their text released:
    /// held back, or in (or after) the stop string once one is reached.
    pub fn held_pieces(&self) -> usize {
        self.starts.len()
    }

    /// The stop string that ended the text, if one did.
    pub fn matched(&self) -> Option<&str> {
        self.matched.map(|k| self.stops[k].as_str())
    }

    /// The held text, at the end of generation (it did not become a stop string).
    pub fn flush(&mut self) -> String {
        self.starts.clear();
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
    fn the_pieces_with_no_text_released_are_counted() {
        let mut m = StopMatcher::new(vec![", 5".into()]);
        assert_eq!((m.push("4"), m.held_pieces()), (("4".into(), false), 0));
        // An empty piece (a partial character) is held until text after it goes out.
        assert_eq!((m.push(""), m.held_pieces()), ((String::new(), false), 1));
        assert_eq!((m.push(","), m.held_pieces()), ((String::new(), false), 2));
        assert_eq!((m.push(" "), m.held_pieces()), ((String::new(), false), 3));
        // Released: the pieces held so far are out, and the new one, partly released.
        assert_eq!((m.push("6,"), m.held_pieces()), ((", 6".into(), false), 0));
        // A piece partly released is out; those from the stop string on are never released.
        let mut m = StopMatcher::new(vec![", 5".into()]);
        assert_eq!((m.push("4,"), m.held_pieces()), (("4".into(), false), 0));
        assert_eq!((m.push(" "), m.held_pieces()), ((String::new(), false), 1));
        assert_eq!((m.push("5!"), m.held_pieces()), ((String::new(), true), 2));
        // Held text released by a piece that is itself held whole.
        let mut m = StopMatcher::new(vec!["ab".into(), "c5".into()]);
        assert_eq!((m.push("a"), m.held_pieces()), ((String::new(), false), 1));
        assert_eq!((m.push("c"), m.held_pieces()), (("a".into(), false), 1));
        assert_eq!((m.push("5"), m.held_pieces()), ((String::new(), true), 2));
        // At the end, the held text goes out with its pieces.
        let mut m = StopMatcher::new(vec!["END".into()]);
        m.push("xE");
        assert_eq!((m.flush(), m.held_pieces()), ("E".into(), 0));
    }

    #[test]
    fn multibyte_text_is_split_on_character_boundaries() {
        assert_eq!(run(&["é!"], &["caf", "é", "?"]), ("café?".into(), false));
        assert_eq!(run(&["é!"], &["café", "!"]), ("caf".into(), true));
    }
}
