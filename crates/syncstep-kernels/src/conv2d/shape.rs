//! A convolution's shape: its sizes, the checks a launch makes before recording anything, and
//! the uniform the shaders read.

use serde::{Deserialize, Serialize};

use super::{Conv2dOp, TILE};
use crate::{expect_len, expect_positive, KernelError, Result};
use syncstep_gpu::{Gpu, Slice};

/// One convolution: input `[n, c_in, h, w]`, weights `[c_out, c_in, kh, kw]`, output
/// `[n, c_out, out_h, out_w]`, zero padding `pad` on every side, no bias.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Conv2dShape {
    pub n: u32,
    pub c_in: u32,
    pub h: u32,
    pub w: u32,
    pub c_out: u32,
    pub kh: u32,
    pub kw: u32,
    pub stride: u32,
    pub pad: u32,
}

/// How an output's sum over k runs in segments, by the size of the op's output map: maps of at
/// most `plane` pixels sum `channels` summed channels a segment (the first rule that holds),
/// larger ones all of them. Small maps give few outputs at small batches, too few to fill a GPU
/// unless segments run side by side: a map of 196 pixels (14×14, ResNet's layer3 at 224²)
/// gives 1,568 at a batch of 8. Multiples of 16 channels, so a segment is whole slices of the
/// GPU family's tiles (8 or 16 k), whatever the taps.
pub const SEGMENTS: [Segments; 2] =
    [Segments { plane: 16, channels: 16 }, Segments { plane: 196, channels: 64 }];

/// One rule of [`SEGMENTS`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segments {
    pub plane: u64,
    pub channels: u32,
}

pub(super) fn out_size(size: u32, k: u32, stride: u32, pad: u32) -> u32 {
    ((size as u64 + 2 * pad as u64).saturating_sub(k as u64) / stride.max(1) as u64 + 1) as u32
}

impl Conv2dShape {
    /// `(h + 2·pad − kh) / stride + 1`; meaningful for a shape `validate` accepts.
    pub fn out_h(&self) -> u32 {
        out_size(self.h, self.kh, self.stride, self.pad)
    }
    /// `(w + 2·pad − kw) / stride + 1`; meaningful for a shape `validate` accepts.
    pub fn out_w(&self) -> u32 {
        out_size(self.w, self.kw, self.stride, self.pad)
    }
    /// Elements of the input (and of its gradient): n·c_in·h·w.
    pub fn x_len(&self) -> u64 {
        [self.n, self.c_in, self.h, self.w].iter().map(|&d| d as u64).product()
    }
    /// Elements of `op`'s two inputs and its output, in
    /// [`conv2d_launch_with`](super::conv2d_launch_with)'s order.
    pub fn operand_lens(&self, op: Conv2dOp) -> [u64; 3] {
        match op {
            Conv2dOp::Forward => [self.x_len(), self.w_len(), self.y_len()],
            Conv2dOp::BackwardInput => [self.y_len(), self.w_len(), self.x_len()],
            Conv2dOp::BackwardWeight => [self.y_len(), self.x_len(), self.w_len()],
        }
    }
    /// Elements of the weights (and of their gradient): c_out·c_in·kh·kw.
    pub fn w_len(&self) -> u64 {
        [self.c_out, self.c_in, self.kh, self.kw].iter().map(|&d| d as u64).product()
    }
    /// Elements of the output (and of its gradient): n·c_out·out_h·out_w.
    pub fn y_len(&self) -> u64 {
        [self.n, self.c_out, self.out_h(), self.out_w()].iter().map(|&d| d as u64).product()
    }
    /// Floating-point operations of the forward, a multiply-add counting 2; each backward
    /// (input or weight) does the same number.
    pub fn flops(&self) -> u64 {
        2 * self.y_len() * self.c_in as u64 * self.kh as u64 * self.kw as u64
    }

    /// Refuses a zero dimension, stride 0, a kernel larger than the padded input, and sizes the
    /// shaders' 32-bit signed index arithmetic cannot hold. `op` names the launch in the error.
    pub fn validate(&self, op: &'static str) -> Result<()> {
        let dims = [
            ("n", self.n),
            ("c_in", self.c_in),
            ("h", self.h),
            ("w", self.w),
            ("c_out", self.c_out),
            ("kh", self.kh),
            ("kw", self.kw),
            ("stride", self.stride),
        ];
        for (arg, v) in dims {
            expect_positive(op, arg, v)?;
        }
        for (arg, k, size, axis) in [("kh", self.kh, self.h, "h"), ("kw", self.kw, self.w, "w")] {
            let padded = size as u64 + 2 * self.pad as u64;
            if k as u64 > padded {
                let problem =
                    format!("is {k}, larger than the padded input {axis} + 2·pad = {padded}");
                return Err(KernelError::Arg { op, arg, problem });
            }
        }
        let limit = i32::MAX as u64;
        let sizes = [
            ("x", self.x_len(), "n·c_in·h·w"),
            ("w", self.w_len(), "c_out·c_in·kh·kw"),
            ("y", self.y_len(), "n·c_out·out_h·out_w"),
            (
                "pad",
                (self.h as u64 + 2 * self.pad as u64) * (self.w as u64 + 2 * self.pad as u64),
                "(h + 2·pad)·(w + 2·pad)",
            ),
        ];
        for (arg, size, formula) in sizes {
            if size > limit {
                let problem = format!("gives {formula} = {size}, more than the shaders' 32-bit indices allow ({limit})");
                return Err(KernelError::Arg { op, arg, problem });
            }
        }
        Ok(())
    }

    /// How many of an output's summed channels (c_in for the forward, c_out for the input-VJP)
    /// each segment of its sum over k holds: by `SEGMENTS`' first rule the op's output map
    /// meets, else all of them (one segment). Every variant sums
    /// each segment from +0 in k's order and adds the segments' sums in order to a total from
    /// +0, so a GPU may take the segments in separate workgroups and still give every variant's
    /// bits. The rule reads the shape without the batch, so the order is the same at every batch
    /// and shard; the weight gradient sums over pixels, not k, and has no segments.
    pub fn sum_segment(&self, op: Conv2dOp) -> u32 {
        let (channels, plane) = match op {
            Conv2dOp::Forward => (self.c_in, self.out_h() as u64 * self.out_w() as u64),
            Conv2dOp::BackwardInput => (self.c_out, self.h as u64 * self.w as u64),
            Conv2dOp::BackwardWeight => return self.c_in.max(self.c_out),
        };
        let rule = SEGMENTS.into_iter().find(|r| plane <= r.plane);
        rule.map_or(channels, |r| r.channels.min(channels))
    }

    /// The uniform for `op`'s kernels, with its sums' segments (see [`Self::sum_segment`]).
    pub(super) fn params_for(&self, op: Conv2dOp) -> Params {
        Params { seg_channels: self.sum_segment(op), ..self.params() }
    }

    /// The uniform, its sums over k in one segment.
    pub(super) fn params(&self) -> Params {
        Params {
            n: self.n,
            c_in: self.c_in,
            h: self.h,
            w: self.w,
            c_out: self.c_out,
            kh: self.kh,
            kw: self.kw,
            stride: self.stride,
            pad: self.pad,
            out_h: self.out_h(),
            out_w: self.out_w(),
            phase_y: 0,
            phase_x: 0,
            phase_h: 0,
            phase_w: 0,
            row_begin: 0,
            row_count: 0,
            row4: 0,
            crop_y: 0,
            crop_x: 0,
            crop_h: 0,
            crop_w: 0,
            dw_kh: self.kh,
            dw_kw: self.kw,
            seg_channels: self.c_in.max(self.c_out),
            seg4: 0,
        }
    }
}

#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
pub(super) struct Params {
    pub(super) n: u32,
    pub(super) c_in: u32,
    pub(super) h: u32,
    pub(super) w: u32,
    pub(super) c_out: u32,
    pub(super) kh: u32,
    pub(super) kw: u32,
    pub(super) stride: u32,
    pub(super) pad: u32,
    pub(super) out_h: u32,
    pub(super) out_w: u32,
    pub(super) phase_y: u32,
    pub(super) phase_x: u32,
    pub(super) phase_h: u32,
    pub(super) phase_w: u32,
    pub(super) row_begin: u32,
    pub(super) row_count: u32,
    pub(super) row4: u32,
    pub(super) crop_y: u32,
    pub(super) crop_x: u32,
    pub(super) crop_h: u32,
    pub(super) crop_w: u32,
    pub(super) dw_kh: u32,
    pub(super) dw_kw: u32,
    pub(super) seg_channels: u32,
    pub(super) seg4: u32,
}

impl Params {
    /// With the GEMMs' segment length: `row4` vec4s of k per row, over `channels` summed
    /// channels of `taps` taps each (k = (channel, tap)); one segment when there is one.
    pub(super) fn with_rows(self, row4: u64, channels: u32, taps: u64) -> Params {
        let seg4 = if self.seg_channels < channels {
            // SEGMENTS' channels are multiples of 4, so every segment is whole vec4s.
            self.seg_channels as u64 * taps / 4
        } else {
            row4
        };
        Params { row4: row4 as u32, seg4: seg4.max(1) as u32, ..self }
    }
}

/// Validates `shape` and each binding's length (inputs first, output last), before anything
/// is recorded; returns the bindings named as the shader orders them.
pub(super) fn checked<'a>(
    gpu: &Gpu,
    op: Conv2dOp,
    shape: &Conv2dShape,
    slices: [Slice<'a>; 3],
) -> Result<[(&'static str, Slice<'a>); 3]> {
    shape.validate(op.name())?;
    let (names, lens) = (op.operands(), shape.operand_lens(op));
    for i in 0..3 {
        expect_len(op.name(), names[i].0, &slices[i], lens[i], names[i].1)?;
        // Named as the caller knows it, before a variant binds it under another name.
        gpu.check_binding(&format!("argument `{}`", names[i].0), &slices[i])
            .map_err(|source| KernelError::Gpu { op: op.name(), source })?;
    }
    Ok([0, 1, 2].map(|i| (names[i].0, slices[i])))
}

pub(super) fn tile_count(len: u64) -> u64 {
    len.div_ceil(TILE)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Segments where the op's output map has at most 16 pixels, 16 summed channels each, at
    /// every batch; 64 on maps of 17 to 196 pixels; one segment elsewhere and for the weight
    /// gradient.
    #[test]
    fn sums_run_in_segments_on_small_maps_at_any_batch() {
        let layer3 = Conv2dShape {
            n: 1,
            c_in: 256,
            h: 2,
            w: 2,
            c_out: 256,
            kh: 3,
            kw: 3,
            stride: 1,
            pad: 1,
        };
        let down = Conv2dShape { c_in: 128, h: 8, w: 8, c_out: 256, stride: 2, ..layer3 };
        let at_224 = Conv2dShape { h: 14, w: 14, ..layer3 };
        for n in [1, 3, 8, 256] {
            let (layer3, down) = (Conv2dShape { n, ..layer3 }, Conv2dShape { n, ..down });
            assert_eq!(layer3.sum_segment(Conv2dOp::Forward), 16);
            assert_eq!(layer3.sum_segment(Conv2dOp::BackwardInput), 16);
            // The forward's 4×4 output sums 16 channels a segment, the input-VJP's 8×8 map 64.
            assert_eq!(down.sum_segment(Conv2dOp::Forward), 16);
            assert_eq!(down.sum_segment(Conv2dOp::BackwardInput), 64);
            assert_eq!(Conv2dShape { n, ..at_224 }.sum_segment(Conv2dOp::Forward), 64);
        }
        let large = Conv2dShape { h: 15, w: 14, ..layer3 };
        assert_eq!(large.sum_segment(Conv2dOp::Forward), 256, "a 15×14 map");
        let wide = Conv2dShape { h: 5, w: 4, ..layer3 };
        assert_eq!(wide.sum_segment(Conv2dOp::Forward), 64, "a 5×4 map");
        let few = Conv2dShape { c_in: 12, ..layer3 };
        assert_eq!(few.sum_segment(Conv2dOp::Forward), 12, "fewer channels than a segment");
        let params = layer3.params_for(Conv2dOp::Forward).with_rows(576, 256, 9);
        assert_eq!((params.seg_channels, params.seg4), (16, 36), "16 channels × 9 taps / 4");
        let whole = layer3.params().with_rows(576, 256, 9);
        assert_eq!(whole.seg4, 576, "one segment");
    }
}
