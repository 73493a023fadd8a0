//! The decode path records a whole forward without creating anything per op once warm: each
//! op's uniform takes a slot of the uniform ring, its index words a run of the batch's
//! arena, bind groups of the same buffers are reused, and the step's mask and the logits'
//! readback reuse their buffers. The device here is shaped as on a GPU (`gpu_tuning()`),
//! whatever the adapter: lavapipe's own shapes (one projection a dispatch) are what the
//! other tests run.

use std::sync::Arc;

use kvplug_backend_kit::model::{DecoderModel, ModelDevice, ModelPackage};
use kvplug_backend_kit::testing::tiny_llama;
use kvplug_backend_kit::{Backend, Device, KitCache};
use kvplug_core::{make_config, CacheKind, KvDtype};
use kvplug_plugin_api::TensorDtype;
use kvplug_wgpu::context::Tuning;
use kvplug_wgpu::WgpuDevice;

/// A GPU's shapes of the projection kernels: `Tuning::gpu` for an adapter with the storage
/// bindings three projections a dispatch take.
fn gpu_tuning() -> Tuning {
    Tuning::gpu(&wgpu::Limits {
        max_storage_buffers_per_shader_stage: 16,
        ..wgpu::Limits::default()
    })
}

fn gpu_device() -> WgpuDevice {
    WgpuDevice::open_tuned(gpu_tuning()).unwrap_or_else(|e| panic!("no wgpu adapter: {e}"))
}

// The model-device checks (the fused attention inputs among them) with a GPU's shapes.
kvplug_backend_kit::model_device_tests!(gpu_device());

/// The tiny test Llama on a fresh wgpu device with a GPU's shapes (its files are read
/// and removed: the package and model hold what they need).
fn tiny_model(tag: &str) -> (Arc<WgpuDevice>, ModelPackage, DecoderModel<WgpuDevice>) {
    let dev = Arc::new(gpu_device());
    let pkg = ModelPackage::open(tiny_llama(tag).path()).unwrap();
    let model = DecoderModel::load(dev.clone(), &pkg).unwrap();
    (dev, pkg, model)
}

/// Prefill 300 tokens, decode 5 warm-up steps, then count what 40 decode steps create (no
/// pool doubling between 305 and 345 cells: the pool holds 512): no buffer, no bind group
/// and no pipeline (a GPU's kernels built per weight dtype are made by the first steps).
#[test]
fn model_decode_creates_no_buffer_bind_group_or_pipeline_once_warm() {
    let (dev, pkg, model) = tiny_model("wgpu-decode");
    for kind in [CacheKind::Contiguous, CacheKind::Seq, CacheKind::Tree] {
        let cfg = make_config(&pkg.cache_params(), 4096, KvDtype::F16);
        let mut c = KitCache::new(dev.clone(), kind, cfg).unwrap();
        let mut acts = None;
        let prompt: Vec<i32> = (0..300).collect();
        let ids: Vec<i32> = prompt.iter().map(|p| p % 40).collect();
        model
            .forward(&mut c, &ids, &prompt, Some(&[299]), false, &mut acts)
            .unwrap();
        let mut decode = |p: i32| {
            let out = model
                .forward(&mut c, &[p % 40], &[p], None, false, &mut acts)
                .unwrap();
            // The logits come back, as a generation loop reads them every step.
            dev.download(out.logits, kvplug_plugin_api::TensorDtype::F32)
                .unwrap();
        };
        for p in 300..305 {
            decode(p);
        }
        let before = dev.created();
        for p in 305..345 {
            decode(p);
        }
        let after = dev.created();
        assert_eq!(
            (
                after.buffers - before.buffers,
                after.bind_groups - before.bind_groups,
                after.kernels - before.kernels
            ),
            (0, 0, 0),
            "buffers, bind groups and pipelines created by 40 decode steps on {kind}"
        );
    }
}

/// A dropped cache and activation arena take their cached bind groups along (each of those
/// holds its buffers alive), instead of leaving them to the sweep after 256 idle submits.
#[test]
fn dropping_a_cache_and_its_activations_frees_their_bind_groups() {
    let (dev, pkg, model) = tiny_model("wgpu-drop");
    let base = dev.bind_groups_held();
    for kind in [CacheKind::Contiguous, CacheKind::Seq, CacheKind::Tree] {
        let cfg = make_config(&pkg.cache_params(), 4096, KvDtype::Q8 { group: 8 });
        let mut c = KitCache::new(dev.clone(), kind, cfg).unwrap();
        let mut acts = None;
        let prompt: Vec<i32> = (0..40).collect();
        model
            .forward(&mut c, &prompt, &prompt, Some(&[39]), false, &mut acts)
            .unwrap();
        model
            .forward(&mut c, &[7], &[40], None, false, &mut acts)
            .unwrap();
        assert!(
            dev.bind_groups_held() > base,
            "{kind}: the steps cached nothing"
        );
        drop((c, acts));
        assert_eq!(
            dev.bind_groups_held(),
            base,
            "{kind}: bind groups left after the cache and activations were dropped"
        );
    }
}

/// The structure of a warm decode step of the tiny Llama (no biases, no post-norms): the
/// kernels it dispatches per layer and the bytes it reads back. A layer is q, k and v in one
/// dispatch that normalizes its input, rotates q and k and stores the three split into
/// heads (1); the K and V writes, in one dispatch (1); attention over one chunk of keys (1: up to 256 keys),
/// or split over chunks and the merge of the chunks (2); the output projection reading
/// attention's heads as merged and adding into the residual (1); gate and up in one dispatch normalizing its input (1); the down
/// projection of the gated product, adding into the residual (1). Around the layers: the
/// embedding, the final norm, the logit row's gather and the head (4); a greedy step adds
/// the top-k kernel's two phases at k = 1 (2) and reads back 4 bytes, a top-k sampling step
/// the same two phases and `8·k` bytes. Undoing a fusion adds a dispatch per layer and fails it.
#[test]
fn a_decode_step_dispatches_a_bounded_number_of_kernels_per_layer() {
    // A layer with attention over one chunk of keys; past 256 keys it adds the merge.
    const PER_LAYER: u64 = 6;
    const AROUND: u64 = 4;
    let (dev, pkg, model) = tiny_model("wgpu-dispatches");
    let cfg = make_config(&pkg.cache_params(), 4096, KvDtype::F16);
    let mut c = KitCache::new(dev.clone(), CacheKind::Contiguous, cfg).unwrap();
    let mut acts = None;
    let prompt: Vec<i32> = (0..8).collect();
    model
        .forward(&mut c, &prompt, &prompt, Some(&[7]), false, &mut acts)
        .unwrap();
    const K: usize = 8;
    let mut ids = dev.zeros(&[1]).unwrap();
    let mut scratch = dev.zeros(&[1, 2 * K]).unwrap();
    let (mut picked, mut values, mut want) = (Vec::new(), Vec::new(), Vec::new());
    let layers = model.n_layers() as u64;
    let vocab = model.config().vocab_size;
    for p in 8..14 {
        // 0: greedy, 1: whole logits, 2: top-k candidates.
        let mode = p % 3;
        let before = dev.created();
        let out = model
            .forward(&mut c, &[3], &[p], None, false, &mut acts)
            .unwrap();
        match mode {
            0 => dev.argmax_rows(out.logits, &mut ids, &mut picked).unwrap(),
            1 => drop(dev.download(out.logits, TensorDtype::F32).unwrap()),
            _ => dev
                .top_k_rows(out.logits, K, &mut scratch, &mut picked, &mut values)
                .unwrap(),
        }
        let after = dev.created();
        assert_eq!(
            after.dispatches - before.dispatches,
            PER_LAYER * layers + AROUND + [2, 0, 2][mode as usize],
            "dispatches of a decode step over {layers} layers"
        );
        // The step's first batch goes to the device after `first_submit` (8) dispatches,
        // not at its readback: at least one submit before the one the read makes.
        assert!(
            after.submits - before.submits >= 2,
            "a decode step of {} dispatches submitted {} batches",
            after.dispatches - before.dispatches,
            after.submits - before.submits
        );
        let read = after.read_back_bytes - before.read_back_bytes;
        let logits = || {
            dev.download(out.logits, TensorDtype::F32)
                .unwrap()
                .to_f32()
                .unwrap()
        };
        match mode {
            0 => {
                assert_eq!(read, 4, "a greedy step reads back its token");
                assert_eq!(picked, [kvplug_core::argmax(&logits())]);
            }
            1 => assert_eq!(read, 4 * vocab as u64, "a step reads back its logits"),
            _ => {
                assert_eq!(read, 8 * K as u64, "a top-k step reads back its candidates");
                kvplug_core::top_k(&logits(), K, &mut want);
                assert!(picked.iter().copied().eq(want.iter().map(|c| c.0)));
                assert!(values.iter().copied().eq(want.iter().map(|c| c.1)));
            }
        }
    }
    // Past one chunk of keys: a greedy step at position 300.
    let fill: Vec<i32> = (14..300).map(|p| p % vocab as i32).collect();
    let at: Vec<i32> = (14..300).collect();
    model
        .forward(
            &mut c,
            &fill,
            &at,
            Some(&[fill.len() - 1]),
            false,
            &mut acts,
        )
        .unwrap();
    let before = dev.created();
    let out = model
        .forward(&mut c, &[3], &[300], None, false, &mut acts)
        .unwrap();
    dev.argmax_rows(out.logits, &mut ids, &mut picked).unwrap();
    assert_eq!(
        dev.created().dispatches - before.dispatches,
        (PER_LAYER + 1) * layers + AROUND + 2,
        "dispatches of a decode step past 256 keys over {layers} layers"
    );
}

/// The structure of a prefill step of the tiny Llama (20 tokens, past `rows_tokens`: the
/// tiled product): per layer q, k and v in one tiled dispatch normalizing its input (1), the
/// rotations of q and k and the head split of v (3), the K and V writes (1), attention (1),
/// the output projection (1), gate and up in one tiled dispatch (1), the down projection
/// (1); around the layers the embedding, the final norm, the logit row's gather and the
/// head (4). Running q, k and v (or gate and up) as dispatches of their own adds two (one) a
/// layer and fails it.
#[test]
fn a_prefill_step_runs_the_projections_of_one_input_as_one_tiled_dispatch() {
    const PER_LAYER: u64 = 9;
    const AROUND: u64 = 4;
    let (dev, pkg, model) = tiny_model("wgpu-prefill-dispatches");
    let cfg = make_config(&pkg.cache_params(), 4096, KvDtype::F16);
    let mut c = KitCache::new(dev.clone(), CacheKind::Contiguous, cfg).unwrap();
    let mut acts = None;
    let prompt: Vec<i32> = (0..20).collect();
    assert!(prompt.len() > gpu_tuning().rows_tokens);
    let before = dev.created();
    model
        .forward(&mut c, &prompt, &prompt, Some(&[19]), false, &mut acts)
        .unwrap();
    let layers = model.n_layers() as u64;
    assert_eq!(
        dev.created().dispatches - before.dispatches,
        PER_LAYER * layers + AROUND,
        "dispatches of a 20-token prefill over {layers} layers"
    );
}

/// A GPU's shapes (three projections a dispatch, RoPE and the head split in the q/k/v
/// kernel), with and without subgroup sums and with the wide tiled product, and the
/// adapter's own give the same logits over
/// a prefill and decode steps, to the 1e-3 the backends are held to against each other
/// (summation orders differ).
#[test]
fn a_gpus_kernel_shapes_give_the_adapters_logits() {
    let (gpu, pkg, gpu_model) = tiny_model("wgpu-shapes");
    let plain = WgpuDevice::open_tuned(Tuning {
        subgroups: false,
        ..gpu_tuning()
    });
    let plain = Arc::new(plain.expect("a wgpu adapter"));
    let plain_model = DecoderModel::load(plain.clone(), &pkg).unwrap();
    let own = Arc::new(WgpuDevice::open().expect("a wgpu adapter"));
    let own_model = DecoderModel::load(own.clone(), &pkg).unwrap();
    let wide = WgpuDevice::open_tuned(Tuning {
        wide: true,
        ..gpu_tuning()
    });
    let wide = Arc::new(wide.expect("a wgpu adapter"));
    let wide_model = DecoderModel::load(wide.clone(), &pkg).unwrap();
    assert!(
        gpu.features().contains(&"subgroups".to_string())
            && !plain.features().contains(&"subgroups".to_string()),
        "the adapter (lavapipe in CI) has subgroup operations and the plain device does \
         not use them"
    );
    let cfg = make_config(&pkg.cache_params(), 4096, KvDtype::F16);
    let devices = [
        (gpu, gpu_model),
        (plain, plain_model),
        (own, own_model),
        (wide, wide_model),
    ];
    let mut runs = devices.map(|(dev, model)| {
        let cache = KitCache::new(dev.clone(), CacheKind::Contiguous, cfg).unwrap();
        (dev, model, cache, None)
    });
    // 70 tokens: past the first 64 of a wide tile, which its invocations' second token
    // halves take.
    let prompt: Vec<i32> = (0..70).map(|i| (i * 7) % 40).collect();
    let mut steps: Vec<(Vec<i32>, Vec<i32>)> = vec![(prompt, (0..70).collect())];
    steps.extend((70..74).map(|p| (vec![(p * 11) % 40], vec![p])));
    for (ids, positions) in &steps {
        let last = Some(&[ids.len() - 1][..]);
        let [a, b, c, d] = runs.each_mut().map(|(dev, model, cache, acts)| {
            let out = model
                .forward(cache, ids, positions, last, false, acts)
                .unwrap();
            let logits = dev.download(out.logits, TensorDtype::F32).unwrap();
            logits.to_f32().unwrap()
        });
        let worst = [&b, &c, &d]
            .iter()
            .flat_map(|o| a.iter().zip(o.iter()))
            .map(|(x, y)| (x - y).abs())
            // A NaN is the worst (f32::max would skip it).
            .fold(0.0, |m: f32, d| if d > m || d.is_nan() { d } else { m });
        assert!(
            worst < 1e-3,
            "step at {positions:?}: logits differ by {worst}"
        );
    }
}

/// Kernel shapes the projection kernels cannot take are refused when the device opens.
#[test]
fn a_tuning_the_kernels_cannot_take_is_refused() {
    for bad in [
        Tuning {
            ways: 2,
            ..gpu_tuning()
        },
        Tuning {
            group: 96,
            ..gpu_tuning()
        },
        Tuning {
            group: 512,
            ..gpu_tuning()
        },
        Tuning {
            lane_steps: 0,
            ..gpu_tuning()
        },
        Tuning {
            max_lanes: 48,
            ..gpu_tuning()
        },
        Tuning {
            min_lanes: 3,
            ..gpu_tuning()
        },
        Tuning {
            min_lanes: 512,
            ..gpu_tuning()
        },
        // Past the workgroups a dispatch dimension may count (rows_main's grid has one
        // workgroup row a token).
        Tuning {
            rows_tokens: 1 << 20,
            ..gpu_tuning()
        },
    ] {
        let err = WgpuDevice::open_tuned(bad).err().expect("refused");
        assert!(err.contains("projections take 1 way"), "{bad:?}: {err}");
    }
}
