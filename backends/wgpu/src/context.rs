//! Opening the adapter and device, and the compute pipelines built once per device.

use std::sync::{Mutex, OnceLock};

use wgpu::util::DeviceExt;

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
    attention: OnceLock<Kernels<3>>,
    rows: OnceLock<Kernels<3>>,
    model: OnceLock<Kernels<11>>,
    /// Commands recorded since the last submit, and how many passes they hold.
    pending: Mutex<Option<(wgpu::CommandEncoder, usize)>>,
    /// The buffer bound to slots an op does not use.
    unused: OnceLock<wgpu::Buffer>,
}

/// Passes recorded before the pending commands are submitted without waiting for a read:
/// bounds the encoder's memory when nothing is read back for a long time.
const MAX_PENDING_PASSES: usize = 4096;

/// Entry points of `model.wgsl`, in the order of [`Context::model`]'s pipelines.
pub const MODEL_ENTRIES: [&str; 11] = [
    "gather_main",
    "rmsnorm_main",
    "linear_main",
    "bias_main",
    "rope_main",
    "heads_main",
    "silu_main",
    "add_main",
    "embed_main",
    "gelu_main",
    "scale_main",
];

/// Pipelines of one shader module sharing one bind-group layout.
pub struct Kernels<const N: usize> {
    /// The layout every pipeline of the module uses.
    pub layout: wgpu::BindGroupLayout,
    /// One pipeline per entry point, in the order given.
    pub pipelines: [wgpu::ComputePipeline; N],
}

/// Binding kinds of a module's bind group, in binding order.
#[derive(Clone, Copy)]
enum Slot {
    Uniform,
    Read,
    ReadWrite,
}

fn kernels<const N: usize>(
    device: &wgpu::Device,
    label: &str,
    source: &str,
    slots: &[Slot],
    entries: [&str; N],
) -> Kernels<N> {
    let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
        label: Some(label),
        source: wgpu::ShaderSource::Wgsl(source.into()),
    });
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
                    Slot::ReadWrite => wgpu::BufferBindingType::Storage { read_only: false },
                },
                has_dynamic_offset: false,
                min_binding_size: None,
            },
            count: None,
        })
        .collect();
    let layout = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
        label: Some(label),
        entries: &layout_entries,
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
            compilation_options: Default::default(),
            cache: None,
        })
    });
    Kernels { layout, pipelines }
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
    /// Opens the adapter (honouring `WGPU_BACKEND` / `WGPU_ADAPTER_NAME`), the device with
    /// the adapter's limits, and builds the kernels.
    pub fn open() -> Result<Self, String> {
        let instance =
            wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle_from_env());
        let adapter = pollster::block_on(pick_adapter(&instance))?;
        let info = adapter.get_info();
        let limits = adapter.limits();
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("kvplug"),
            required_features: wgpu::Features::empty(),
            required_limits: limits.clone(),
            ..Default::default()
        }))
        .map_err(|e| format!("requesting a device from {}: {e}", info.name))?;
        Ok(Context {
            device,
            queue,
            adapter_features: adapter.features(),
            info,
            limits,
            attention: OnceLock::new(),
            rows: OnceLock::new(),
            model: OnceLock::new(),
            pending: Mutex::new(None),
            unused: OnceLock::new(),
        })
    }

    /// Attention kernels: scores, softmax, output (compiled on first use, which keeps
    /// plugin loading fast).
    pub fn attention(&self) -> &Kernels<3> {
        self.attention.get_or_init(|| {
            use Slot::*;
            kernels(
                &self.device,
                "attention",
                include_str!("shaders/attention.wgsl"),
                &[Uniform, Read, Read, Read, Read, ReadWrite, ReadWrite],
                ["scores_main", "softmax_main", "output_main"],
            )
        })
    }

    /// Row kernels: write, gather, place.
    pub fn rows(&self) -> &Kernels<3> {
        self.rows.get_or_init(|| {
            use Slot::*;
            kernels(
                &self.device,
                "rows",
                include_str!("shaders/rows.wgsl"),
                &[Uniform, Read, Read, ReadWrite, ReadWrite],
                ["write_main", "gather_main", "place_main"],
            )
        })
    }

    /// Model kernels, in [`MODEL_ENTRIES`] order.
    pub fn model(&self) -> &Kernels<11> {
        self.model.get_or_init(|| {
            use Slot::*;
            kernels(
                &self.device,
                "model",
                include_str!("shaders/model.wgsl"),
                &[Uniform, Read, Read, Read, ReadWrite],
                MODEL_ENTRIES,
            )
        })
    }

    /// A buffer holding `bytes` (at least 4 bytes, as bindings must not be empty).
    pub fn buffer_with(
        &self,
        label: &str,
        bytes: &[u8],
        usage: wgpu::BufferUsages,
    ) -> wgpu::Buffer {
        let pad;
        let contents = if bytes.len() < 4 {
            pad = [bytes, &[0u8; 4][bytes.len()..]].concat();
            &pad[..]
        } else {
            bytes
        };
        self.device
            .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some(label),
                contents,
                usage,
            })
    }

    /// A zeroed storage buffer of `size` bytes (at least 4).
    pub fn storage(&self, label: &str, size: u64) -> wgpu::Buffer {
        self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: size.max(4),
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_SRC
                | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        })
    }

    /// A 4-byte storage buffer for the read-only slots an op leaves unused (one per device).
    pub fn unused(&self) -> &wgpu::Buffer {
        self.unused.get_or_init(|| self.storage("unused", 4))
    }

    /// Records commands into the pending encoder, after everything recorded before. Commands
    /// run in recording order; they are submitted by [`Context::flush`] (which every read
    /// and host write calls first), so a forward's ops go to the GPU in one submission.
    pub fn record(&self, passes: usize, f: impl FnOnce(&mut wgpu::CommandEncoder)) {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        let (enc, n) = pending.get_or_insert_with(|| {
            let enc = self
                .device
                .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
            (enc, 0)
        });
        f(enc);
        *n += passes;
        if *n >= MAX_PENDING_PASSES {
            let (enc, _) = pending.take().expect("inserted above");
            self.queue.submit([enc.finish()]);
        }
    }

    /// Submits the pending commands, if any. The lock is held until they are submitted, so
    /// a flush that finds nothing pending returns only once every command recorded before
    /// it has reached the queue (a readback on another thread may have taken them).
    pub fn flush(&self) {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((enc, _)) = pending.take() {
            self.queue.submit([enc.finish()]);
        }
    }

    /// Writes `bytes` into `buffer` at `offset` after every command recorded so far (a queue
    /// write alone would land before the commands still pending).
    pub fn write_buffer(&self, buffer: &wgpu::Buffer, offset: u64, bytes: &[u8]) {
        self.flush();
        self.queue.write_buffer(buffer, offset, bytes);
    }

    /// Records one compute pass per `(pipeline, workgroups)` over `bind_group`.
    pub fn dispatch(
        &self,
        bind_group: &wgpu::BindGroup,
        passes: &[(&wgpu::ComputePipeline, [u32; 3])],
    ) {
        self.record(passes.len(), |enc| {
            for (pipeline, [x, y, z]) in passes {
                if *x == 0 || *y == 0 || *z == 0 {
                    continue;
                }
                let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                    label: None,
                    timestamp_writes: None,
                });
                pass.set_pipeline(pipeline);
                pass.set_bind_group(0, bind_group, &[]);
                pass.dispatch_workgroups(*x, *y, *z);
            }
        });
    }

    /// A bind group of `buffers` (whole buffers, in binding order).
    pub fn bind(
        &self,
        layout: &wgpu::BindGroupLayout,
        buffers: &[&wgpu::Buffer],
    ) -> wgpu::BindGroup {
        let entries: Vec<wgpu::BindGroupEntry> = buffers
            .iter()
            .enumerate()
            .map(|(i, b)| wgpu::BindGroupEntry {
                binding: i as u32,
                resource: b.as_entire_binding(),
            })
            .collect();
        self.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: None,
            layout,
            entries: &entries,
        })
    }

    /// Reads a buffer back to the host (blocking).
    pub fn read(&self, buffer: &wgpu::Buffer, size: u64) -> Result<Vec<u8>, String> {
        self.read_regions(buffer, &[(0, size.max(4))]).map(|mut b| {
            b.truncate(size as usize);
            b
        })
    }

    /// Reads `(offset, size)` regions of a buffer back to the host, concatenated (blocking).
    /// Offsets and sizes are multiples of 4.
    pub fn read_regions(
        &self,
        buffer: &wgpu::Buffer,
        regions: &[(u64, u64)],
    ) -> Result<Vec<u8>, String> {
        let size: u64 = regions.iter().map(|r| r.1).sum();
        let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("readback"),
            size: size.max(4),
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        // After the pending commands, then everything goes to the GPU.
        self.record(0, |enc| {
            let mut at = 0;
            for &(offset, len) in regions {
                enc.copy_buffer_to_buffer(buffer, offset, &staging, at, len);
                at += len;
            }
        });
        self.flush();
        let (tx, rx) = std::sync::mpsc::channel();
        staging.map_async(wgpu::MapMode::Read, .., move |r| {
            let _ = tx.send(r);
        });
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| format!("waiting for the device: {e}"))?;
        rx.recv()
            .map_err(|e| format!("readback callback dropped: {e}"))?
            .map_err(|e| format!("mapping the readback buffer: {e}"))?;
        let bytes = staging
            .get_mapped_range(..)
            .map_err(|e| format!("reading the mapped range: {e:?}"))?[..size as usize]
            .to_vec();
        staging.unmap();
        Ok(bytes)
    }
}
