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
            "{:w$}  {:<6} {:<10} {:<5} {:<8} {:<6} {:>9} {:>9}",
            "scenario", "backend", "kind", "dtype", "inputs", "result", "max err", "err/bound"
        );
        for r in &self.results {
            let status = match r.status {
                Status::Pass => "pass",
                Status::Fail(_) => "FAIL",
                Status::NotApplicable(_) => "n/a",
            };
            let _ = writeln!(
                s,
                "{:w$}  {:<6} {:<10} {:<5} {:<8} {:<6} {:>9.2e} {:>9.3}",
                r.scenario,
                r.backend,
                r.kind,
                r.dtype,
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
                        "FAIL {} [{} {} {} {}]: {m}",
                        r.scenario,
                        r.backend,
                        r.kind,
                        r.dtype,
                        r.inputs.as_str()
                    );
                }
                Status::NotApplicable(m) => {
                    let _ = writeln!(
                        s,
                        "n/a  {} [{} {} {} {}]: {m}",
                        r.scenario,
                        r.backend,
                        r.kind,
                        r.dtype,
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
