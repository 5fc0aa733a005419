//! The forward, `y = conv(x, w)`: Direct and Blocked kernels, and the im2col + GEMM path.

use super::gemm::{im2col_gemm, PixelGrid, Weights};
use super::scratch;
use super::Device;
use super::{
    checked, implicit_launch, no_kernel, tile_count, Conv2dAlgo, Conv2dOp, Conv2dShape, SHADER, WG,
};
use crate::{launch, KernelError, Result};
use syncstep_gpu::{grid_1d, Encoder, Gpu, Slice};

/// [`conv2d_forward`](super::conv2d_forward) with the kernel chosen by `algo`.
pub fn conv2d_forward_with(
    gpu: &Device,
    enc: &mut Encoder,
    algo: Conv2dAlgo,
    shape: &Conv2dShape,
    x: Slice,
    w: Slice,
    y: Slice,
) -> Result<()> {
    const OP: &str = "conv2d_forward";
    let s = shape;
    let bindings = checked(gpu, Conv2dOp::Forward, s, [x, w, y])?;
    let (entry, threads) = match algo {
        Conv2dAlgo::Direct => ("conv2d_forward_direct", s.y_len()),
        Conv2dAlgo::Blocked => (
            "conv2d_forward_blocked",
            tile_count(s.c_out as u64)
                * tile_count(s.n as u64 * s.out_h() as u64 * s.out_w() as u64),
        ),
        Conv2dAlgo::Implicit => return implicit_launch(gpu, enc, Conv2dOp::Forward, s, (x, w, y)),
        Conv2dAlgo::Gemm(_) if algo.has(Conv2dOp::Forward) => {
            return forward_gemm(gpu, enc, algo, s, x, w, y)
        }
        Conv2dAlgo::Gemm(_) => return Err(no_kernel(OP, algo)),
    };
    gpu.charge_flops(s.flops() as f64);
    let params = s.params_for(Conv2dOp::Forward);
    launch(gpu, enc, OP, &SHADER, entry, &params, &bindings, grid_1d(threads, WG))
}

pub(super) fn forward_gemm(
    gpu: &Gpu,
    enc: &mut Encoder,
    algo: Conv2dAlgo,
    s: &Conv2dShape,
    x: Slice,
    w: Slice,
    y: Slice,
) -> Result<()> {
    const OP: &str = "conv2d_forward";
    let k_len = s.c_in as u64 * s.kh as u64 * s.kw as u64;
    let row4 = k_len.div_ceil(4);
    let taps = s.kh as u64 * s.kw as u64;
    let params = s.params_for(Conv2dOp::Forward).with_rows(row4, s.c_in, taps);
    // OIHW rows are the GEMM's weight rows as they are when they are whole vec4s.
    let padded;
    let weights = if k_len.is_multiple_of(4) {
        w
    } else {
        let len = s.c_out as u64 * row4 * 4;
        padded = gpu
            .scratch(scratch::WEIGHT_ROWS, len)
            .map_err(|source| KernelError::Gpu { op: OP, source })?;
        let rows = Slice::new(&padded, 0, len);
        let threads = s.c_out as u64 * row4;
        launch(
            gpu,
            enc,
            OP,
            &SHADER,
            "conv2d_forward_weight_rows",
            &params,
            &[("w", w), ("weight rows", rows)],
            grid_1d(threads, WG),
        )?;
        rows
    };
    let grid = PixelGrid {
        images: s.n,
        grid_h: s.out_h(),
        grid_w: s.out_w(),
        channels: s.c_out,
        out_h: s.out_h(),
        out_w: s.out_w(),
        step: 1,
        origin_y: 0,
        origin_x: 0,
    };
    im2col_gemm(
        gpu,
        enc,
        OP,
        algo,
        ("conv2d_forward_im2col", params),
        &grid,
        x,
        Weights::Rows(weights),
        y,
    )
}
