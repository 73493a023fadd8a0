//! Opening the adapter and device, the compute pipelines built once per device, and the
//! recorder that batches ops into submissions without creating anything per op.

use std::collections::HashMap;
use std::num::NonZeroU64;
use std::ops::Deref;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};

use wgpu::util::DeviceExt;

use crate::model::WEIGHT_DTYPES;
use crate::profile::Profile;

/// Adapter, device, queue and the kernels.
pub struct Context {
    /// The device.
    pub device: wgpu::Device,
    /// Its queue.
    pub queue: wgpu::Queue,
    /// What the adapter is.
    pub info: wgpu::AdapterInfo,
    /// Features the adapter offers.
    pub adapter_features: wgpu::Features,
    /// Limits the device was created with (the adapter's).
    pub limits: wgpu::Limits,
    /// How the projection kernels are shaped for this adapter.
    pub tuning: Tuning,
    /// Whether `rows_main` reduces with subgroup operations (the tuning asks for them and
    /// the adapter has them).
    pub subgroups: bool,
    attention: OnceLock<Kernels<6>>,
    rows: OnceLock<Kernels<3>>,
    model: OnceLock<Kernels<{ MODEL_ENTRIES.len() }>>,
    project: OnceLock<Kernels<3>>,
    /// `project`'s kernels built for one weight dtype, by its flag.
    project_by_dtype: [OnceLock<Kernels<3>>; WEIGHT_DTYPES],
    /// Bytes between uniform ring slots (the adapter's dynamic offset alignment).
    slot: usize,
    recorder: Arc<Mutex<Recorder>>,
    /// The buffer bound to slots an op does not use.
    unused: OnceLock<wgpu::Buffer>,
    /// The staging buffer of readbacks, grown on demand; its lock serialises readbacks.
    readback: Mutex<Option<wgpu::Buffer>>,
    buffers_created: AtomicU64,
    bind_groups_created: AtomicU64,
    kernels_built: AtomicU64,
    dispatches: AtomicU64,
    read_back: AtomicU64,
    /// `KVPLUG_WGPU_TRACE`: what the readbacks since the last line cost, printed every 64.
    trace: Option<Mutex<Trace>>,
}

/// The counters of `KVPLUG_WGPU_TRACE` (set to anything): every 64 readbacks one line on
/// stderr with the dispatches, submits, time waiting for the device and wall time since
/// the last line, which tells a device-bound step from a host-bound one.
struct Trace {
    since: std::time::Instant,
    reads: u64,
    waited: std::time::Duration,
    dispatches: u64,
    submits: u64,
}

/// Ops recorded in one batch before it is submitted without waiting for a read: the uniform
/// ring holds one slot per op of the batch.
const RING_SLOTS: usize = 1024;

/// The most dispatches recorded before the batch is submitted without waiting for a read, so
/// that the device runs a step's first layers while the host records the rest (the device
/// otherwise starts only at the step's readback). A step's first batch is submitted sooner,
/// after `Tuning::first_submit` dispatches, and each next one after twice as many as the
/// last, up to this.
const SUBMIT_AFTER: u32 = 64;

/// The largest uniform of any module (`AttnParams`, 64 bytes).
const MAX_PARAMS: usize = 64;

/// Submits a cached bind group may go unused before it is dropped (with the buffers it
/// holds): long enough for a draft model's steps between two target verifies (a step of
/// `n` dispatches submits about log2(SUBMIT_AFTER / first_submit) + n / SUBMIT_AFTER times:
/// 5 for a 0.5B model's 148 on a GPU).
const KEEP_SUBMITS: u64 = 256;

/// What a [`Context`] has created, dispatched and read back since it opened: the counters
/// that make a step's structure visible (a warm decode step creates nothing, dispatches a
/// bounded number of kernels per layer and reads back only what the caller asked for).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Created {
    /// Buffers of every kind: pools, activations, weights, staging, the recorder's own.
    pub buffers: u64,
    /// Bind groups (each cached one counts once).
    pub bind_groups: u64,
    /// Compute pipelines compiled (each module's once, on first use).
    pub kernels: u64,
    /// Compute dispatches recorded.
    pub dispatches: u64,
    /// Bytes copied back to the host.
    pub read_back_bytes: u64,
    /// Batches submitted.
    pub submits: u64,
}

/// What one storage binding of an op holds (see [`Context::dispatch`]).
#[derive(Clone, Copy)]
pub enum Bind<'a> {
    /// A buffer, whole.
    Buffer(&'a wgpu::Buffer),
    /// The batch's index-word arena, where the op's words are.
    Words,
    /// The context's scratch buffer, at least this many bytes: contents do not outlive the op.
    Scratch(u64),
    /// The context's buffer of a split tiled product's sums, at least this many bytes: as
    /// `Scratch`, a buffer of its own (an op may bind both writable).
    Partials(u64),
    /// Nothing the op reads (a shared 4-byte buffer).
    Unused,
}

/// The most storage bindings of any module (project's thirteen, with three ways).
const MAX_STORAGE_SLOTS: usize = 13;

/// A cached bind group: its layout and the buffers of its storage slots (the uniform slot is
/// always the ring). Holding the buffers keeps their addresses, the key's identity, unique.
#[derive(PartialEq, Eq, Hash)]
struct BindKey {
    layout: wgpu::BindGroupLayout,
    ring: wgpu::Buffer,
    slots: [Option<wgpu::Buffer>; MAX_STORAGE_SLOTS],
}

/// A buffer that takes the cached bind groups holding it along when it is dropped, so its
/// memory is freed once the commands using it have run rather than when the cache would
/// next sweep them (pools, scratch, activations and weights are made as these).
pub struct OwnedBuffer {
    buf: wgpu::Buffer,
    recorder: Weak<Mutex<Recorder>>,
}

impl Deref for OwnedBuffer {
    type Target = wgpu::Buffer;
    fn deref(&self) -> &wgpu::Buffer {
        &self.buf
    }
}

impl Drop for OwnedBuffer {
    fn drop(&mut self) {
        if let Some(r) = self.recorder.upgrade() {
            lock(&r).forget(&self.buf);
        }
    }
}

/// The recorder, taken even where a thread panicked holding it (as every lock here is).
fn lock<T>(r: &Mutex<T>) -> MutexGuard<'_, T> {
    r.lock().unwrap_or_else(|p| p.into_inner())
}

/// The batch being recorded and the host data its ops read, uploaded when it is submitted.
struct Recorder {
    /// The compute pass the batch's dispatches go to, open until a copy or the submit
    /// (wgpu orders the dispatches of one pass as it orders passes). Declared before the
    /// encoder so that it ends first when the recorder drops.
    pass: Option<wgpu::ComputePass<'static>>,
    encoder: Option<wgpu::CommandEncoder>,
    /// Each op's uniform, one ring slot each.
    params: Vec<u8>,
    /// Index words of the batch's ops (cells, positions, token ids, RoPE frequencies).
    words: Vec<u32>,
    ring: wgpu::Buffer,
    arena: wgpu::Buffer,
    scratch: wgpu::Buffer,
    partials: wgpu::Buffer,
    /// Bind groups by the buffers they bind, and the submit that last used each.
    bind_groups: HashMap<BindKey, (wgpu::BindGroup, u64)>,
    submits: u64,
    /// Dispatches in the batch.
    pending: u32,
    /// Dispatches after which the batch is submitted: `Tuning::first_submit` after a flush,
    /// doubling at each submit it makes, up to [`SUBMIT_AFTER`].
    submit_at: u32,
    /// `KVPLUG_WGPU_PROFILE`'s timestamps, when asked for.
    profile: Option<Profile>,
}

impl Recorder {
    fn arena_words(&self) -> usize {
        (self.arena.size() / 4) as usize
    }

    /// The batch's encoder, its open compute pass ended first.
    fn encoder(&mut self, device: &wgpu::Device) -> &mut wgpu::CommandEncoder {
        self.pass = None;
        self.encoder.get_or_insert_with(|| {
            device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None })
        })
    }

    /// The batch's compute pass, begun if none is open.
    fn pass(&mut self, device: &wgpu::Device) -> &mut wgpu::ComputePass<'static> {
        if self.pass.is_none() {
            let pass = self
                .encoder(device)
                .begin_compute_pass(&wgpu::ComputePassDescriptor {
                    label: None,
                    timestamp_writes: None,
                })
                .forget_lifetime();
            self.pass = Some(pass);
        }
        self.pass.as_mut().expect("begun above")
    }

    /// Uploads the batch's uniforms and words, submits its commands, and drops the bind
    /// groups unused for [`KEEP_SUBMITS`] submits.
    fn submit(&mut self, device: &wgpu::Device, queue: &wgpu::Queue) {
        self.pass = None;
        let Some(mut enc) = self.encoder.take() else {
            return;
        };
        if let Some(p) = &self.profile {
            p.resolve(&mut enc);
        }
        if !self.params.is_empty() {
            queue.write_buffer(&self.ring, 0, &self.params);
        }
        if !self.words.is_empty() {
            queue.write_buffer(&self.arena, 0, bytemuck::cast_slice(&self.words));
        }
        queue.submit([enc.finish()]);
        if let Some(p) = &mut self.profile {
            p.collect(device);
        }
        self.params.clear();
        self.words.clear();
        self.pending = 0;
        self.submits += 1;
        let now = self.submits;
        self.bind_groups
            .retain(|_, (_, used)| now - *used <= KEEP_SUBMITS);
    }

    fn forget(&mut self, buffer: &wgpu::Buffer) {
        self.bind_groups
            .retain(|k, _| !k.slots.iter().flatten().any(|b| b == buffer));
    }

    /// The bind group of `slots` for `kernels`, made on first use.
    fn bind_group<const N: usize>(
        &mut self,
        ctx: &Context,
        kernels: &Kernels<N>,
        slots: &[Bind<'_>],
    ) -> wgpu::BindGroup {
        let buffer = |b: &Bind<'_>| match *b {
            Bind::Buffer(buf) => buf.clone(),
            Bind::Words => self.arena.clone(),
            Bind::Scratch(_) => self.scratch.clone(),
            Bind::Partials(_) => self.partials.clone(),
            Bind::Unused => ctx.unused().clone(),
        };
        let mut key = BindKey {
            layout: kernels.layout.clone(),
            ring: self.ring.clone(),
            slots: Default::default(),
        };
        for (k, b) in key.slots.iter_mut().zip(slots) {
            *k = Some(buffer(b));
        }
        let now = self.submits;
        if let Some((bg, used)) = self.bind_groups.get_mut(&key) {
            *used = now;
            return bg.clone();
        }
        let ring = wgpu::BindGroupEntry {
            binding: 0,
            resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                buffer: &key.ring,
                offset: 0,
                size: Some(kernels.params_size),
            }),
        };
        let entries: Vec<wgpu::BindGroupEntry> = std::iter::once(ring)
            .chain(
                key.slots
                    .iter()
                    .flatten()
                    .enumerate()
                    .map(|(i, b)| wgpu::BindGroupEntry {
                        binding: i as u32 + 1,
                        resource: b.as_entire_binding(),
                    }),
            )
            .collect();
        ctx.bind_groups_created.fetch_add(1, Ordering::Relaxed);
        let bg = ctx.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: None,
            layout: &kernels.layout,
            entries: &entries,
        });
        self.bind_groups.insert(key, (bg.clone(), now));
        bg
    }
}

/// Entry points of `attention.wgsl`, in the order of [`Context::attention`]'s pipelines.
pub const ATTENTION_ENTRIES: [&str; 6] = [
    "scores_main",
    "softmax_main",
    "output_main",
    "quantize_main",
    "flash_main",
    "combine_main",
];

/// Entry points of `model.wgsl`, in the order of [`Context::model`]'s pipelines.
pub const MODEL_ENTRIES: [&str; 13] = [
    "gather_main",
    "rmsnorm_main",
    "rope_heads_main",
    "rope_main",
    "heads_main",
    "silu_main",
    "add_main",
    "embed_main",
    "gelu_main",
    "scale_main",
    "hadamard_main",
    "topk_main",
    "adjust_main",
];

/// Entry points of `project.wgsl`, in the order of [`Context::project`]'s pipelines: the
/// tiled product's as [`Tuning::wide`] says.
fn project_entries(wide: bool) -> [&'static str; 3] {
    let tiled = if wide {
        "linear_wide_main"
    } else {
        "linear_main"
    };
    ["rows_main", tiled, "splits_main"]
}

/// Storage bindings the three-way projection module needs (input, norm or up, index
/// words, a split product's sums, and a weight, an output and a bias per projection).
const THREE_WAY_BINDINGS: u32 = 13;

/// How the projection kernels (project.wgsl) are shaped for an adapter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tuning {
    /// Projections one dispatch computes (1 or 3: q/k/v, gate/up).
    pub ways: usize,
    /// Invocations in a workgroup of `rows_main` (its `GROUP`; a power of two, at most 256).
    pub group: u32,
    /// Steps a lane of a decode projection takes along its row.
    pub lane_steps: u32,
    /// The most lanes a row of a decode projection takes (a power of two; the workgroup's
    /// `group` where larger).
    pub max_lanes: u32,
    /// The fewest lanes a row of a decode projection takes (a power of two, at most
    /// `max_lanes`). (On an H200, 2026-12-04, a build flooring at 1 rather than 8 gave the
    /// Qwen2.5-0.5B shape's head 4 lanes and 1.04x greedy tg128, SmolLM2's 2 and 0.98x, in
    /// one call: 8 stays until measured again.)
    pub min_lanes: u32,
    /// Whether `rows_main` adds its lanes' sums with subgroup operations where the adapter
    /// has them (`Features::SUBGROUP`), rather than through workgroup memory alone.
    pub subgroups: bool,
    /// The most tokens a projection computes with `rows_main` (several invocations an
    /// output row); more take `linear_main`, the tiled product. A rows_main dispatch
    /// reads the weights once per token, the tiled one once per 64 tokens.
    pub rows_tokens: usize,
    /// Whether a dispatch whose weights share a dtype runs kernels built for it
    /// ([`Context::project`]): a GPU's compiler then drops the other dtypes' branches; on a
    /// CPU adapter each dtype's build costs about a second of compiling for little gain.
    pub by_dtype: bool,
    /// Dispatches recorded after a flush (a readback or a host write: at least once a step)
    /// before the batch is first submitted (1 to [`SUBMIT_AFTER`]): the device idles until
    /// then, so fewer start it sooner, and later submits wait for twice as many as the last.
    pub first_submit: u32,
    /// Whether `rows_main` stages its token's input in workgroup memory, made once per
    /// workgroup, where the op makes it (x·norm, gated or merged heads) and a workgroup
    /// computes several rows, rather than each lane making the values it reads. (On an H200,
    /// 2026-12-04: staged everywhere, the Qwen2.5-0.5B shape's gate/up took 30.4 µs rather
    /// than 33.8, its down projection, one row a workgroup, 30.9 rather than 22.6 and the
    /// head, a plain input, 221 rather than 178.)
    pub stage: bool,
    /// Invocations a decode projection should have at least a token: rows take more lanes
    /// (fewer steps each, down to one) until it has (0: `lane_steps` alone decides).
    pub threads: u32,
    /// Workgroups a tiled product (`linear_main`) should have at least: one with fewer
    /// tiles splits its inner dimension into parts (doubling them while each keeps at least
    /// `model::SPLIT_STEPS` steps and their sums fit a binding, then as few as cover the
    /// steps), a second pass adding the parts' sums (0: never split). Off on every adapter
    /// until measured on a GPU (`tiles=N` tries it): an H200 profile (2026-12-04,
    /// Qwen2.5-0.5B shape, pp512) had the 896-row products on 112 workgroups, under one an
    /// SM, the down projection's 152 steps each.
    pub tiles: u32,
    /// Whether the tiled product is `linear_wide_main` (128 × 128 outputs a workgroup, 8 × 8
    /// an invocation) rather than `linear_main` (64 × 64, 4 × 4): four times the products
    /// per read of workgroup memory, a quarter of the workgroups. Off on every adapter
    /// until measured on a GPU (`wide=1` tries it; pair it with `tiles=N` where a
    /// projection's rows are few).
    pub wide: bool,
}

impl Tuning {
    /// A CPU adapter's (lavapipe): it runs a workgroup's invocations in turn, so few
    /// invocations with long loops (32 steps: 32 spans of a block-format row, which leaves
    /// most rows 8 lanes; SmolLM2 Q4_1 decoded at 1.61 tok/s so, 1.56 with 32 quads a
    /// lane), and one projection a dispatch (choosing a projection's
    /// binding at each load costs it about as much as the loads). From 3 tokens on, the
    /// tiled product: there a dispatch of it costs about 2.3 tokens of `rows_main`, whatever
    /// its tokens up to 64 (a 15-token SmolLM2 prefill ran 4.6x faster than with 16).
    pub const CPU: Tuning = Tuning {
        ways: 1,
        group: 64,
        lane_steps: 32,
        max_lanes: 64,
        min_lanes: 8,
        rows_tokens: 2,
        subgroups: true,
        by_dtype: false,
        first_submit: SUBMIT_AFTER,
        stage: false,
        threads: 0,
        tiles: 0,
        wide: false,
    };

    /// These shapes with the fields `spec` names changed (`KVPLUG_WGPU_TUNING`, for trying
    /// shapes on a GPU: comma-separated `ways=N`, `group=N`, `lane_steps=N`, `max_lanes=N`,
    /// `min_lanes=N`,
    /// `rows_tokens=N`, `subgroups=0|1`, `by_dtype=0|1`, `first_submit=N`, `stage=0|1`,
    /// `threads=N`, `tiles=N`, `wide=0|1`).
    fn with(mut self, spec: &str) -> Result<Tuning, String> {
        for field in spec.split(',').map(str::trim).filter(|f| !f.is_empty()) {
            let bad = || {
                format!(
                    "KVPLUG_WGPU_TUNING: {field:?} is not ways=N, group=N, lane_steps=N, \
                     max_lanes=N, min_lanes=N, rows_tokens=N, subgroups=0|1, by_dtype=0|1, \
                     first_submit=N, stage=0|1, threads=N, tiles=N or wide=0|1"
                )
            };
            let (name, value) = field.split_once('=').ok_or_else(bad)?;
            let n: u32 = value.trim().parse().map_err(|_| bad())?;
            match name.trim() {
                "ways" => self.ways = n as usize,
                "group" => self.group = n,
                "lane_steps" => self.lane_steps = n,
                "max_lanes" => self.max_lanes = n,
                "min_lanes" => self.min_lanes = n,
                "rows_tokens" => self.rows_tokens = n as usize,
                "subgroups" if n <= 1 => self.subgroups = n == 1,
                "by_dtype" if n <= 1 => self.by_dtype = n == 1,
                "first_submit" => self.first_submit = n,
                "stage" if n <= 1 => self.stage = n == 1,
                "threads" => self.threads = n,
                "tiles" => self.tiles = n,
                "wide" if n <= 1 => self.wide = n == 1,
                _ => return Err(bad()),
            }
        }
        Ok(self)
    }

    /// Whether the kernels can take these shapes on an adapter of `limits`.
    fn check(&self, limits: &wgpu::Limits) -> Result<(), String> {
        let fits = match self.ways {
            1 => true,
            3 => limits.max_storage_buffers_per_shader_stage >= THREE_WAY_BINDINGS,
            _ => false,
        };
        if !fits
            || !self.group.is_power_of_two()
            || !(8..=256).contains(&self.group)
            || self.lane_steps == 0
            || !self.max_lanes.is_power_of_two()
            || self.max_lanes < 8
            || !self.min_lanes.is_power_of_two()
            || self.min_lanes > self.max_lanes
            || self.rows_tokens > limits.max_compute_workgroups_per_dimension as usize
            || !(1..=SUBMIT_AFTER).contains(&self.first_submit)
        {
            return Err(format!(
                "{self:?}: projections take 1 way, or 3 with {THREE_WAY_BINDINGS} storage \
                 bindings a stage; a workgroup a power of two from 8 to 256; a step a lane; \
                 from min_lanes to max_lanes lanes a row, powers of two, max_lanes from 8; \
                 rows_main at most {} tokens (a \
                 workgroup row each); a first submit after 1 to {SUBMIT_AFTER} dispatches",
                limits.max_compute_workgroups_per_dimension
            ));
        }
        Ok(())
    }

    /// A GPU's: memory latency is hidden only by many short chains of loads, so 256
    /// invocations a workgroup, at most eight steps a lane and at least 65,536 invocations
    /// a dispatch, and three projections a dispatch where the adapter allows
    /// [`THREE_WAY_BINDINGS`] storage bindings a stage. (On an H200, 2026-12-04, greedy
    /// tg128 of the Qwen2.5-0.5B, 1.5B and SmolLM2 shapes: 65,536 invocations gave 1.14x,
    /// 1.13x and 1.26x of none (steps alone), 32,768 1.08x, 1.09x, 1.19x and 131,072 1.12x,
    /// 1.15x, 1.27x; with four steps a lane rather than eight, 0.99x, 0.85x and 1.01x of
    /// 65,536 alone.)
    pub fn gpu(limits: &wgpu::Limits) -> Tuning {
        let three = limits.max_storage_buffers_per_shader_stage >= THREE_WAY_BINDINGS;
        Tuning {
            ways: if three { 3 } else { 1 },
            group: 256,
            lane_steps: 8,
            max_lanes: 256,
            min_lanes: 8,
            rows_tokens: 16,
            subgroups: true,
            by_dtype: true,
            first_submit: 8,
            stage: true,
            threads: 1 << 16,
            tiles: 0,
            wide: false,
        }
    }
}

/// `project.wgsl` for `ways` projections a dispatch, after `weights.wgsl`: the weight
/// (16-byte units, as weights are padded to), output and bias bindings from 5 on, and the
/// accessors of projection `sel`'s; then its sums, with subgroup operations
/// (`reduce_subgroup.wgsl`) or without.
fn project_source(ways: usize, subgroups: bool) -> String {
    // Naga takes subgroup built-ins from a device with `Features::SUBGROUP` without the
    // `enable subgroups;` directive, which it refuses (wgpu 30).
    let mut s = String::from(include_str!("shaders/weights.wgsl"));
    let mut decls = String::new();
    for (k, (name, access, ty)) in [
        ("w", "read", "vec4<u32>"),
        ("out", "read_write", "f32"),
        ("bias", "read", "f32"),
    ]
    .into_iter()
    .enumerate()
    {
        for w in 0..ways {
            decls += &format!(
                "@group(0) @binding({}) var<storage, {access}> {name}{w}: array<{ty}>;\n",
                5 + k * ways + w
            );
        }
    }
    // The body of an accessor: `f(w)` for projection `sel`.
    let pick = |f: &dyn Fn(usize) -> String| match ways {
        1 => f(0),
        _ => format!(
            "switch sel {{ {} default: {{ {} }} }}",
            (1..ways)
                .map(|w| format!("case {w}u: {{ {} }}", f(w)))
                .collect::<String>(),
            f(0)
        ),
    };
    decls += &format!(
        "fn wb(i: u32) -> u32 {{ {} }}\n\
         fn wq(i: u32) -> vec4<u32> {{ {} }}\n\
         fn out_get(i: u32) -> f32 {{ {} }}\n\
         fn out_set(i: u32, v: f32) {{ {} }}\n\
         fn bias_at(i: u32) -> f32 {{ {} }}\n",
        pick(&|w| format!("return w{w}[i >> 2u][i & 3u];")),
        pick(&|w| format!("return w{w}[i];")),
        pick(&|w| format!("return out{w}[i];")),
        pick(&|w| format!("out{w}[i] = v;")),
        pick(&|w| format!("return bias{w}[i];")),
    );
    s += &include_str!("shaders/project.wgsl").replace("//@WAYS\n", &decls);
    s += match subgroups {
        true => include_str!("shaders/reduce_subgroup.wgsl"),
        false => include_str!("shaders/reduce_workgroup.wgsl"),
    };
    s
}

/// Pipelines of one shader module sharing one bind-group layout: binding 0 is the uniform
/// (bound at a dynamic offset), the others storage buffers.
pub struct Kernels<const N: usize> {
    /// The layout every pipeline of the module uses.
    pub layout: wgpu::BindGroupLayout,
    /// One pipeline per entry point, in the order given.
    pub pipelines: [wgpu::ComputePipeline; N],
    /// The entry points' names, in the same order.
    names: [&'static str; N],
    /// Bytes of the module's uniform.
    params_size: NonZeroU64,
}

/// Binding kinds of a module's bind group, in binding order.
#[derive(Clone, Copy)]
enum Slot {
    Uniform,
    Read,
    ReadWrite,
}

/// Picks the adapter: `WGPU_ADAPTER_NAME` (substring, case-insensitive) when set, else the
/// default adapter for the backends `WGPU_BACKEND` allows.
async fn pick_adapter(instance: &wgpu::Instance) -> Result<wgpu::Adapter, String> {
    if let Ok(want) = std::env::var("WGPU_ADAPTER_NAME") {
        let want_lc = want.to_lowercase();
        let adapters = instance.enumerate_adapters(wgpu::Backends::all()).await;
        let names: Vec<String> = adapters.iter().map(|a| a.get_info().name).collect();
        return adapters
            .into_iter()
            .find(|a| a.get_info().name.to_lowercase().contains(&want_lc))
            .ok_or_else(|| {
                format!(
                    "no adapter matches WGPU_ADAPTER_NAME={want} (found: {})",
                    names.join(", ")
                )
            });
    }
    instance
        .request_adapter(&wgpu::RequestAdapterOptions {
            power_preference: wgpu::PowerPreference::from_env().unwrap_or_default(),
            ..Default::default()
        })
        .await
        .map_err(|e| format!("no adapter: {e}"))
}

impl Context {
    /// The pipelines of `entries` in one module of `source` (counted in `kernels_built`),
    /// bound by `layout` where given (another module's, binding as it does), else by a
    /// layout of `slots`.
    fn kernels<const N: usize>(
        &self,
        label: &str,
        source: &str,
        (params_size, slots): (usize, &[Slot]),
        entries: [&'static str; N],
        compilation_options: wgpu::PipelineCompilationOptions<'_>,
        layout: Option<&wgpu::BindGroupLayout>,
    ) -> Kernels<N> {
        let device = &self.device;
        self.kernels_built.fetch_add(N as u64, Ordering::Relaxed);
        assert!(params_size <= MAX_PARAMS && params_size % 16 == 0);
        let params_size = NonZeroU64::new(params_size as u64).expect("a uniform has fields");
        let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
            label: Some(label),
            source: wgpu::ShaderSource::Wgsl(source.into()),
        });
        let layout = layout.cloned().unwrap_or_else(|| {
            let layout_entries: Vec<wgpu::BindGroupLayoutEntry> = slots
                .iter()
                .enumerate()
                .map(|(i, s)| wgpu::BindGroupLayoutEntry {
                    binding: i as u32,
                    visibility: wgpu::ShaderStages::COMPUTE,
                    ty: wgpu::BindingType::Buffer {
                        ty: match s {
                            Slot::Uniform => wgpu::BufferBindingType::Uniform,
                            Slot::Read => wgpu::BufferBindingType::Storage { read_only: true },
                            Slot::ReadWrite => {
                                wgpu::BufferBindingType::Storage { read_only: false }
                            }
                        },
                        has_dynamic_offset: matches!(s, Slot::Uniform),
                        min_binding_size: matches!(s, Slot::Uniform).then_some(params_size),
                    },
                    count: None,
                })
                .collect();
            device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
                label: Some(label),
                entries: &layout_entries,
            })
        });
        let pipeline_layout = device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
            label: Some(label),
            bind_group_layouts: &[Some(&layout)],
            immediate_size: 0,
        });
        let pipelines = entries.map(|entry| {
            device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(entry),
                layout: Some(&pipeline_layout),
                module: &module,
                entry_point: Some(entry),
                compilation_options: compilation_options.clone(),
                cache: None,
            })
        });
        Kernels {
            layout,
            pipelines,
            names: entries,
            params_size,
        }
    }

    /// Opens the adapter (honouring `WGPU_BACKEND` / `WGPU_ADAPTER_NAME`), the device with
    /// the adapter's limits — where `max_binding` is given, storage bindings capped at that
    /// many bytes and at 8 a stage (WebGPU's default count), as a smaller adapter's would be
    /// — and builds the kernels, shaped by `tuning` where given (else the adapter's kind's:
    /// [`Tuning::CPU`] or [`Tuning::gpu`]).
    pub fn open(max_binding: Option<u64>, tuning: Option<Tuning>) -> Result<Self, String> {
        let instance =
            wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle_from_env());
        let adapter = pollster::block_on(pick_adapter(&instance))?;
        let info = adapter.get_info();
        let mut limits = adapter.limits();
        if let Some(cap) = max_binding {
            let l = &mut limits.max_storage_buffer_binding_size;
            *l = (*l).min(cap);
            let n = &mut limits.max_storage_buffers_per_shader_stage;
            *n = (*n).min(8);
        }
        let default = match info.device_type {
            wgpu::DeviceType::Cpu => Tuning::CPU,
            _ => Tuning::gpu(&limits),
        };
        let tuning = match tuning {
            Some(t) => t,
            None => match std::env::var("KVPLUG_WGPU_TUNING") {
                Ok(spec) => default.with(&spec)?,
                Err(_) => default,
            },
        };
        tuning.check(&limits)?;
        // reduce_subgroup.wgsl numbers a workgroup's invocations subgroup by subgroup, which
        // covers the workgroup only when its subgroups are full: a workgroup of a multiple
        // of the largest subgroup size (or within the smallest) has only full ones where the
        // drivers we know of are concerned; Vulkan does not promise it.
        let subgroups = tuning.subgroups
            && adapter.features().contains(wgpu::Features::SUBGROUP)
            && (tuning.group.checked_rem(info.subgroup_max_size) == Some(0)
                || tuning.group <= info.subgroup_min_size);
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("kvplug"),
            // Timestamps only for `KVPLUG_WGPU_PROFILE`.
            required_features: match std::env::var_os("KVPLUG_WGPU_PROFILE") {
                Some(_) => adapter.features() & Profile::FEATURES,
                None => wgpu::Features::empty(),
            } | match subgroups {
                true => wgpu::Features::SUBGROUP,
                false => wgpu::Features::empty(),
            },
            required_limits: limits.clone(),
            ..Default::default()
        }))
        .map_err(|e| format!("requesting a device from {}: {e}", info.name))?;
        let align = limits.min_uniform_buffer_offset_alignment as usize;
        let slot = MAX_PARAMS.div_ceil(align) * align;
        let buffer = |label, size, usage| {
            device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(label),
                size,
                usage: usage | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            })
        };
        let recorder = Recorder {
            encoder: None,
            pass: None,
            params: Vec::with_capacity(RING_SLOTS * slot),
            words: Vec::new(),
            ring: buffer(
                "uniform ring",
                (RING_SLOTS * slot) as u64,
                wgpu::BufferUsages::UNIFORM,
            ),
            arena: buffer("index words", 1 << 16, wgpu::BufferUsages::STORAGE),
            scratch: buffer("scratch", 1 << 16, wgpu::BufferUsages::STORAGE),
            partials: buffer("partials", 4, wgpu::BufferUsages::STORAGE),
            bind_groups: HashMap::new(),
            submits: 0,
            pending: 0,
            submit_at: tuning.first_submit,
            profile: Profile::from_env(&device, &queue),
        };
        Ok(Context {
            device,
            queue,
            adapter_features: adapter.features(),
            tuning,
            subgroups,
            info,
            limits,
            attention: OnceLock::new(),
            rows: OnceLock::new(),
            model: OnceLock::new(),
            project: OnceLock::new(),
            project_by_dtype: Default::default(),
            slot,
            recorder: Arc::new(Mutex::new(recorder)),
            unused: OnceLock::new(),
            readback: Mutex::new(None),
            // The recorder's ring, arena and scratch, made above.
            buffers_created: AtomicU64::new(3),
            bind_groups_created: AtomicU64::new(0),
            kernels_built: AtomicU64::new(0),
            dispatches: AtomicU64::new(0),
            read_back: AtomicU64::new(0),
            trace: std::env::var_os("KVPLUG_WGPU_TRACE").map(|_| {
                Mutex::new(Trace {
                    since: std::time::Instant::now(),
                    reads: 0,
                    waited: Default::default(),
                    dispatches: 0,
                    submits: 0,
                })
            }),
        })
    }

    /// Attention kernels, in [`ATTENTION_ENTRIES`] order (compiled on first use, which keeps
    /// plugin loading fast).
    pub fn attention(&self) -> &Kernels<6> {
        self.attention.get_or_init(|| {
            use Slot::*;
            self.kernels(
                "attention",
                include_str!("shaders/attention.wgsl"),
                (
                    size_of::<crate::AttnParams>(),
                    &[
                        Uniform, Read, Read, Read, Read, ReadWrite, ReadWrite, ReadWrite, Read,
                    ],
                ),
                ATTENTION_ENTRIES,
                Default::default(),
                None,
            )
        })
    }

    /// Row kernels: write, gather, place.
    pub fn rows(&self) -> &Kernels<3> {
        self.rows.get_or_init(|| {
            use Slot::*;
            self.kernels(
                "rows",
                include_str!("shaders/rows.wgsl"),
                (
                    size_of::<crate::RowParams>(),
                    &[Uniform, Read, Read, ReadWrite, ReadWrite, Read, ReadWrite],
                ),
                ["write_main", "gather_main", "place_main"],
                Default::default(),
                None,
            )
        })
    }

    /// Model kernels, in [`MODEL_ENTRIES`] order.
    pub fn model(&self) -> &Kernels<{ MODEL_ENTRIES.len() }> {
        self.model.get_or_init(|| {
            use Slot::*;
            self.kernels(
                "model",
                concat!(
                    include_str!("shaders/weights.wgsl"),
                    include_str!("shaders/model.wgsl")
                ),
                (
                    size_of::<crate::model::OpParams>(),
                    &[Uniform, Read, Read, Read, ReadWrite],
                ),
                MODEL_ENTRIES,
                Default::default(),
                None,
            )
        })
    }

    /// Linear kernels, in [`project_entries`] order, for [`Tuning::ways`] projections a
    /// dispatch. Bindings: the uniform, the input, the norm weight or up projection, the
    /// index words, then the projections' weights, their outputs, their biases. `dtype`:
    /// the weights' dtype flag where every projection of the dispatch has it, for kernels
    /// built for it (weights.wgsl's `FMT`: the driver folds the dtype's branches, 1.05–1.07×
    /// decode on an H200), made on first use and binding as the generic ones (their layout).
    pub fn project(&self, dtype: Option<u32>) -> &Kernels<3> {
        match dtype {
            None => self.project.get_or_init(|| self.project_kernels(None)),
            Some(f) => {
                self.project_by_dtype[f as usize].get_or_init(|| self.project_kernels(Some(f)))
            }
        }
    }

    fn project_kernels(&self, dtype: Option<u32>) -> Kernels<3> {
        use Slot::*;
        // A dtype's kernels bind as the generic ones: one cached bind group serves both.
        let layout = dtype.map(|_| &self.project(None).layout);
        let ways = self.tuning.ways;
        let slots: Vec<Slot> = [Uniform, Read, Read, Read, ReadWrite]
            .into_iter()
            .chain(
                [Read, ReadWrite, Read]
                    .into_iter()
                    .flat_map(|s| vec![s; ways]),
            )
            .collect();
        self.kernels(
            "project",
            &project_source(ways, self.subgroups),
            (size_of::<crate::model::ProjParams>(), &slots),
            project_entries(self.tuning.wide),
            wgpu::PipelineCompilationOptions {
                constants: &[
                    ("GROUP", self.tuning.group as f64),
                    ("FMT", dtype.map_or(255.0, f64::from)),
                ],
                // Each kernel writes its workgroup memory before reading it.
                zero_initialize_workgroup_memory: false,
            },
            layout,
        )
    }

    /// A buffer holding `bytes` (at least 4 bytes, as bindings must not be empty).
    pub fn buffer_with(&self, label: &str, bytes: &[u8], usage: wgpu::BufferUsages) -> OwnedBuffer {
        let pad;
        let contents = if bytes.len() < 4 {
            pad = [bytes, &[0u8; 4][bytes.len()..]].concat();
            &pad[..]
        } else {
            bytes
        };
        self.buffers_created.fetch_add(1, Ordering::Relaxed);
        self.owned(
            self.device
                .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                    label: Some(label),
                    contents,
                    usage,
                }),
        )
    }

    /// A zeroed storage buffer of `size` bytes (at least 4).
    pub fn storage(&self, label: &str, size: u64) -> OwnedBuffer {
        self.owned(self.raw_storage(label, size))
    }

    fn owned(&self, buf: wgpu::Buffer) -> OwnedBuffer {
        OwnedBuffer {
            buf,
            recorder: Arc::downgrade(&self.recorder),
        }
    }

    /// [`Context::storage`] for the buffers the context keeps itself: made and replaced with
    /// the recorder held, they must not lock it when dropped.
    fn raw_storage(&self, label: &str, size: u64) -> wgpu::Buffer {
        self.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: size.max(4),
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_SRC
                | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        })
    }

    /// A 4-byte storage buffer for the slots an op leaves unused (one per device).
    pub fn unused(&self) -> &wgpu::Buffer {
        self.unused.get_or_init(|| self.raw_storage("unused", 4))
    }

    /// Records commands into the pending batch, after everything recorded before. Commands
    /// run in recording order; they are submitted by [`Context::flush`] (which every read
    /// and host write calls first) and as the batch grows (`Tuning::first_submit`, then up
    /// to every [`SUBMIT_AFTER`] dispatches).
    pub fn record(&self, f: impl FnOnce(&mut wgpu::CommandEncoder)) {
        let mut r = self.recorder();
        f(r.encoder(&self.device));
    }

    /// Submits the pending batch, if any, its parameters and index words uploaded just
    /// before it. The lock is held until it is submitted, so a flush that finds nothing
    /// pending returns only once every command recorded before it has reached the queue (a
    /// readback on another thread may have taken them).
    pub fn flush(&self) {
        let mut r = self.recorder();
        r.submit(&self.device, &self.queue);
        r.submit_at = self.tuning.first_submit;
    }

    /// Writes `bytes` into `buffer` at `offset` after every command recorded so far (a queue
    /// write alone would land before the commands still pending).
    pub fn write_buffer(&self, buffer: &wgpu::Buffer, offset: u64, bytes: &[u8]) {
        self.flush();
        self.queue.write_buffer(buffer, offset, bytes);
    }

    /// Records one dispatch per `(pipeline index, workgroups)` of `kernels` over one bind
    /// group, into the batch's open compute pass: `params(w)` is the op's uniform, given that
    /// its index `words` (concatenated) start at word `w` of the slot bound as
    /// [`Bind::Words`]; `slots` fills the storage bindings in order. Dispatches with an empty
    /// grid are skipped.
    ///
    /// The uniform takes a slot of the batch's ring (a dynamic offset) and the words a run of
    /// its arena, both uploaded at the submit; the bind group of the same buffers is reused
    /// across steps. So once warm, an op creates no buffer and no bind group.
    pub fn dispatch<P: bytemuck::Pod, const N: usize>(
        &self,
        kernels: &Kernels<N>,
        params: impl FnOnce(u32) -> P,
        words: &[&[u32]],
        slots: &[Bind<'_>],
        passes: &[(usize, [u32; 3])],
    ) {
        debug_assert_eq!(std::mem::size_of::<P>() as u64, kernels.params_size.get());
        let n_words: usize = words.iter().map(|w| w.len()).sum();
        let mut r = self.recorder();
        if r.params.len() + self.slot > RING_SLOTS * self.slot
            || r.words.len() + n_words > r.arena_words()
            || r.profile.as_ref().is_some_and(|p| !p.fits(passes.len()))
        {
            r.submit(&self.device, &self.queue);
        }
        if n_words > r.arena_words() {
            let old = std::mem::replace(&mut r.arena, self.arena(n_words));
            r.forget(&old);
        }
        for slot in slots {
            let (buf, bytes, label) = match *slot {
                Bind::Scratch(bytes) => (&mut r.scratch, bytes, "scratch"),
                Bind::Partials(bytes) => (&mut r.partials, bytes, "partials"),
                _ => continue,
            };
            if bytes > buf.size() {
                // Doubled, within the binding limit (which callers keep `bytes` within).
                let limit = self.limits.max_storage_buffer_binding_size.max(bytes);
                let size = bytes.next_power_of_two().min(limit);
                let old = std::mem::replace(buf, self.raw_storage(label, size));
                r.forget(&old);
            }
        }
        let first_word = r.words.len() as u32;
        for w in words {
            r.words.extend_from_slice(w);
        }
        let offset = r.params.len();
        r.params
            .extend_from_slice(bytemuck::bytes_of(&params(first_word)));
        r.params.resize(offset + self.slot, 0);
        let bind_group = r.bind_group(self, kernels, slots);
        r.pass(&self.device);
        let r = &mut *r;
        let pass = r.pass.as_mut().expect("begun above");
        for &(pipeline, [x, y, z]) in passes {
            if x == 0 || y == 0 || z == 0 {
                continue;
            }
            pass.set_pipeline(&kernels.pipelines[pipeline]);
            pass.set_bind_group(0, &bind_group, &[offset as u32]);
            match &mut r.profile {
                Some(p) => {
                    let label = format!("{} {x}x{y}x{z}", kernels.names[pipeline]);
                    p.around(pass, label, |pass| pass.dispatch_workgroups(x, y, z));
                }
                None => pass.dispatch_workgroups(x, y, z),
            }
            r.pending += 1;
            self.dispatches.fetch_add(1, Ordering::Relaxed);
        }
        if r.pending >= r.submit_at {
            r.submit(&self.device, &self.queue);
            r.submit_at = (2 * r.submit_at).min(SUBMIT_AFTER);
        }
    }

    /// Bind groups held in the cache now.
    pub fn bind_groups_held(&self) -> usize {
        self.recorder().bind_groups.len()
    }

    /// Buffers, bind groups and pipelines this context has created so far, dispatches it
    /// recorded and bytes it read back.
    pub fn created(&self) -> Created {
        Created {
            buffers: self.buffers_created.load(Ordering::Relaxed),
            bind_groups: self.bind_groups_created.load(Ordering::Relaxed),
            kernels: self.kernels_built.load(Ordering::Relaxed),
            dispatches: self.dispatches.load(Ordering::Relaxed),
            read_back_bytes: self.read_back.load(Ordering::Relaxed),
            submits: self.recorder().submits,
        }
    }

    fn recorder(&self) -> MutexGuard<'_, Recorder> {
        lock(&self.recorder)
    }

    fn create_buffer(&self, desc: &wgpu::BufferDescriptor<'_>) -> wgpu::Buffer {
        self.buffers_created.fetch_add(1, Ordering::Relaxed);
        self.device.create_buffer(desc)
    }

    /// An index-word arena of at least `words` words (a power of two, at least 64 KiB).
    fn arena(&self, words: usize) -> wgpu::Buffer {
        self.create_buffer(&wgpu::BufferDescriptor {
            label: Some("index words"),
            size: (words.next_power_of_two() * 4).max(1 << 16) as u64,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        })
    }

    /// Reads a buffer back to the host (blocking).
    pub fn read(&self, buffer: &wgpu::Buffer, size: u64) -> Result<Vec<u8>, String> {
        self.read_with(buffer, size, <[u8]>::to_vec)
    }

    /// Reads `(offset, size)` regions of a buffer back to the host, concatenated (blocking).
    /// Offsets and sizes are multiples of 4. The staging buffer is reused across reads.
    pub fn read_regions(
        &self,
        buffer: &wgpu::Buffer,
        regions: &[(u64, u64)],
    ) -> Result<Vec<u8>, String> {
        self.read_regions_with(buffer, regions, <[u8]>::to_vec)
    }

    /// The first `size` bytes of a buffer, given to `use_bytes` where they are mapped
    /// (blocking; no copy of them is made first).
    pub fn read_with<R>(
        &self,
        buffer: &wgpu::Buffer,
        size: u64,
        use_bytes: impl FnOnce(&[u8]) -> R,
    ) -> Result<R, String> {
        self.read_regions_with(buffer, &[(0, size.max(4))], |b| {
            use_bytes(&b[..size as usize])
        })
    }

    /// [`Context::read_regions`], the concatenated bytes given to `use_bytes` where they
    /// are mapped.
    fn read_regions_with<R>(
        &self,
        buffer: &wgpu::Buffer,
        regions: &[(u64, u64)],
        use_bytes: impl FnOnce(&[u8]) -> R,
    ) -> Result<R, String> {
        let size: u64 = regions.iter().map(|r| r.1).sum();
        let mut cached = self.readback.lock().unwrap_or_else(|p| p.into_inner());
        let staging = match cached.take() {
            Some(b) if b.size() >= size => b,
            _ => self.create_buffer(&wgpu::BufferDescriptor {
                label: Some("readback"),
                size: size.max(4).next_power_of_two(),
                usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            }),
        };
        // After the pending commands, then everything goes to the GPU.
        self.record(|enc| {
            let mut at = 0;
            for &(offset, len) in regions {
                enc.copy_buffer_to_buffer(buffer, offset, &staging, at, len);
                at += len;
            }
        });
        self.flush();
        let (tx, rx) = std::sync::mpsc::channel();
        staging.map_async(wgpu::MapMode::Read, ..size.max(4), move |r| {
            let _ = tx.send(r);
        });
        let waiting = std::time::Instant::now();
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| format!("waiting for the device: {e}"))?;
        if let Some(trace) = &self.trace {
            let submits = self.recorder().submits;
            let mut t = lock(trace);
            t.waited += waiting.elapsed();
            t.reads += 1;
            if t.reads == 64 {
                let dispatches = self.dispatches.load(Ordering::Relaxed);
                eprintln!(
                    "wgpu trace: 64 reads in {:.2} ms, {:.2} ms of it waiting for the device; \
                     {} dispatches, {} submits",
                    t.since.elapsed().as_secs_f64() * 1e3,
                    t.waited.as_secs_f64() * 1e3,
                    dispatches - t.dispatches,
                    submits - t.submits
                );
                *t = Trace {
                    since: std::time::Instant::now(),
                    reads: 0,
                    waited: Default::default(),
                    dispatches,
                    submits,
                };
            }
        }
        rx.recv()
            .map_err(|e| format!("readback callback dropped: {e}"))?
            .map_err(|e| format!("mapping the readback buffer: {e}"))?;
        let got = use_bytes(
            &staging
                .get_mapped_range(..size.max(4))
                .map_err(|e| format!("reading the mapped range: {e:?}"))?[..size as usize],
        );
        staging.unmap();
        self.read_back.fetch_add(size, Ordering::Relaxed);
        // Kept only after a clean read: a failed one leaves no mapped buffer behind.
        *cached = Some(staging);
        Ok(got)
    }
}

#[cfg(test)]
mod tests {
    use super::Tuning;

    #[test]
    fn a_tuning_spec_changes_the_fields_it_names() {
        let t = Tuning::CPU.with(" group=128, lane_steps=8 ").unwrap();
        assert_eq!((t.ways, t.group, t.lane_steps), (1, 128, 8));
        assert!(!Tuning::CPU.with("subgroups=0").unwrap().subgroups);
        assert!(Tuning::CPU.with("by_dtype=1").unwrap().by_dtype);
        assert_eq!(Tuning::CPU.with("rows_tokens=16").unwrap().rows_tokens, 16);
        assert_eq!(Tuning::CPU.with("tiles=512").unwrap().tiles, 512);
        assert!(Tuning::CPU.with("wide=1").unwrap().wide);
        assert!(Tuning::CPU.with("wide=2").is_err());
        assert_eq!(Tuning::CPU.with("min_lanes=2").unwrap().min_lanes, 2);
        assert_eq!(Tuning::CPU.with("").unwrap(), Tuning::CPU);
        for bad in [
            "group",
            "group=x",
            "lanes=4",
            "ways=-1",
            "subgroups=2",
            "by_dtype=2",
        ] {
            let e = Tuning::CPU.with(bad).unwrap_err();
            assert!(e.contains("KVPLUG_WGPU_TUNING") && e.contains(bad), "{e}");
        }
    }
}
