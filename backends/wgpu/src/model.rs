//! The model graph's operations on wgpu: WGSL kernels over f32 storage buffers, so
//! activations stay on the device between layers (only logits are read back).

use kvplug_backend_kit::model::{ModelDevice, StoredDtype, StoredTensor};
use kvplug_backend_kit::{Device, KitError};
use wgpu::BufferUsages;

use crate::context::Bind;
use crate::{WgpuDevice, WgpuTensor};

/// A `[rows, cols]` weight in a storage buffer, in its stored dtype (the shaders widen
/// each element as they read it).
pub struct WgpuWeight {
    buf: crate::context::OwnedBuffer,
    /// The shaders' dtype flag: 0 f32, 1 f16, 2 bf16.
    dtype: u32,
    rows: usize,
    cols: usize,
}

#[repr(C)]
#[derive(Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
pub(crate) struct OpParams {
    n: [u32; 4],
    flag: u32,
    total: u32,
    /// Where the op's index words start, and its second array of them (set by [`WgpuDevice::op`]).
    idx: [u32; 2],
    eps: f32,
    pad2: [f32; 3],
}

/// Indices into [`crate::context::MODEL_ENTRIES`].
#[derive(Clone, Copy)]
enum Op {
    Gather = 0,
    RmsNorm = 1,
    Linear = 2,
    Bias = 3,
    Rope = 4,
    Heads = 5,
    Silu = 6,
    Add = 7,
    Embed = 8,
    Gelu = 9,
    Scale = 10,
}

/// The read-only operands of one op: buffers `a` and `b` (absent ones are bound to a dummy)
/// and up to two arrays of index words (read at `idx0` and `idx1`).
#[derive(Clone, Copy, Default)]
struct Inputs<'a> {
    a: Option<&'a wgpu::Buffer>,
    b: Option<&'a wgpu::Buffer>,
    words: &'a [&'a [u32]],
}

fn inputs<'a>(
    a: Option<&'a wgpu::Buffer>,
    b: Option<&'a wgpu::Buffer>,
    words: &'a [&'a [u32]],
) -> Inputs<'a> {
    Inputs { a, b, words }
}

/// Workgroups for `total` invocations in 64-wide groups, spread over x and y.
fn flat_groups(total: usize) -> [u32; 3] {
    let groups = (total as u32).div_ceil(64).max(1);
    let x = groups.min(65535);
    [x, groups.div_ceil(x), 1]
}

impl WgpuDevice {
    fn op(
        &self,
        op: Op,
        params: OpParams,
        inputs: Inputs<'_>,
        out: &wgpu::Buffer,
        groups: [u32; 3],
    ) {
        let ctx = self.context();
        let Inputs { a, b, words } = inputs;
        fn buffer(x: Option<&wgpu::Buffer>) -> Bind<'_> {
            x.map_or(Bind::Unused, Bind::Buffer)
        }
        let idx = if words.is_empty() {
            Bind::Unused
        } else {
            Bind::Words
        };
        let first = words.first().map_or(0, |w| w.len() as u32);
        ctx.dispatch(
            ctx.model(),
            |idx0| OpParams {
                idx: [idx0, idx0 + first],
                ..params
            },
            words,
            &[buffer(a), buffer(b), idx, Bind::Buffer(out)],
            &[(op as usize, groups)],
        );
    }

    fn flat(
        &self,
        op: Op,
        n: [u32; 4],
        flag: u32,
        total: usize,
        inputs: Inputs<'_>,
        out: &wgpu::Buffer,
    ) {
        let params = OpParams {
            n,
            flag,
            total: total as u32,
            ..Default::default()
        };
        self.op(op, params, inputs, out, flat_groups(total));
    }
}

impl ModelDevice for WgpuDevice {
    type Weight = WgpuWeight;

    fn weight(&self, data: StoredTensor, rows: usize, cols: usize) -> Result<WgpuWeight, KitError> {
        if data.len() != rows * cols {
            return Err(KitError::Device(format!(
                "a {rows}x{cols} weight given {} elements",
                data.len()
            )));
        }
        let dtype = match data.dtype() {
            StoredDtype::F32 => 0,
            StoredDtype::F16 => 1,
            StoredDtype::BF16 => 2,
        };
        // Storage buffers hold whole 32-bit words: an odd count of halves gets one pad.
        let bytes = data.bytes();
        let padded;
        let bytes = if bytes.len() % 4 == 0 {
            bytes
        } else {
            padded = [bytes, &[0u8; 2]].concat();
            &padded[..]
        };
        Ok(WgpuWeight {
            buf: self
                .context()
                .buffer_with("weight", bytes, BufferUsages::STORAGE),
            dtype,
            rows,
            cols,
        })
    }

    fn tensor(&self, data: &[f32], dims: &[usize]) -> Result<WgpuTensor, KitError> {
        Ok(WgpuTensor {
            buf: self.context().buffer_with(
                "tensor",
                bytemuck::cast_slice(data),
                BufferUsages::STORAGE | BufferUsages::COPY_SRC,
            ),
            dims: dims.to_vec(),
        })
    }

    fn embed(&self, table: &WgpuWeight, ids: &[i32], out: &mut WgpuTensor) -> Result<(), KitError> {
        let w = table.cols;
        self.flat(
            Op::Embed,
            [w as u32, 0, 0, 0],
            table.dtype,
            ids.len() * w,
            inputs(None, Some(&table.buf), &[bytemuck::cast_slice(ids)]),
            &out.buf,
        );
        Ok(())
    }

    fn rms_norm(
        &self,
        x: &WgpuTensor,
        w: &WgpuTensor,
        eps: f32,
        out: &mut WgpuTensor,
    ) -> Result<(), KitError> {
        let width = w.dims[0];
        let rows = x.dims.iter().product::<usize>() / width;
        let params = OpParams {
            n: [width as u32, 0, 0, 0],
            eps,
            ..Default::default()
        };
        self.op(
            Op::RmsNorm,
            params,
            inputs(Some(&x.buf), Some(&w.buf), &[]),
            &out.buf,
            [rows as u32, 1, 1],
        );
        Ok(())
    }

    fn linear(
        &self,
        x: &WgpuTensor,
        w: &WgpuWeight,
        bias: Option<&WgpuTensor>,
        out: &mut WgpuTensor,
    ) -> Result<(), KitError> {
        let t = x.dims[0];
        let params = OpParams {
            n: [w.rows as u32, w.cols as u32, 0, 0],
            flag: w.dtype,
            ..Default::default()
        };
        self.op(
            Op::Linear,
            params,
            inputs(Some(&x.buf), Some(&w.buf), &[]),
            &out.buf,
            [(w.rows as u32).div_ceil(64), t as u32, 1],
        );
        if let Some(b) = bias {
            self.flat(
                Op::Bias,
                [w.rows as u32, 0, 0, 0],
                0,
                t * w.rows,
                inputs(Some(&b.buf), None, &[]),
                &out.buf,
            );
        }
        Ok(())
    }

    fn rope(
        &self,
        x: &mut WgpuTensor,
        heads: usize,
        positions: &[i32],
        inv_freq: &[f32],
    ) -> Result<(), KitError> {
        let hd = 2 * inv_freq.len();
        let total = positions.len() * heads * hd / 2;
        self.flat(
            Op::Rope,
            [heads as u32, hd as u32, 0, 0],
            0,
            total,
            inputs(
                None,
                None,
                &[
                    bytemuck::cast_slice(positions),
                    bytemuck::cast_slice(inv_freq),
                ],
            ),
            &x.buf,
        );
        Ok(())
    }

    fn split_heads(
        &self,
        x: &WgpuTensor,
        heads: usize,
        out: &mut WgpuTensor,
    ) -> Result<(), KitError> {
        let (t, d) = (x.dims[0], x.dims[1] / heads);
        self.flat(
            Op::Heads,
            [heads as u32, t as u32, d as u32, 0],
            0,
            heads * t * d,
            inputs(Some(&x.buf), None, &[]),
            &out.buf,
        );
        Ok(())
    }

    fn merge_heads(&self, x: &WgpuTensor, out: &mut WgpuTensor) -> Result<(), KitError> {
        let (h, t, d) = (x.dims[0], x.dims[1], x.dims[2]);
        self.flat(
            Op::Heads,
            [h as u32, t as u32, d as u32, 0],
            1,
            h * t * d,
            inputs(Some(&x.buf), None, &[]),
            &out.buf,
        );
        Ok(())
    }

    fn silu_mul(
        &self,
        gate: &WgpuTensor,
        up: &WgpuTensor,
        out: &mut WgpuTensor,
    ) -> Result<(), KitError> {
        let n = self.dims(gate).iter().product();
        self.flat(
            Op::Silu,
            [0; 4],
            0,
            n,
            inputs(Some(&gate.buf), Some(&up.buf), &[]),
            &out.buf,
        );
        Ok(())
    }

    fn gelu_tanh_mul(
        &self,
        gate: &WgpuTensor,
        up: &WgpuTensor,
        out: &mut WgpuTensor,
    ) -> Result<(), KitError> {
        let n = self.dims(gate).iter().product();
        self.flat(
            Op::Gelu,
            [0; 4],
            0,
            n,
            inputs(Some(&gate.buf), Some(&up.buf), &[]),
            &out.buf,
        );
        Ok(())
    }

    fn scale(&self, x: &mut WgpuTensor, s: f32) -> Result<(), KitError> {
        let params = OpParams {
            total: x.dims.iter().product::<usize>() as u32,
            eps: s,
            ..Default::default()
        };
        let total = params.total as usize;
        self.op(
            Op::Scale,
            params,
            Inputs::default(),
            &x.buf,
            flat_groups(total),
        );
        Ok(())
    }

    fn add_assign(&self, x: &mut WgpuTensor, y: &WgpuTensor) -> Result<(), KitError> {
        let n = y.dims.iter().product();
        self.flat(
            Op::Add,
            [0; 4],
            0,
            n,
            inputs(Some(&y.buf), None, &[]),
            &x.buf,
        );
        Ok(())
    }

    fn gather_rows(
        &self,
        x: &WgpuTensor,
        rows: &[usize],
        out: &mut WgpuTensor,
    ) -> Result<(), KitError> {
        let w = x.dims[1];
        let rows: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
        self.flat(
            Op::Gather,
            [w as u32, 0, 0, 0],
            0,
            rows.len() * w,
            inputs(Some(&x.buf), None, &[&rows]),
            &out.buf,
        );
        Ok(())
    }
}
