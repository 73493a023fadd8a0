//! Replays a scenario against a backend cache and the f64 oracle, op by op.
//!
//! # What "agrees with the oracle" means
//!
//! Every `update_and_attend` output element must lie within the oracle's error bound for
//! it ([`kvplug_core::oracle::attend`] documents the derivation). The oracle stores K/V
//! exactly as the KV dtype does — f32, f16 and bf16 rounded to nearest even, q8/q4 with the
//! reference affine quantizer (`kvplug_core::quant`) — so the only freedom a backend has is the
//! order and rounding of its f32 arithmetic: dot products over `head_dim`, the exps, and
//! the weighted sums over the visible keys. The bound is `γ(n)`-style worst-case analysis
//! of exactly those (about 1e-5 for outputs of magnitude ~1 with `head_dim` 64), computed
//! per element from the data; it is the same for every dtype. Anything else — a pool that
//! keeps more or less precision than its dtype, a different quantizer, a wrong mask — moves
//! outputs by far more (half an f16 ULP is 2.4e-4) and fails.
//!
//! A cache that declares reduced-precision arithmetics ([`kvplug_core::Arithmetic`]) runs
//! each case once per arithmetic, on a new cache set to it, against that arithmetic's bound
//! (the f32 one plus its derived term); a new cache must use the first it declares.
//!
//! After every step the backend's reported plan (read path and read window) must also
//! match the oracle's own naive cell model.

use std::any::Any;

use kvplug_core::oracle::{Attention, RefCache, RefRows};
use kvplug_core::{
    Arithmetic, CacheConfig, CacheError, CacheKind, ErrorKind, KvDtype, LayerSet, SlidingLayers,
};
use kvplug_plugin_api::abi_stable::std_types::{ROption, RSlice};
use kvplug_plugin_api::{CacheHandle, HostTensor, PluginError, SeqRows, TensorDtype};

use crate::report::{Failure, Status};
use crate::rng::{activations, Inputs, Stream};
use crate::rows;
use crate::scenario::{Op, Scenario, SeqSpec, Tamper};

/// Makes the caches under test (the host passes its session factories).
pub trait CacheFactory {
    /// Backend id, for reports.
    fn backend(&self) -> &str;
    /// `Err(reason)` when the backend lacks `kind` or `dtype`: the case is not applicable.
    fn applicable(&self, kind: CacheKind, dtype: KvDtype) -> Result<(), String>;
    /// Builds a cache; the second value keeps whatever owns it (a session) alive.
    fn build(
        &self,
        kind: CacheKind,
        cfg: &CacheConfig,
    ) -> Result<(CacheHandle, Box<dyn Any>), PluginError>;
}

/// One cell of the matrix.
#[derive(Clone, Debug, serde::Serialize)]
pub struct CaseResult {
    /// Scenario name.
    pub scenario: String,
    /// Backend id.
    pub backend: String,
    /// Cache kind.
    pub kind: String,
    /// KV dtype.
    pub dtype: String,
    /// The attention arithmetic the cache was set to (its bound is the one checked).
    pub arithmetic: String,
    /// Input distribution.
    pub inputs: Inputs,
    /// Outcome.
    pub status: Status,
    /// Largest abs error seen vs the oracle.
    pub max_err: f64,
    /// Largest ratio of an error to its bound (a pass keeps it <= 1).
    pub max_ratio: f64,
    /// `update_and_attend` outputs compared.
    pub outputs: usize,
    /// Where a failing case diverged.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub failure: Option<Failure>,
}

impl CaseResult {
    /// ` <arithmetic>` where it is not the f32 reference (for one-line case labels).
    pub fn arithmetic_label(&self) -> String {
        if self.arithmetic == Arithmetic::F32.as_str() {
            String::new()
        } else {
            format!(" {}", self.arithmetic)
        }
    }
}

struct Case<'a> {
    scenario: &'a Scenario,
    cache: CacheHandle,
    oracle: RefCache,
    kind: CacheKind,
    inputs: Inputs,
    max_err: f64,
    max_ratio: f64,
    outputs: usize,
    /// The located divergence of the op that failed, if it has one.
    detail: Option<Failure>,
    /// The last `export`: the backend's rows and the oracle's.
    exported: Option<(SeqRows, RefRows)>,
}

/// Backend and oracle results of one op.
type Outcome = (Result<(), PluginError>, Result<(), CacheError>);

fn same_error(kind: ErrorKind, (b, o): &Outcome) -> Result<(), String> {
    match (b, o) {
        (Err(be), Err(oe)) if be.kind.cache_kind() == Some(kind) && oe.kind == kind => Ok(()),
        (Err(be), Err(oe)) if oe.kind == kind => {
            Err(format!("backend failed with '{be}', expected {kind}"))
        }
        (Err(_), Err(oe)) => Err(format!(
            "the oracle failed with '{oe}', not {kind}: the scenario is wrong"
        )),
        (Ok(()), _) => Err(format!("backend accepted the op, expected {kind}")),
        (Err(_), Ok(())) => Err(format!(
            "the oracle accepted the op, expected {kind}: the scenario is wrong"
        )),
    }
}

fn agree((b, o): Outcome) -> Result<(), String> {
    match (b, o) {
        (Ok(()), Ok(())) => Ok(()),
        (Err(b), Err(o)) => Err(format!("refused by backend ({b}) and oracle ({o})")),
        (Err(b), Ok(())) => Err(format!("backend refused ({b}), the oracle accepted")),
        (Ok(()), Err(o)) => Err(format!("backend accepted, the oracle refused ({o})")),
    }
}

fn opt(x: Option<i32>) -> ROption<i32> {
    x.into()
}

impl Case<'_> {
    fn exec(&mut self, idx: usize, op: &Op) -> Result<Outcome, String> {
        let c = &self.cache;
        let o = &mut self.oracle;
        Ok(match op {
            Op::Step {
                pos,
                pos_range,
                seq,
                tamper,
                tamper_layer,
            } => return self.step(idx, pos, pos_range, seq, *tamper, *tamper_layer),
            Op::SeqCp { src, dst, p0, p1 } => (
                c.seq_cp(*src, *dst, opt(*p0), opt(*p1)).into_result(),
                o.seq_cp(*src, *dst, *p0, *p1),
            ),
            Op::SeqRm { seq, p0, p1 } => (
                c.seq_rm(*seq, opt(*p0), opt(*p1)).into_result(),
                o.seq_rm(*seq, *p0, *p1),
            ),
            Op::SeqKeep { seq } => (c.seq_keep(*seq).into_result(), o.seq_keep(*seq)),
            Op::Propose { parents } => (
                c.propose(RSlice::from_slice(parents)).into_result(),
                o.propose(parents),
            ),
            Op::Commit { accepted } => (
                c.commit(RSlice::from_slice(accepted)).into_result(),
                o.commit(accepted),
            ),
            Op::Rewind { len } => (c.rewind(*len as u64).into_result(), o.rewind(*len)),
            Op::Export { seq } => return self.export(idx, *seq),
            Op::Import {
                seq,
                pos_range,
                from_export,
            } => return self.import(idx, *seq, *pos_range, *from_export),
            Op::Clear => (c.clear().into_result(), {
                o.clear();
                Ok(())
            }),
            Op::Check { .. } | Op::ExpectError { .. } => unreachable!("handled by run"),
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn step(
        &mut self,
        idx: usize,
        pos: &Option<Vec<i32>>,
        range: &Option<[i32; 2]>,
        seq: &Option<SeqSpec>,
        tamper: Option<Tamper>,
        tamper_layer: usize,
    ) -> Result<Outcome, String> {
        let positions: Vec<i32> = match (pos, range) {
            (Some(p), _) => p.clone(),
            (None, Some([a, b])) => (*a..*b).collect(),
            (None, None) => unreachable!("validated at parse"),
        };
        let t = positions.len();
        if self.kind == CacheKind::Seq {
            let seqs = match seq {
                None => vec![0; t],
                Some(SeqSpec::One(s)) => vec![*s; t],
                Some(SeqSpec::PerToken(v)) => v.clone(),
            };
            let outcome = (
                self.cache
                    .begin_step(RSlice::from_slice(&seqs))
                    .into_result(),
                self.oracle.begin_step(&seqs),
            );
            if outcome.0.is_err() || outcome.1.is_err() {
                return Ok(outcome);
            }
        }
        let cfg = &self.scenario.config;
        let (hq, hkv, d) = (cfg.n_q_heads, cfg.n_kv_heads, cfg.head_dim);
        let scale = 1.0 / (d as f32).sqrt();
        let seed = self.scenario.seed;
        for layer in 0..cfg.n_layers {
            let tk = if tamper == Some(Tamper::KShape) && layer == tamper_layer {
                t + 1
            } else {
                t
            };
            let draw =
                |stream, heads, t| activations(self.inputs, seed, idx, layer, stream, heads, t, d);
            let (q, k, v) = (
                draw(Stream::Q, hq, t),
                draw(Stream::K, hkv, tk),
                draw(Stream::V, hkv, t),
            );
            let backend = self
                .cache
                .update_and_attend(
                    layer as u32,
                    &HostTensor::from_f32(&[1, hq, t, d], &q),
                    &HostTensor::from_f32(&[1, hkv, tk, d], &k),
                    &HostTensor::from_f32(&[1, hkv, t, d], &v),
                    RSlice::from_slice(&positions),
                    scale,
                    TensorDtype::F32,
                )
                .into_result();
            let wide = |x: &[f32]| x.iter().map(|&v| v as f64).collect::<Vec<f64>>();
            let oracle = self.oracle.update_and_attend(
                layer,
                &wide(&q),
                &wide(&k),
                &wide(&v),
                &positions,
                scale as f64,
            );
            match (backend, oracle) {
                (Ok(out), Ok(want)) => {
                    if layer == 0 {
                        self.check_plan(idx)?;
                    }
                    self.compare(idx, layer, &positions, &out, &want)?
                }
                (b, o) => return Ok((b.map(|_| ()), o.map(|_| ()))),
            }
        }
        Ok((Ok(()), Ok(())))
    }

    /// `export_seq` on both; the backend's rows must decode to the oracle's values.
    fn export(&mut self, idx: usize, seq: i32) -> Result<Outcome, String> {
        let (b, o) = (
            self.cache.export_seq(seq).into_result(),
            self.oracle.export_seq(seq),
        );
        let (rows, want) = match (b, o) {
            (Ok(rows), Ok(want)) => (rows, want),
            (b, o) => return Ok((b.map(|_| ()), o.map(|_| ()))),
        };
        if let Err(m) = rows::compare(self.oracle.config(), &rows, &want) {
            self.detail = Some(Failure {
                layer: m.layer,
                kv_head: m.kv_head,
                position: m.position,
                element: m.element,
                expected: m.expected,
                actual: m.actual,
                ..Failure::default()
            });
            return Err(format!(
                "op {idx} (export of sequence {seq}): {}",
                m.message
            ));
        }
        self.exported = Some((rows, want));
        Ok((Ok(()), Ok(())))
    }

    /// `import_seq` on both: generated rows for `range`, or the last export's.
    fn import(
        &mut self,
        idx: usize,
        seq: i32,
        range: Option<[i32; 2]>,
        from_export: bool,
    ) -> Result<Outcome, String> {
        let cfg = *self.oracle.config();
        let (rows, values) = if from_export {
            self.exported
                .clone()
                .ok_or("import from_export before any export: the scenario is wrong")?
        } else {
            let [a, b] = range.expect("validated at parse");
            let positions: Vec<i32> = (a..b).collect();
            let window_from = cfg.sliding.filter(|s| !s.layers.is_empty()).map_or(0, |s| {
                kvplug_core::oracle::window_start(&positions, s.window)
            });
            let mut values = RefRows {
                positions,
                k: Vec::new(),
                v: Vec::new(),
                window_from,
            };
            let (hkv, d) = (cfg.n_kv_heads, cfg.head_dim);
            for layer in 0..cfg.n_layers {
                let held = values.layer_rows(&cfg, layer);
                let t = values.positions.len();
                for (stream, side) in [(Stream::K, 0), (Stream::V, 1)] {
                    let x = activations(
                        self.inputs,
                        self.scenario.seed,
                        idx,
                        layer,
                        stream,
                        hkv,
                        t,
                        d,
                    );
                    let mut kept = Vec::with_capacity(hkv * held.len() * d);
                    for h in 0..hkv {
                        kept.extend(
                            x[(h * t + held.start) * d..(h * t + held.end) * d]
                                .iter()
                                .map(|&v| v as f64),
                        );
                    }
                    [&mut values.k, &mut values.v][side].push(kept);
                }
            }
            rows::to_seq_rows(&cfg, &values)
        };
        Ok((
            self.cache.import_seq(seq, &rows).into_result(),
            self.oracle.import_seq(seq, &values),
        ))
    }

    /// The backend's reported plan of the step just opened vs the oracle's.
    fn check_plan(&mut self, idx: usize) -> Result<(), String> {
        let want = self.oracle.last_plan().ok_or("the oracle opened no step")?;
        let stats = self
            .cache
            .stats()
            .into_result()
            .map_err(|e| format!("op {idx}: stats failed: {e}"))?;
        let got = (
            stats.last_plan.into_option().map(|s| s.to_string()),
            stats.last_read_len as usize,
        );
        let expect = (Some(want.kind.as_str().to_string()), want.read_len);
        if got != expect {
            return Err(format!(
                "op {idx}: the backend planned {:?} reading {} cells; the oracle's cell model says {} reading {}",
                got.0, got.1, want.kind.as_str(), want.read_len
            ));
        }
        Ok(())
    }

    fn compare(
        &mut self,
        idx: usize,
        layer: usize,
        positions: &[i32],
        out: &HostTensor,
        want: &Attention,
    ) -> Result<(), String> {
        let got = out.to_f32().ok_or("backend returned a non-float output")?;
        if got.len() != want.out.len() {
            return Err(format!(
                "op {idx} layer {layer}: output has {} values, expected {}",
                got.len(),
                want.out.len()
            ));
        }
        let mut worst = (0.0f64, 0usize);
        for (i, &g) in got.iter().enumerate() {
            let e = if g.is_finite() {
                (g as f64 - want.out[i]).abs()
            } else {
                f64::INFINITY
            };
            self.max_err = self.max_err.max(e);
            let ratio = if e == 0.0 { 0.0 } else { e / want.bound[i] };
            if ratio > worst.0 {
                worst = (ratio, i);
            }
        }
        self.outputs += 1;
        self.max_ratio = self.max_ratio.max(worst.0);
        if worst.0 > 1.0 {
            let at = (layer, positions, worst.1);
            return Err(self.locate(idx, at, got[worst.1] as f64, want));
        }
        Ok(())
    }

    /// Names the output element `i` of `layer` that broke its bound: query head and token,
    /// its position, the keys it should have seen and how it was masked.
    fn locate(
        &mut self,
        idx: usize,
        (layer, positions, i): (usize, &[i32], usize),
        got: f64,
        want: &Attention,
    ) -> String {
        let cfg = self.oracle.config();
        let d = cfg.head_dim;
        let plan = self.oracle.last_plan().expect("a step is open");
        let (l, t) = (plan.read_len, plan.cells.len());
        let (head, token, element) = (i / (t * d), (i / d) % t, i % d);
        let kv_head = head / (want.out.len() / (t * d) / cfg.n_kv_heads);
        let keys: Vec<usize> = (0..l)
            .filter(|&j| self.oracle.last_mask()[token * l + j])
            .collect();
        let mut mask = match plan.kind {
            kvplug_core::PlanKind::SingleContiguous => "causal".to_string(),
            kvplug_core::PlanKind::Explicit => "explicit".to_string(),
        };
        if let Some(s) = cfg.sliding.filter(|_| cfg.slides(layer)) {
            mask.push_str(&format!(" + window {}", s.window));
        }
        let position = positions[token];
        let message = format!(
            "op {idx} layer {layer}: query head {head} (KV head {kv_head}), token {token} at position {position}, element {element}: {got:.6} but the oracle gives {:.6}, error {:.3e} above its {} bound {:.3e}; the query should see key cells {} ({} mask, read window {l})",
            want.out[i],
            (got - want.out[i]).abs(),
            self.oracle.arithmetic(),
            want.bound[i],
            cell_runs(&keys),
            mask
        );
        self.detail = Some(Failure {
            layer: Some(layer),
            head: Some(head),
            kv_head: Some(kv_head),
            token: Some(token),
            position: Some(position),
            element: Some(element),
            mask: Some(mask),
            key_cells: Some(keys),
            expected: Some(want.out[i]),
            actual: Some(got),
            bound: Some(want.bound[i]),
            ..Failure::default()
        });
        message
    }

    fn check(&mut self, idx: usize, op: &Op) -> Result<(), String> {
        let Op::Check {
            seq_len,
            can_extend,
            plan,
        } = op
        else {
            unreachable!()
        };
        if let Some(c) = seq_len {
            let got = self
                .cache
                .seq_len(c.seq)
                .into_result()
                .map_err(|e| format!("op {idx}: seq_len({}) failed: {e}", c.seq))?;
            let oracle = self
                .oracle
                .seq_len(c.seq)
                .map_err(|e| format!("op {idx}: oracle seq_len failed: {e}"))?;
            if got as usize != c.len || oracle != c.len {
                return Err(format!(
                    "op {idx}: seq_len({}) = {got} (oracle {oracle}), expected {}",
                    c.seq, c.len
                ));
            }
        }
        if let Some(c) = can_extend {
            let (got, oracle) = (
                self.cache.can_extend(c.n as u64),
                self.oracle.can_extend(c.n),
            );
            if got != c.value || oracle != c.value {
                return Err(format!(
                    "op {idx}: can_extend({}) = {got} (oracle {oracle}), expected {}",
                    c.n, c.value
                ));
            }
        }
        if let Some(p) = plan {
            let stats = self
                .cache
                .stats()
                .into_result()
                .map_err(|e| format!("op {idx}: stats failed: {e}"))?;
            let got = stats.last_plan.into_option().map(|s| s.to_string());
            if got.as_deref() != Some(p.0.as_str()) {
                return Err(format!(
                    "op {idx}: last plan was {got:?}, expected {}",
                    p.0.as_str()
                ));
            }
        }
        Ok(())
    }

    fn run(&mut self) -> Result<(), Box<(String, Failure)>> {
        for (idx, op) in self.scenario.ops.iter().enumerate() {
            let result = match op {
                Op::Check { .. } => self.check(idx, op),
                Op::ExpectError { error, op: inner } => self.exec(idx, inner).and_then(|o| {
                    same_error(error.0, &o).map_err(|m| format!("op {idx} (expect_error): {m}"))
                }),
                _ => self
                    .exec(idx, op)
                    .and_then(|o| agree(o).map_err(|m| format!("op {idx}: {m}"))),
            };
            if let Err(m) = result {
                let failure = Failure {
                    op: idx,
                    op_name: op.name().to_string(),
                    ..self.detail.take().unwrap_or_default()
                };
                return Err(Box::new((m, failure)));
            }
        }
        Ok(())
    }
}

/// `0-39, 41`: ascending cells as runs.
fn cell_runs(cells: &[usize]) -> String {
    if cells.is_empty() {
        return "none".into();
    }
    let mut runs: Vec<String> = Vec::new();
    let mut start = cells[0];
    for (i, &c) in cells.iter().enumerate() {
        let last = i + 1 == cells.len() || cells[i + 1] != c + 1;
        if last {
            runs.push(if start == c {
                c.to_string()
            } else {
                format!("{start}-{c}")
            });
            if i + 1 < cells.len() {
                start = cells[i + 1];
            }
        }
    }
    runs.join(", ")
}

/// Runs `scenario` for one kind and dtype on the factory's backend, once per attention
/// arithmetic the built cache declares (each on a new cache set to it, held to its bound).
pub fn run_case(
    scenario: &Scenario,
    kind: CacheKind,
    dtype: KvDtype,
    inputs: Inputs,
    factory: &dyn CacheFactory,
) -> Vec<CaseResult> {
    let first = run_arithmetic(scenario, kind, dtype, inputs, factory, None);
    let Some(declared) = first.1 else {
        return vec![first.0];
    };
    let mut results = vec![first.0];
    for a in declared.into_iter().skip(1) {
        results.push(run_arithmetic(scenario, kind, dtype, inputs, factory, Some(a)).0);
    }
    results
}

/// One arithmetic of [`run_case`]: `None` runs the first one the cache declares (checking
/// that a new cache uses it) and returns every declared one, in order.
fn run_arithmetic(
    scenario: &Scenario,
    kind: CacheKind,
    dtype: KvDtype,
    inputs: Inputs,
    factory: &dyn CacheFactory,
    arithmetic: Option<Arithmetic>,
) -> (CaseResult, Option<Vec<Arithmetic>>) {
    let mut declared = None;
    let mut result = CaseResult {
        scenario: scenario.name.clone(),
        backend: factory.backend().to_string(),
        kind: kind.as_str().to_string(),
        dtype: dtype.to_string(),
        arithmetic: arithmetic.unwrap_or_default().to_string(),
        inputs,
        status: Status::Pass,
        max_err: 0.0,
        max_ratio: 0.0,
        outputs: 0,
        failure: None,
    };
    if let Err(reason) = factory.applicable(kind, dtype) {
        result.status = Status::NotApplicable(reason);
        return (result, declared);
    }
    let c = &scenario.config;
    let sliding = match &c.sliding {
        Some(s) => match LayerSet::of(s.layers.iter().copied()) {
            Ok(layers) => Some(SlidingLayers {
                window: s.window,
                layers,
            }),
            Err(e) => {
                result.status = Status::Fail(format!("config.sliding: {e}"));
                return (result, declared);
            }
        },
        None => None,
    };
    let cfg = CacheConfig {
        sliding,
        conv: None,
        delta: None,
        ssm: None,
        capacity: c.capacity,
        n_layers: c.n_layers,
        n_kv_heads: c.n_kv_heads,
        head_dim: c.head_dim,
        min_chunk: c.min_chunk,
        kv_dtype: dtype,
    };
    let built = factory.build(kind, &cfg);
    let oracle = RefCache::new(kind, cfg);
    result.status = match (built, oracle, scenario.expect_build_error) {
        (Err(b), Err(o), Some(want)) if b.kind.cache_kind() == Some(want.0) && o.kind == want.0 => {
            Status::Pass
        }
        (_, _, Some(want)) => Status::Fail(format!(
            "building must fail with {} on the backend and the oracle",
            want.0
        )),
        (Err(e), _, None) => Status::Fail(format!("building the cache failed: {e}")),
        (_, Err(e), None) => Status::Fail(format!("the oracle refused the config: {e}")),
        (Ok((cache, _session)), Ok(mut oracle), None) => {
            let chosen = match choose_arithmetic(&cache, arithmetic) {
                Ok((chosen, all)) => {
                    declared = Some(all);
                    chosen
                }
                Err(m) => {
                    result.status = Status::Fail(m);
                    return (result, None);
                }
            };
            result.arithmetic = chosen.to_string();
            oracle.set_arithmetic(chosen);
            let mut case = Case {
                scenario,
                cache,
                oracle,
                kind,
                inputs,
                max_err: 0.0,
                max_ratio: 0.0,
                outputs: 0,
                detail: None,
                exported: None,
            };
            let status = match case.run() {
                Ok(()) => Status::Pass,
                Err(failed) => {
                    let (m, failure) = *failed;
                    result.failure = Some(failure);
                    Status::Fail(m)
                }
            };
            result.max_err = case.max_err;
            result.max_ratio = case.max_ratio;
            result.outputs = case.outputs;
            status
        }
    };
    (result, declared)
}

/// The arithmetics `cache` declares, and the one the case runs: `wanted`, set on the cache,
/// or (`None`) the first declared, which a new cache must already use. Fails on an
/// undeclared f32, a name the oracle does not know, or a cache not doing as told.
fn choose_arithmetic(
    cache: &CacheHandle,
    wanted: Option<Arithmetic>,
) -> Result<(Arithmetic, Vec<Arithmetic>), String> {
    let names = cache.attention_arithmetics();
    let all = names
        .iter()
        .map(|n| {
            n.parse::<Arithmetic>()
                .map_err(|e| format!("the cache declares {e}"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    if !all.contains(&Arithmetic::F32) {
        return Err("the cache does not declare f32 attention, which every cache computes".into());
    }
    if let Some(twice) = (1..all.len()).find(|&i| all[..i].contains(&all[i])) {
        return Err(format!("the cache declares {} twice", all[twice]));
    }
    let chosen = match wanted {
        Some(a) => {
            cache
                .set_attention_arithmetic(a.as_str().into())
                .into_result()
                .map_err(|e| format!("setting the declared arithmetic {a} failed: {e}"))?;
            a
        }
        None => all[0],
    };
    let current = cache.attention_arithmetic();
    if current.as_str() != chosen.as_str() {
        return Err(format!(
            "the cache reports attention arithmetic '{current}' where it should compute with {chosen}"
        ));
    }
    Ok((chosen, all))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::Matrix;
    use crate::scenario::builtin_scenarios;

    struct NoTree;

    impl CacheFactory for NoTree {
        fn backend(&self) -> &str {
            "stub"
        }
        fn applicable(&self, kind: CacheKind, _: KvDtype) -> Result<(), String> {
            match kind {
                CacheKind::Tree => Err("backend has no 'tree' cache".into()),
                _ => Ok(()),
            }
        }
        fn build(
            &self,
            _: CacheKind,
            _: &CacheConfig,
        ) -> Result<(CacheHandle, Box<dyn Any>), PluginError> {
            Err(PluginError::new(
                kvplug_plugin_api::AbiErrorKind::Backend,
                "stub builds nothing",
            ))
        }
    }

    #[test]
    fn key_cells_print_as_runs() {
        assert_eq!(cell_runs(&[]), "none");
        assert_eq!(cell_runs(&[0, 1, 2, 5, 7, 8]), "0-2, 5, 7-8");
        assert_eq!(cell_runs(&[4]), "4");
    }

    #[test]
    fn a_missing_kind_is_not_applicable_and_never_a_pass() {
        let s = &builtin_scenarios()[0];
        let [na] = &run_case(s, CacheKind::Tree, KvDtype::F16, Inputs::Uniform, &NoTree)[..] else {
            panic!("one result per case that does not build")
        };
        let na = na.clone();
        assert_eq!(
            na.status,
            Status::NotApplicable("backend has no 'tree' cache".into())
        );
        let failed = run_case(s, CacheKind::Seq, KvDtype::F16, Inputs::Uniform, &NoTree).remove(0);
        assert_eq!(
            failed.status,
            Status::Fail("building the cache failed: backend: stub builds nothing".into())
        );
        let m = Matrix {
            results: vec![na.clone()],
            ..Matrix::default()
        };
        assert!(!m.ok(), "a run with nothing passed is not ok");
        assert!(m
            .render()
            .contains("n/a  prefill_decode [stub tree f16 uniform]: backend has no 'tree' cache"));
        let m = Matrix {
            results: vec![na, failed],
            missing_backends: vec!["wgpu".into()],
            ..Matrix::default()
        };
        let text = m.render();
        assert!(
            text.contains("FAIL required backend 'wgpu' is not loaded"),
            "{text}"
        );
        assert!(
            text.ends_with("conformance: 0 passed, 2 failed, 1 skipped\n"),
            "{text}"
        );
    }
}
