//! The decode hot path of the hybrids: a whole Qwen3.5, LFM2 or Granite 4.0-H decode step —
//! the delta-rule, convolution and Mamba2 layers with their recurrent state, the attention
//! layers, the logits —
//! allocates nothing once warm, on every cache kind (the cpu backend in process).

use std::path::Path;
use std::sync::Arc;

use candle_core::quantized::GgmlDType;
use kvplug_backend_kit::model::{DecoderModel, ModelPackage};
use kvplug_backend_kit::testing::CountingAllocator;
use kvplug_backend_kit::KitCache;
use kvplug_core::config::SURPLUS_ANCHORS;
use kvplug_core::{make_config, CacheKind, KvDtype, ModelCacheSpec};

mod common;
use common::hybrids::{granite, lfm2, qwen35, SMALL_LFM2, VOCAB};

#[global_allocator]
static GLOBAL: CountingAllocator = CountingAllocator;

/// Warm-up decode steps. Each step's state takes an anchor slot, new until the surplus
/// check first frees spare anchors, reused after that; the first check also counts the
/// anchors needed, which can move the second check one step later. Two checks' worth of
/// steps reach the largest number of slots.
const WARM: i32 = (2 * SURPLUS_ANCHORS + 4) as i32;

/// Prefills a 40-token prompt (reading its last row's logits), decodes [`WARM`] steps, then
/// counts the allocations of 40 more steps, each reading its logits.
fn allocations_per_decode(model: &Path, kind: CacheKind) -> usize {
    let pkg = ModelPackage::open(model).unwrap();
    let dev = Arc::new(kvplug_cpu::CpuDevice::new());
    let m = DecoderModel::load(dev.clone(), &pkg).unwrap();
    let params = pkg.cache_params();
    let mut cfg = make_config(&params, 4096, KvDtype::F16);
    let config = std::fs::read(model.join("config.json")).unwrap();
    let config = serde_json::from_slice(&config).unwrap();
    let (l, h, d) = (params.n_layers, params.n_kv_heads, params.head_dim);
    let spec = ModelCacheSpec::from_config(&config, l, h, d).unwrap();
    (cfg.conv, cfg.delta) = (spec.conv().unwrap(), spec.delta().unwrap());
    cfg.ssm = spec.ssm().unwrap();
    let mut c = KitCache::new(dev, kind, cfg).unwrap();
    let mut acts = None;
    let prompt: Vec<i32> = (0..40).map(|i| (i * 37 + 5) % VOCAB as i32).collect();
    let positions: Vec<i32> = (0..40).collect();
    m.forward(&mut c, &prompt, &positions, Some(&[39]), false, &mut acts)
        .unwrap();
    let mut decode = |p: i32| {
        m.forward(&mut c, &[p % 97], &[p], Some(&[0]), false, &mut acts)
            .unwrap();
    };
    for p in 40..40 + WARM {
        decode(p);
    }
    let before = CountingAllocator::calls();
    for p in 40 + WARM..80 + WARM {
        decode(p);
    }
    CountingAllocator::calls() - before
}

#[test]
fn hybrid_decode_steps_allocate_nothing_once_warm() {
    // One test owns the counter (tests in one binary run on parallel threads).
    let dir = tempfile::tempdir().unwrap();
    let models = [
        (
            "qwen35",
            qwen35(&dir.path().join("qwen35"), &[GgmlDType::F32]),
        ),
        ("lfm2", lfm2(&dir.path().join("lfm2"), &SMALL_LFM2)),
        (
            "granite",
            granite(&dir.path().join("granite"), &[GgmlDType::F32]),
        ),
    ];
    for (name, model) in &models {
        for kind in [CacheKind::Contiguous, CacheKind::Seq, CacheKind::Tree] {
            assert_eq!(allocations_per_decode(model, kind), 0, "{name} on {kind}");
        }
    }
}
