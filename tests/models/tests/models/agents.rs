//! The agent store with the synthetic `tiny` model: prefix reuse, hot agents, the warm tier
//! under a memory budget and model tagging, each checked against plain greedy decoding of
//! the same prompt on a fresh cache.

use std::path::Path;

use kvplug::formats::synth::{synth, PRESETS};
use kvplug::Reply;
use kvplug::{run_decode, RunSpec};
use kvplug::{AgentStore, AgentStoreOptions, GenOptions, KvDtype, Model, Runtime, Sampler};

use crate::common;
use common::{runtime, BACKENDS};

const NEW: usize = 8;

fn tiny(seed: u64) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    synth(&PRESETS[0], dir.path(), seed, "f32").unwrap();
    dir
}

fn store(rt: &Runtime, backend: &str, model: &Path, capacity: usize, dir: &Path) -> AgentStore {
    store_of(
        &common::model(rt, backend, model),
        KvDtype::F16,
        capacity,
        dir,
    )
}

fn store_of(model: &Model, kv_dtype: KvDtype, capacity: usize, dir: &Path) -> AgentStore {
    let opts = AgentStoreOptions {
        capacity,
        kv_dtype,
        dir: dir.to_path_buf(),
        warm: Default::default(),
    };
    AgentStore::new(model, opts).unwrap()
}

/// Greedy decoding of `prompt` alone on a fresh contiguous cache.
fn plain(rt: &Runtime, backend: &str, model: &Path, prompt: &[i32]) -> Vec<i32> {
    let spec = RunSpec {
        prompt: prompt.to_vec(),
        max_tokens: NEW,
        kv_dtype: KvDtype::F16,
        capacity: 256,
        stop_tokens: Default::default(),
    };
    let m = common::model(rt, backend, model);
    run_decode(&m, &spec, None, Sampler::greedy(), None, &mut |_| Ok(()))
        .unwrap()
        .ids
}

fn tokens(seed: i32, n: usize) -> Vec<i32> {
    (0..n as i32)
        .map(|i| (i * 37 + seed * 11) % 250 + 3)
        .collect()
}

fn ask(s: &mut AgentStore, agent: Option<&str>, prompt: &[i32]) -> Reply {
    s.generate(agent, prompt, GenOptions::max_tokens(NEW))
        .unwrap()
}

/// A request cancelled before it starts is an error, and the agent's next request runs
/// as on a fresh store.
#[test]
fn a_cancelled_request_is_an_error_and_the_agent_goes_on() {
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;
    let model = tiny(7);
    let rt = runtime();
    let files = tempfile::tempdir().unwrap();
    let mut s = store(&rt, "cpu", model.path(), 256, files.path());
    let prompt = tokens(2, 30);
    let cancelled = GenOptions {
        cancel: Some(Arc::new(AtomicBool::new(true))),
        ..GenOptions::max_tokens(NEW)
    };
    let e = s.generate(Some("a"), &prompt, cancelled).unwrap_err();
    assert!(e.to_string().contains("cancelled"), "{e}");
    let r = ask(&mut s, Some("a"), &prompt);
    assert_eq!(r.ids, plain(&rt, "cpu", model.path(), &prompt));
}

#[test]
fn requests_reuse_shared_prefixes_and_agents_their_history() {
    let model = tiny(7);
    let rt = runtime();
    let files = tempfile::tempdir().unwrap();
    for backend in BACKENDS {
        let mut s = store(&rt, backend, model.path(), 256, files.path());
        let system = tokens(1, 40);
        let with = |suffix: &[i32]| [system.as_slice(), suffix].concat();
        let (a, b) = (with(&[5, 6, 7]), with(&[9, 8, 7, 6]));
        let first = ask(&mut s, None, &a);
        assert_eq!((first.cached_tokens, first.prefilled_tokens), (0, a.len()));
        let second = ask(&mut s, None, &b);
        assert_eq!(
            second.cached_tokens,
            system.len(),
            "{backend}: the shared system prompt"
        );
        assert_eq!(
            second.ids,
            plain(&rt, backend, model.path(), &b),
            "{backend}"
        );

        // A named agent continues its own conversation.
        let turn1 = ask(&mut s, Some("ada"), &a);
        let next = [a.as_slice(), &turn1.ids, &[4, 4, 2]].concat();
        let turn2 = ask(&mut s, Some("ada"), &next);
        assert_eq!(
            turn2.cached_tokens,
            a.len() + turn1.ids.len() - 1,
            "{backend}"
        );
        assert_eq!(
            turn2.ids,
            plain(&rt, backend, model.path(), &next),
            "{backend}"
        );
        assert!(s.is_hot("ada"));
    }
}

#[test]
fn a_budget_parks_idle_agents_to_files_and_restores_them() {
    let (model, other) = (tiny(7), tiny(8));
    let rt = runtime();
    let files = tempfile::tempdir().unwrap();
    for backend in BACKENDS {
        // Room for two agents' histories (48 cells each), not three.
        let mut s = store(&rt, backend, model.path(), 110, files.path());
        let prompts: Vec<Vec<i32>> = (0..3).map(|i| tokens(10 + i, 40)).collect();
        let names = ["a", "b", "c"];
        let mut first = Vec::new();
        for (n, p) in names.iter().zip(&prompts) {
            first.push(ask(&mut s, Some(n), p));
        }
        assert!(
            !s.is_hot("a") && s.is_hot("b") && s.is_hot("c"),
            "{backend}: a is the LRU"
        );
        let a_file = s.file_of("a").unwrap();
        assert!(a_file.exists(), "{backend}: a was parked to its file");

        let next = [prompts[0].as_slice(), &first[0].ids, &[7, 7]].concat();
        let again = ask(&mut s, Some("a"), &next);
        assert_eq!(
            again.restored_tokens,
            prompts[0].len() + NEW - 1,
            "{backend}"
        );
        assert_eq!(again.cached_tokens, again.restored_tokens);
        assert_eq!(
            again.ids,
            plain(&rt, backend, model.path(), &next),
            "{backend}"
        );
        s.park_all().unwrap();
        drop(s);

        // Another model never loads these files and leaves them in place.
        let mut o = store(&rt, backend, other.path(), 110, files.path());
        let cold = ask(&mut o, Some("a"), &next);
        assert_eq!(
            cold.cached_tokens, 0,
            "{backend}: another model's file was used"
        );
        assert!(a_file.exists());
        drop(o);
        // The first model, after the swap back, finds its agent again.
        let mut back = store(&rt, backend, model.path(), 110, files.path());
        let resumed = ask(&mut back, Some("a"), &next);
        assert_eq!(resumed.restored_tokens, next.len() - 1, "{backend}");
        assert_eq!(resumed.ids, again.ids, "{backend}");
        for f in std::fs::read_dir(files.path()).unwrap() {
            std::fs::remove_file(f.unwrap().path()).unwrap();
        }
    }
}

/// Parking an agent that shares a beginning with the one asking frees the rest of its
/// history: the asker's hold on the shared cells does not keep the parked agent's own.
#[test]
fn parking_an_agent_frees_what_it_does_not_share_with_the_asker() {
    let model = tiny(7);
    let rt = runtime();
    let files = tempfile::tempdir().unwrap();
    // a holds 47 cells, b 10 shared with a and 57 of its own: 104 of 110.
    let mut s = store(&rt, "cpu", model.path(), 110, files.path());
    let shared = tokens(1, 10);
    let pa = [shared.as_slice(), &tokens(2, 30)].concat();
    let pb = [shared.as_slice(), &tokens(3, 50)].concat();
    let turn1 = ask(&mut s, Some("a"), &pa);
    ask(&mut s, Some("b"), &pb);
    assert!(s.is_hot("a") && s.is_hot("b"));
    // a's next turn needs more than the 6 free cells: b goes to its file.
    let next = [pa.as_slice(), &turn1.ids, &[4, 4, 2]].concat();
    let turn2 = ask(&mut s, Some("a"), &next);
    assert!(!s.is_hot("b"));
    assert_eq!(turn2.ids, plain(&rt, "cpu", model.path(), &next));
}

/// Restoring a parked agent's file takes no cell promised to a request in flight: with too
/// little room for the restore and the rest, the request waits and nothing is restored.
#[test]
fn a_restore_leaves_the_cells_promised_to_requests_in_flight() {
    let model = tiny(7);
    let rt = runtime();
    let files = tempfile::tempdir().unwrap();
    const CAPACITY: usize = 110;
    let mut s = store(&rt, "cpu", model.path(), CAPACITY, files.path());
    let py = tokens(4, 40);
    let turn1 = ask(&mut s, Some("y"), &py);
    s.park("y").unwrap();
    let free = |s: &AgentStore| CAPACITY - s.cache().stats().unwrap().live_cells as usize;
    // A request in flight is promised its 40 prompt cells and 50 more (evicting y's
    // published history for them).
    let x = s
        .admit(Some("x"), &tokens(5, 40), 50, true)
        .unwrap()
        .unwrap();
    assert!(x.history == 0 && free(&s) >= 90);
    // y's next turn would restore its 47 cells from its file: that and the rest of its
    // turn would not fit beside x's 90 (the engine's `extra` counts them).
    let next = [py.as_slice(), &turn1.ids, &[7, 7]].concat();
    assert!(s.admit(Some("y"), &next, 90 + NEW, true).unwrap().is_none());
    assert!(free(&s) >= 90, "x's cells are still free: {}", free(&s));
    assert!(!s.is_hot("y"), "nothing was restored");
}

#[test]
fn a_parked_file_of_another_kv_dtype_or_key_basis_is_a_miss_not_an_error() {
    let model = tiny(7);
    let rt = runtime();
    let files = tempfile::tempdir().unwrap();
    let m = common::model(&rt, "cpu", model.path());
    let q8 = KvDtype::Q8 { group: 16 };
    let prompt = tokens(3, 40);
    let mut s = store_of(&m, KvDtype::F16, 128, files.path());
    let first = ask(&mut s, Some("a"), &prompt);
    s.park_all().unwrap();
    drop(s);
    let next = [prompt.as_slice(), &first.ids, &[7, 7]].concat();
    // Each store after the first finds the last one's file: of another dtype or key basis
    // it is prefilled (and replaced on parking); of its own it is restored.
    for (model, dtype, restores) in [
        (m.clone(), q8, false),
        (m.clone(), q8, true),
        (m.with_key_rotation(false), q8, false),
        (m.clone(), KvDtype::F16, false),
    ] {
        let mut s = store_of(&model, dtype, 128, files.path());
        let got = ask(&mut s, Some("a"), &next);
        let want = if restores { next.len() - 1 } else { 0 };
        assert_eq!(
            got.restored_tokens,
            want,
            "{dtype}, {} keys",
            model.key_basis(dtype)
        );
        s.park_all().unwrap();
    }
}
