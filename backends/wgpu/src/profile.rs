//! `KVPLUG_WGPU_PROFILE` (set to anything): the device time of each kernel, from timestamps
//! the recorder writes around every dispatch. Every [`REPORT_SUBMITS`] submits one block on
//! stderr lists the kernels (entry point and grid) by total time. A diagnostic: each
//! submit then waits for its timestamps, so steps run slower than without it.

use std::collections::HashMap;

/// Timestamps one submit can hold (two per dispatch); the recorder submits before more.
pub const QUERIES: u32 = 4096;

/// Submits between two reports.
const REPORT_SUBMITS: u64 = 64;

/// The timestamps of the batch being recorded and the totals since the last report.
pub struct Profile {
    set: wgpu::QuerySet,
    resolved: wgpu::Buffer,
    staging: wgpu::Buffer,
    /// Nanoseconds a timestamp tick is.
    period: f64,
    /// The pending batch's dispatches, in order: timestamps 2i and 2i + 1 bracket dispatch i.
    labels: Vec<String>,
    /// Per label: dispatches and nanoseconds since the last report.
    totals: HashMap<String, (u64, f64)>,
    /// Submits since the last report.
    submits: u64,
}

impl Profile {
    /// The features a profile needs.
    pub const FEATURES: wgpu::Features =
        wgpu::Features::TIMESTAMP_QUERY.union(wgpu::Features::TIMESTAMP_QUERY_INSIDE_PASSES);

    /// A profile when `KVPLUG_WGPU_PROFILE` is set and the device has [`Self::FEATURES`]
    /// (else a line on stderr says why there is none).
    pub fn from_env(device: &wgpu::Device, queue: &wgpu::Queue) -> Option<Profile> {
        std::env::var_os("KVPLUG_WGPU_PROFILE")?;
        if !device.features().contains(Self::FEATURES) {
            eprintln!("KVPLUG_WGPU_PROFILE: the adapter has no timestamp queries in passes");
            return None;
        }
        let buffer = |label, usage| {
            device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(label),
                size: QUERIES as u64 * 8,
                usage,
                mapped_at_creation: false,
            })
        };
        Some(Profile {
            set: device.create_query_set(&wgpu::QuerySetDescriptor {
                label: Some("profile"),
                ty: wgpu::QueryType::Timestamp,
                count: QUERIES,
            }),
            resolved: buffer(
                "profile resolve",
                wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
            ),
            staging: buffer(
                "profile staging",
                wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            ),
            period: queue.get_timestamp_period() as f64,
            labels: Vec::new(),
            totals: HashMap::new(),
            submits: 0,
        })
    }

    /// Whether `n` more dispatches fit in the pending batch's timestamps.
    pub fn fits(&self, n: usize) -> bool {
        2 * (self.labels.len() + n) <= QUERIES as usize
    }

    /// Records `dispatch` between two timestamps, under `label`.
    pub fn around(
        &mut self,
        pass: &mut wgpu::ComputePass<'static>,
        label: String,
        dispatch: impl FnOnce(&mut wgpu::ComputePass<'static>),
    ) {
        let i = 2 * self.labels.len() as u32;
        pass.write_timestamp(&self.set, i);
        dispatch(pass);
        pass.write_timestamp(&self.set, i + 1);
        self.labels.push(label);
    }

    /// Copies the batch's timestamps out, after its commands (the pass has ended).
    pub fn resolve(&self, enc: &mut wgpu::CommandEncoder) {
        let n = 2 * self.labels.len() as u32;
        if n > 0 {
            enc.resolve_query_set(&self.set, 0..n, &self.resolved, 0);
            enc.copy_buffer_to_buffer(&self.resolved, 0, &self.staging, 0, n as u64 * 8);
        }
    }

    /// After the submit: waits for the batch, adds its times, reports every
    /// [`REPORT_SUBMITS`] submits.
    pub fn collect(&mut self, device: &wgpu::Device) {
        let labels = std::mem::take(&mut self.labels);
        if labels.is_empty() {
            return;
        }
        let bytes = labels.len() as u64 * 16;
        self.staging
            .slice(..bytes)
            .map_async(wgpu::MapMode::Read, |_| {});
        if device.poll(wgpu::PollType::wait_indefinitely()).is_err() {
            // The map is abandoned with the batch's times.
            self.staging.unmap();
            return;
        }
        if let Ok(view) = self.staging.slice(..bytes).get_mapped_range() {
            let ticks: &[u64] = bytemuck::cast_slice(&view);
            for (label, t) in labels.into_iter().zip(ticks.chunks_exact(2)) {
                let e = self.totals.entry(label).or_default();
                e.0 += 1;
                e.1 += t[1].saturating_sub(t[0]) as f64 * self.period;
            }
        }
        self.staging.unmap();
        self.submits += 1;
        if self.submits == REPORT_SUBMITS {
            self.report();
        }
    }

    fn report(&mut self) {
        if self.totals.is_empty() {
            return;
        }
        let mut rows: Vec<_> = self.totals.drain().collect();
        rows.sort_by(|a, b| b.1 .1.total_cmp(&a.1 .1));
        let all: f64 = rows.iter().map(|r| r.1 .1).sum();
        let dispatches: u64 = rows.iter().map(|r| r.1 .0).sum();
        let submits = std::mem::take(&mut self.submits).max(1);
        eprintln!(
            "wgpu profile: {submits} submits, {dispatches} dispatches, {:.3} ms of kernels a \
             submit",
            all / 1e6 / submits as f64
        );
        for (label, (n, ns)) in rows.iter().take(24) {
            eprintln!(
                "  {label:<36} {n:>7} x {:>8.2} us = {:>8.3} ms ({:.1}%)",
                ns / *n as f64 / 1e3,
                ns / 1e6,
                100.0 * ns / all
            );
        }
    }
}

impl Drop for Profile {
    /// What the last report left out.
    fn drop(&mut self) {
        self.report();
    }
}
