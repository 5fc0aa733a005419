//! The forward of one replica's step: conv → BatchNorm units (statistics through the
//! communicator), fused BN + residual + ReLU, the max-pool, and the head; and the activation pattern
//! the gates impose or capture.

use super::activations::{Act, UnitId};
use super::{
    bn_shape, conv_shape, pool_shape, BnRows, Communicator, Dims, Pass, Replica, Result, StepError,
    Transient, BN_EPS,
};
use crate::gpu::Slice;
use crate::kernels::conv2d::{self, Conv2dOp};
use crate::kernels::{avgpool, batchnorm, dense, maxpool};
use crate::model::{ActivationPattern, BatchNorm, Block, Conv};

/// A Conv→BN unit of the forward; its saved tensors are [`Act::Conv`] (the conv output, BN's
/// input) and [`Act::Stats`].
pub(super) struct Unit {
    pub(super) id: UnitId,
    pub(super) conv: Conv,
    pub(super) bn: BatchNorm,
    pub(super) site: usize,
    pub(super) input: Dims,
    pub(super) out: Dims,
    /// Positions the statistics describe (every replica's).
    pub(super) count: u32,
}

/// A conv and the BN after it, for [`Replica::conv_bn`]: the unit, its input `x` and its
/// dimensions.
pub(super) struct ConvBn<'a> {
    pub(super) id: UnitId,
    pub(super) conv: Conv,
    pub(super) bn: BatchNorm,
    pub(super) x: Slice<'a>,
    pub(super) input: Dims,
}

impl<'a> ConvBn<'a> {
    pub(super) fn new(id: UnitId, conv: Conv, bn: BatchNorm, x: Slice<'a>, input: Dims) -> Self {
        ConvBn { id, conv, bn, x, input }
    }
}

impl Replica {
    pub(super) fn upload_pattern(&mut self, p: &ActivationPattern) -> Result<()> {
        for (i, mask) in p.relu.iter().enumerate() {
            let gate: Vec<f32> = mask.iter().map(|&m| m as f32).collect();
            let b = self.act(Act::ImposedRelu(i), gate.len() as u64)?;
            self.gpu.queue.write_buffer(&b, 0, bytemuck::cast_slice(&gate));
        }
        let b = self.act(Act::ImposedPool, p.pool_argmax.len() as u64)?;
        self.gpu.queue.write_buffer(&b, 0, bytemuck::cast_slice(&p.pool_argmax));
        Ok(())
    }

    /// The pattern this pass ran on: every ReLU site's output (captured as the forward made
    /// it) through `> 0`, or the imposed masks, and the pool's argmax.
    pub(super) async fn read_pattern<S>(&self, pass: &Pass<'_, S>) -> Result<ActivationPattern> {
        let mut relu = Vec::new();
        for site in 0..pass.relu_sites {
            let gate = match pass.impose {
                Some(_) => Act::ImposedRelu(site),
                None => Act::CapturedRelu(site),
            };
            let v = self.gpu.read_f32(Slice::whole(&self.acts.saved(gate))).await?;
            relu.push(v.iter().map(|&x| (x > 0.0) as u8).collect());
        }
        let argmax = self.acts.saved(pass.pool_argmax);
        let pool_argmax = self.gpu.read::<u32>(Slice::whole(&argmax)).await?;
        Ok(ActivationPattern { relu, pool_argmax })
    }

    /// conv → BatchNorm statistics of `units` (training mode: through the communicator, in one trip for
    /// all of them, and the running statistics updated; eval mode: the running ones), saving
    /// each conv output and statistics the backward reads. Returns the units' indices; `bn_relu`
    /// or `bn_apply` applies their BN.
    pub(super) async fn conv_bn<S: Communicator, const K: usize>(
        &mut self,
        pass: &mut Pass<'_, S>,
        units: [ConvBn<'_>; K],
    ) -> Result<[usize; K]> {
        let mut rows = Vec::with_capacity(K);
        for u in &units {
            let out = self.conv_forward(pass, u)?;
            if pass.eval.is_none() {
                rows.push(self.example_stats(pass, rows.len(), u.id, out)?);
            }
            let site = self
                .model
                .batchnorms()
                .iter()
                .position(|bn| *bn == u.bn)
                .ok_or_else(|| StepError::NotABatchNorm { unit: format!("{:?}", u.id) })?;
            let (id, conv, bn, input) = (u.id, u.conv, u.bn, u.input);
            pass.units.push(Unit { id, conv, bn, site, input, out, count: 0 });
        }
        let first = pass.units.len() - K;
        if pass.eval.is_none() {
            let sites: Vec<BnRows> = pass.units[first..]
                .iter()
                .zip(&rows)
                .map(|(u, rows)| BnRows { site: u.site, rows: rows.slice(), local: u.out.n })
                .collect();
            pass.comm.bn_stats(&self.gpu, &mut pass.enc, &sites).await?;
        }
        for (i, unit) in (first..pass.units.len()).enumerate() {
            pass.units[unit].count = self.unit_statistics(pass, unit, rows.get(i))?;
        }
        Ok(std::array::from_fn(|i| first + i))
    }

    /// `u`'s convolution into its [`Act::Conv`]; returns the output's dimensions.
    fn conv_forward<S>(&mut self, pass: &mut Pass<S>, u: &ConvBn) -> Result<Dims> {
        self.gpu.profile_scope(&format!("{} forward", self.model.conv_name(&u.conv)));
        let (conv, input) = (u.conv, u.input);
        let out = Dims {
            n: input.n,
            c: conv.c_out,
            h: conv.out_size(input.h),
            w: conv.out_size(input.w),
        };
        let shape = conv_shape(&conv, input);
        let y = self.act(Act::Conv(u.id), out.len())?;
        match conv2d::conv2d_choice(&self.gpu, Conv2dOp::Forward, &shape)?.1 {
            // The kept taps' weights, copied once for this forward and the input-VJP.
            Some(crop) => {
                let kept = self.act(Act::KeptWeights(u.id), crop.shape.w_len())?;
                let (gpu, enc) = (&self.gpu, &mut pass.enc);
                let kept = Slice::whole(&kept);
                conv2d::crop_weights(gpu, enc, &shape, &crop, self.param(conv.weight), kept)?;
                let (x, y) = (u.x, Slice::whole(&y));
                conv2d::conv2d_launch_kept(gpu, enc, Conv2dOp::Forward, &crop, x, kept, y)?;
            }
            None => {
                let operands = (u.x, conv.weight, Slice::whole(&y));
                self.conv_launch(pass, Conv2dOp::Forward, &shape, operands)?
            }
        }
        Ok(out)
    }

    /// The per-example statistics rows of unit `id`'s conv output, the `slot`-th of its trip:
    /// this device's, first in room for every replica's, which the communicator gathers; merged,
    /// they are the statistics of the global batch.
    fn example_stats<S: Communicator>(
        &mut self,
        pass: &mut Pass<S>,
        slot: usize,
        id: UnitId,
        out: Dims,
    ) -> Result<Transient> {
        let bs = bn_shape(out);
        let global = batchnorm::BnShape { n: pass.comm.examples(out.n), ..bs };
        let rows = self.acts.at_least(&self.gpu, Act::StatsRows(slot), global.rows_len())?;
        if pass.comm.gathers_rows() {
            let y = self.acts.saved(Act::Conv(id));
            let local_rows = Slice::new(&rows.buffer, 0, bs.rows_len());
            let (gpu, enc) = (&self.gpu, &mut pass.enc);
            batchnorm::bn_example_stats(gpu, enc, &bs, Slice::whole(&y), local_rows)?;
        }
        Ok(rows)
    }

    /// Unit `unit`'s [`Act::Stats`]: merged from every replica's `rows`, with the running
    /// statistics updated (training), or the running statistics (eval, no rows). Returns how
    /// many positions they describe.
    fn unit_statistics<S: Communicator>(
        &mut self,
        pass: &mut Pass<S>,
        unit: usize,
        rows: Option<&Transient>,
    ) -> Result<u32> {
        let u = &pass.units[unit];
        let (id, bn, out) = (u.id, u.bn, u.out);
        self.gpu.profile_scope(&format!("{} forward", self.model.conv_name(&u.conv)));
        let stats = self.act(Act::Stats(id), 2 * out.c as u64)?;
        let (Some(rows), None) = (rows, &pass.eval) else {
            // Running statistics in the packed [mean | M2] form the apply kernels read.
            let running = pass.eval.as_ref().expect("without rows, the pass is an evaluation");
            let local = out.n * out.hw();
            let (rm, rv) =
                (&self.model.buffers[bn.running_mean], &self.model.buffers[bn.running_var]);
            let mut packed = running[rm.range()].to_vec();
            packed.extend(running[rv.range()].iter().map(|v| v * local as f32));
            self.gpu.queue.write_buffer(&stats, 0, bytemuck::cast_slice(&packed));
            return Ok(local);
        };
        let global = batchnorm::BnShape { n: pass.comm.examples(out.n), ..bn_shape(out) };
        let (gpu, enc) = (&self.gpu, &mut pass.enc);
        let running = batchnorm::Running {
            momentum: pass.cfg.bn_momentum,
            mean: self.running_slice(bn.running_mean),
            var: self.running_slice(bn.running_var),
        };
        // One device takes its rows in the same launch; else they were gathered.
        let rows = match pass.comm.gathers_rows() {
            true => batchnorm::Rows::Given(rows.slice()),
            false => batchnorm::Rows::Take(rows.slice()),
        };
        let y = self.acts.saved(Act::Conv(id));
        let (y, stats) = (Slice::whole(&y), Slice::whole(&stats));
        batchnorm::bn_stats(gpu, enc, &global, y, rows, stats, Some(running))?;
        Ok(global.n * global.hw)
    }

    /// The conv output and statistics `unit` saved.
    pub(super) fn saved(&self, unit: &Unit) -> (wgpu::Buffer, wgpu::Buffer) {
        (self.acts.saved(Act::Conv(unit.id)), self.acts.saved(Act::Stats(unit.id)))
    }

    /// The forward's next ReLU site: the BN output of `unit`, plus `shortcut` when given,
    /// through the ReLU into `out` ([`Replica::bn_relu_at`]), copied where a captured pattern
    /// reads it.
    pub(super) fn bn_relu<S>(
        &mut self,
        pass: &mut Pass<S>,
        unit: usize,
        shortcut: Option<Slice<'_>>,
        out: Slice<'_>,
    ) -> Result<()> {
        let site = pass.relu_sites;
        self.bn_relu_at(pass, unit, site, shortcut, out)?;
        if pass.capture && pass.impose.is_none() {
            let kept = self.act(Act::CapturedRelu(site), out.len)?;
            pass.enc.copy_buffer_to_buffer(out.buffer, out.offset, &kept, 0, out.bytes());
        }
        pass.relu_sites += 1;
        Ok(())
    }

    /// The BN output of `unit`, plus `shortcut` when given, through ReLU site `site` into `out`,
    /// in one fused kernel. The ReLU's gate is its own input, or the site's imposed mask. The
    /// backward calls it again for the outputs the forward did not keep: the same bits.
    pub(super) fn bn_relu_at<S>(
        &mut self,
        pass: &mut Pass<S>,
        unit: usize,
        site: usize,
        shortcut: Option<Slice<'_>>,
        out: Slice<'_>,
    ) -> Result<()> {
        let u = &pass.units[unit];
        let (y, stats) = self.saved(u);
        let imposed = match pass.impose {
            Some(p) => {
                let expected = u.out.len();
                if p.relu.get(site).map(|m| m.len() as u64) != Some(expected) {
                    return Err(StepError::ImposedRelu { site, units: expected });
                }
                Some(self.acts.saved(Act::ImposedRelu(site)))
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
            shortcut,
            imposed.as_ref().map(Slice::whole),
            out,
        )?;
        Ok(())
    }

    /// The BN output of `unit` alone (a downsample shortcut, which the block's `bn_relu` adds)
    /// into a scratch buffer.
    pub(super) fn bn_apply<S>(&mut self, pass: &mut Pass<S>, unit: usize) -> Result<Transient> {
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
            z.slice(),
        )?;
        Ok(z)
    }

    pub(super) async fn forward<S: Communicator>(
        &mut self,
        pass: &mut Pass<'_, S>,
        x: Dims,
    ) -> Result<(wgpu::Buffer, Dims)> {
        let m = self.model.clone();
        let input = self.acts.saved(Act::Input);
        let stem = ConvBn::new(UnitId::Stem, m.stem_conv, m.stem_bn, Slice::whole(&input), x);
        let [stem] = self.conv_bn(pass, [stem]).await?;
        let d = pass.units[stem].out;
        // Only the pool reads the stem's ReLU output: the backward takes its gate from the
        // pool's output (`maxpool_relu_backward`), or from an imposed mask.
        let r = self.scratch.take(&self.gpu, d.len())?;
        self.bn_relu(pass, stem, None, r.slice())?;
        let ps = pool_shape(d);
        let pooled = Dims { n: d.n, c: d.c, h: ps.out_h(), w: ps.out_w() };
        let y = self.act(Act::Pool, pooled.len())?;
        match pass.impose {
            Some(p) => {
                if p.pool_argmax.len() as u64 != pooled.len() {
                    return Err(StepError::ImposedPool);
                }
                pass.pool_argmax = Act::ImposedPool;
                let given = self.acts.saved(Act::ImposedPool);
                maxpool::maxpool_forward_with_argmax(
                    &self.gpu,
                    &mut pass.enc,
                    &ps,
                    r.slice(),
                    Slice::whole(&given),
                    Slice::whole(&y),
                )?;
            }
            None => {
                let argmax = self.act(Act::PoolArgmax, pooled.len())?;
                maxpool::maxpool_forward(
                    &self.gpu,
                    &mut pass.enc,
                    &ps,
                    r.slice(),
                    Slice::whole(&y),
                    Slice::whole(&argmax),
                )?;
            }
        }
        self.scratch.give_back(&r);
        let (mut x, mut d) = (y, pooled);
        for (i, b) in m.blocks.iter().enumerate() {
            (x, d) = self.block_forward(pass, i, b, x, d).await?;
        }
        Ok((x, d))
    }

    /// Block `i` (`b`) from its input `x`: its main path's units, each BN but the last through a
    /// ReLU, the last added to the shortcut before the block's ReLU. Returns its output.
    async fn block_forward<S: Communicator>(
        &mut self,
        pass: &mut Pass<'_, S>,
        i: usize,
        b: &Block,
        x: wgpu::Buffer,
        d: Dims,
    ) -> Result<(wgpu::Buffer, Dims)> {
        let (conv, bn) = b.units[0];
        let first = ConvBn::new(UnitId::Main(i, 0), conv, bn, Slice::whole(&x), d);
        // The downsample reads the block's input too: its statistics travel with the first unit's.
        let (mut u, ds) = match b.downsample {
            Some((c, bn)) => {
                let [u, ds] = self
                    .conv_bn(
                        pass,
                        [first, ConvBn::new(UnitId::Downsample(i), c, bn, Slice::whole(&x), d)],
                    )
                    .await?;
                (u, Some(ds))
            }
            None => (self.conv_bn(pass, [first]).await?[0], None),
        };
        // The ReLU outputs inside the block are the next conv's input only here: the backward
        // makes them again (`bn_relu_at`) rather than keep them.
        for (j, &(conv, bn)) in b.units.iter().enumerate().skip(1) {
            let r = self.scratch.take(&self.gpu, pass.units[u].out.len())?;
            self.bn_relu(pass, u, None, r.slice())?;
            let next = ConvBn::new(UnitId::Main(i, j), conv, bn, r.slice(), pass.units[u].out);
            [u] = self.conv_bn(pass, [next]).await?;
            self.scratch.give_back(&r);
        }
        let d = pass.units[u].out;
        let out = self.act(Act::BlockOut(i), d.len())?;
        match ds {
            Some(ds) => {
                let shortcut = self.bn_apply(pass, ds)?;
                self.bn_relu(pass, u, Some(shortcut.slice()), Slice::whole(&out))?;
                self.scratch.give_back(&shortcut);
            }
            None => self.bn_relu(pass, u, Some(Slice::whole(&x)), Slice::whole(&out))?,
        }
        Ok((out, d))
    }

    /// Global average pool and fc: returns the pooled features and the logits.
    pub(super) fn head_forward<S>(
        &mut self,
        pass: &mut Pass<S>,
        x: &wgpu::Buffer,
        d: Dims,
    ) -> Result<(wgpu::Buffer, wgpu::Buffer)> {
        let (n, c, k) = (d.n, d.c, self.model.classes);
        self.gpu.profile_scope("fc and loss");
        let feat = self.act(Act::Gap, (n * c) as u64)?;
        avgpool::global_avgpool_forward(
            &self.gpu,
            &mut pass.enc,
            &avgpool::AvgPoolShape { n, c, hw: d.hw() },
            Slice::whole(x),
            Slice::whole(&feat),
        )?;
        let logits = self.act(Act::Logits, (n * k) as u64)?;
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
}
