//! [`Batch`]: the tokens one [`Context::decode`](crate::Context::decode) runs.

/// Tokens with their positions and sequences, and which of them want logits back (as
/// llama.cpp's `llama_batch`). Cleared and refilled between steps, it allocates nothing once
/// it has grown to a step's size.
#[derive(Clone, Debug, Default)]
pub struct Batch {
    tokens: Vec<i32>,
    positions: Vec<i32>,
    seq_ids: Vec<i32>,
    logit_rows: Vec<i32>,
}

impl Batch {
    /// An empty batch.
    pub fn new() -> Self {
        Batch::default()
    }

    /// `tokens` of sequence `seq` at positions `start..`, logits wanted for the last one
    /// (a prompt, or one decode step).
    pub fn sequence(tokens: &[i32], start: usize, seq: i32) -> Self {
        let mut b = Batch::new();
        b.push_run(tokens, start, seq, true);
        b
    }

    /// Empties the batch, keeping its buffers.
    pub fn clear(&mut self) {
        self.tokens.clear();
        self.positions.clear();
        self.seq_ids.clear();
        self.logit_rows.clear();
    }

    /// Adds `token` at `position` of sequence `seq`; `logits`: return this row's logits.
    pub fn push(&mut self, token: i32, position: i32, seq: i32, logits: bool) {
        if logits {
            self.logit_rows.push(self.tokens.len() as i32);
        }
        self.tokens.push(token);
        self.positions.push(position);
        self.seq_ids.push(seq);
    }

    /// Adds `tokens` of `seq` at positions `start..`; `last_logits`: return the last one's.
    pub fn push_run(&mut self, tokens: &[i32], start: usize, seq: i32, last_logits: bool) {
        for (i, &t) in tokens.iter().enumerate() {
            let last = i + 1 == tokens.len();
            self.push(t, (start + i) as i32, seq, last && last_logits);
        }
    }

    /// Tokens in the batch.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether it holds no token.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Token ids.
    pub fn tokens(&self) -> &[i32] {
        &self.tokens
    }

    /// Each token's position.
    pub fn positions(&self) -> &[i32] {
        &self.positions
    }

    /// Each token's sequence (a seq cache's; other kinds take 0).
    pub fn seq_ids(&self) -> &[i32] {
        &self.seq_ids
    }

    /// Indices of the tokens whose logits come back, in order.
    pub fn logit_rows(&self) -> &[i32] {
        &self.logit_rows
    }
}
