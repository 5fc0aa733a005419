//! Softmax cross-entropy with label smoothing: per-example losses, and the gradient of the
//! step's loss with respect to the logits. See shaders/cross_entropy.wgsl. The step's loss, the
//! per-example losses summed in the canonical order and divided by the global batch, is the
//! host's (`step`): replicas' losses then add up to the single device's bit for bit.
//!
//! Labels are u32 in `[0, k)`. A shader cannot return an error, so an example whose label is
//! `>= k` gets a NaN loss and a NaN gradient row: validate labels on the host before upload.

use super::{expect_len, expect_positive, launch, KernelError, Result};
use syncstep_gpu::{Encoder, Gpu, Serial, Shader, Slice};

pub(crate) const SHADER: Shader =
    Shader::file("cross_entropy", include_str!("../shaders/cross_entropy.wgsl"));
/// Invocations of a row's workgroup (`WG` in the shader).
const WG: u32 = 64;

/// `m` examples over `k` classes: logits `[m, k]`, labels `[m]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CrossEntropyShape {
    pub m: u32,
    pub k: u32,
}

impl CrossEntropyShape {
    pub fn logits_len(&self) -> u64 {
        self.m as u64 * self.k as u64
    }
    pub fn labels_len(&self) -> u64 {
        self.m as u64
    }

    /// What an invocation waits for in series over `passes` passes over a row (each a strided
    /// loop of loads, then a workgroup reduction: log₂ WG rounds, a barrier each).
    fn serial(&self, passes: u32) -> Serial {
        let steps = self.k.div_ceil(WG);
        let rounds = WG.ilog2() + 2;
        Serial {
            loads: passes * steps,
            barriers: passes * rounds,
            instructions: passes * (8 * steps + 6 * rounds),
        }
    }

    /// Checks dimensions, hyper-parameters, logits and labels; the uniform every entry point
    /// reads (the forward's divisor is unused: 1).
    fn check(
        &self,
        op: &'static str,
        smoothing: f32,
        divisor: f32,
        logits: &Slice,
        labels: &Slice,
    ) -> Result<Params> {
        expect_positive(op, "m", self.m)?;
        expect_positive(op, "k", self.k)?;
        if !(0.0..1.0).contains(&smoothing) {
            return Err(KernelError::Arg {
                op,
                arg: "smoothing",
                problem: format!("is {smoothing}, expected 0 <= smoothing < 1"),
            });
        }
        if !(divisor.is_finite() && divisor > 0.0) {
            return Err(KernelError::Arg {
                op,
                arg: "divisor",
                problem: format!("is {divisor}, expected a finite value > 0"),
            });
        }
        expect_len(op, "logits", logits, self.logits_len(), "m*k")?;
        expect_len(op, "labels", labels, self.labels_len(), "m")?;
        Ok(Params { m: self.m, k: self.k, smoothing, divisor, nan: f32::NAN })
    }
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    m: u32,
    k: u32,
    smoothing: f32,
    divisor: f32,
    nan: f32,
}

/// Per-example losses ℓ_i into `losses` `[m]`. `smoothing` is ε in `[0, 1)` (0.1 is usual).
pub fn cross_entropy_forward(
    gpu: &Gpu,
    enc: &mut Encoder,
    s: &CrossEntropyShape,
    smoothing: f32,
    logits: Slice,
    labels: Slice,
    losses: Slice,
) -> Result<()> {
    const OP: &str = "cross_entropy_forward";
    let params = s.check(OP, smoothing, 1.0, &logits, &labels)?;
    expect_len(OP, "losses", &losses, s.labels_len(), "m")?;
    let bindings = [("logits", logits), ("labels", labels), ("losses", losses)];
    gpu.describe_serial_next(s.serial(3));
    launch(gpu, enc, OP, &SHADER, OP, &params, &bindings, [s.m, 1, 1])
}

/// `dlogits = (softmax(logits) − q) / divisor`, the gradient of the step's loss (Σ ℓ_i / D, D the
/// global batch); `dlogits` is `[m, k]`, overwritten.
#[allow(clippy::too_many_arguments)] // the signature mirrors the math: shape, ε, D, the tensors
pub fn cross_entropy_backward(
    gpu: &Gpu,
    enc: &mut Encoder,
    s: &CrossEntropyShape,
    smoothing: f32,
    divisor: f32,
    logits: Slice,
    labels: Slice,
    dlogits: Slice,
) -> Result<()> {
    const OP: &str = "cross_entropy_backward";
    let params = s.check(OP, smoothing, divisor, &logits, &labels)?;
    expect_len(OP, "dlogits", &dlogits, s.logits_len(), "m*k")?;
    gpu.describe_serial_next(s.serial(2));
    launch(
        gpu,
        enc,
        OP,
        &SHADER,
        OP,
        &params,
        &[("logits", logits), ("labels", labels), ("dlogits", dlogits)],
        [s.m, 1, 1],
    )
}
