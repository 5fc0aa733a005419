//! The kernel self-check: a few real kernels at small ResNet-34 shapes, run on whatever device
//! the caller has (lavapipe natively, the visitor's GPU in a browser) and held to the f64
//! reference computed in the same process (in the same wasm, in a browser). It is the browser
//! face's first proof that WGSL compiled by that browser computes what the reference says,
//! before the equivalence gates run there.
//!
//! Each output buffer is poisoned with NaN first, so an element a kernel leaves unwritten
//! fails the check. Errors are norm-relative, ‖gpu − ref‖₂ / ‖ref‖₂, as the gates measure.
//! Nothing here reads a clock or the file system: it runs unchanged on wasm32.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use serde_json::Value;

use crate::compare::norm_rel;
use crate::gpu::{Encoder, Gpu, GpuError, Slice};
use crate::kernels::conv2d::{self as kconv, Conv2dShape};
use crate::kernels::Device;
use crate::kernels::{elementwise as kelem, KernelError};
use crate::reference::conv2d::{self as rconv, ConvGeometry};
use crate::reference::elementwise as relem;

#[derive(Debug, thiserror::Error)]
pub enum SelfCheckError {
    #[error(transparent)]
    Kernel(#[from] KernelError),
    #[error(transparent)]
    Gpu(#[from] GpuError),
}

pub type Result<T, E = SelfCheckError> = std::result::Result<T, E>;

/// One kernel's outcome: `{kernel, shape, elements, error, tolerance}` as reports write it
/// ([`KernelCheck::to_json`] adds `pass`).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct KernelCheck {
    /// The kernel's launcher name, as in `kernels` and `reference`.
    pub kernel: &'static str,
    /// The shapes, human-readable: `x[2,3,16,16] w[64,3,7,7] → y[2,64,8,8] (7×7/s2/p3)`.
    pub shape: String,
    /// Output elements compared.
    pub elements: u64,
    /// ‖gpu − ref‖₂ / ‖ref‖₂; infinite when the GPU output has a NaN or infinity.
    pub error: f64,
    pub tolerance: f64,
}

impl KernelCheck {
    #[must_use]
    pub fn passed(&self) -> bool {
        self.error <= self.tolerance
    }

    /// The outcome with whether it passed, as the report and the page's progress give it.
    pub fn to_json(&self) -> Value {
        serde_json::to_value(Judged { outcome: self, pass: self.passed() })
            .expect("an outcome serialises")
    }
}

/// The whole self-check: every kernel's outcome, on one adapter, from one seed.
#[derive(Clone, Debug, PartialEq)]
pub struct SelfCheck {
    pub adapter: String,
    pub seed: u64,
    pub kernels: Vec<KernelCheck>,
}

impl SelfCheck {
    #[must_use]
    pub fn passed(&self) -> bool {
        !self.kernels.is_empty() && self.kernels.iter().all(KernelCheck::passed)
    }

    /// The worst kernel relative to its tolerance, for a one-line summary.
    pub fn worst(&self) -> Option<&KernelCheck> {
        self.kernels
            .iter()
            .max_by(|a, b| (a.error / a.tolerance).total_cmp(&(b.error / b.tolerance)))
    }

    pub fn to_json(&self) -> String {
        let kernels = self.kernels.iter().map(|k| Judged { outcome: k, pass: k.passed() });
        let report = Report {
            check: "kernels",
            adapter: &self.adapter,
            seed: self.seed,
            pass: self.passed(),
            kernels: kernels.collect(),
        };
        serde_json::to_string(&report).expect("a report serialises")
    }
}

/// A kernel's outcome and whether it passed.
#[derive(serde::Serialize)]
struct Judged<'a> {
    #[serde(flatten)]
    outcome: &'a KernelCheck,
    pass: bool,
}

/// The self-check's report: `{check, adapter, seed, pass, kernels}`.
#[derive(serde::Serialize)]
struct Report<'a> {
    check: &'static str,
    adapter: &'a str,
    seed: u64,
    pass: bool,
    kernels: Vec<Judged<'a>>,
}

/// What the self-check reports as it goes: a kernel about to run, then its outcome.
#[derive(Clone, Copy, Debug)]
pub enum Progress<'a> {
    Started { index: usize, total: usize, kernel: &'static str },
    Finished { index: usize, total: usize, check: &'a KernelCheck },
}

#[derive(Clone, Copy)]
enum ConvOp {
    Forward,
    BackwardInput,
    BackwardWeight,
}

#[derive(Clone, Copy)]
enum ElementwiseOp {
    ReluForward,
    ReluBackward,
    Add,
}

/// One case of the check; its data come from the seed.
enum Case {
    Conv { op: ConvOp, shape: Conv2dShape, tolerance: f64 },
    Elementwise { op: ElementwiseOp, len: usize },
}

impl Case {
    fn kernel(&self) -> &'static str {
        match self {
            Case::Conv { op: ConvOp::Forward, .. } => "conv2d_forward",
            Case::Conv { op: ConvOp::BackwardInput, .. } => "conv2d_backward_input",
            Case::Conv { op: ConvOp::BackwardWeight, .. } => "conv2d_backward_weight",
            Case::Elementwise { op: ElementwiseOp::ReluForward, .. } => "relu_forward",
            Case::Elementwise { op: ElementwiseOp::ReluBackward, .. } => "relu_backward",
            Case::Elementwise { op: ElementwiseOp::Add, .. } => "add",
        }
    }
}

const fn conv(
    n: u32,
    c_in: u32,
    hw: u32,
    c_out: u32,
    k: u32,
    stride: u32,
    pad: u32,
) -> Conv2dShape {
    Conv2dShape { n, c_in, h: hw, w: hw, c_out, kh: k, kw: k, stride, pad }
}

/// The kernels checked, in order: ResNet-34's stem, a basic-block 3×3, a stride-2 input-VJP, a
/// 1×1 projection's weight gradient, ReLU both ways and the residual add, at sizes small enough
/// for a software rasteriser (SwiftShader) and the f64 reference to take well under a second each.
/// Tolerances are the kernel tests' own (tests/suite/conv2d.rs, tests/suite/elementwise.rs).
fn cases() -> Vec<Case> {
    vec![
        Case::Conv { op: ConvOp::Forward, shape: conv(2, 3, 16, 64, 7, 2, 3), tolerance: 1e-5 },
        Case::Conv { op: ConvOp::Forward, shape: conv(2, 64, 8, 64, 3, 1, 1), tolerance: 1e-5 },
        Case::Conv {
            op: ConvOp::BackwardInput,
            shape: conv(2, 64, 8, 128, 3, 2, 1),
            tolerance: 1e-5,
        },
        Case::Conv {
            op: ConvOp::BackwardWeight,
            shape: conv(2, 64, 8, 128, 1, 2, 0),
            tolerance: 1e-4,
        },
        Case::Elementwise { op: ElementwiseOp::ReluForward, len: 2 * 64 * 8 * 8 + 3 },
        Case::Elementwise { op: ElementwiseOp::ReluBackward, len: 2 * 64 * 8 * 8 + 3 },
        Case::Elementwise { op: ElementwiseOp::Add, len: 2 * 64 * 8 * 8 + 3 },
    ]
}

/// Uniform values in [-1, 1) from `seed`.
fn uniform(seed: u64, n: usize) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

fn to_f64(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

fn dims(d: &[u32]) -> String {
    format!("[{}]", d.iter().map(u32::to_string).collect::<Vec<_>>().join(","))
}

fn geometry(s: &Conv2dShape) -> ConvGeometry {
    let u = |v: u32| v as usize;
    ConvGeometry {
        n: u(s.n),
        c_in: u(s.c_in),
        h: u(s.h),
        w: u(s.w),
        c_out: u(s.c_out),
        kh: u(s.kh),
        kw: u(s.kw),
        stride: u(s.stride),
        pad: u(s.pad),
    }
}

/// Runs every case on `gpu`, reporting through `progress` before and after each kernel. A
/// kernel that computes wrong numbers is a failed [`KernelCheck`], not an error; errors are
/// launches the device refused or a lost device.
pub async fn run(gpu: &Device, seed: u64, progress: &mut dyn FnMut(Progress)) -> Result<SelfCheck> {
    let cases = cases();
    let total = cases.len();
    let mut kernels = Vec::with_capacity(total);
    for (index, case) in cases.iter().enumerate() {
        progress(Progress::Started { index, total, kernel: case.kernel() });
        let case_seed = seed.wrapping_mul(1000).wrapping_add(index as u64 * 10);
        let kernel = case.kernel();
        let check = match *case {
            Case::Conv { op, shape, tolerance } => {
                check_conv(gpu, kernel, op, &shape, tolerance, case_seed).await?
            }
            Case::Elementwise { op, len } => {
                check_elementwise(gpu, kernel, op, len, case_seed).await?
            }
        };
        progress(Progress::Finished { index, total, check: &check });
        kernels.push(check);
    }
    Ok(SelfCheck { adapter: crate::gpu::describe(&gpu.info), seed, kernels })
}

/// Uploads `inputs`, records `launch` into one encoder writing a NaN-poisoned output of `len`
/// elements, submits it and reads the output back.
async fn run_kernel(
    gpu: &Gpu,
    inputs: &[&[f32]],
    len: u64,
    launch: impl FnOnce(&mut Encoder, &[Slice], Slice) -> Result<(), KernelError>,
) -> Result<Vec<f32>> {
    let buffers =
        inputs.iter().map(|v| gpu.upload("selfcheck input", v)).collect::<Result<Vec<_>, _>>()?;
    let out = gpu.buffer("selfcheck output", len)?;
    gpu.poison(Slice::whole(&out));
    let slices: Vec<Slice> = buffers.iter().map(Slice::whole).collect();
    let mut enc = gpu.encoder();
    launch(&mut enc, &slices, Slice::whole(&out))?;
    gpu.submit(enc).await?;
    Ok(gpu.read_f32(Slice::whole(&out)).await?)
}

async fn check_conv(
    gpu: &Device,
    kernel: &'static str,
    op: ConvOp,
    s: &Conv2dShape,
    tolerance: f64,
    seed: u64,
) -> Result<KernelCheck> {
    let g = geometry(s);
    let x = uniform(seed, s.x_len() as usize);
    let w = uniform(seed + 1, s.w_len() as usize);
    let dy = uniform(seed + 2, s.y_len() as usize);
    let (x_dims, w_dims, y_dims) = (
        dims(&[s.n, s.c_in, s.h, s.w]),
        dims(&[s.c_out, s.c_in, s.kh, s.kw]),
        dims(&[s.n, s.c_out, s.out_h(), s.out_w()]),
    );
    let geometry_note = format!("{}×{}/s{}/p{}", s.kh, s.kw, s.stride, s.pad);
    let (got, want, shape) = match op {
        ConvOp::Forward => {
            let got = run_kernel(gpu, &[&x, &w], s.y_len(), |enc, i, out| {
                kconv::conv2d_forward(gpu, enc, s, i[0], i[1], out)
            })
            .await?;
            (
                got,
                rconv::conv2d_forward(&g, &to_f64(&x), &to_f64(&w)),
                format!("x{x_dims} w{w_dims} → y{y_dims} ({geometry_note})"),
            )
        }
        ConvOp::BackwardInput => {
            let got = run_kernel(gpu, &[&dy, &w], s.x_len(), |enc, i, out| {
                kconv::conv2d_backward_input(gpu, enc, s, i[0], i[1], out)
            })
            .await?;
            (
                got,
                rconv::conv2d_backward_input(&g, &to_f64(&dy), &to_f64(&w)),
                format!("dy{y_dims} w{w_dims} → dx{x_dims} ({geometry_note})"),
            )
        }
        ConvOp::BackwardWeight => {
            let got = run_kernel(gpu, &[&dy, &x], s.w_len(), |enc, i, out| {
                kconv::conv2d_backward_weight(gpu, enc, s, i[0], i[1], out)
            })
            .await?;
            (
                got,
                rconv::conv2d_backward_weight(&g, &to_f64(&dy), &to_f64(&x)),
                format!("dy{y_dims} x{x_dims} → dw{w_dims} ({geometry_note})"),
            )
        }
    };
    Ok(KernelCheck {
        kernel,
        shape,
        elements: want.len() as u64,
        error: norm_rel(&got, &want),
        tolerance,
    })
}

async fn check_elementwise(
    gpu: &Gpu,
    kernel: &'static str,
    op: ElementwiseOp,
    len: usize,
    seed: u64,
) -> Result<KernelCheck> {
    // A gate different from the input, so the mask is exercised rather than implied.
    let (a, b) = (uniform(seed, len), uniform(seed + 1, len));
    let (a64, b64) = (to_f64(&a), to_f64(&b));
    let n = len as u64;
    let (got, want, shape) = match op {
        ElementwiseOp::ReluForward => (
            run_kernel(gpu, &[&a, &b], n, |enc, i, out| {
                kelem::relu_forward(gpu, enc, i[0], i[1], out)
            })
            .await?,
            relem::relu_forward(&a64, &b64),
            format!("x[{len}] gate[{len}] → y[{len}]"),
        ),
        ElementwiseOp::ReluBackward => (
            run_kernel(gpu, &[&a, &b], n, |enc, i, out| {
                kelem::relu_backward(gpu, enc, i[0], i[1], out)
            })
            .await?,
            relem::relu_backward(&a64, &b64),
            format!("dy[{len}] gate[{len}] → dx[{len}]"),
        ),
        ElementwiseOp::Add => (
            run_kernel(gpu, &[&a, &b], n, |enc, i, out| kelem::add(gpu, enc, i[0], i[1], out))
                .await?,
            relem::add(&a64, &b64),
            format!("a[{len}] + b[{len}] → out[{len}]"),
        ),
    };
    Ok(KernelCheck { kernel, shape, elements: n, error: norm_rel(&got, &want), tolerance: 1e-7 })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn report_json_says_which_kernel_failed() {
        let ok = KernelCheck {
            kernel: "add",
            shape: "a[3]".into(),
            elements: 3,
            error: 0.0,
            tolerance: 1e-7,
        };
        let bad = KernelCheck {
            kernel: "relu_forward",
            shape: "x[3]".into(),
            elements: 3,
            error: f64::INFINITY,
            tolerance: 1e-7,
        };
        let report = SelfCheck { adapter: "test".into(), seed: 1, kernels: vec![ok, bad] };
        assert!(!report.passed());
        assert_eq!(report.worst().map(|k| k.kernel), Some("relu_forward"));
        let j = report.to_json();
        assert!(j.contains(r#""pass":false"#) && j.contains(r#""error":null"#), "{j}");
    }
}
