//! The input-VJP, `dx = convᵀ(dy, w)`: a gather over output positions, run phase by phase
//! (iy mod stride, ix mod stride) so that every pixel of a phase has the same taps.

use super::gemm::{im2col_gemm, PixelGrid, Weights};
use super::scratch;
use super::Device;
use super::{
    checked, implicit_launch, tile_count, Conv2dAlgo, Conv2dOp, Conv2dShape, GemmLanes, GemmTile,
    Params, ROW_RUN, SHADER, WG,
};
use crate::{launch, KernelError, Result};
use syncstep_gpu::{grid_1d, Encoder, Gpu, Slice};

/// [`conv2d_backward_input`](super::conv2d_backward_input) with the kernel chosen by `algo`.
/// All but Direct run once per phase (iy mod stride, ix mod stride).
pub fn conv2d_backward_input_with(
    gpu: &Device,
    enc: &mut Encoder,
    algo: Conv2dAlgo,
    shape: &Conv2dShape,
    dy: Slice,
    w: Slice,
    dx: Slice,
) -> Result<()> {
    const OP: &str = "conv2d_backward_input";
    let s = shape;
    let bindings = checked(gpu, Conv2dOp::BackwardInput, s, [dy, w, dx])?;
    if algo == Conv2dAlgo::Implicit {
        return implicit_launch(gpu, enc, Conv2dOp::BackwardInput, s, (dy, w, dx));
    }
    if algo == Conv2dAlgo::Direct {
        gpu.charge_flops(s.flops() as f64);
        return launch(
            gpu,
            enc,
            OP,
            &SHADER,
            "conv2d_backward_input_direct",
            &s.params_for(Conv2dOp::BackwardInput),
            &bindings,
            grid_1d(s.x_len(), WG),
        );
    }
    // Phase (py, px) holds the pixels iy = py + stride·a < h, ix = px + stride·b < w.
    let phases =
        (0..s.stride.min(s.h)).flat_map(|py| (0..s.stride.min(s.w)).map(move |px| (py, px)));
    let tapless = |(py, px): (u32, u32)| phase_taps(py, s.kh, s) * phase_taps(px, s.kw, s) == 0;
    // The GEMMs zero the phases no tap reaches (1×1 kernels at stride 2) with one clear of dx
    // rather than a GEMM each, where dx's buffer allows it (clears need COPY_DST).
    let cleared = algo != Conv2dAlgo::Blocked
        && phases.clone().any(tapless)
        && dx.buffer.usage().contains(wgpu::BufferUsages::COPY_DST);
    if cleared {
        enc.clear_buffer(dx.buffer, dx.offset, Some(dx.bytes()));
    }
    for (phase_y, phase_x) in phases {
        let phase_h = (s.h - phase_y).div_ceil(s.stride);
        let phase_w = (s.w - phase_x).div_ceil(s.stride);
        let params =
            Params { phase_y, phase_x, phase_h, phase_w, ..s.params_for(Conv2dOp::BackwardInput) };
        if algo == Conv2dAlgo::Blocked {
            let threads = tile_count(s.c_in as u64)
                * tile_count(s.n as u64 * phase_h as u64 * phase_w as u64);
            // The op's FLOPs, apportioned to the phases by their pixels.
            let share = (phase_h as u64 * phase_w as u64) as f64 / (s.h as u64 * s.w as u64) as f64;
            gpu.charge_flops(s.flops() as f64 * share);
            launch(
                gpu,
                enc,
                OP,
                &SHADER,
                "conv2d_backward_input_blocked",
                &params,
                &bindings,
                grid_1d(threads, WG),
            )?;
        } else if !(cleared && tapless((phase_y, phase_x))) {
            backward_input_gemm_phase(gpu, enc, algo, s, params, dy, w, dx)?;
        }
    }
    Ok(())
}

/// Taps of a kernel of size `k` that the phase starting at `phase` reaches (`phase_taps` in
/// the shader).
pub(super) fn phase_taps(phase: u32, k: u32, s: &Conv2dShape) -> u32 {
    let k0 = (phase + s.pad) % s.stride;
    if k0 >= k {
        0
    } else {
        (k - k0).div_ceil(s.stride)
    }
}

/// One phase of the input-VJP as a GEMM: weight rows over the phase's taps, then im2col of dy.
#[allow(clippy::too_many_arguments)]
pub(super) fn backward_input_gemm_phase(
    gpu: &Gpu,
    enc: &mut Encoder,
    algo: Conv2dAlgo,
    s: &Conv2dShape,
    params: Params,
    dy: Slice,
    w: Slice,
    dx: Slice,
) -> Result<()> {
    const OP: &str = "conv2d_backward_input";
    let taps =
        phase_taps(params.phase_y, s.kh, s) as u64 * phase_taps(params.phase_x, s.kw, s) as u64;
    let row4 = (s.c_out as u64 * taps).div_ceil(4);
    let params = params.with_rows(row4, s.c_out, taps);
    let gpu_err = |source| KernelError::Gpu { op: OP, source };
    let (weight_rows, taps);
    let weights =
        if matches!(algo, Conv2dAlgo::Gemm(GemmTile { lanes: GemmLanes::ChannelsGather, .. })) {
            taps = gpu.upload("conv2d taps", &gather_taps(s, &params)).map_err(gpu_err)?;
            Weights::Gather { w, taps: Slice::whole(&taps), khw: s.kh * s.kw }
        } else {
            let len = (s.c_in as u64 * row4 * 4).max(4);
            weight_rows = gpu.scratch(scratch::WEIGHT_ROWS, len).map_err(gpu_err)?;
            let rows = Slice::new(&weight_rows, 0, len);
            if row4 > 0 {
                let threads = s.c_in as u64 * row4.div_ceil(ROW_RUN);
                launch(
                    gpu,
                    enc,
                    OP,
                    &SHADER,
                    "conv2d_backward_input_weight_rows",
                    &params,
                    &[("w", w), ("weight rows", rows)],
                    grid_1d(threads, WG),
                )?;
            }
            Weights::Rows(rows)
        };
    let grid = PixelGrid {
        images: s.n,
        grid_h: params.phase_h,
        grid_w: params.phase_w,
        channels: s.c_in,
        out_h: s.h,
        out_w: s.w,
        step: s.stride,
        origin_y: params.phase_y,
        origin_x: params.phase_x,
    };
    im2col_gemm(
        gpu,
        enc,
        OP,
        algo,
        ("conv2d_backward_input_im2col", params),
        &grid,
        dy,
        weights,
        dx,
    )
}

/// conv2d_gemm_gather's table for one phase: for each k = (co, ty, tx) of an im2col row, the
/// offset in w of (co, ci, ky0 + stride·ty, kx0 + stride·tx) less that of (0, ci, 0, 0); u32
/// max pads the last vec4 (and stands alone when the phase has no taps).
pub(super) fn gather_taps(s: &Conv2dShape, params: &Params) -> Vec<u32> {
    let (taps_y, taps_x) =
        (phase_taps(params.phase_y, s.kh, s), phase_taps(params.phase_x, s.kw, s));
    let (ky0, kx0) = ((params.phase_y + s.pad) % s.stride, (params.phase_x + s.pad) % s.stride);
    let co_stride = s.c_in * s.kh * s.kw;
    let mut taps: Vec<u32> = (0..s.c_out)
        .flat_map(|co| (0..taps_y).flat_map(move |ty| (0..taps_x).map(move |tx| (co, ty, tx))))
        .map(|(co, ty, tx)| co * co_stride + (ky0 + s.stride * ty) * s.kw + kx0 + s.stride * tx)
        .collect();
    taps.resize((params.row4 as usize * 4).max(4), u32::MAX);
    taps
}
