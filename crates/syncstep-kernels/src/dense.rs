//! The fully connected layer (torchvision `fc`): forward and the gradients of its input,
//! weight and bias. See shaders/dense.wgsl.

use super::{expect_len, expect_positive, launch, pairwise_shader, shader_source, Result};
use syncstep_gpu::{grid_1d, Encoder, Gpu, Serial, Shader, Slice};

pub(crate) const SHADER: Shader = Shader::file("dense", shader_source!("dense.wgsl"));
const WG: u32 = 256;
/// Instructions a step of an invocation's dot product issues beside its loads: two addresses
/// and a multiply-add; and a pairwise push's (its levels' tests and adds).
const DOT_TERM: u32 = 6;
const PAIRWISE_TERM: u32 = 6;

/// `m` examples of `k_in` features mapped to `k_out`: x `[m, k_in]`, weight `[k_out, k_in]`,
/// bias `[k_out]`, y `[m, k_out]`, all row-major.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DenseShape {
    pub m: u32,
    pub k_in: u32,
    pub k_out: u32,
}

impl DenseShape {
    pub fn input_len(&self) -> u64 {
        self.m as u64 * self.k_in as u64
    }
    pub fn output_len(&self) -> u64 {
        self.m as u64 * self.k_out as u64
    }
    pub fn weight_len(&self) -> u64 {
        self.k_out as u64 * self.k_in as u64
    }
    pub fn bias_len(&self) -> u64 {
        self.k_out as u64
    }

    fn check_dims(&self, op: &'static str) -> Result<()> {
        expect_positive(op, "m", self.m)?;
        expect_positive(op, "k_in", self.k_in)?;
        expect_positive(op, "k_out", self.k_out)
    }
}

/// `out[i, j] = Σ_t a[i*a_row + t*a_inner] · b[t*b_inner + j*b_col]`, out `[rows, cols]`.
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    rows: u32,
    cols: u32,
    inner: u32,
    a_row: u32,
    a_inner: u32,
    b_inner: u32,
    b_col: u32,
}

/// `y = x·wᵀ + b`.
pub fn dense_forward(
    gpu: &Gpu,
    enc: &mut Encoder,
    s: &DenseShape,
    x: Slice,
    w: Slice,
    b: Slice,
    y: Slice,
) -> Result<()> {
    const OP: &str = "dense_forward";
    s.check_dims(OP)?;
    expect_len(OP, "x", &x, s.input_len(), "m*k_in")?;
    expect_len(OP, "w", &w, s.weight_len(), "k_out*k_in")?;
    expect_len(OP, "b", &b, s.bias_len(), "k_out")?;
    expect_len(OP, "y", &y, s.output_len(), "m*k_out")?;
    let params = Params {
        rows: s.m,
        cols: s.k_out,
        inner: s.k_in,
        a_row: s.k_in,
        a_inner: 1,
        b_inner: 1,
        b_col: s.k_in,
    };
    gpu.charge_flops(2.0 * (s.m as u64 * s.weight_len()) as f64);
    gpu.describe_serial_next(Serial::loop_of(params.inner as u64, DOT_TERM));
    launch(
        gpu,
        enc,
        OP,
        &SHADER,
        OP,
        &params,
        &[("x", x), ("w", w), ("y", y), ("b", b)],
        grid_1d(s.output_len(), WG),
    )
}

/// `dx = dy·w`.
pub fn dense_backward_input(
    gpu: &Gpu,
    enc: &mut Encoder,
    s: &DenseShape,
    dy: Slice,
    w: Slice,
    dx: Slice,
) -> Result<()> {
    const OP: &str = "dense_backward_input";
    s.check_dims(OP)?;
    expect_len(OP, "dy", &dy, s.output_len(), "m*k_out")?;
    expect_len(OP, "w", &w, s.weight_len(), "k_out*k_in")?;
    expect_len(OP, "dx", &dx, s.input_len(), "m*k_in")?;
    let params = Params {
        rows: s.m,
        cols: s.k_in,
        inner: s.k_out,
        a_row: s.k_out,
        a_inner: 1,
        b_inner: s.k_in,
        b_col: 1,
    };
    gpu.charge_flops(2.0 * (s.m as u64 * s.weight_len()) as f64);
    gpu.describe_serial_next(Serial::loop_of(params.inner as u64, DOT_TERM));
    launch(
        gpu,
        enc,
        OP,
        &SHADER,
        OP,
        &params,
        &[("dy", dy), ("w", w), ("dx", dx)],
        grid_1d(s.input_len(), WG),
    )
}

/// `dw = dyᵀ·x`, summed pairwise over the batch (see dense.wgsl).
pub fn dense_backward_weight(
    gpu: &Gpu,
    enc: &mut Encoder,
    s: &DenseShape,
    dy: Slice,
    x: Slice,
    dw: Slice,
) -> Result<()> {
    const OP: &str = "dense_backward_weight";
    s.check_dims(OP)?;
    expect_len(OP, "dy", &dy, s.output_len(), "m*k_out")?;
    expect_len(OP, "x", &x, s.input_len(), "m*k_in")?;
    expect_len(OP, "dw", &dw, s.weight_len(), "k_out*k_in")?;
    let params = Params {
        rows: s.k_out,
        cols: s.k_in,
        inner: s.m,
        a_row: 1,
        a_inner: s.k_out,
        b_inner: s.k_in,
        b_col: 1,
    };
    gpu.charge_flops(2.0 * (s.m as u64 * s.weight_len()) as f64);
    gpu.describe_serial_next(Serial::loop_of(params.inner as u64, DOT_TERM + PAIRWISE_TERM));
    launch(
        gpu,
        enc,
        OP,
        &pairwise_shader(&SHADER, s.m),
        OP,
        &params,
        &[("dy", dy), ("x", x), ("dw", dw)],
        grid_1d(s.weight_len(), WG),
    )
}

/// `db = Σ_m dy`, summed pairwise over the batch (see dense.wgsl).
pub fn dense_backward_bias(
    gpu: &Gpu,
    enc: &mut Encoder,
    s: &DenseShape,
    dy: Slice,
    db: Slice,
) -> Result<()> {
    const OP: &str = "dense_backward_bias";
    s.check_dims(OP)?;
    expect_len(OP, "dy", &dy, s.output_len(), "m*k_out")?;
    expect_len(OP, "db", &db, s.bias_len(), "k_out")?;
    let params =
        Params { rows: s.m, cols: s.k_out, inner: 0, a_row: 0, a_inner: 0, b_inner: 0, b_col: 0 };
    gpu.charge_flops(s.output_len() as f64);
    gpu.describe_serial_next(Serial::loop_of(s.m as u64, PAIRWISE_TERM));
    launch(
        gpu,
        enc,
        OP,
        &pairwise_shader(&SHADER, s.m),
        OP,
        &params,
        &[("dy", dy), ("db", db)],
        grid_1d(s.bias_len(), WG),
    )
}
