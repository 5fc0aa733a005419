//! The `step` layer: one replica's ResNet-34 training step on one device — forward (saving
//! what the backward reads), label-smoothed loss, backward to every parameter, BN running
//! statistics, SGD. What crosses devices goes through a [`Communicator`]: BatchNorm rows at
//! every BN site and gradient buckets as the backward finishes them. [`OneDevice`] exchanges
//! nothing; data-parallel replicas gather every replica's per-example rows and all-reduce the
//! buckets (`parallel::ReplicaLink`; the `collective` layer moves the bytes).
//!
//! The whole forward and backward is recorded into one command encoder; an exchange that needs
//! the statistics on the host submits what was recorded so far and continues in a new encoder.

use std::ops::Range;

use crate::canonical;
use crate::collective::{CollectiveError, Pieces};
use crate::data::{Batch, DataError};
use crate::gpu::{Encoder, Gpu, GpuError, Slice};
use crate::kernels::conv2d::Conv2dOp;
use crate::kernels::{batchnorm, conv2d, maxpool, sgd, Device, KernelError};
use crate::model::{
    ActivationPattern, Conv, ModelError, ResNet, ALIGN_BYTES, POOL_K, POOL_PAD, POOL_STRIDE,
};

mod activations;
mod backward;
mod forward;

use activations::{Act, Activations, UnitId};
use forward::Unit;

pub const BN_EPS: f32 = 1e-5;

#[derive(Debug, thiserror::Error)]
pub enum StepError {
    #[error(transparent)]
    Kernel(#[from] KernelError),
    #[error(transparent)]
    Gpu(#[from] GpuError),
    #[error(transparent)]
    Data(#[from] DataError),
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Collective(#[from] CollectiveError),
    /// A step hyper-parameter outside its range.
    #[error("{what} must be {range}")]
    Setting { what: &'static str, range: &'static str },
    #[error("batch must be at least 1")]
    NoBatch,
    #[error("empty batch")]
    EmptyBatch,
    #[error("parameter/buffer vectors have {params}/{running} values, the model layout needs {param_len}/{buffer_len}")]
    Layout { params: usize, running: usize, param_len: usize, buffer_len: usize },
    #[error("momentum has {got} values, the layout needs {needed}")]
    Velocity { got: usize, needed: usize },
    #[error(
        "a batch of {len} examples cannot be examples {start}.. of a global batch of {global}"
    )]
    NotAShard { len: usize, start: u64, global: u64 },
    /// A batch whose buffers cannot exist on the device (`size`: the largest activation's
    /// bytes, written out; `why`: the limit it passes).
    #[error("a batch of {batch} image(s) of {h}×{w}: its largest activation holds {values} values ({size}), {why}: use a smaller --batch or --image-size")]
    BatchTooLarge { batch: u64, h: u32, w: u32, values: u64, size: String, why: String },
    #[error("imposed pattern has no ReLU site {site} of {units} units")]
    ImposedRelu { site: usize, units: u64 },
    #[error("imposed pattern's pool argmax has the wrong size")]
    ImposedPool,
    /// A unit of the forward whose BatchNorm the model does not have (a bug, not an input).
    #[error("{unit} is not a BatchNorm of the model")]
    NotABatchNorm { unit: String },
    #[error("replica {replica} sent {values} BatchNorm row values for {examples} examples at BN site {site}, not {expected}: the replicas disagree on the shards")]
    BatchNormRows { replica: usize, values: usize, examples: u32, site: usize, expected: usize },
    #[error("an activation pattern from another rank does not parse")]
    PatternFromRank,
    #[error("this process's replicas take examples {start}..{end} of the batch of {global}; given {given_start}..{given_end}")]
    NotThisProcessPart { start: usize, end: usize, global: u64, given_start: u64, given_end: usize },
    #[error("the model's outputs for image {image} of the evaluation are not finite ({value}), so it has no score: the forward pass overflowed (the weights of a run that diverged, or inputs far from what they were trained on, do that)")]
    NonFiniteOutput { image: usize, value: f32 },
    #[error("replica {replica}'s {what} differ from replica 0's: not writing a checkpoint")]
    ReplicasDiffer { replica: usize, what: &'static str },
    /// The loss of `step` is NaN or infinite: the run diverged; nothing was updated.
    #[error("the loss became {loss} at step {step}: lower the learning rate")]
    NonFiniteLoss { step: u64, loss: f32 },
}

pub type Result<T, E = StepError> = std::result::Result<T, E>;

/// Hyper-parameters of a training step (PyTorch's defaults where it has them).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepConfig {
    pub label_smoothing: f32,
    pub lr: f32,
    pub momentum: f32,
    pub weight_decay: f32,
    pub bn_momentum: f32,
}

impl Default for StepConfig {
    fn default() -> Self {
        StepConfig {
            label_smoothing: 0.1,
            lr: 0.01,
            momentum: 0.9,
            weight_decay: 5e-4,
            bn_momentum: 0.1,
        }
    }
}

impl StepConfig {
    pub fn validate(&self) -> Result<()> {
        let ok = |v: f32, lo: f32, hi: f32| v.is_finite() && v >= lo && v < hi;
        let checks = [
            (ok(self.label_smoothing, 0.0, 1.0), "label smoothing", "in [0, 1)"),
            (ok(self.lr, 0.0, f32::MAX), "learning rate", "finite and ≥ 0"),
            (ok(self.momentum, 0.0, 1.0), "momentum", "in [0, 1)"),
            (ok(self.weight_decay, 0.0, f32::MAX), "weight decay", "finite and ≥ 0"),
            (ok(self.bn_momentum, 0.0, 1.0 + f32::EPSILON), "BatchNorm momentum", "in [0, 1]"),
        ];
        match checks.iter().find(|(good, ..)| !good) {
            Some(&(_, what, range)) => Err(StepError::Setting { what, range }),
            None => Ok(()),
        }
    }
}

/// What a replica's step exchanges beyond its device, as named operations: BatchNorm rows
/// (forward statistics and backward sums) and gradient buckets. [`OneDevice`] exchanges nothing;
/// `parallel::ReplicaLink` moves them between data-parallel replicas, in one process or across
/// MPI ranks (the `collective` layer moves the bytes).
///
/// BatchNorm statistics and backward sums are first taken per example (rows of C + C floats,
/// see `kernels::batchnorm`) and only then reduced over the batch's rows on the device; the
/// exchange makes every replica's rows available, in the global batch's order, so each replica
/// reduces exactly the rows one device holding it would.
///
/// One call is one trip beyond the device, for every site whose rows are ready together: the
/// first conv of a block with a downsample and the downsample read the same input, so their
/// statistics travel together, and so do the backward sums of the downsample and the block's
/// second BN, which read the same cotangent. That leaves 33 trips each way for ResNet-34's 36
/// sites, the fewest the dependencies allow.
#[allow(async_fn_in_trait)]
pub trait Communicator {
    /// How many examples' rows a site ends up with, for a device holding `local` examples: the
    /// global batch's (`local` on one device).
    fn examples(&self, local: u32) -> u32;
    /// Whether BatchNorm's per-example rows travel beyond this device; where they do not (one
    /// device), a site takes its rows and reduces them in one launch.
    fn gathers_rows(&self) -> bool {
        true
    }
    /// Each site's `rows` holds room for `examples(local)` rows, this device's `local` rows of
    /// per-example `[mean | M2]` first; fills it with every replica's rows in the global
    /// batch's order, in place, in time for what is recorded after this call: by the next
    /// submission at the latest (see [`land_rows`](Self::land_rows)). Submits what `enc`
    /// recorded.
    async fn bn_stats(&self, gpu: &Gpu, enc: &mut Encoder, sites: &[BnRows<'_>]) -> Result<()>;
    /// The same for the backward's per-example `[Σdy | Σdy·x̂]`.
    async fn bn_sums(&self, gpu: &Gpu, enc: &mut Encoder, sites: &[BnRows<'_>]) -> Result<()>;
    /// Before the step submits anything recorded after the last `bn_stats` or `bn_sums` itself:
    /// that trip's rows are in place.
    async fn land_rows(&self, _gpu: &Gpu) -> Result<()> {
        Ok(())
    }
    /// `done` is the part of the flat gradient buffer's first piece (and of its other pieces,
    /// `Pieces`) that is final once `enc` runs, written by nothing recorded later: from some
    /// offset to the end, growing from call to call. The exchange may record the copies of a
    /// gradient bucket into `enc` and move it while the backward goes on.
    fn gradients_final(&self, gpu: &Gpu, enc: &mut Encoder, done: Slice<'_>) -> Result<()>;
    /// After the backward: the exchange of the gradient completes, its first piece `gradient`
    /// holds the step's gradient.
    async fn finish_gradients(&self, _gpu: &Gpu, _gradient: Slice<'_>) -> Result<()> {
        Ok(())
    }
    /// What a device holding `local` examples of a global batch of `global` divides its loss
    /// by: the global batch, so that the replicas' gradients add up to the single device's.
    fn loss_divisor(&self, _local: u32, global: u64) -> f32 {
        global as f32
    }
}

/// One BN site's rows in a [`Communicator`] call.
#[derive(Clone, Copy)]
pub struct BnRows<'a> {
    /// The site's number in forward order (`ResNet::batchnorms`).
    pub site: usize,
    /// Room for every replica's rows, exactly.
    pub rows: Slice<'a>,
    /// This device's examples: its rows come first in `rows`.
    pub local: u32,
}

impl BnRows<'_> {
    /// Values in one example's row, of a global batch of `global` examples.
    pub fn width(&self, global: u64) -> usize {
        (self.rows.len / global) as usize
    }
}

/// One device exchanging nothing: plain training-mode BatchNorm, its gradient its own.
pub struct OneDevice;

impl Communicator for OneDevice {
    fn examples(&self, local: u32) -> u32 {
        local
    }
    fn gathers_rows(&self) -> bool {
        false
    }
    async fn bn_stats(&self, _: &Gpu, _: &mut Encoder, _: &[BnRows<'_>]) -> Result<()> {
        Ok(())
    }
    async fn bn_sums(&self, _: &Gpu, _: &mut Encoder, _: &[BnRows<'_>]) -> Result<()> {
        Ok(())
    }
    fn gradients_final(&self, _: &Gpu, _: &mut Encoder, _: Slice<'_>) -> Result<()> {
        Ok(())
    }
}

/// Which examples of which global batch a step's batch is: examples `start..start + len` of a
/// global batch of `global` (a data-parallel replica's shard), or all of it (one device). The
/// loss is divided by the global batch on every replica, and every sum over examples is taken
/// in [`canonical`] pieces of it, so the replicas' results add up to the single device's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    pub start: u64,
    pub global: u64,
}

impl Shard {
    /// A batch of `len` examples that is the whole global batch: one device's step.
    pub fn whole(len: usize) -> Shard {
        Shard { start: 0, global: len as u64 }
    }

    /// The [`canonical::pieces`] of this shard's `len` examples, as ranges of them (from 0).
    pub fn pieces(&self, len: u64) -> Vec<Range<u64>> {
        let pieces = canonical::pieces(self.start..self.start + len, self.global);
        pieces.into_iter().map(|p| p.start - self.start..p.end - self.start).collect()
    }
}

/// Options of one forward/backward.
#[derive(Clone, Copy, Debug, Default)]
pub struct StepOptions<'a> {
    /// Impose this activation pattern instead of deciding it.
    pub impose: Option<&'a ActivationPattern>,
    /// Read this step's activation pattern back into [`StepOutput::pattern`].
    pub capture_pattern: bool,
}

/// What a forward/backward returns to the host (the gradients stay on the device).
#[derive(Clone, Debug, Default)]
pub struct StepOutput {
    /// The step's loss: this device's per-example losses summed in the canonical order and
    /// divided by the global batch. For a data-parallel replica, `parallel::DataParallel` makes
    /// it the global batch's, the same on every replica.
    pub loss: f32,
    /// This device's examples' losses ℓ_i, undivided.
    pub losses: Vec<f32>,
    pub logits: Vec<f32>,
    pub pattern: Option<ActivationPattern>,
}

/// One device's copy of the model: parameters, gradients, momentum and BN running statistics,
/// each one flat buffer in the model's layout, plus activation buffers reused across steps:
/// one per `Act` for what the forward saves for the backward (and the small per-site ones),
/// and a pool of scratch buffers shared by what lives only part of a pass.
pub struct Replica {
    pub gpu: Device,
    pub model: ResNet,
    pub params: wgpu::Buffer,
    /// The gradient of each of this replica's [`Shard::pieces`], one flat gradient buffer (a
    /// slab) each, [`Replica::slab_stride`] bytes apart. The first holds the step's gradient once
    /// all-reduced (on one device, its only piece).
    pub grads: wgpu::Buffer,
    pub velocity: wgpu::Buffer,
    pub running: wgpu::Buffer,
    acts: Activations,
    scratch: Scratch,
    /// The weights of the step's gather GEMMs, laid out once a step, for the input shape
    /// (examples, height, width) they were planned for.
    weight_rows: Option<((u32, u32, u32), conv2d::WeightRows)>,
}

/// Activation buffers that live for part of a pass (the backward's cotangents, a downsample
/// shortcut): `take` hands out the first `len` elements of a free buffer, the smallest free one
/// large enough, and `give_back` frees it once the last kernel reading it has been recorded.
/// Buffers of every size share the pool, so it holds what the pass needs at once, not one set
/// per layer size: where no free buffer is large enough, the largest free one too small is
/// replaced by one of the size asked. Reusing a buffer inside one encoder is safe: commands run
/// in recording order, and wgpu orders one dispatch's reads of a buffer before a later
/// dispatch's writes to it (and keeps a replaced buffer until the work recorded on it is done).
#[derive(Default)]
struct Scratch {
    /// Every buffer, and whether it is taken now.
    buffers: Vec<(wgpu::Buffer, bool)>,
    /// The batch (n, h, w) the buffers were sized for.
    geometry: (u32, u32, u32),
}

/// The first `len` elements of `buffer`, which may be larger: an activation in [`Scratch`], or
/// a trip's BatchNorm rows.
#[derive(Clone)]
pub(super) struct Transient {
    buffer: wgpu::Buffer,
    len: u64,
}

impl Transient {
    fn slice(&self) -> Slice<'_> {
        Slice::new(&self.buffer, 0, self.len)
    }
}

impl Scratch {
    /// A pass over a batch of `geometry` begins: every buffer is free (also any a failed pass
    /// left taken); buffers sized for another geometry are dropped.
    fn begin(&mut self, geometry: (u32, u32, u32)) {
        if geometry != self.geometry {
            self.buffers.clear();
            self.geometry = geometry;
        }
        self.buffers.iter_mut().for_each(|(_, taken)| *taken = false);
    }

    fn take(&mut self, gpu: &Gpu, len: u64) -> Result<Transient> {
        let len = len.max(1);
        let free =
            |(i, (b, taken)): (usize, &(wgpu::Buffer, bool))| (!taken).then_some((b.size(), i));
        let free: Vec<(u64, usize)> = self.buffers.iter().enumerate().filter_map(free).collect();
        if let Some(&(_, i)) = free.iter().filter(|(size, _)| *size >= len * 4).min() {
            self.buffers[i].1 = true;
            return Ok(Transient { buffer: self.buffers[i].0.clone(), len });
        }
        if let Some(&(_, i)) = free.iter().max() {
            self.buffers.swap_remove(i);
        }
        let buffer = gpu.buffer("scratch", len)?;
        self.buffers.push((buffer.clone(), true));
        Ok(Transient { buffer, len })
    }

    fn give_back(&mut self, t: &Transient) {
        if let Some((_, taken)) = self.buffers.iter_mut().find(|(b, _)| *b == t.buffer) {
            *taken = false;
        }
    }

    fn bytes(&self) -> u64 {
        self.buffers.iter().map(|(b, _)| b.size()).sum()
    }
}

/// Spatial size and channels of an activation, with the batch it belongs to.
#[derive(Clone, Copy, Debug)]
struct Dims {
    n: u32,
    c: u32,
    h: u32,
    w: u32,
}

impl Dims {
    fn len(&self) -> u64 {
        (self.n * self.c * self.h * self.w) as u64
    }
    fn hw(&self) -> u32 {
        self.h * self.w
    }
}

/// Per-step state threaded through forward and backward.
struct Pass<'p, S> {
    enc: Encoder,
    comm: &'p S,
    cfg: &'p StepConfig,
    units: Vec<Unit>,
    /// The ReLU sites the forward has passed.
    relu_sites: usize,
    impose: Option<&'p ActivationPattern>,
    /// Whether the forward copies each ReLU site's output for [`Replica::read_pattern`].
    capture: bool,
    /// Whether the pass laid out its weights ([`Replica::lay_out_weights`]): its convolutions
    /// then read them from there.
    laid_out: bool,
    /// The buffer holding the pool's argmax: its own, or the imposed one.
    pool_argmax: Act,
    /// Inference: BN normalises with these running statistics (the model's flat buffer
    /// layout) and updates nothing.
    eval: Option<Vec<f32>>,
    /// The canonical pieces of this device's examples, as ranges of them: each sum over
    /// examples is taken per piece, into that piece's gradient slab.
    pieces: Vec<Range<u64>>,
    /// What the loss is divided by: the global batch.
    divisor: f32,
}

impl<S> Pass<'_, S> {
    /// The index in `units` of the unit `id`, which this pass's forward recorded.
    fn unit(&self, id: UnitId) -> usize {
        match self.units.iter().position(|u| u.id == id) {
            Some(unit) => unit,
            None => unreachable!("{id:?} is in every forward"),
        }
    }
}

impl Replica {
    /// A replica holding `params` (model layout) and running statistics `running`.
    pub fn new(gpu: Device, model: ResNet, params: &[f32], running: &[f32]) -> Result<Replica> {
        if params.len() != model.param_len || running.len() != model.buffer_len {
            return Err(StepError::Layout {
                params: params.len(),
                running: running.len(),
                param_len: model.param_len,
                buffer_len: model.buffer_len,
            });
        }
        let params_buf = gpu.upload("params", params)?;
        let grads = gpu.buffer("grads", model.param_len as u64)?;
        let velocity = gpu.buffer("velocity", model.param_len as u64)?;
        let running_buf = gpu.upload("running", running)?;
        Ok(Replica {
            gpu,
            model,
            params: params_buf,
            grads,
            velocity,
            running: running_buf,
            acts: Activations::default(),
            scratch: Scratch::default(),
            weight_rows: None,
        })
    }

    /// Bytes this replica holds on its device: parameters, gradients, momentum, running
    /// statistics, every activation buffer (saved and scratch) and the kernels' scratch its
    /// `Gpu` keeps ([`Gpu::scratch`]).
    pub fn device_bytes(&self) -> u64 {
        let flat = [&self.params, &self.grads, &self.velocity, &self.running]
            .iter()
            .map(|b| b.size())
            .sum::<u64>();
        let rows = self.weight_rows.as_ref().map_or(0, |(_, rows)| rows.bytes());
        flat + self.acts.bytes() + self.scratch.bytes() + self.gpu.scratch_bytes() + rows
    }

    /// Lays out the weights of every convolution the step at input `x` runs as a gather GEMM,
    /// forward and input-VJP, by one dispatch ([`conv2d::WeightRows`]).
    fn lay_out_weights(&mut self, enc: &mut Encoder, x: Dims) -> Result<()> {
        let key = (x.n, x.h, x.w);
        if self.weight_rows.as_ref().is_none_or(|(k, _)| *k != key) {
            self.weight_rows = None;
            let mut convs = Vec::new();
            for input in self.model.conv_inputs(x.h, x.w) {
                let shape = conv2d_shape(&input.conv, x.n, input.h, input.w);
                let w_at = self.model.params[input.conv.weight].offset as u64;
                convs.push((Conv2dOp::Forward, shape, w_at));
                // The stem's input is the image: the step takes no input-VJP of it.
                if input.conv != self.model.stem_conv {
                    convs.push((Conv2dOp::BackwardInput, shape, w_at));
                }
            }
            let rows = conv2d::WeightRows::new(&self.gpu, &self.params, &convs)?;
            self.weight_rows = Some((key, rows));
        }
        match &self.weight_rows {
            Some((_, rows)) => Ok(rows.lay_out(&self.gpu, enc)?),
            None => Ok(()),
        }
    }

    /// `op` at `shape` against parameter `weight` (`a` and `out` as [`conv2d::conv2d_launch`]
    /// takes them): from the weights `pass` laid out, where it did.
    fn conv_launch<S>(
        &self,
        pass: &mut Pass<S>,
        op: Conv2dOp,
        shape: &conv2d::Conv2dShape,
        (a, weight, out): (Slice, usize, Slice),
    ) -> Result<()> {
        let (gpu, enc, w) = (&self.gpu, &mut pass.enc, self.param(weight));
        match self.weight_rows.as_ref().filter(|_| pass.laid_out) {
            Some((_, rows)) => Ok(rows.launch(gpu, enc, op, shape, a, w, out)?),
            None => Ok(conv2d::conv2d_launch(gpu, enc, op, shape, a, w, out)?),
        }
    }

    fn param(&self, index: usize) -> Slice<'_> {
        let p = &self.model.params[index];
        Slice::new(&self.params, p.offset as u64 * 4, p.len() as u64)
    }

    /// Parameter `index`'s gradient in the slab of piece `piece`.
    fn grad(&self, index: usize, piece: usize) -> Slice<'_> {
        let p = &self.model.params[index];
        Slice::new(
            &self.grads,
            piece as u64 * self.slab_stride() + p.offset as u64 * 4,
            p.len() as u64,
        )
    }

    /// Bytes from one piece's gradient slab to the next: the flat layout's, aligned as every
    /// device allows a storage binding to start.
    pub fn slab_stride(&self) -> u64 {
        (self.model.param_len as u64 * 4).next_multiple_of(256)
    }

    /// The first slab: the step's gradient, once all-reduced.
    pub fn gradient(&self) -> Slice<'_> {
        Slice::new(&self.grads, 0, self.model.param_len as u64)
    }

    /// Where the gradients of `count` pieces lie in [`Replica::grads`].
    pub fn grad_pieces(&self, count: usize) -> Pieces {
        Pieces { count: count as u64, stride: self.slab_stride() }
    }

    /// Makes room for `count` gradient slabs (the buffer grows, never shrinks).
    fn grad_slabs(&mut self, count: usize) -> Result<()> {
        let bytes = (count as u64 - 1) * self.slab_stride() + self.model.param_len as u64 * 4;
        if self.grads.size() < bytes {
            self.grads = self.gpu.buffer("grads", bytes / 4)?;
        }
        Ok(())
    }

    fn running_slice(&self, index: usize) -> Slice<'_> {
        let b = &self.model.buffers[index];
        Slice::new(&self.running, b.offset as u64 * 4, b.len() as u64)
    }

    /// The activation buffer `act` of `len` elements, made on first use and reused.
    fn act(&mut self, act: Act, len: u64) -> Result<wgpu::Buffer> {
        self.acts.sized(&self.gpu, act, len)
    }

    /// Forward, loss (divided by the global batch) and backward for `batch`, examples `shard`
    /// of the global batch: leaves the gradient of each of the shard's canonical pieces in its
    /// slab of `grads` (one device: the gradient, in the first) and updates the running
    /// statistics.
    pub async fn forward_backward(
        &mut self,
        batch: &Batch,
        cfg: &StepConfig,
        shard: Shard,
        comm: &impl Communicator,
        opts: StepOptions<'_>,
    ) -> Result<StepOutput> {
        cfg.validate()?;
        batch.validate(self.model.classes)?;
        ResNet::check_image_size(batch.h, batch.w)?;
        if batch.is_empty() || shard.start + batch.len() as u64 > shard.global {
            let Shard { start, global } = shard;
            return Err(StepError::NotAShard { len: batch.len(), start, global });
        }
        self.model.check_training_batch(shard.global, batch.h, batch.w)?;
        let n = batch.len() as u32;
        let pieces = shard.pieces(n as u64);
        self.grad_slabs(pieces.len())?;
        let divisor = comm.loss_divisor(n, shard.global);
        self.scratch.begin((n, batch.h, batch.w));
        let input = self.act(Act::Input, batch.images.len() as u64)?;
        self.gpu.queue.write_buffer(&input, 0, bytemuck::cast_slice(&batch.images));
        let labels = self.act(Act::Labels, n as u64)?;
        self.gpu.queue.write_buffer(&labels, 0, bytemuck::cast_slice(&batch.labels));

        let mut pass = Pass {
            enc: self.gpu.encoder(),
            comm,
            cfg,
            units: Vec::new(),
            relu_sites: 0,
            impose: opts.impose,
            capture: opts.capture_pattern,
            laid_out: false,
            pool_argmax: Act::PoolArgmax,
            eval: None,
            pieces,
            divisor,
        };
        if let Some(p) = opts.impose {
            self.upload_pattern(p)?;
        }
        let x = Dims { n, c: 3, h: batch.h, w: batch.w };
        self.lay_out_weights(&mut pass.enc, x)?;
        pass.laid_out = true;
        let (out, dims) = self.forward(&mut pass, x).await?;
        let (feat, logits) = self.head_forward(&mut pass, &out, dims)?;
        let (losses, dout) = self.loss_backward(&mut pass, &feat, &logits, dims, &labels)?;
        self.backward(&mut pass, dout).await?;

        let mut enc = std::mem::replace(&mut pass.enc, self.gpu.encoder());
        let read = self.gpu.record_read(&mut enc, &[Slice::whole(&losses), Slice::whole(&logits)]);
        comm.land_rows(&self.gpu).await?;
        self.gpu.submit(enc).await?;
        let mut logits = read.read::<f32>(&self.gpu).await?;
        let losses: Vec<f32> = logits.drain(..n as usize).collect();
        let loss = canonical::sum(&losses) / pass.divisor;
        let pattern =
            if opts.capture_pattern { Some(self.read_pattern(&pass).await?) } else { None };
        Ok(StepOutput { loss, losses, logits, pattern })
    }

    /// Inference: the logits of `batch` with BatchNorm in eval mode (running statistics).
    /// Changes no parameter, gradient or statistic.
    pub async fn predict(&mut self, batch: &Batch) -> Result<Vec<f32>> {
        batch.validate(self.model.classes)?;
        ResNet::check_image_size(batch.h, batch.w)?;
        if batch.is_empty() {
            return Err(StepError::EmptyBatch);
        }
        let running = self.read_running().await?;
        self.scratch.begin((batch.len() as u32, batch.h, batch.w));
        let input = self.act(Act::Input, batch.images.len() as u64)?;
        self.gpu.queue.write_buffer(&input, 0, bytemuck::cast_slice(&batch.images));
        let cfg = StepConfig::default();
        let mut pass = Pass {
            enc: self.gpu.encoder(),
            comm: &OneDevice,
            cfg: &cfg,
            units: Vec::new(),
            relu_sites: 0,
            impose: None,
            capture: false,
            laid_out: false,
            pool_argmax: Act::PoolArgmax,
            eval: Some(running),
            pieces: Vec::new(),
            divisor: 1.0,
        };
        let x = Dims { n: batch.len() as u32, c: 3, h: batch.h, w: batch.w };
        let (out, dims) = self.forward(&mut pass, x).await?;
        let (_, logits) = self.head_forward(&mut pass, &out, dims)?;
        let enc = std::mem::replace(&mut pass.enc, self.gpu.encoder());
        self.gpu.submit(enc).await?;
        Ok(self.gpu.read_f32(Slice::whole(&logits)).await?)
    }

    /// SGD with momentum and weight decay over the whole flat parameter buffer, in parts that
    /// one storage binding holds each (ResNet-101's buffer is past WebGPU's default 128 MiB).
    /// The update is per element: the parts give the whole buffer's bits.
    pub async fn sgd_update(&self, cfg: &StepConfig) -> Result<()> {
        cfg.validate()?;
        let mut enc = self.gpu.encoder();
        let p =
            sgd::SgdParams { lr: cfg.lr, momentum: cfg.momentum, weight_decay: cfg.weight_decay };
        // Whole multiples of the layout's alignment: every part starts where a binding may.
        let align = ALIGN_BYTES as u64 / 4;
        let part = self.gpu.limits.max_storage_buffer_binding_size / 4 / align * align;
        let (len, grad) = (self.model.param_len as u64, self.gradient());
        for start in (0..len).step_by(part.max(align) as usize) {
            let (at, n) = (start * 4, part.min(len - start));
            sgd::sgd_update(
                &self.gpu,
                &mut enc,
                &p,
                Slice::new(&self.params, at, n),
                Slice::new(grad.buffer, grad.offset + at, n),
                Slice::new(&self.velocity, at, n),
            )?;
        }
        self.gpu.submit(enc).await?;
        Ok(())
    }

    pub async fn read_params(&self) -> Result<Vec<f32>> {
        Ok(self.gpu.read_f32(Slice::whole(&self.params)).await?)
    }

    pub async fn read_grads(&self) -> Result<Vec<f32>> {
        Ok(self.gpu.read_f32(self.gradient()).await?)
    }

    pub async fn read_velocity(&self) -> Result<Vec<f32>> {
        Ok(self.gpu.read_f32(Slice::whole(&self.velocity)).await?)
    }

    pub async fn read_running(&self) -> Result<Vec<f32>> {
        Ok(self.gpu.read_f32(Slice::whole(&self.running)).await?)
    }

    /// Replaces the momentum buffer (resuming from a checkpoint).
    pub fn write_velocity(&self, v: &[f32]) -> Result<()> {
        if v.len() != self.model.param_len {
            return Err(StepError::Velocity { got: v.len(), needed: self.model.param_len });
        }
        self.gpu.queue.write_buffer(&self.velocity, 0, bytemuck::cast_slice(v));
        Ok(())
    }
}

/// Refuses, before any work, a training step of `batch` images of `h`×`w` whose buffers cannot
/// exist on a device with `limits`: every size in 64 bits, against one storage binding, one
/// buffer, and the shaders' 32-bit indices.
pub fn check_batch_fits(
    model: &ResNet,
    batch: u64,
    h: u32,
    w: u32,
    limits: &wgpu::Limits,
) -> Result<()> {
    let largest = model.largest_activation(batch, h, w).unwrap_or(u64::MAX);
    let bytes = largest.saturating_mul(4);
    let binding = limits.max_storage_buffer_binding_size.min(limits.max_buffer_size);
    let refuse = |why: String| {
        let size = crate::host::format_bytes(bytes, crate::host::ByteScale::Fit);
        Err(StepError::BatchTooLarge { batch, h, w, values: largest, size, why })
    };
    if bytes > binding {
        let allowed = crate::host::format_bytes(binding, crate::host::ByteScale::Fit);
        return refuse(format!("more than one storage binding on this device allows ({allowed}, max_storage_buffer_binding_size)"));
    }
    if largest > i32::MAX as u64 {
        return refuse("more than the shaders' 32-bit indices reach".into());
    }
    Ok(())
}

fn conv_shape(c: &Conv, x: Dims) -> conv2d::Conv2dShape {
    conv2d_shape(c, x.n, x.h, x.w)
}

/// The kernel shape of `conv` on `n` inputs of `h`×`w`: what the step launches.
pub fn conv2d_shape(c: &Conv, n: u32, h: u32, w: u32) -> conv2d::Conv2dShape {
    conv2d::Conv2dShape {
        n,
        c_in: c.c_in,
        h,
        w,
        c_out: c.c_out,
        kh: c.k,
        kw: c.k,
        stride: c.stride,
        pad: c.pad,
    }
}

fn bn_shape(d: Dims) -> batchnorm::BnShape {
    batchnorm::BnShape { n: d.n, c: d.c, hw: d.hw() }
}

fn pool_shape(d: Dims) -> maxpool::MaxPoolShape {
    maxpool::MaxPoolShape {
        n: d.n,
        c: d.c,
        h: d.h,
        w: d.w,
        k: POOL_K,
        stride: POOL_STRIDE,
        pad: POOL_PAD,
    }
}
