//! Where each k of a gather GEMM reads: the table the forward and the input-VJP walk instead of
//! an im2col matrix (shaders/conv2d/implicit.wgsl). Built on the host from the shape alone, in
//! the order every variant sums k, with the taps that read only padding for every pixel of a
//! phase left out (they add +0).

use super::super::{Conv2dOp, Conv2dShape};

/// One phase of a gather GEMM: the output pixels (iy, ix) ≡ (py, px) mod the output step, all
/// with the same taps.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Phase {
    pub grid_h: u32,
    pub grid_w: u32,
    /// The source row and column grid point (0, 0) reads at tap offset 0, and the output row
    /// and column it writes.
    pub source_origin: (i32, i32),
    pub output_origin: (u32, u32),
    /// k per segment of the sums: the summed channels of one segment times the kept taps.
    pub seg_len: u32,
    /// The kept taps, as a grid of rows and columns.
    pub taps: TapGrid,
    /// Per k: (source offset, row offset, column offset, w offset).
    pub entries: Vec<[i32; 4]>,
}

/// A phase's kept taps: `rows` × `cols` of them (the taps along an axis that read inside the
/// source for some pixel are an interval), tap (ry, cx) reading the source at row
/// `dy0 + step·ry` and column `dx0 + step·cx` from a pixel's origin. k runs over (channel, ry,
/// cx) in that order, so k = channel · rows · cols + ry · cols + cx.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TapGrid {
    pub rows: u32,
    pub cols: u32,
    pub dy0: i32,
    pub dx0: i32,
    /// +1 for the forward (kernel row ky reads row +ky), −1 for the input-VJP (tap ty reads dy
    /// at row −ty).
    pub step: i32,
}

impl TapGrid {
    /// Taps of one channel.
    pub fn len(&self) -> u32 {
        self.rows * self.cols
    }
    /// Whether no tap is kept: the phase writes +0.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A gather GEMM's table and the geometry its uniform needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Table {
    pub phases: Vec<Phase>,
    /// Source rows and columns a grid step moves: the stride (forward) or 1 (input-VJP).
    pub source_step: u32,
    /// Output rows and columns a grid step moves: 1 (forward) or the stride (input-VJP).
    pub output_step: u32,
    /// w elements between two of the GEMM's columns.
    pub w_col_stride: u32,
    /// The GEMM's columns: c_out (forward) or c_in (input-VJP).
    pub cols: u32,
    /// Segments per phase (the same for every phase: they split the summed channels).
    pub segments: u32,
}

impl Table {
    /// The table of `op` (the forward or the input-VJP) at `s`.
    pub fn of(op: Conv2dOp, s: &Conv2dShape) -> Table {
        match op {
            Conv2dOp::Forward => forward(s),
            _ => backward_input(s),
        }
    }

    /// The k entries of every phase, then a spare one; with the records before them, what the
    /// kernels read as `ig_table`.
    pub fn words(&self) -> Vec<[i32; 4]> {
        let mut records = Vec::with_capacity(3 * self.phases.len());
        let mut entries = Vec::new();
        for p in &self.phases {
            let first = entries.len() as i32;
            records.push([p.grid_h as i32, p.grid_w as i32, p.entries.len() as i32, first]);
            records.push([
                p.source_origin.0,
                p.source_origin.1,
                p.output_origin.0 as i32,
                p.output_origin.1 as i32,
            ]);
            records.push([p.seg_len as i32, p.taps.dy0, p.taps.dx0, p.taps.step]);
            entries.extend_from_slice(&p.entries);
        }
        entries.push([0; 4]);
        records.extend(entries);
        records
    }

    /// Rows of the laid-out weights: every phase's k.
    pub fn k_rows(&self) -> u64 {
        self.phases.iter().map(|p| p.entries.len() as u64).sum()
    }

    /// Elements of the output over `images`: every phase's pixels, `cols` channels each.
    pub fn out_len(&self, images: u32) -> u64 {
        let pixels: u64 = self.phases.iter().map(|p| p.grid_h as u64 * p.grid_w as u64).sum();
        pixels * images as u64 * self.cols as u64
    }

    /// FLOPs of the GEMM over `images`: a multiply-add for every kept k of every output.
    pub fn flops(&self, images: u32) -> f64 {
        let per_image: u64 = self
            .phases
            .iter()
            .map(|p| p.grid_h as u64 * p.grid_w as u64 * p.entries.len() as u64)
            .sum();
        2.0 * (per_image * images as u64 * self.cols as u64) as f64
    }

    /// vec4s of the table as the kernels read it ([`Table::words`]).
    pub fn words_len(&self) -> u64 {
        3 * self.phases.len() as u64 + self.k_rows() + 1
    }

    /// Pixels of the largest phase.
    pub fn most_pixels(&self, images: u32) -> u64 {
        self.phases.iter().map(|p| p.grid_h as u64 * p.grid_w as u64).max().unwrap_or(0)
            * images as u64
    }
}

/// Taps `0..k` of an axis that read inside `0..size` for some grid point `g < grid`, whose tap
/// `t` reads `origin + g·step + sign·t`.
fn kept_taps(k: u32, size: u32, grid: u32, origin: i32, step: u32, sign: i32) -> Vec<u32> {
    (0..k)
        .filter(|&t| {
            (0..grid as i64).any(|g| {
                let at = origin as i64 + g * step as i64 + sign as i64 * t as i64;
                (0..size as i64).contains(&at)
            })
        })
        .collect()
}

/// The grid of kept `rows` × `cols` (intervals of taps), tap t reading `step`·t from the origin.
fn grid(rows: &[u32], cols: &[u32], step: i32) -> TapGrid {
    let first = |taps: &[u32]| taps.first().map_or(0, |&t| step * t as i32);
    TapGrid {
        rows: rows.len() as u32,
        cols: cols.len() as u32,
        dy0: first(rows),
        dx0: first(cols),
        step,
    }
}

/// The forward: one phase over the output pixels; k = (ci, ky, kx), reading x at
/// (oy·stride − pad + ky, ox·stride − pad + kx).
fn forward(s: &Conv2dShape) -> Table {
    let (oh, ow, pad) = (s.out_h(), s.out_w(), s.pad as i32);
    let rows = kept_taps(s.kh, s.h, oh, -pad, s.stride, 1);
    let cols = kept_taps(s.kw, s.w, ow, -pad, s.stride, 1);
    let mut entries = Vec::with_capacity(s.c_in as usize * rows.len() * cols.len());
    for ci in 0..s.c_in as i32 {
        for &ky in &rows {
            for &kx in &cols {
                let (ky, kx) = (ky as i32, kx as i32);
                let source = (ci * s.h as i32 + ky) * s.w as i32 + kx;
                let w = (ci * s.kh as i32 + ky) * s.kw as i32 + kx;
                entries.push([source, ky, kx, w]);
            }
        }
    }
    let taps = grid(&rows, &cols, 1);
    let phase = Phase {
        grid_h: oh,
        grid_w: ow,
        source_origin: (-pad, -pad),
        output_origin: (0, 0),
        seg_len: (s.sum_segment(Conv2dOp::Forward) * taps.len()).max(1),
        taps,
        entries,
    };
    Table {
        phases: vec![phase],
        source_step: s.stride,
        output_step: 1,
        w_col_stride: s.c_in * s.kh * s.kw,
        cols: s.c_out,
        segments: s.c_in.div_ceil(s.sum_segment(Conv2dOp::Forward)),
    }
}

/// The input-VJP, phase by phase: pixels iy = py + stride·a, ix = px + stride·b, whose taps are
/// ky = ky0 + stride·ty (ky0 = (py + pad) mod stride), reading dy at (oy0 − ty, ox0 − tx) with
/// oy0 = (iy + pad − ky0) / stride; k = (co, ty, tx).
fn backward_input(s: &Conv2dShape) -> Table {
    let (oh, ow) = (s.out_h(), s.out_w());
    let seg_channels = s.sum_segment(Conv2dOp::BackwardInput);
    let mut phases = Vec::new();
    for py in 0..s.stride.min(s.h) {
        for px in 0..s.stride.min(s.w) {
            let grid_h = (s.h - py).div_ceil(s.stride);
            let grid_w = (s.w - px).div_ceil(s.stride);
            let (ky0, kx0) = ((py + s.pad) % s.stride, (px + s.pad) % s.stride);
            let origin_y = ((py + s.pad - ky0) / s.stride) as i32;
            let origin_x = ((px + s.pad - kx0) / s.stride) as i32;
            // Tap t of the phase is kernel row ky0 + stride·t, where that is inside the kernel.
            let phase_taps =
                |k0: u32, k: u32| if k0 >= k { 0 } else { (k - k0).div_ceil(s.stride) };
            let rows = kept_taps(phase_taps(ky0, s.kh), oh, grid_h, origin_y, 1, -1);
            let cols = kept_taps(phase_taps(kx0, s.kw), ow, grid_w, origin_x, 1, -1);
            let mut entries = Vec::with_capacity(s.c_out as usize * rows.len() * cols.len());
            for co in 0..s.c_out as i32 {
                for &ty in &rows {
                    for &tx in &cols {
                        let (ty, tx) = (ty as i32, tx as i32);
                        let ky = (ky0 + s.stride * ty as u32) as i32;
                        let kx = (kx0 + s.stride * tx as u32) as i32;
                        let source = co * (oh * ow) as i32 - ty * ow as i32 - tx;
                        let w = (co * s.c_in as i32 * s.kh as i32 + ky) * s.kw as i32 + kx;
                        entries.push([source, -ty, -tx, w]);
                    }
                }
            }
            let taps = grid(&rows, &cols, -1);
            phases.push(Phase {
                grid_h,
                grid_w,
                source_origin: (origin_y, origin_x),
                output_origin: (py, px),
                seg_len: (seg_channels * taps.len()).max(1),
                taps,
                entries,
            });
        }
    }
    Table {
        phases,
        source_step: 1,
        output_step: s.stride,
        w_col_stride: s.kh * s.kw,
        cols: s.c_in,
        segments: s.c_out.div_ceil(seg_channels),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(n: u32, c_in: u32, h: u32, c_out: u32, k: u32, stride: u32, pad: u32) -> Conv2dShape {
        Conv2dShape { n, c_in, h, w: h, c_out, kh: k, kw: k, stride, pad }
    }

    /// On a 1×1 map a 3×3 kernel reads only its centre tap; at 2×2 its corner taps each reach
    /// one pixel, so all are kept.
    #[test]
    fn taps_that_read_only_padding_are_left_out() {
        let one = Table::of(Conv2dOp::Forward, &shape(2, 8, 1, 16, 3, 1, 1));
        assert_eq!(one.phases[0].entries.len(), 8, "the centre tap of each channel");
        assert!(one.phases[0].entries.iter().all(|e| (e[1], e[2]) == (1, 1)));
        let two = Table::of(Conv2dOp::Forward, &shape(2, 8, 2, 16, 3, 1, 1));
        assert_eq!(two.phases[0].entries.len(), 8 * 9);
        let vjp = Table::of(Conv2dOp::BackwardInput, &shape(2, 8, 1, 16, 3, 1, 1));
        assert_eq!(vjp.phases[0].entries.len(), 16);
    }

    /// A 3×3, stride-2 input-VJP has four phases of 4, 2, 2 and 1 taps; a 1×1 one at stride 2
    /// has one phase with its tap and three with none, which write +0.
    #[test]
    fn the_input_vjp_runs_phase_by_phase() {
        let s = shape(1, 4, 8, 8, 3, 2, 1);
        let taps: Vec<usize> = Table::of(Conv2dOp::BackwardInput, &s)
            .phases
            .iter()
            .map(|p| p.entries.len() / 8)
            .collect();
        assert_eq!(taps, [1, 2, 2, 4]);
        let down = shape(1, 4, 8, 8, 1, 2, 0);
        let taps: Vec<usize> = Table::of(Conv2dOp::BackwardInput, &down)
            .phases
            .iter()
            .map(|p| p.entries.len() / 8)
            .collect();
        assert_eq!(taps, [1, 0, 0, 0]);
    }

    /// Segments: 16 channels times the kept taps, on maps of at most 16 pixels.
    #[test]
    fn segments_are_sixteen_channels_of_the_kept_taps() {
        let t = Table::of(Conv2dOp::Forward, &shape(4, 64, 2, 64, 3, 1, 1));
        assert_eq!((t.segments, t.phases[0].seg_len), (4, 16 * 9));
        let t = Table::of(Conv2dOp::Forward, &shape(4, 64, 1, 64, 3, 1, 1));
        assert_eq!((t.segments, t.phases[0].seg_len), (4, 16));
        let t = Table::of(Conv2dOp::Forward, &shape(4, 64, 8, 64, 3, 1, 1));
        assert_eq!(t.segments, 1);
    }

    /// Every phase's entries are its tap grid's: k = (channel, ry, cx), tap (ry, cx) reading
    /// the rows and columns the grid gives, at the channel's plane plus the tap's offset.
    #[test]
    fn the_entries_are_the_tap_grids() {
        let shapes = [
            shape(2, 3, 13, 8, 7, 2, 3),
            shape(2, 8, 9, 8, 3, 1, 1),
            shape(2, 8, 9, 8, 3, 2, 1),
            shape(2, 8, 1, 8, 3, 1, 1),
            shape(2, 8, 2, 8, 3, 2, 1),
            shape(2, 8, 8, 8, 1, 2, 0),
        ];
        for s in shapes {
            for op in [Conv2dOp::Forward, Conv2dOp::BackwardInput] {
                let (plane, width) = match op {
                    Conv2dOp::Forward => ((s.h * s.w) as i32, s.w as i32),
                    _ => ((s.out_h() * s.out_w()) as i32, s.out_w() as i32),
                };
                for p in Table::of(op, &s).phases {
                    let g = p.taps;
                    assert_eq!(p.entries.len() as u32 % g.len().max(1), 0, "{s:?} {op:?}");
                    for (k, e) in p.entries.iter().enumerate() {
                        let (ch, t) = (k as u32 / g.len(), k as u32 % g.len());
                        let (dy, dx) = (
                            g.dy0 + g.step * (t / g.cols) as i32,
                            g.dx0 + g.step * (t % g.cols) as i32,
                        );
                        assert_eq!((e[1], e[2]), (dy, dx), "{s:?} {op:?} k {k}");
                        assert_eq!(e[0], ch as i32 * plane + dy * width + dx, "{s:?} {op:?} k {k}");
                    }
                }
            }
        }
    }
}
