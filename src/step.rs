//! The `step` layer: one replica's ResNet-34 training step on one device — forward (saving
//! what the backward reads), label-smoothed loss, backward to every parameter, BN running
//! statistics, SGD. BatchNorm sites call a [`BnSync`] hook: [`LocalBn`] on one device, a
//! gather of every replica's per-example rows in data-parallel runs (`parallel::SyncBn`; the
//! `collective` layer moves the bytes).
//!
//! The whole forward and backward is recorded into one command encoder; a hook that needs the
//! statistics on the host submits what was recorded so far and continues in a new encoder.

use std::collections::HashMap;

use crate::collective::CollectiveError;
use crate::data::{Batch, DataError};
use crate::gpu::{Encoder, Gpu, GpuError, Slice};
use crate::kernels::conv2d::Conv2dOp;
use crate::kernels::{
    avgpool, batchnorm, conv2d, cross_entropy, dense, elementwise, maxpool, sgd, KernelError,
};
use crate::model::{
    ActivationPattern, BatchNorm, Conv, ModelError, ResNet34, POOL_K, POOL_PAD, POOL_STRIDE,
};

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
    #[error("{0}")]
    Invalid(String),
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
            (ok(self.label_smoothing, 0.0, 1.0), "label smoothing must be in [0, 1)"),
            (ok(self.lr, 0.0, f32::MAX), "learning rate must be finite and ≥ 0"),
            (ok(self.momentum, 0.0, 1.0), "momentum must be in [0, 1)"),
            (ok(self.weight_decay, 0.0, f32::MAX), "weight decay must be finite and ≥ 0"),
            (ok(self.bn_momentum, 0.0, 1.0 + f32::EPSILON), "BatchNorm momentum must be in [0, 1]"),
        ];
        match checks.iter().find(|(good, _)| !good) {
            Some((_, msg)) => Err(StepError::Invalid(msg.to_string())),
            None => Ok(()),
        }
    }
}

/// What a BatchNorm site does beyond this device. Statistics and backward sums are first taken
/// per example (rows of C + C floats, see `kernels::batchnorm`) and only then reduced over the
/// batch's rows on the device; a hook makes every replica's rows available, in replica order,
/// so each replica reduces exactly the rows one device holding the global batch would.
///
/// One call is one trip beyond the device, for every site whose rows are ready together: the
/// first conv of a block with a downsample and the downsample read the same input, so their
/// statistics travel together, and so do the backward sums of the downsample and the block's
/// second BN, which read the same cotangent. That leaves 33 trips each way for ResNet-34's 36
/// sites, the fewest the dependencies allow.
#[allow(async_fn_in_trait)]
pub trait BnSync {
    /// How many replicas' rows a site ends up with (1 on one device). All shards are equal.
    fn replicas(&self) -> u32;
    /// Each site's `rows` holds room for `replicas()·local` rows, this device's `local` rows of
    /// per-example `[mean | M2]` first; fills it with every replica's rows in replica order, in
    /// place.
    async fn stats(&self, gpu: &Gpu, enc: &mut Encoder, sites: &[BnRows<'_>]) -> Result<()>;
    /// The same for the backward's per-example `[Σdy | Σdy·x̂]`. `done` is the part of the flat
    /// gradient buffer that is final by now (recorded into `enc`, written by nothing later): from
    /// some offset to the end, growing from call to call, so a hook can start moving gradients
    /// while the backward goes on.
    async fn sums(
        &self,
        gpu: &Gpu,
        enc: &mut Encoder,
        sites: &[BnRows<'_>],
        done: Slice<'_>,
    ) -> Result<()>;
}

/// One BN site's rows in a [`BnSync`] call.
#[derive(Clone, Copy)]
pub struct BnRows<'a> {
    /// The site's number in forward order (`ResNet34::batchnorms`).
    pub site: usize,
    pub rows: &'a wgpu::Buffer,
    /// This device's examples: its rows come first in `rows`.
    pub local: u32,
}

/// One device's own statistics: plain training-mode BatchNorm.
pub struct LocalBn;

impl BnSync for LocalBn {
    fn replicas(&self) -> u32 {
        1
    }
    async fn stats(&self, _: &Gpu, _: &mut Encoder, _: &[BnRows<'_>]) -> Result<()> {
        Ok(())
    }
    async fn sums(&self, _: &Gpu, _: &mut Encoder, _: &[BnRows<'_>], _: Slice<'_>) -> Result<()> {
        Ok(())
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
    pub loss: f32,
    pub logits: Vec<f32>,
    pub pattern: Option<ActivationPattern>,
}

/// One device's copy of the model: parameters, gradients, momentum and BN running statistics,
/// each one flat buffer in the model's layout, plus activation buffers reused across steps:
/// one per name for what the forward saves for the backward (and the small per-site ones), and
/// a pool of scratch buffers shared by what lives only part of a pass.
pub struct Replica {
    pub gpu: Gpu,
    pub model: ResNet34,
    pub params: wgpu::Buffer,
    pub grads: wgpu::Buffer,
    pub velocity: wgpu::Buffer,
    pub running: wgpu::Buffer,
    acts: HashMap<String, wgpu::Buffer>,
    scratch: Scratch,
}

/// Activation buffers that live for part of a pass (the backward's cotangents, a downsample
/// shortcut), shared by size: `take` hands out a free buffer of exactly `len` elements, making
/// one when none is free, and `give_back` frees it once the last kernel reading it has been
/// recorded. Reusing a buffer inside one encoder is safe: commands run in recording order, and
/// wgpu orders one dispatch's reads of a buffer before a later dispatch's writes to it.
#[derive(Default)]
struct Scratch {
    /// Every buffer, and whether it is taken now.
    buffers: Vec<(wgpu::Buffer, bool)>,
    /// The batch (n, h, w) the buffers were sized for.
    geometry: (u32, u32, u32),
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

    fn take(&mut self, gpu: &Gpu, len: u64) -> Result<wgpu::Buffer> {
        let bytes = len.max(1) * 4;
        if let Some((b, taken)) =
            self.buffers.iter_mut().find(|(b, taken)| !*taken && b.size() == bytes)
        {
            *taken = true;
            return Ok(b.clone());
        }
        let b = gpu.buffer("scratch", len)?;
        self.buffers.push((b.clone(), true));
        Ok(b)
    }

    fn give_back(&mut self, buffer: &wgpu::Buffer) {
        if let Some((_, taken)) = self.buffers.iter_mut().find(|(b, _)| b == buffer) {
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

/// A Conv→BN unit of the forward; its saved tensors are `{name}.conv` (the conv output, BN's
/// input) and `{name}.stats`.
struct Unit {
    name: String,
    conv: Conv,
    bn: BatchNorm,
    site: usize,
    input: Dims,
    out: Dims,
    /// Positions the statistics describe (every replica's).
    count: u32,
}

/// A conv and the BN after it, for [`Replica::conv_bn`]: the unit's name, its input `x` and its
/// dimensions.
struct ConvBn<'a> {
    name: String,
    conv: Conv,
    bn: BatchNorm,
    x: &'a wgpu::Buffer,
    input: Dims,
}

impl<'a> ConvBn<'a> {
    fn new(name: &str, conv: Conv, bn: BatchNorm, x: &'a wgpu::Buffer, input: Dims) -> Self {
        ConvBn { name: name.to_string(), conv, bn, x, input }
    }
}

/// A unit's backward, for [`Replica::units_backward`].
struct UnitGrad<'a> {
    unit: usize,
    /// The cotangent of the ReLU after the unit's BN, and that ReLU's site.
    dr: &'a wgpu::Buffer,
    relu_site: usize,
    /// The conv's input.
    x: &'a wgpu::Buffer,
    /// Whether the cotangent of the conv's input is wanted (not for the stem: it is the image).
    input_grad: bool,
}

/// Per-step state threaded through forward and backward.
struct Pass<'p, S> {
    enc: Encoder,
    sync: &'p S,
    cfg: &'p StepConfig,
    units: Vec<Unit>,
    relu_gates: Vec<String>,
    impose: Option<&'p ActivationPattern>,
    /// The buffer holding the pool's argmax: its own, or the imposed one.
    pool_argmax: &'static str,
    /// Inference: BN normalises with these running statistics (the model's flat buffer
    /// layout) and updates nothing.
    eval: Option<Vec<f32>>,
}

impl Replica {
    /// A replica holding `params` (model layout) and running statistics `running`.
    pub fn new(gpu: Gpu, model: ResNet34, params: &[f32], running: &[f32]) -> Result<Replica> {
        if params.len() != model.param_len || running.len() != model.buffer_len {
            return Err(StepError::Invalid(format!(
                "parameter/buffer vectors have {}/{} values, the model layout needs {}/{}",
                params.len(),
                running.len(),
                model.param_len,
                model.buffer_len
            )));
        }
        let binding = gpu.limits.max_storage_buffer_binding_size;
        if (model.param_len as u64) * 4 > binding {
            return Err(GpuError::Limit {
                what: "the flat parameter buffer".into(),
                needed: model.param_len as u64 * 4,
                allowed: binding,
                limit: "max_storage_buffer_binding_size",
            }
            .into());
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
            acts: HashMap::new(),
            scratch: Scratch::default(),
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
        flat + self.acts.values().map(wgpu::Buffer::size).sum::<u64>()
            + self.scratch.bytes()
            + self.gpu.scratch_bytes()
    }

    fn param(&self, index: usize) -> Slice<'_> {
        let p = &self.model.params[index];
        Slice::new(&self.params, p.offset as u64 * 4, p.len() as u64)
    }
    fn grad(&self, index: usize) -> Slice<'_> {
        let p = &self.model.params[index];
        Slice::new(&self.grads, p.offset as u64 * 4, p.len() as u64)
    }
    fn running_slice(&self, index: usize) -> Slice<'_> {
        let b = &self.model.buffers[index];
        Slice::new(&self.running, b.offset as u64 * 4, b.len() as u64)
    }

    /// The activation buffer `name` of `len` elements, created on first use and reused.
    fn act(&mut self, name: &str, len: u64) -> Result<wgpu::Buffer> {
        if let Some(b) = self.acts.get(name) {
            if b.size() == len.max(1) * 4 {
                return Ok(b.clone());
            }
        }
        let b = self.gpu.buffer(name, len)?;
        self.acts.insert(name.to_string(), b.clone());
        Ok(b)
    }

    /// Forward, loss (divided by `divisor`) and backward for `batch`: leaves every parameter
    /// gradient in `grads` and updates the running statistics.
    pub async fn forward_backward(
        &mut self,
        batch: &Batch,
        cfg: &StepConfig,
        divisor: f32,
        sync: &impl BnSync,
        opts: StepOptions<'_>,
    ) -> Result<StepOutput> {
        cfg.validate()?;
        batch.validate(self.model.classes)?;
        ResNet34::check_image_size(batch.h, batch.w)?;
        if batch.is_empty() {
            return Err(StepError::Invalid("empty batch".into()));
        }
        let n = batch.len() as u32;
        self.scratch.begin((n, batch.h, batch.w));
        let input = self.act("input", batch.images.len() as u64)?;
        self.gpu.queue.write_buffer(&input, 0, bytemuck::cast_slice(&batch.images));
        let labels = self.act("labels", n as u64)?;
        self.gpu.queue.write_buffer(&labels, 0, bytemuck::cast_slice(&batch.labels));

        let mut pass = Pass {
            enc: self.gpu.encoder(),
            sync,
            cfg,
            units: Vec::new(),
            relu_gates: Vec::new(),
            impose: opts.impose,
            pool_argmax: "pool.argmax",
            eval: None,
        };
        if let Some(p) = opts.impose {
            self.upload_pattern(p)?;
        }
        let x = Dims { n, c: 3, h: batch.h, w: batch.w };
        let (out, dims) = self.forward(&mut pass, x).await?;
        let (feat, logits) = self.head_forward(&mut pass, &out, dims)?;
        let (loss, dout) = self.loss_backward(&mut pass, divisor, &feat, &logits, dims, &labels)?;
        self.backward(&mut pass, dout).await?;

        let mut enc = std::mem::replace(&mut pass.enc, self.gpu.encoder());
        let read = self.gpu.record_read(&mut enc, &[Slice::whole(&loss), Slice::whole(&logits)]);
        self.gpu.submit(enc).await?;
        let mut logits = read.read::<f32>(&self.gpu).await?;
        let loss = logits.remove(0);
        let pattern =
            if opts.capture_pattern { Some(self.read_pattern(&pass).await?) } else { None };
        Ok(StepOutput { loss, logits, pattern })
    }

    /// Inference: the logits of `batch` with BatchNorm in eval mode (running statistics).
    /// Changes no parameter, gradient or statistic.
    pub async fn predict(&mut self, batch: &Batch) -> Result<Vec<f32>> {
        batch.validate(self.model.classes)?;
        ResNet34::check_image_size(batch.h, batch.w)?;
        if batch.is_empty() {
            return Err(StepError::Invalid("empty batch".into()));
        }
        let running = self.read_running().await?;
        self.scratch.begin((batch.len() as u32, batch.h, batch.w));
        let input = self.act("input", batch.images.len() as u64)?;
        self.gpu.queue.write_buffer(&input, 0, bytemuck::cast_slice(&batch.images));
        let cfg = StepConfig::default();
        let mut pass = Pass {
            enc: self.gpu.encoder(),
            sync: &LocalBn,
            cfg: &cfg,
            units: Vec::new(),
            relu_gates: Vec::new(),
            impose: None,
            pool_argmax: "pool.argmax",
            eval: Some(running),
        };
        let x = Dims { n: batch.len() as u32, c: 3, h: batch.h, w: batch.w };
        let (out, dims) = self.forward(&mut pass, x).await?;
        let (_, logits) = self.head_forward(&mut pass, &out, dims)?;
        let enc = std::mem::replace(&mut pass.enc, self.gpu.encoder());
        self.gpu.submit(enc).await?;
        Ok(self.gpu.read_f32(Slice::whole(&logits)).await?)
    }

    /// SGD with momentum and weight decay over the whole flat parameter buffer.
    pub async fn sgd_update(&self, cfg: &StepConfig) -> Result<()> {
        cfg.validate()?;
        let mut enc = self.gpu.encoder();
        let p =
            sgd::SgdParams { lr: cfg.lr, momentum: cfg.momentum, weight_decay: cfg.weight_decay };
        sgd::sgd_update(
            &self.gpu,
            &mut enc,
            &p,
            Slice::whole(&self.params),
            Slice::whole(&self.grads),
            Slice::whole(&self.velocity),
        )?;
        self.gpu.submit(enc).await?;
        Ok(())
    }

    pub async fn read_params(&self) -> Result<Vec<f32>> {
        Ok(self.gpu.read_f32(Slice::whole(&self.params)).await?)
    }
    pub async fn read_grads(&self) -> Result<Vec<f32>> {
        Ok(self.gpu.read_f32(Slice::whole(&self.grads)).await?)
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
            return Err(StepError::Invalid(format!(
                "momentum has {} values, the layout needs {}",
                v.len(),
                self.model.param_len
            )));
        }
        self.gpu.queue.write_buffer(&self.velocity, 0, bytemuck::cast_slice(v));
        Ok(())
    }

    fn upload_pattern(&mut self, p: &ActivationPattern) -> Result<()> {
        for (i, mask) in p.relu.iter().enumerate() {
            let gate: Vec<f32> = mask.iter().map(|&m| m as f32).collect();
            let b = self.act(&format!("impose.relu{i}"), gate.len() as u64)?;
            self.gpu.queue.write_buffer(&b, 0, bytemuck::cast_slice(&gate));
        }
        let b = self.act("impose.pool", p.pool_argmax.len() as u64)?;
        self.gpu.queue.write_buffer(&b, 0, bytemuck::cast_slice(&p.pool_argmax));
        Ok(())
    }

    async fn read_pattern<S>(&self, pass: &Pass<'_, S>) -> Result<ActivationPattern> {
        let mut relu = Vec::new();
        for name in &pass.relu_gates {
            let v = self.gpu.read_f32(Slice::whole(&self.acts[name])).await?;
            relu.push(v.iter().map(|&x| (x > 0.0) as u8).collect());
        }
        let pool_argmax = self.gpu.read::<u32>(Slice::whole(&self.acts[pass.pool_argmax])).await?;
        Ok(ActivationPattern { relu, pool_argmax })
    }

    /// conv → BatchNorm statistics of `units` (training mode: through `sync`, in one trip for
    /// all of them, and the running statistics updated; eval mode: the running ones), saving
    /// each conv output and statistics the backward reads. Returns the units' indices; `bn_relu`
    /// or `bn_apply` applies their BN.
    async fn conv_bn<S: BnSync, const K: usize>(
        &mut self,
        pass: &mut Pass<'_, S>,
        units: [ConvBn<'_>; K],
    ) -> Result<[usize; K]> {
        let mut rows = Vec::with_capacity(K);
        for u in &units {
            self.gpu.profile_scope(&format!("{} forward", self.model.conv_name(&u.conv)));
            let (conv, input) = (u.conv, u.input);
            let out = Dims {
                n: input.n,
                c: conv.c_out,
                h: conv.out_size(input.h),
                w: conv.out_size(input.w),
            };
            let shape = conv_shape(&conv, input);
            let y = self.act(&format!("{}.conv", u.name), out.len())?;
            match shape.crop() {
                // The kept taps' weights, copied once for this forward and the input-VJP.
                Some(crop) => {
                    let kept = self.act(&format!("{}.kept weights", u.name), crop.shape.w_len())?;
                    conv2d::crop_weights(
                        &self.gpu,
                        &mut pass.enc,
                        &shape,
                        &crop,
                        self.param(conv.weight),
                        Slice::whole(&kept),
                    )?;
                    conv2d::conv2d_launch_kept(
                        &self.gpu,
                        &mut pass.enc,
                        Conv2dOp::Forward,
                        &crop,
                        Slice::whole(u.x),
                        Slice::whole(&kept),
                        Slice::whole(&y),
                    )?;
                }
                None => conv2d::conv2d_forward(
                    &self.gpu,
                    &mut pass.enc,
                    &shape,
                    Slice::whole(u.x),
                    self.param(conv.weight),
                    Slice::whole(&y),
                )?,
            }
            if pass.eval.is_none() {
                // The rows of every replica's examples: this device's first, then the hook's
                // gather; merged, they are the statistics of the global batch.
                let bs = bn_shape(out);
                let global = batchnorm::BnShape { n: pass.sync.replicas() * out.n, ..bs };
                let r = self.act(&format!("{}.stats.rows", u.name), global.rows_len())?;
                batchnorm::bn_example_stats(
                    &self.gpu,
                    &mut pass.enc,
                    &bs,
                    Slice::whole(&y),
                    Slice::new(&r, 0, bs.rows_len()),
                )?;
                rows.push(r);
            }
            let site =
                self.model.batchnorms().iter().position(|bn| *bn == u.bn).ok_or_else(|| {
                    StepError::Invalid(format!("{} is not a BatchNorm of the model", u.name))
                })?;
            pass.units.push(Unit {
                name: u.name.clone(),
                conv,
                bn: u.bn,
                site,
                input,
                out,
                count: 0,
            });
        }
        let first = pass.units.len() - K;
        if pass.eval.is_none() {
            let sites: Vec<BnRows> = pass.units[first..]
                .iter()
                .zip(&rows)
                .map(|(u, rows)| BnRows { site: u.site, rows, local: u.out.n })
                .collect();
            pass.sync.stats(&self.gpu, &mut pass.enc, &sites).await?;
        }
        for (i, unit) in (first..pass.units.len()).enumerate() {
            let u = &pass.units[unit];
            let (name, bn, out) = (u.name.clone(), u.bn, u.out);
            self.gpu.profile_scope(&format!("{} forward", self.model.conv_name(&u.conv)));
            let stats = self.act(&format!("{name}.stats"), 2 * out.c as u64)?;
            let count = match &pass.eval {
                None => {
                    let global =
                        batchnorm::BnShape { n: pass.sync.replicas() * out.n, ..bn_shape(out) };
                    batchnorm::bn_merge_examples(
                        &self.gpu,
                        &mut pass.enc,
                        &global,
                        Slice::whole(&rows[i]),
                        Slice::whole(&stats),
                    )?;
                    let count = global.n * global.hw;
                    batchnorm::bn_update_running(
                        &self.gpu,
                        &mut pass.enc,
                        out.c,
                        count,
                        pass.cfg.bn_momentum,
                        Slice::whole(&stats),
                        self.running_slice(bn.running_mean),
                        self.running_slice(bn.running_var),
                    )?;
                    count
                }
                Some(running) => {
                    // Running statistics in the packed [mean | M2] form the apply kernels read.
                    let local = out.n * out.hw();
                    let (rm, rv) =
                        (&self.model.buffers[bn.running_mean], &self.model.buffers[bn.running_var]);
                    let mut packed = running[rm.range()].to_vec();
                    packed.extend(running[rv.range()].iter().map(|v| v * local as f32));
                    self.gpu.queue.write_buffer(&stats, 0, bytemuck::cast_slice(&packed));
                    local
                }
            };
            pass.units[unit].count = count;
        }
        Ok(std::array::from_fn(|i| first + i))
    }

    /// The conv output and statistics `unit` saved.
    fn saved(&self, unit: &Unit) -> (wgpu::Buffer, wgpu::Buffer) {
        (
            self.acts[&format!("{}.conv", unit.name)].clone(),
            self.acts[&format!("{}.stats", unit.name)].clone(),
        )
    }

    /// The BN output of `unit`, plus `shortcut` when given, through a ReLU into the saved
    /// activation `name`, in one fused kernel. The ReLU's gate is its own input, or the imposed
    /// mask of this ReLU site.
    fn bn_relu<S>(
        &mut self,
        pass: &mut Pass<S>,
        unit: usize,
        shortcut: Option<&wgpu::Buffer>,
        name: &str,
    ) -> Result<wgpu::Buffer> {
        let u = &pass.units[unit];
        let (y, stats) = self.saved(u);
        let r = self.act(name, u.out.len())?;
        let site = pass.relu_gates.len();
        let imposed = match pass.impose {
            Some(p) => {
                let expected = u.out.len();
                if p.relu.get(site).map(|m| m.len() as u64) != Some(expected) {
                    return Err(StepError::Invalid(format!(
                        "imposed pattern has no ReLU site {site} of {expected} units"
                    )));
                }
                Some(self.acts[&format!("impose.relu{site}")].clone())
            }
            None => None,
        };
        let (weight, bias) = (self.param(u.bn.weight), self.param(u.bn.bias));
        batchnorm::bn_apply_relu(
            &self.gpu,
            &mut pass.enc,
            &bn_shape(u.out),
            u.count,
            BN_EPS,
            Slice::whole(&y),
            Slice::whole(&stats),
            weight,
            bias,
            shortcut.map(Slice::whole),
            imposed.as_ref().map(Slice::whole),
            Slice::whole(&r),
        )?;
        // The backward masks with the output: r > 0 exactly where the ReLU's input was > 0;
        // under an imposed pattern the gate itself decides, so keep it for the backward.
        let gate =
            if pass.impose.is_some() { format!("impose.relu{site}") } else { name.to_string() };
        pass.relu_gates.push(gate);
        Ok(r)
    }

    /// The BN output of `unit` alone (a downsample shortcut, which the block's `bn_relu` adds)
    /// into a scratch buffer.
    fn bn_apply<S>(&mut self, pass: &mut Pass<S>, unit: usize) -> Result<wgpu::Buffer> {
        let u = &pass.units[unit];
        let (y, stats) = self.saved(u);
        let z = self.scratch.take(&self.gpu, u.out.len())?;
        let (weight, bias) = (self.param(u.bn.weight), self.param(u.bn.bias));
        batchnorm::bn_forward_apply(
            &self.gpu,
            &mut pass.enc,
            &bn_shape(u.out),
            u.count,
            BN_EPS,
            Slice::whole(&y),
            Slice::whole(&stats),
            weight,
            bias,
            Slice::whole(&z),
        )?;
        Ok(z)
    }

    async fn forward<S: BnSync>(
        &mut self,
        pass: &mut Pass<'_, S>,
        x: Dims,
    ) -> Result<(wgpu::Buffer, Dims)> {
        let m = self.model.clone();
        let input = self.acts["input"].clone();
        let [stem] =
            self.conv_bn(pass, [ConvBn::new("stem", m.stem_conv, m.stem_bn, &input, x)]).await?;
        let r = self.bn_relu(pass, stem, None, "stem.relu")?;
        let d = pass.units[stem].out;
        let ps = pool_shape(d);
        let pooled = Dims { n: d.n, c: d.c, h: ps.out_h(), w: ps.out_w() };
        let y = self.act("pool", pooled.len())?;
        match pass.impose {
            Some(p) => {
                if p.pool_argmax.len() as u64 != pooled.len() {
                    return Err(StepError::Invalid(
                        "imposed pattern's pool argmax has the wrong size".into(),
                    ));
                }
                pass.pool_argmax = "impose.pool";
                let given = self.acts["impose.pool"].clone();
                maxpool::maxpool_forward_with_argmax(
                    &self.gpu,
                    &mut pass.enc,
                    &ps,
                    Slice::whole(&r),
                    Slice::whole(&given),
                    Slice::whole(&y),
                )?;
            }
            None => {
                let argmax = self.act("pool.argmax", pooled.len())?;
                maxpool::maxpool_forward(
                    &self.gpu,
                    &mut pass.enc,
                    &ps,
                    Slice::whole(&r),
                    Slice::whole(&y),
                    Slice::whole(&argmax),
                )?;
            }
        }
        let (mut x, mut d) = (y, pooled);
        for (i, b) in m.blocks.iter().enumerate() {
            let p = block_name(i);
            let conv1 = ConvBn::new(&format!("{p}.1"), b.conv1, b.bn1, &x, d);
            // The downsample reads the block's input too: its statistics travel with conv1's.
            let (u1, ds) = match b.downsample {
                Some((c, bn)) => {
                    let [u1, ds] = self
                        .conv_bn(pass, [conv1, ConvBn::new(&format!("{p}.ds"), c, bn, &x, d)])
                        .await?;
                    (u1, Some(ds))
                }
                None => (self.conv_bn(pass, [conv1]).await?[0], None),
            };
            let r1 = self.bn_relu(pass, u1, None, &format!("{p}.relu1"))?;
            let [u2] = self
                .conv_bn(
                    pass,
                    [ConvBn::new(&format!("{p}.2"), b.conv2, b.bn2, &r1, pass.units[u1].out)],
                )
                .await?;
            let out = match ds {
                Some(ds) => {
                    let shortcut = self.bn_apply(pass, ds)?;
                    let out = self.bn_relu(pass, u2, Some(&shortcut), &format!("{p}.out"))?;
                    self.scratch.give_back(&shortcut);
                    out
                }
                None => self.bn_relu(pass, u2, Some(&x), &format!("{p}.out"))?,
            };
            (x, d) = (out, pass.units[u2].out);
        }
        Ok((x, d))
    }

    /// Global average pool and fc: returns the pooled features and the logits.
    fn head_forward<S>(
        &mut self,
        pass: &mut Pass<S>,
        x: &wgpu::Buffer,
        d: Dims,
    ) -> Result<(wgpu::Buffer, wgpu::Buffer)> {
        let (n, c, k) = (d.n, d.c, self.model.classes);
        self.gpu.profile_scope("fc and loss");
        let feat = self.act("gap", (n * c) as u64)?;
        avgpool::global_avgpool_forward(
            &self.gpu,
            &mut pass.enc,
            &avgpool::AvgPoolShape { n, c, hw: d.hw() },
            Slice::whole(x),
            Slice::whole(&feat),
        )?;
        let logits = self.act("logits", (n * k) as u64)?;
        let (fw, fb) = (self.param(self.model.fc_weight), self.param(self.model.fc_bias));
        dense::dense_forward(
            &self.gpu,
            &mut pass.enc,
            &dense::DenseShape { m: n, k_in: c, k_out: k },
            Slice::whole(&feat),
            fw,
            fb,
            Slice::whole(&logits),
        )?;
        Ok((feat, logits))
    }

    /// The loss (returned in a one-element buffer), then its backward through fc and the
    /// pool: returns the loss and the cotangent of the last block's output (scratch), where
    /// the blocks' backward starts.
    fn loss_backward<S>(
        &mut self,
        pass: &mut Pass<S>,
        divisor: f32,
        feat: &wgpu::Buffer,
        logits: &wgpu::Buffer,
        d: Dims,
        labels: &wgpu::Buffer,
    ) -> Result<(wgpu::Buffer, wgpu::Buffer)> {
        let (n, c, k) = (d.n, d.c, self.model.classes);
        let cs = cross_entropy::CrossEntropyShape { m: n, k };
        let losses = self.act("losses", n as u64)?;
        let loss = self.act("loss", 1)?;
        let (lg, lb, eps) = (Slice::whole(logits), Slice::whole(labels), pass.cfg.label_smoothing);
        cross_entropy::cross_entropy_forward(
            &self.gpu,
            &mut pass.enc,
            &cs,
            eps,
            divisor,
            lg,
            lb,
            Slice::whole(&losses),
            Slice::whole(&loss),
        )?;
        let dlogits = self.act("logits.grad", (n * k) as u64)?;
        cross_entropy::cross_entropy_backward(
            &self.gpu,
            &mut pass.enc,
            &cs,
            eps,
            divisor,
            lg,
            lb,
            Slice::whole(&dlogits),
        )?;
        let ds = dense::DenseShape { m: n, k_in: c, k_out: k };
        let (fw, fb) = (self.model.fc_weight, self.model.fc_bias);
        let dfeat = self.act("gap.grad", (n * c) as u64)?;
        let dl = Slice::whole(&dlogits);
        dense::dense_backward_input(
            &self.gpu,
            &mut pass.enc,
            &ds,
            dl,
            self.param(fw),
            Slice::whole(&dfeat),
        )?;
        dense::dense_backward_weight(
            &self.gpu,
            &mut pass.enc,
            &ds,
            dl,
            Slice::whole(feat),
            self.grad(fw),
        )?;
        dense::dense_backward_bias(&self.gpu, &mut pass.enc, &ds, dl, self.grad(fb))?;
        let dx = self.scratch.take(&self.gpu, d.len())?;
        avgpool::global_avgpool_backward(
            &self.gpu,
            &mut pass.enc,
            &avgpool::AvgPoolShape { n, c, hw: d.hw() },
            Slice::whole(&dfeat),
            Slice::whole(&dx),
        )?;
        Ok((loss, dx))
    }

    /// The backward of `units` (in reverse layout order), each given the cotangent `dr` of the
    /// ReLU after its BN, whose site is `relu_site` (the BN kernels mask `dr` with that ReLU's
    /// gate as they read it), and its conv's input `x`: BN (the sums of all of them through the
    /// sync hook in one trip), then each conv's weight gradient and, where `input_grad`, the
    /// cotangent of its input (scratch), returned in the units' order.
    async fn units_backward<S: BnSync, const K: usize>(
        &mut self,
        pass: &mut Pass<'_, S>,
        units: [UnitGrad<'_>; K],
    ) -> Result<[Option<wgpu::Buffer>; K]> {
        // Per unit: its saved conv output and statistics, its ReLU's gate, its BN rows and sums.
        let mut read = Vec::with_capacity(K);
        for g in &units {
            let u = &pass.units[g.unit];
            let (name, conv, bn, out, count) = (u.name.clone(), u.conv, u.bn, u.out, u.count);
            let (y, stats) = self.saved(u);
            self.gpu.profile_scope(&format!("{} backward", self.model.conv_name(&conv)));
            let gate = self.acts[&pass.relu_gates[g.relu_site]].clone();
            let bs = bn_shape(out);
            let global = batchnorm::BnShape { n: pass.sync.replicas() * out.n, ..bs };
            let rows = self.act(&format!("{name}.sums.rows"), global.rows_len())?;
            let local_rows = Slice::new(&rows, 0, bs.rows_len());
            batchnorm::bn_example_sums(
                &self.gpu,
                &mut pass.enc,
                &bs,
                count,
                BN_EPS,
                Slice::whole(g.dr),
                Some(Slice::whole(&gate)),
                Slice::whole(&y),
                Slice::whole(&stats),
                local_rows,
            )?;
            // dβ = Σdy and dγ = Σdy·x̂ over this replica's own examples (docs/design.md: they stay
            // local until the gradient all-reduce); then Σdy, Σdy·x̂ over every replica's for dx.
            let sums = self.act(&format!("{name}.sums"), 2 * out.c as u64)?;
            batchnorm::bn_sum_examples(
                &self.gpu,
                &mut pass.enc,
                &bs,
                local_rows,
                Slice::whole(&sums),
            )?;
            let c4 = out.c as u64 * 4;
            let (gb, gg) = (self.grad(bn.bias), self.grad(bn.weight));
            pass.enc.copy_buffer_to_buffer(&sums, 0, gb.buffer, gb.offset, c4);
            pass.enc.copy_buffer_to_buffer(&sums, c4, gg.buffer, gg.offset, c4);
            read.push((y, stats, gate, rows, sums));
        }
        // Units go backward in reverse forward order, which is the layout's: every later unit's
        // gradients are final, and so are the first unit's dγ, dβ just copied. The rest is later.
        let first = &pass.units[units[0].unit];
        let from = self.model.params[first.bn.weight].offset as u64;
        let done = Slice::new(&self.grads, from * 4, self.model.param_len as u64 - from);
        let sites: Vec<BnRows> = units
            .iter()
            .zip(&read)
            .map(|(g, (.., rows, _))| BnRows {
                site: pass.units[g.unit].site,
                rows,
                local: pass.units[g.unit].out.n,
            })
            .collect();
        pass.sync.sums(&self.gpu, &mut pass.enc, &sites, done).await?;
        let mut dxs = Vec::with_capacity(K);
        for (g, (y, stats, gate, rows, sums)) in units.iter().zip(&read) {
            let u = &pass.units[g.unit];
            let (conv, bn, input, out, count) = (u.conv, u.bn, u.input, u.out, u.count);
            self.gpu.profile_scope(&format!("{} backward", self.model.conv_name(&conv)));
            let bs = bn_shape(out);
            let global = batchnorm::BnShape { n: pass.sync.replicas() * out.n, ..bs };
            if global.n > bs.n {
                // Over every replica's rows; on one device those are the rows just summed.
                batchnorm::bn_sum_examples(
                    &self.gpu,
                    &mut pass.enc,
                    &global,
                    Slice::whole(rows),
                    Slice::whole(sums),
                )?;
            }
            let dy = self.scratch.take(&self.gpu, out.len())?;
            batchnorm::bn_backward_input(
                &self.gpu,
                &mut pass.enc,
                &bs,
                count,
                BN_EPS,
                Slice::whole(g.dr),
                Some(Slice::whole(gate)),
                Slice::whole(y),
                Slice::whole(stats),
                self.param(bn.weight),
                Slice::whole(sums),
                Slice::whole(&dy),
            )?;
            let shape = conv_shape(&conv, input);
            conv2d::conv2d_backward_weight(
                &self.gpu,
                &mut pass.enc,
                &shape,
                Slice::whole(&dy),
                Slice::whole(g.x),
                self.grad(conv.weight),
            )?;
            let dx = if g.input_grad {
                let dx = self.scratch.take(&self.gpu, input.len())?;
                match shape.crop() {
                    Some(crop) => {
                        let kept = &self.acts[&format!("{}.kept weights", u.name)];
                        conv2d::conv2d_launch_kept(
                            &self.gpu,
                            &mut pass.enc,
                            Conv2dOp::BackwardInput,
                            &crop,
                            Slice::whole(&dy),
                            Slice::whole(kept),
                            Slice::whole(&dx),
                        )?;
                    }
                    None => conv2d::conv2d_backward_input(
                        &self.gpu,
                        &mut pass.enc,
                        &shape,
                        Slice::whole(&dy),
                        self.param(conv.weight),
                        Slice::whole(&dx),
                    )?,
                }
                Some(dx)
            } else {
                None
            };
            self.scratch.give_back(&dy);
            dxs.push(dx);
        }
        Ok(dxs.try_into().unwrap_or_else(|_| unreachable!("one cotangent per unit")))
    }

    /// The blocks' and the stem's backward from `dout`, the cotangent of the last block's
    /// output. Every cotangent is scratch, given back after its last reader.
    async fn backward<S: BnSync>(
        &mut self,
        pass: &mut Pass<'_, S>,
        mut dout: wgpu::Buffer,
    ) -> Result<()> {
        let m = self.model.clone();
        // The stem is unit 0; blocks' units are found by name.
        let mut unit_of = HashMap::new();
        for (i, u) in pass.units.iter().enumerate() {
            unit_of.insert(u.name.clone(), i);
        }
        for (i, b) in m.blocks.iter().enumerate().rev() {
            let p = block_name(i);
            let block_input = if i == 0 {
                self.acts["pool"].clone()
            } else {
                self.acts[&format!("{}.out", block_name(i - 1))].clone()
            };
            // ReLU sites: 0 is the stem's; block i has 1 + 2i (after bn1) and 2 + 2i (its output).
            let (relu1, out) = (1 + 2 * i, 2 + 2 * i);
            // The downsample (last in the layout) first: units go backward in reverse layout
            // order, so the gradients final at each BN site are one suffix of the layout. It
            // and conv2 read the same cotangent: their BN sums travel together.
            let r1 = self.acts[&format!("{p}.relu1")].clone();
            let conv2 = UnitGrad {
                unit: unit_of[&format!("{p}.2")],
                dr: &dout,
                relu_site: out,
                x: &r1,
                input_grad: true,
            };
            let (dx2, dr1) = match b.downsample {
                Some(_) => {
                    let ds = UnitGrad {
                        unit: unit_of[&format!("{p}.ds")],
                        dr: &dout,
                        relu_site: out,
                        x: &block_input,
                        input_grad: true,
                    };
                    let [dx2, dr1] = self.units_backward(pass, [ds, conv2]).await?;
                    (dx2, dr1)
                }
                None => {
                    let [dr1] = self.units_backward(pass, [conv2]).await?;
                    (None, dr1)
                }
            };
            let dr1 = dr1.expect("conv2's input cotangent was asked for");
            let conv1 = UnitGrad {
                unit: unit_of[&format!("{p}.1")],
                dr: &dr1,
                relu_site: relu1,
                x: &block_input,
                input_grad: true,
            };
            let [dx1] = self.units_backward(pass, [conv1]).await?;
            let dx1 = dx1.expect("conv1's input cotangent was asked for");
            self.scratch.give_back(&dr1);
            // The block input's cotangent: the conv branch's dx1 plus the shortcut's.
            let dx = self.scratch.take(&self.gpu, dx1.size() / 4)?;
            match dx2 {
                Some(dx2) => {
                    elementwise::add(
                        &self.gpu,
                        &mut pass.enc,
                        Slice::whole(&dx1),
                        Slice::whole(&dx2),
                        Slice::whole(&dx),
                    )?;
                    self.scratch.give_back(&dx2);
                }
                None => {
                    let gate = self.acts[&pass.relu_gates[out]].clone();
                    elementwise::add_relu_backward(
                        &self.gpu,
                        &mut pass.enc,
                        Slice::whole(&dx1),
                        Slice::whole(&dout),
                        Slice::whole(&gate),
                        Slice::whole(&dx),
                    )?;
                }
            }
            self.scratch.give_back(&dx1);
            self.scratch.give_back(&dout);
            dout = dx;
        }
        let stem = &pass.units[0];
        let ps = pool_shape(stem.out);
        let dr = self.scratch.take(&self.gpu, stem.out.len())?;
        let argmax = self.acts[pass.pool_argmax].clone();
        maxpool::maxpool_backward(
            &self.gpu,
            &mut pass.enc,
            &ps,
            Slice::whole(&dout),
            Slice::whole(&argmax),
            Slice::whole(&dr),
        )?;
        self.scratch.give_back(&dout);
        let input = self.acts["input"].clone();
        // The stem's input is the image: no cotangent needed.
        self.units_backward(
            pass,
            [UnitGrad { unit: 0, dr: &dr, relu_site: 0, x: &input, input_grad: false }],
        )
        .await?;
        self.scratch.give_back(&dr);
        Ok(())
    }
}

fn block_name(i: usize) -> String {
    format!("block{i}")
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
