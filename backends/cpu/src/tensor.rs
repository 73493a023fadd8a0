//! [`CpuTensor`]: a dense row-major f32 tensor.

/// A dense row-major f32 activation tensor.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CpuTensor {
    /// Dimensions, outermost first.
    pub dims: Vec<usize>,
    /// `dims.iter().product()` values.
    pub data: Vec<f32>,
}

impl CpuTensor {
    /// A tensor over `data`; panics if the sizes disagree (a programming error).
    pub fn new(dims: &[usize], data: Vec<f32>) -> Self {
        assert_eq!(
            dims.iter().product::<usize>(),
            data.len(),
            "dims {dims:?} vs {} values",
            data.len()
        );
        CpuTensor {
            dims: dims.to_vec(),
            data,
        }
    }

    /// A zeroed tensor.
    pub fn zeros(dims: &[usize]) -> Self {
        CpuTensor::new(dims, vec![0.0; dims.iter().product()])
    }
}
