//! Cropped kernels: on maps smaller than a kernel's reach some taps read only padding, and the
//! plain launchers run the convolution of the other taps (see [`Conv2dShape::crop`]).

use super::backward_weight::backward_weight_blocked;
use super::scratch;
use super::shape::checked;
use super::Device;
use super::{
    conv2d_algo, conv2d_launch_with, Conv2dAlgo, Conv2dOp, Conv2dShape, Params, SHADER, WG,
};
use crate::{expect_len, launch, KernelError, Result};
use syncstep_gpu::{grid_1d, Encoder, Gpu, Slice};

/// The taps of a kernel that read inside the input for some output, where that is not all of
/// them: `shape` is the convolution of those taps alone, whose first row and column are
/// (`ky`, `kx`) of the whole kernel. See [`Conv2dShape::crop`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Crop {
    pub ky: u32,
    pub kx: u32,
    pub shape: Conv2dShape,
}

impl Conv2dShape {
    /// On maps smaller than the kernel's reach some taps read padding for every output:
    /// ResNet-34's 3×3 convolutions on the 1×1 maps of layer4 at a 32² input read only their
    /// centre tap. The convolution of the other taps (a smaller kernel with less padding and the
    /// same output size) has the same nonzero terms in the same order, and the dropped taps'
    /// weight gradient is +0, which is what every variant sums there. So the plain launchers
    /// run that one, and skip 8/9 of layer4's arithmetic. None where every tap reads the input
    /// somewhere, or where the kept taps would need a padding one `pad` cannot express (rows
    /// and columns cropped differently). Meaningful for a shape `validate` accepts.
    pub fn crop(&self) -> Option<Crop> {
        // Tap t of an axis reads input o·stride − pad + t for outputs o < out. Kept: from the
        // first tap that reads inside for some o to the last (with stride > 1 a tap between
        // may read only padding, and is kept).
        let axis = |size: u32, k: u32, out: u32| {
            let reads = |&t: &u32| {
                (0..out as i64).any(|o| {
                    (0..size as i64)
                        .contains(&(o * self.stride as i64 - self.pad as i64 + t as i64))
                })
            };
            let first = (0..k).find(reads)?;
            let last = (0..k).rev().find(reads)?;
            Some((first, last + 1 - first))
        };
        let (ky, kh) = axis(self.h, self.kh, self.out_h())?;
        let (kx, kw) = axis(self.w, self.kw, self.out_w())?;
        let shape = Conv2dShape { kh, kw, pad: self.pad - ky, ..*self };
        let expressible =
            ky == kx && shape.out_h() == self.out_h() && shape.out_w() == self.out_w();
        ((kh, kw) != (self.kh, self.kw) && expressible).then_some(Crop { ky, kx, shape })
    }
}

/// `op` with `algo` run on `crop` (from `shape.crop()`; None: the whole kernel), as
/// [`conv2d_launch`](super::conv2d_launch) runs its choice. A cropped weight gradient needs
/// `out` with COPY_DST.
#[allow(clippy::too_many_arguments)]
pub fn conv2d_launch_cropped(
    gpu: &Device,
    enc: &mut Encoder,
    op: Conv2dOp,
    algo: Conv2dAlgo,
    shape: &Conv2dShape,
    crop: Option<&Crop>,
    a: Slice,
    b: Slice,
    out: Slice,
) -> Result<()> {
    let [_, (_, w), _] = checked(gpu, op, shape, [a, b, out])?;
    let Some(crop) = crop else { return conv2d_launch_with(gpu, enc, op, algo, shape, a, b, out) };
    if op == Conv2dOp::BackwardWeight {
        // The dropped taps' gradient is +0: a clear, then the kept taps' kernel.
        if !out.buffer.usage().contains(wgpu::BufferUsages::COPY_DST) {
            return Err(KernelError::Arg {
                op: op.name(),
                arg: "dw",
                problem: "needs COPY_DST to run on a cropped kernel (its dropped taps are cleared)"
                    .to_string(),
            });
        }
        enc.clear_buffer(out.buffer, out.offset, Some(out.bytes()));
        if algo == Conv2dAlgo::Blocked {
            return backward_weight_blocked(gpu, enc, &crop.shape, a, b, out, Some((shape, crop)));
        }
    }
    let kept_len = crop.shape.w_len();
    let kept = gpu
        .scratch(scratch::KEPT_TAPS, kept_len)
        .map_err(|source| KernelError::Gpu { op: op.name(), source })?;
    let kept = Slice::new(&kept, 0, kept_len);
    if op == Conv2dOp::BackwardWeight {
        conv2d_launch_with(gpu, enc, op, algo, &crop.shape, a, b, kept)?;
        launch(
            gpu,
            enc,
            op.name(),
            &SHADER,
            "conv2d_uncrop_weight_gradient",
            &crop_params(shape, crop),
            &[("kept taps' dw", kept), ("dw", out)],
            crop_grid(shape),
        )
    } else {
        crop_weights(gpu, enc, shape, crop, w, kept)?;
        conv2d_launch_with(gpu, enc, op, algo, &crop.shape, a, kept, out)
    }
}

/// Copies the kept taps of `crop` (`shape.crop()`) out of the whole kernel `w` into `kept`
/// (`crop.shape.w_len()` elements), for [`conv2d_launch_kept`]. The plain launchers copy on
/// every call; a step copies once for a convolution's forward and input-VJP.
pub fn crop_weights(
    gpu: &Gpu,
    enc: &mut Encoder,
    shape: &Conv2dShape,
    crop: &Crop,
    w: Slice,
    kept: Slice,
) -> Result<()> {
    const OP: &str = "conv2d_crop_weights";
    shape.validate(OP)?;
    expect_len(OP, "w", &w, shape.w_len(), "c_out·c_in·kh·kw")?;
    expect_len(OP, "kept", &kept, crop.shape.w_len(), "c_out·c_in times the kept taps")?;
    launch(
        gpu,
        enc,
        OP,
        &SHADER,
        OP,
        &crop_params(shape, crop),
        &[("w", w), ("kept", kept)],
        crop_grid(shape),
    )
}

/// The forward or input-VJP as [`conv2d_launch`](super::conv2d_launch) runs it on a cropped
/// kernel, from the kept taps' weights [`crop_weights`] copied: `a` is x or dy, `out` y or dx of
/// the whole shape.
pub fn conv2d_launch_kept(
    gpu: &Device,
    enc: &mut Encoder,
    op: Conv2dOp,
    crop: &Crop,
    a: Slice,
    kept: Slice,
    out: Slice,
) -> Result<()> {
    if op == Conv2dOp::BackwardWeight {
        return Err(KernelError::Arg {
            op: op.name(),
            arg: "op",
            problem: "reads no weights: use conv2d_launch".to_string(),
        });
    }
    conv2d_launch_with(gpu, enc, op, conv2d_algo(gpu, op, &crop.shape)?, &crop.shape, a, kept, out)
}

/// The crop kernels' parameters: the whole kernel's shape, and where the kept taps sit in it.
pub(super) fn crop_params(shape: &Conv2dShape, crop: &Crop) -> Params {
    Params {
        crop_y: crop.ky,
        crop_x: crop.kx,
        crop_h: crop.shape.kh,
        crop_w: crop.shape.kw,
        ..shape.params()
    }
}

/// One crop-kernel invocation per `CROP_RUN` (output channel, input channel) pairs.
pub(super) fn crop_grid(shape: &Conv2dShape) -> [u32; 3] {
    const CROP_RUN: u64 = 16; // as in shaders/conv2d/crop.wgsl
    grid_1d((shape.c_out as u64 * shape.c_in as u64).div_ceil(CROP_RUN), WG)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Brute force over small geometries: a crop keeps the rows and columns from the first to
    /// the last tap some output reads inside the input, with the same output size. No crop means
    /// those are all of them, or no tap reads, or the kept taps start at different rows and
    /// columns, or their convolution would have another output size.
    #[test]
    fn crop_keeps_exactly_the_taps_that_read_the_input() {
        let mut cropped = 0;
        for (h, w, kh, kw, stride, pad) in small_geometries() {
            let s = Conv2dShape { n: 1, c_in: 1, h, w, c_out: 1, kh, kw, stride, pad };
            if s.validate("test").is_err() {
                continue;
            }
            let reads = |k: u32, size: u32, out: u32| {
                (0..out).any(|o| {
                    (0..size as i64).contains(&((o * stride) as i64 - pad as i64 + k as i64))
                })
            };
            // The first to the last tap that reads (with stride > 1 some between may not).
            let hull = |k: u32, size: u32, out: u32| {
                let reading: Vec<u32> = (0..k).filter(|&t| reads(t, size, out)).collect();
                reading.first().map(|&first| (first, reading.last().unwrap() + 1 - first))
            };
            let (rows, cols) = (hull(kh, h, s.out_h()), hull(kw, w, s.out_w()));
            match (s.crop(), rows, cols) {
                (Some(c), _, _) => {
                    cropped += 1;
                    assert_eq!(
                        (rows, cols),
                        (Some((c.ky, c.shape.kh)), Some((c.kx, c.shape.kw))),
                        "{s:?}"
                    );
                    assert_eq!((c.shape.out_h(), c.shape.out_w()), (s.out_h(), s.out_w()), "{s:?}");
                    assert_eq!(c.shape.pad + c.ky, pad, "{s:?}");
                    c.shape.validate("test").unwrap();
                }
                (None, Some((ky, kh_kept)), Some((kx, kw_kept)))
                    if (kh_kept, kw_kept) != (kh, kw) =>
                {
                    let kept = Conv2dShape { kh: kh_kept, kw: kw_kept, pad: pad - ky, ..s };
                    let same_size = (kept.out_h(), kept.out_w()) == (s.out_h(), s.out_w());
                    assert!(
                        ky != kx || !same_size,
                        "{s:?}: taps {rows:?} × {cols:?} could be cropped"
                    );
                }
                (None, _, _) => {} // every tap kept, or none reads the input
            }
        }
        assert!(cropped > 50, "only {cropped} geometries crop: the test checks little");
        // ResNet-34 at 32²: layer4's 3×3 convolutions on 1×1 maps keep their centre tap, its
        // strided one (2×2 → 1×1) a 2×2 corner; layer3's 2×2 maps keep every tap.
        let resnet = |h, stride| {
            Conv2dShape { n: 8, c_in: 512, h, w: h, c_out: 512, kh: 3, kw: 3, stride, pad: 1 }
                .crop()
                .map(|c| (c.ky, c.shape.kh, c.shape.pad))
        };
        assert_eq!(resnet(1, 1), Some((1, 1, 0)));
        assert_eq!(resnet(2, 2), Some((1, 2, 0)));
        assert_eq!(resnet(2, 1), None);
    }

    /// (h, w, kh, kw, stride, pad) over small values.
    fn small_geometries() -> impl Iterator<Item = (u32, u32, u32, u32, u32, u32)> {
        let small = |n: u32| 1..=n;
        small(4).flat_map(move |h| {
            small(4).flat_map(move |w| {
                small(5).flat_map(move |kh| {
                    small(5).flat_map(move |kw| {
                        small(3).flat_map(move |stride| {
                            (0..=3).map(move |pad| (h, w, kh, kw, stride, pad))
                        })
                    })
                })
            })
        })
    }
}
