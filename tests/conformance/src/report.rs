//! The pass/fail matrix.

use std::fmt::Write as _;

use crate::runner::CaseResult;

/// Outcome of one case.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
#[serde(tag = "status", content = "detail", rename_all = "snake_case")]
pub enum Status {
    /// Every output within tolerance and every check held.
    Pass,
    /// The first divergence.
    Fail(String),
    /// The backend lacks the kind or dtype (not a pass).
    NotApplicable(String),
}

/// Where a failing case first diverged: the op, and of what follows the fields that apply
/// (`kvplug conform --json` carries them; the failure message names them too).
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct Failure {
    /// Index of the op in the scenario.
    pub op: usize,
    /// Its name (`step`, `export`, ...).
    pub op_name: String,
    /// Layer.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub layer: Option<usize>,
    /// Query head (attention output).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub head: Option<usize>,
    /// KV head (the head's keys and values, or an exported row's head).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_head: Option<usize>,
    /// Query token within the step.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token: Option<usize>,
    /// The query token's (or exported row's) position.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub position: Option<i32>,
    /// Element within the head row.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub element: Option<usize>,
    /// How the query was masked: `causal` (the maskless path), `explicit`, with
    /// `+ window W` on a sliding layer.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mask: Option<String>,
    /// The key cells the query should have seen.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key_cells: Option<Vec<usize>>,
    /// The oracle's value.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expected: Option<f64>,
    /// The backend's value.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub actual: Option<f64>,
    /// The error bound the value had to meet.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bound: Option<f64>,
}

/// All cases of a run.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Matrix {
    /// Results in run order.
    pub results: Vec<CaseResult>,
    /// Backends that were required but not loaded.
    pub missing_backends: Vec<String>,
    /// Loaded backends that cannot build caches, with the reason (e.g. no GPU adapter).
    pub unusable_backends: Vec<(String, String)>,
}

impl Matrix {
    /// Cases that failed.
    pub fn failures(&self) -> usize {
        self.results
            .iter()
            .filter(|r| matches!(r.status, Status::Fail(_)))
            .count()
    }

    /// Cases that passed.
    pub fn passes(&self) -> usize {
        self.results
            .iter()
            .filter(|r| r.status == Status::Pass)
            .count()
    }

    /// Cases that did not apply.
    pub fn not_applicable(&self) -> usize {
        self.results.len() - self.failures() - self.passes()
    }

    /// True when nothing failed, some case passed and no required backend is missing.
    pub fn ok(&self) -> bool {
        self.failures() == 0
            && self.passes() > 0
            && self.missing_backends.is_empty()
            && self.unusable_backends.is_empty()
    }

    /// A text table, one line per case, then failures in full and a summary line.
    pub fn render(&self) -> String {
        let mut s = String::new();
        let w = self
            .results
            .iter()
            .map(|r| r.scenario.len())
            .max()
            .unwrap_or(8)
            .max(8);
        let _ = writeln!(
            s,
            "{:w$}  {:<6} {:<10} {:<5} {:<10} {:<8} {:<6} {:>9} {:>9}",
            "scenario",
            "backend",
            "kind",
            "dtype",
            "arithmetic",
            "inputs",
            "result",
            "max err",
            "err/bound"
        );
        for r in &self.results {
            let status = match r.status {
                Status::Pass => "pass",
                Status::Fail(_) => "FAIL",
                Status::NotApplicable(_) => "n/a",
            };
            let _ = writeln!(
                s,
                "{:w$}  {:<6} {:<10} {:<5} {:<10} {:<8} {:<6} {:>9.2e} {:>9.3}",
                r.scenario,
                r.backend,
                r.kind,
                r.dtype,
                r.arithmetic,
                r.inputs.as_str(),
                status,
                r.max_err,
                r.max_ratio
            );
        }
        for r in &self.results {
            match &r.status {
                Status::Fail(m) => {
                    let _ = writeln!(
                        s,
                        "FAIL {} [{} {} {}{} {}]: {m}",
                        r.scenario,
                        r.backend,
                        r.kind,
                        r.dtype,
                        r.arithmetic_label(),
                        r.inputs.as_str()
                    );
                }
                Status::NotApplicable(m) => {
                    let _ = writeln!(
                        s,
                        "n/a  {} [{} {} {}{} {}]: {m}",
                        r.scenario,
                        r.backend,
                        r.kind,
                        r.dtype,
                        r.arithmetic_label(),
                        r.inputs.as_str()
                    );
                }
                Status::Pass => {}
            }
        }
        if self.results.is_empty() {
            let _ = writeln!(
                s,
                "FAIL no case ran: no scenario applies to the selected backends, kinds, dtypes and inputs"
            );
        }
        for b in &self.missing_backends {
            let _ = writeln!(s, "FAIL required backend '{b}' is not loaded");
        }
        for (b, why) in &self.unusable_backends {
            let _ = writeln!(s, "FAIL backend '{b}' cannot build caches: {why}");
        }
        let _ = writeln!(
            s,
            "conformance: {} passed, {} failed, {} skipped",
            self.passes(),
            self.failures()
                + self.missing_backends.len()
                + self.unusable_backends.len()
                + usize::from(self.results.is_empty()),
            self.not_applicable()
        );
        s
    }
}
