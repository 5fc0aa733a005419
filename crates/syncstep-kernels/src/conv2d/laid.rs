//! A step's weights laid out for its gather GEMMs by one dispatch, rather than one per op: the
//! forward and the input-VJP of every convolution the implicit family runs read their weights
//! as rows ([k][column]), which depend on the weights only, so a step lays them all out before
//! its forward and its launches read them from here ([`WeightRows::launch`]).

use super::implicit::LAYOUT_WORKGROUP;
use super::implicit::{
    gather_gemm_laid, lay_out, GatherLayout, GatherPlan, LayoutRecords, Plan, Table,
};
use super::{conv2d_choice, conv2d_launch, implicit_plan, runs_winograd};
use super::{Conv2dAlgo, Conv2dOp, Conv2dShape, Device};
use crate::{KernelError, Result};
use syncstep_gpu::{Encoder, Gpu, Slice};

/// The op name a layouts' dispatch goes by in errors and profiles.
const OP: &str = "conv2d_weight_rows";

/// The laid-out weights of a list of convolutions, in chunks that each fit a storage binding,
/// one dispatch a chunk.
pub struct WeightRows {
    /// The buffer the weights lie in.
    w: wgpu::Buffer,
    chunks: Vec<Chunk>,
    laid: Vec<Laid>,
}

/// The layouts one dispatch writes: their rows, the weights they read (from float `w_at` of
/// the weights' buffer, `w_len` floats), their tables' words, their records and each
/// workgroup's layout.
struct Chunk {
    rows: wgpu::Buffer,
    vec4s: u64,
    w_at: u64,
    w_len: u64,
    tables: wgpu::Buffer,
    records: wgpu::Buffer,
    workgroups: wgpu::Buffer,
}

/// One convolution's laid-out weights: `op` at `shape` against the weights at float `w_at`, as
/// `plan` runs it, its rows in chunk `chunk` from vec4 `at`.
struct Laid {
    op: Conv2dOp,
    shape: Conv2dShape,
    w_at: u64,
    table: Table,
    plan: GatherPlan,
    layout: GatherLayout,
    chunk: usize,
    at: u64,
}

impl WeightRows {
    /// Room for the layouts of `convs` (an op, a shape and where its weights start in `w`, in
    /// floats) that `gpu` runs as gather GEMMs; the others stay out and lay out their own.
    pub fn new(
        gpu: &Device,
        w: &wgpu::Buffer,
        convs: &[(Conv2dOp, Conv2dShape, u64)],
    ) -> Result<WeightRows> {
        let limits = &gpu.limits;
        let room = limits.max_storage_buffer_binding_size.min(limits.max_buffer_size) / 4;
        WeightRows::within(gpu, w, convs, room)
    }

    /// [`WeightRows::new`] in chunks of at most `room` floats of rows and of weights each (a
    /// device's binding allows more).
    pub fn within(
        gpu: &Device,
        w: &wgpu::Buffer,
        convs: &[(Conv2dOp, Conv2dShape, u64)],
        room: u64,
    ) -> Result<WeightRows> {
        let limits = &gpu.limits;
        // Rows start at a workgroup's first vec4 (and so at a binding's alignment), weights at
        // a binding's alignment.
        let align = (limits.min_storage_buffer_offset_alignment as u64 / 4).max(4);
        let rows_align = align.max(4 * LAYOUT_WORKGROUP);
        let mut laid: Vec<Laid> = Vec::new();
        let mut chunks: Vec<(u64, u64, u64)> = Vec::new();
        for &(op, shape, w_at) in convs {
            let Some(plan) = gathered(gpu, op, &shape)? else { continue };
            let table = Table::of(op, &shape);
            let layout = GatherLayout::of(gpu, op, &table, plan)?;
            // A chunk: (floats of its rows, the first and past the last float of its weights).
            let (w_first, w_end) = (w_at / align * align, w_at + shape.w_len());
            let fits = |&(rows, first, end): &(u64, u64, u64)| {
                rows.next_multiple_of(rows_align) + layout.floats() <= room
                    && end.max(w_end) - first.min(w_first) <= room
            };
            if !fits(&(0, w_first, w_end)) {
                continue;
            }
            if chunks.last().is_none_or(|c| !fits(c)) {
                chunks.push((0, w_first, w_end));
            }
            let chunk = chunks.len() - 1;
            let c = &mut chunks[chunk];
            let at = c.0.next_multiple_of(rows_align);
            *c = (at + layout.floats(), c.1.min(w_first), c.2.max(w_end));
            laid.push(Laid { op, shape, w_at, table, plan, layout, chunk, at: at / 4 });
        }
        let chunks = chunks
            .iter()
            .enumerate()
            .map(|(i, &(floats, w_first, w_end))| {
                let mine = laid.iter().filter(|l| l.chunk == i);
                chunk(gpu, mine, floats, (w_first, w_end))
            })
            .collect::<Result<Vec<Chunk>>>()?;
        Ok(WeightRows { w: w.clone(), chunks, laid })
    }

    /// Records the layouts' dispatches: each reads the weights as they are when it runs.
    pub fn lay_out(&self, gpu: &Gpu, enc: &mut Encoder) -> Result<()> {
        for c in &self.chunks {
            let records = LayoutRecords {
                records: Slice::whole(&c.records),
                workgroups: Slice::whole(&c.workgroups),
                vec4s: c.vec4s,
            };
            let w = Slice::new(&self.w, c.w_at * 4, c.w_len);
            lay_out(gpu, enc, OP, &records, (w, Slice::whole(&c.tables), Slice::whole(&c.rows)))?;
        }
        Ok(())
    }

    /// The dispatches [`WeightRows::lay_out`] records.
    pub fn dispatches(&self) -> usize {
        self.chunks.len()
    }

    /// Bytes it holds on the device.
    pub fn bytes(&self) -> u64 {
        let bytes =
            |c: &Chunk| c.rows.size() + c.tables.size() + c.records.size() + c.workgroups.size();
        self.chunks.iter().map(bytes).sum()
    }

    /// `op` at `shape` (`a`, `w`, `out` as [`conv2d_launch`] takes them): from the rows laid out
    /// here where they hold `w`'s for it, else as [`conv2d_launch`] runs it.
    #[allow(clippy::too_many_arguments)]
    pub fn launch(
        &self,
        gpu: &Device,
        enc: &mut Encoder,
        op: Conv2dOp,
        shape: &Conv2dShape,
        a: Slice,
        w: Slice,
        out: Slice,
    ) -> Result<()> {
        let held = |l: &&Laid| {
            l.op == op && l.shape == *shape && *w.buffer == self.w && w.offset == l.w_at * 4
        };
        let Some(l) = self.laid.iter().find(held) else {
            return conv2d_launch(gpu, enc, op, shape, a, w, out);
        };
        super::shape::checked(gpu, op, shape, [a, w, out])?;
        let rows = Slice::new(&self.chunks[l.chunk].rows, l.at * 16, l.layout.floats());
        gather_gemm_laid(gpu, enc, op, shape, (&l.table, l.plan, &l.layout), (a, rows, out))
    }
}

/// The plan `gpu` runs `op` at `shape` by, where [`conv2d_launch`] runs it as a gather GEMM.
fn gathered(gpu: &Device, op: Conv2dOp, shape: &Conv2dShape) -> Result<Option<GatherPlan>> {
    if op == Conv2dOp::BackwardWeight || runs_winograd(gpu, op, shape)?.is_some() {
        return Ok(None);
    }
    if conv2d_choice(gpu, op, shape)?.0 != Conv2dAlgo::Implicit {
        return Ok(None);
    }
    match implicit_plan(gpu, op, shape)? {
        Plan::Gather(plan) => Ok(Some(plan)),
        Plan::Weight(_) => Ok(None),
    }
}

/// The buffers of the layouts `laid` (of one chunk): `floats` of rows, reading the weights
/// from float `w_first` to `w_end`.
fn chunk<'a>(
    gpu: &Gpu,
    laid: impl Iterator<Item = &'a Laid>,
    floats: u64,
    (w_first, w_end): (u64, u64),
) -> Result<Chunk> {
    let gpu_err = |source| KernelError::Gpu { op: OP, source };
    let (mut words, mut records, mut workgroups) = (Vec::new(), Vec::new(), Vec::new());
    for (i, l) in laid.enumerate() {
        let record = l.layout.record(&l.table, l.at, l.w_at - w_first, words.len() as u64);
        records.extend(record);
        words.extend(l.table.words());
        let first = l.at / LAYOUT_WORKGROUP;
        let end = (l.at + l.layout.floats() / 4).div_ceil(LAYOUT_WORKGROUP);
        workgroups.extend((first..end).map(|_| i as u32));
    }
    Ok(Chunk {
        rows: gpu.buffer("conv2d weight rows of a step", floats).map_err(gpu_err)?,
        vec4s: floats / 4,
        w_at: w_first,
        w_len: w_end - w_first,
        tables: gpu.upload("conv2d weight rows' tables", &words).map_err(gpu_err)?,
        records: gpu.upload("conv2d weight rows' records", &records).map_err(gpu_err)?,
        workgroups: gpu.upload("conv2d weight rows' workgroups", &workgroups).map_err(gpu_err)?,
    })
}
