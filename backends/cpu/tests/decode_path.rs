//! The decode hot path: fast-path classification, zero allocations per step once warm, and
//! lazy pool growth.

mod common;

use common::*;
use kvplug_backend_kit::testing::CountingAllocator;
use kvplug_core::{make_config, CacheKind, CacheVerbs, KeyBasis, KvDtype, PlanKind};

#[global_allocator]
static GLOBAL: CountingAllocator = CountingAllocator;

/// Prefill 300 tokens, decode a few warm-up steps, then count allocations over 40 decode
/// steps (no pool doubling happens between 305 and 345 cells: the pool holds 512), with
/// layer 0 sliding through `window` when given.
fn allocations_per_decode(kind: CacheKind, dtype: KvDtype, window: Option<usize>) -> usize {
    let mut cfg = config(2, 4096, dtype);
    cfg.sliding = window.map(|window| kvplug_core::SlidingLayers {
        window,
        layers: kvplug_core::LayerSet::of([0]).unwrap(),
    });
    let mut c = cache(kind, cfg);
    let mut prefill = Step::new(300);
    let positions: Vec<i32> = (0..300).collect();
    prefill.run(&mut c, &positions);
    let mut step = Step::new(1);
    let decode =
        |c: &mut kvplug_backend_kit::KitCache<kvplug_cpu::CpuDevice>, step: &mut Step, p: i32| {
            if kind == CacheKind::Seq {
                c.begin_step(&[0]).unwrap();
            }
            step.run(c, &[p]);
        };
    for p in 300..305 {
        decode(&mut c, &mut step, p);
    }
    let before = CountingAllocator::calls();
    for p in 305..345 {
        decode(&mut c, &mut step, p);
    }
    let n = CountingAllocator::calls() - before;
    assert_eq!(c.stats().last_plan, Some(PlanKind::SingleContiguous));
    n
}

#[test]
fn decode_steps_allocate_nothing_once_warm() {
    // One test owns the counter (tests in one binary run on parallel threads).
    for kind in [CacheKind::Contiguous, CacheKind::Seq, CacheKind::Tree] {
        for dtype in [KvDtype::F16, KvDtype::Q8_DEFAULT, KvDtype::Q4_DEFAULT] {
            assert_eq!(
                allocations_per_decode(kind, dtype, None),
                0,
                "{kind} {dtype}"
            );
        }
        // A hybrid cache: layer 0 slides with a window of 32, so it drops rows every step.
        let n = allocations_per_decode(kind, KvDtype::F16, Some(32));
        assert_eq!(n, 0, "{kind} with a sliding layer");
    }
    for kind in [CacheKind::Contiguous, CacheKind::Seq, CacheKind::Tree] {
        for dtype in [KvDtype::F16, KvDtype::Q4 { group: 16 }] {
            assert_eq!(
                allocations_per_model_decode(kind, dtype),
                0,
                "model decode on {kind} {dtype}"
            );
        }
    }
    single_sequence_always_takes_the_fast_path();
    short_sessions_stay_small_and_quantized_pools_are_smaller();
    a_model_is_loaded_once_and_drafts_are_views();
}

/// Binding the same model again shares its weights, a draft is a view of the first layers,
/// and the weights go when the last holder does; a model read into memory is shared among
/// those asking for it so, not with a mapped one.
fn a_model_is_loaded_once_and_drafts_are_views() {
    use kvplug_backend_kit::model::{DecoderModel, Residency};
    let tmp = kvplug_backend_kit::testing::tiny_llama("cpu-decode");
    let dir = tmp.path();
    let dev = std::sync::Arc::new(kvplug_cpu::CpuDevice::new());
    let a = DecoderModel::load_shared(dev.clone(), dir, Residency::Mapped).unwrap();
    let before = CountingAllocator::calls();
    let b = DecoderModel::load_shared(dev.clone(), dir, Residency::Mapped).unwrap();
    let draft = b.view(1).unwrap();
    assert!(
        CountingAllocator::calls() - before < 16,
        "sharing loads nothing"
    );
    assert!(a.shares_weights_with(&b) && a.shares_weights_with(&draft));
    assert_eq!((b.n_layers(), draft.n_layers()), (2, 1));
    assert!(b.view(3).is_err() && b.view(0).is_err());
    drop((a, b, draft));
    let c = DecoderModel::load_shared(dev.clone(), dir, Residency::Mapped).unwrap();
    let d = DecoderModel::load_shared(dev.clone(), dir, Residency::Mapped).unwrap();
    assert!(c.shares_weights_with(&d));
    let e = DecoderModel::load_shared(dev.clone(), dir, Residency::Loaded).unwrap();
    let f = DecoderModel::load_shared(dev, dir, Residency::Loaded).unwrap();
    assert!(e.shares_weights_with(&f) && !e.shares_weights_with(&c));
}

/// A whole model decode step — every layer, the cache step, the logits — allocates nothing
/// once warm (activation buffers reused, the step's plan in place), keys rotated or not.
fn allocations_per_model_decode(kind: CacheKind, dtype: KvDtype) -> usize {
    use kvplug_backend_kit::model::{DecoderModel, ModelPackage};
    let tmp = kvplug_backend_kit::testing::tiny_llama("cpu-decode");
    let dir = tmp.path();
    let pkg = ModelPackage::open(dir).unwrap();
    let dev = std::sync::Arc::new(kvplug_cpu::CpuDevice::new());
    let model = DecoderModel::load(dev.clone(), &pkg)
        .unwrap()
        .with_key_basis(KeyBasis::default_for(dtype));
    let cfg = make_config(&pkg.cache_params(), 4096, dtype);
    let mut c = kvplug_backend_kit::KitCache::new(dev, kind, cfg).unwrap();
    let mut acts = None;
    let prompt: Vec<i32> = (0..40).collect();
    model
        .forward(&mut c, &prompt, &prompt, Some(&[39]), false, &mut acts)
        .unwrap();
    let mut decode = |p: i32| {
        let out = model
            .forward(&mut c, &[p % 40], &[p], None, false, &mut acts)
            .unwrap();
        assert!(out.hidden.is_none());
    };
    for p in 40..45 {
        decode(p);
    }
    let before = CountingAllocator::calls();
    for p in 45..85 {
        decode(p);
    }
    CountingAllocator::calls() - before
}

fn single_sequence_always_takes_the_fast_path() {
    for kind in [CacheKind::Contiguous, CacheKind::Seq, CacheKind::Tree] {
        let mut c = cache(kind, config(1, 1024, KvDtype::F16));
        let mut pos = 0;
        for chunk in [7usize, 1, 1, 33, 1, 2, 1] {
            let positions: Vec<i32> = (pos..pos + chunk as i32).collect();
            if kind == CacheKind::Seq {
                c.begin_step(&vec![0; chunk]).unwrap();
            }
            Step::new(chunk).run(&mut c, &positions);
            assert_eq!(
                c.stats().last_plan,
                Some(PlanKind::SingleContiguous),
                "{kind} chunk {chunk}"
            );
            pos += chunk as i32;
        }
    }
}

fn short_sessions_stay_small_and_quantized_pools_are_smaller() {
    let mut bytes = Vec::new();
    for dtype in [KvDtype::F16, KvDtype::Q8_DEFAULT, KvDtype::Q4_DEFAULT] {
        let mut c = cache(CacheKind::Seq, config(2, 32768, dtype));
        let positions: Vec<i32> = (0..100).collect();
        Step::new(100).run(&mut c, &positions);
        let s = c.stats();
        assert!(
            s.pool_cells <= 512,
            "{dtype}: {} cells for 100 tokens",
            s.pool_cells
        );
        assert_eq!((s.live_cells, s.high_water), (100, 100));
        bytes.push(s.allocated_bytes as f64);
    }
    let (q8, q4) = (bytes[1] / bytes[0], bytes[2] / bytes[0]);
    assert!(q8 <= 0.54, "q8/f16 = {q8}");
    assert!(q4 <= 0.32, "q4/f16 = {q4}");
}
