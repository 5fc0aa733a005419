//! Global average pool (the head's spatial mean) and its backward. See shaders/avgpool.wgsl.

use super::{expect_len, expect_positive, launch, Result};
use syncstep_gpu::{grid_1d, Encoder, Gpu, Serial, Shader, Slice};

pub(crate) const SHADER: Shader = Shader::file("avgpool", include_str!("../shaders/avgpool.wgsl"));
const WG: u32 = 256;

/// `x` is `[n, c, hw]` (NCHW with h·w flattened), `y` is `[n, c]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AvgPoolShape {
    pub n: u32,
    pub c: u32,
    pub hw: u32,
}

impl AvgPoolShape {
    /// Number of (n, c) planes, which is also the output length.
    pub fn planes(&self) -> u64 {
        self.n as u64 * self.c as u64
    }
    pub fn input_len(&self) -> u64 {
        self.planes() * self.hw as u64
    }
    pub fn output_len(&self) -> u64 {
        self.planes()
    }

    fn check(
        &self,
        op: &'static str,
        input: (&'static str, &Slice),
        output: (&'static str, &Slice),
    ) -> Result<Params> {
        expect_positive(op, "n", self.n)?;
        expect_positive(op, "c", self.c)?;
        expect_positive(op, "hw", self.hw)?;
        expect_len(op, input.0, input.1, self.input_len(), "n*c*hw")?;
        expect_len(op, output.0, output.1, self.output_len(), "n*c")?;
        Ok(Params { planes: self.planes() as u32, hw: self.hw })
    }
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Params {
    planes: u32,
    hw: u32,
}

/// `y[n, c] = mean over hw of x[n, c, :]`, each mean summed in ascending order.
pub fn global_avgpool_forward(
    gpu: &Gpu,
    enc: &mut Encoder,
    s: &AvgPoolShape,
    x: Slice,
    y: Slice,
) -> Result<()> {
    const OP: &str = "global_avgpool_forward";
    let params = s.check(OP, ("x", &x), ("y", &y))?;
    gpu.describe_serial_next(Serial::loop_of(params.hw as u64, 2));
    launch(gpu, enc, OP, &SHADER, OP, &params, &[("x", x), ("y", y)], grid_1d(s.output_len(), WG))
}

/// `dx[n, c, :] = dy[n, c] / hw`, overwriting dx.
pub fn global_avgpool_backward(
    gpu: &Gpu,
    enc: &mut Encoder,
    s: &AvgPoolShape,
    dy: Slice,
    dx: Slice,
) -> Result<()> {
    const OP: &str = "global_avgpool_backward";
    let params = s.check(OP, ("dx", &dx), ("dy", &dy))?;
    launch(
        gpu,
        enc,
        OP,
        &SHADER,
        OP,
        &params,
        &[("dy", dy), ("dx", dx)],
        grid_1d(s.input_len(), WG),
    )
}
