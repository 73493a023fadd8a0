//! OpenAI's harmony format, GPT-OSS's answers: a run of messages, each
//! `[<|start|>assistant]<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>TYPE]<|message|>BODY`
//! and an end: `<|end|>` (the model goes on with another message), `<|call|>` or
//! `<|return|>` (the turn is over: the generator stops on them, so an answer's text ends
//! there). [`parse`] splits an answer (its special tokens written out): `analysis` bodies are
//! reasoning, `final` and recipient-less `commentary` bodies (preambles) are content, and a
//! body addressed `to=functions.NAME` is a call of NAME with the body as its JSON arguments.
//! Text outside any message (a model that skipped the markers) is content too.
//! On an answer still growing (`complete` false) it gives what the messages so far hold (a
//! call only once its message ended), each field a prefix of what the whole answer gives:
//! text can be streamed from it as it grows.

use crate::tools::{Parsed, Tool, ToolCall};

const START: &str = "<|start|>";
const CHANNEL: &str = "<|channel|>";
const MESSAGE: &str = "<|message|>";
/// What ends a message's body: `<|end|>`, the turn's two ends, or a next message's start.
const BODY_ENDS: [&str; 4] = ["<|end|>", "<|call|>", "<|return|>", START];

/// The tokens that end a harmony turn, and the text: the generator stops on them (`<|end|>`
/// ends only a message, and is not a stop token for a harmony model).
pub const TURN_ENDS: [&str; 3] = ["<|return|>", "<|call|>", "<|endoftext|>"];

/// Whether chat template `src` writes harmony (GPT-OSS's template).
pub fn is_harmony_template(src: &str) -> bool {
    src.contains(CHANNEL) && src.contains(MESSAGE)
}

/// `answer` split into reasoning, content and calls of `tools` (see the module docs); where
/// `complete`, its end ends its last message (the generator stopped on one of
/// [`TURN_ENDS`], which are not in the text; an answer cut at its token limit or at a stop
/// string is not complete, and a call it ends inside is not made). A call of a tool not in
/// `tools` stays in the content as its body.
pub fn parse(answer: &str, tools: &[Tool], complete: bool) -> Parsed {
    let mut p = Parsed::default();
    let add = |to: &mut String, body: &str| {
        let body = body.trim();
        if !body.is_empty() {
            if !to.is_empty() {
                to.push('\n');
            }
            to.push_str(body);
        }
    };
    // Text before a header's first marker is outside any message.
    let loose = |header: &str| -> usize { header.find("<|").unwrap_or(header.len()) };
    let mut rest = answer;
    loop {
        let Some(at) = rest.find(MESSAGE) else {
            // A header still coming, or text after the last message.
            add(&mut p.content, &rest[..loose(rest)]);
            break;
        };
        let from = loose(&rest[..at]);
        add(&mut p.content, &rest[..from]);
        let header = &rest[from..at];
        let after = &rest[at + MESSAGE.len()..];
        let end = BODY_ENDS
            .iter()
            .filter_map(|e| after.find(e).map(|i| (i, *e)))
            .min();
        let (body, ended) = match end {
            Some((i, e)) => {
                // A next message's start is not consumed: it opens that message.
                rest = &after[i + if e == START { 0 } else { e.len() }..];
                (&after[..i], true)
            }
            None => {
                rest = "";
                (after, complete)
            }
        };
        match (recipient(header), channel(header)) {
            (Some(to), _) => {
                let name = to.strip_prefix("functions.").unwrap_or(to);
                if !ended {
                    // A call is whole only once its message ends.
                } else if tools.iter().any(|t| t.name == name) {
                    let args = body.trim();
                    let arguments = serde_json::from_str::<serde_json::Value>(args)
                        .map_or_else(|_| args.to_string(), |v| v.to_string());
                    p.calls.push(ToolCall {
                        name: name.to_string(),
                        arguments,
                    });
                } else {
                    add(&mut p.content, body);
                }
            }
            (None, Some("analysis")) => add(&mut p.reasoning, body),
            (None, _) => add(&mut p.content, body),
        }
    }
    p
}

/// The content of a harmony answer as its text comes in piece by piece (a chat shows the
/// final channel, not the reasoning): [`parse`]'s content beyond what was returned before.
/// A stream made for another model's answer passes every piece through as it is.
pub struct ContentStream {
    harmony: bool,
    text: String,
    sent: usize,
}

impl ContentStream {
    /// A stream of an answer in harmony (`harmony`), or in plain text.
    pub fn new(harmony: bool) -> Self {
        ContentStream {
            harmony,
            text: String::new(),
            sent: 0,
        }
    }

    /// Adds `piece` of the answer's text; returns the text to show for it: the content it
    /// completes (a harmony answer), or `piece` itself.
    pub fn push(&mut self, piece: &str) -> String {
        if !self.harmony {
            return piece.to_string();
        }
        self.text.push_str(piece);
        let content = parse(&self.text, &[], false).content;
        let new = content.get(self.sent..).unwrap_or_default().to_string();
        self.sent = self.sent.max(content.len());
        new
    }
}

/// The word after `marker` in a message header, up to a space or the next marker.
fn word_after<'a>(header: &'a str, marker: &str) -> Option<&'a str> {
    let at = header.find(marker)? + marker.len();
    let word = &header[at..];
    let end = word
        .find(|c: char| c.is_whitespace() || c == '<')
        .unwrap_or(word.len());
    Some(&word[..end]).filter(|w| !w.is_empty())
}

fn channel(header: &str) -> Option<&str> {
    word_after(header, CHANNEL)
}

/// The recipient (`to=…`), before or after the channel.
fn recipient(header: &str) -> Option<&str> {
    word_after(header, "to=")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools() -> Vec<Tool> {
        ["get_weather", "search"]
            .map(|name| Tool {
                name: name.into(),
                description: None,
                parameters: serde_json::json!({"type": "object"}),
            })
            .to_vec()
    }

    #[test]
    fn channels_split_into_reasoning_content_and_calls() {
        let answer = "<|channel|>analysis<|message|>User asks weather. Call it.<|end|>\
            <|start|>assistant<|channel|>commentary to=functions.get_weather \
            <|constrain|>json<|message|>{\"city\": \"Paris\"}";
        let p = parse(answer, &tools(), false);
        assert_eq!(p.reasoning, "User asks weather. Call it.");
        assert_eq!(p.content, "");
        assert!(p.calls.is_empty(), "its message may go on");
        // The generator stopped on <|call|>: the text ends there.
        let p = parse(answer, &tools(), true);
        assert_eq!(
            p.calls,
            [ToolCall {
                name: "get_weather".into(),
                arguments: r#"{"city":"Paris"}"#.into()
            }]
        );
        // The recipient before the channel, a preamble, then the final answer.
        let answer = "<|channel|>analysis<|message|>Think.<|end|>\
            <|start|>assistant<|channel|>commentary<|message|>Let me look.<|end|>\
            <|start|>assistant to=functions.search<|channel|>commentary json<|message|>\
            {\"q\": 1}<|call|><|start|>assistant<|channel|>final<|message|>It is 20 °C.";
        let p = parse(answer, &tools(), true);
        assert_eq!(p.reasoning, "Think.");
        assert_eq!(p.content, "Let me look.\nIt is 20 °C.");
        assert_eq!(p.calls[0].name, "search");
        assert_eq!(p.calls[0].arguments, r#"{"q":1}"#);
    }

    #[test]
    fn other_answers_are_content_and_nothing_is_lost() {
        assert_eq!(parse("  plain text ", &tools(), true).content, "plain text");
        // Text outside the messages, before and after.
        let p = parse(
            "Hello<|channel|>final<|message|>Hi<|end|>bye",
            &tools(),
            true,
        );
        assert_eq!(p.content, "Hello\nHi\nbye");
        // A call the answer was cut inside (its token limit) is not made.
        let cut = "<|channel|>commentary to=functions.search<|message|>{\"q\": ";
        assert_eq!(parse(cut, &tools(), false), Parsed::default());
        // An undeclared tool's call stays in the content.
        let p = parse(
            "<|channel|>commentary to=functions.rm<|message|>{\"path\": \"/\"}<|call|>",
            &tools(),
            true,
        );
        assert!(p.calls.is_empty());
        assert_eq!(p.content, "{\"path\": \"/\"}");
        // Arguments that are not JSON are passed on as written.
        let p = parse(
            "<|channel|>commentary to=functions.search<|message|>not json",
            &tools(),
            true,
        );
        assert_eq!(p.calls[0].arguments, "not json");
        assert_eq!(parse("", &tools(), true), Parsed::default());
    }

    #[test]
    fn an_answer_cut_short_gives_prefixes_of_the_whole() {
        let answer = "Well <|channel|>analysis<|message|>First thought. Second.<|end|>\
            <|start|>assistant<|channel|>analysis<|message|>More.<|end|>\
            <|start|>assistant<|channel|>commentary to=functions.rm<|message|>{}<|end|>\
            <|start|>assistant<|channel|>final<|message|>The answer is 4.";
        let whole = parse(answer, &tools(), true);
        assert_eq!(whole.reasoning, "First thought. Second.\nMore.");
        assert_eq!(whole.content, "Well\n{}\nThe answer is 4.");
        // Cut anywhere but inside a marker (a special token comes whole).
        let markers: Vec<(usize, usize)> = answer
            .match_indices("<|")
            .map(|(i, _)| (i, i + answer[i..].find("|>").unwrap() + 2))
            .collect();
        let cuts = (0..=answer.len()).filter(|&c| {
            answer.is_char_boundary(c) && !markers.iter().any(|&(s, e)| s < c && c < e)
        });
        for cut in cuts {
            let p = parse(&answer[..cut], &tools(), false);
            assert!(whole.reasoning.starts_with(&p.reasoning), "{cut}: {p:?}");
            assert!(whole.content.starts_with(&p.content), "{cut}: {p:?}");
        }
    }

    #[test]
    fn a_stream_gives_the_content_piece_by_piece() {
        let pieces = [
            "<|channel|>",
            "analysis",
            "<|message|>",
            "Hmm",
            ".",
            "<|end|>",
            "<|start|>",
            "assistant",
            "<|channel|>",
            "final",
            "<|message|>",
            "Hi",
            " there",
            "!",
        ];
        let mut s = ContentStream::new(true);
        let shown: Vec<String> = pieces.iter().map(|p| s.push(p)).collect();
        assert_eq!(shown.concat(), "Hi there!");
        assert_eq!(shown[11..], ["Hi", " there", "!"]);
        // Another model's answer passes as it is.
        let mut plain = ContentStream::new(false);
        assert_eq!(plain.push("<|channel|>"), "<|channel|>");
    }

    #[test]
    fn gpt_oss_template_is_harmony() {
        assert!(is_harmony_template(
            "{{- '<|start|>assistant<|channel|>final<|message|>' + m.content + '<|end|>' }}"
        ));
        assert!(!is_harmony_template("{{ '<|im_start|>assistant\\n' }}"));
    }
}
