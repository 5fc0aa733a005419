//! The forward of one replica's step: conv → BatchNorm units (statistics through the sync
//! hook), fused BN + residual + ReLU, the max-pool, and the head; and the activation pattern
//! the gates impose or capture.

use super::{
    block_name, bn_shape, conv_shape, pool_shape, BnRows, BnSync, Dims, Pass, Replica, Result,
    StepError, BN_EPS,
};
use crate::gpu::Slice;
use crate::kernels::conv2d::{self, Conv2dOp};
use crate::kernels::{avgpool, batchnorm, dense, maxpool};
use crate::model::{ActivationPattern, BatchNorm, Conv};

/// A Conv→BN unit of the forward; its saved tensors are `{name}.conv` (the conv output, BN's
/// input) and `{name}.stats`.
pub(super) struct Unit {
    pub(super) name: String,
    pub(super) conv: Conv,
    pub(super) bn: BatchNorm,
    pub(super) site: usize,
    pub(super) input: Dims,
    pub(super) out: Dims,
    /// Positions the statistics describe (every replica's).
    pub(super) count: u32,
}

/// A conv and the BN after it, for [`Replica::conv_bn`]: the unit's name, its input `x` and its
/// dimensions.
pub(super) struct ConvBn<'a> {
    pub(super) name: String,
    pub(super) conv: Conv,
    pub(super) bn: BatchNorm,
    pub(super) x: &'a wgpu::Buffer,
    pub(super) input: Dims,
}

impl<'a> ConvBn<'a> {
    pub(super) fn new(
        name: &str,
        conv: Conv,
        bn: BatchNorm,
        x: &'a wgpu::Buffer,
        input: Dims,
    ) -> Self {
        ConvBn { name: name.to_string(), conv, bn, x, input }
    }
}

impl Replica {
    pub(super) fn upload_pattern(&mut self, p: &ActivationPattern) -> Result<()> {
        for (i, mask) in p.relu.iter().enumerate() {
            let gate: Vec<f32> = mask.iter().map(|&m| m as f32).collect();
            let b = self.act(&format!("impose.relu{i}"), gate.len() as u64)?;
            self.gpu.queue.write_buffer(&b, 0, bytemuck::cast_slice(&gate));
        }
        let b = self.act("impose.pool", p.pool_argmax.len() as u64)?;
        self.gpu.queue.write_buffer(&b, 0, bytemuck::cast_slice(&p.pool_argmax));
        Ok(())
    }

    pub(super) async fn read_pattern<S>(&self, pass: &Pass<'_, S>) -> Result<ActivationPattern> {
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
    pub(super) async fn conv_bn<S: BnSync, const K: usize>(
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
                let global = batchnorm::BnShape { n: pass.sync.examples(out.n), ..bs };
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
                        batchnorm::BnShape { n: pass.sync.examples(out.n), ..bn_shape(out) };
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
    pub(super) fn saved(&self, unit: &Unit) -> (wgpu::Buffer, wgpu::Buffer) {
        (
            self.acts[&format!("{}.conv", unit.name)].clone(),
            self.acts[&format!("{}.stats", unit.name)].clone(),
        )
    }

    /// The BN output of `unit`, plus `shortcut` when given, through a ReLU into the saved
    /// activation `name`, in one fused kernel. The ReLU's gate is its own input, or the imposed
    /// mask of this ReLU site.
    pub(super) fn bn_relu<S>(
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
    pub(super) fn bn_apply<S>(&mut self, pass: &mut Pass<S>, unit: usize) -> Result<wgpu::Buffer> {
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

    pub(super) async fn forward<S: BnSync>(
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
    pub(super) fn head_forward<S>(
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
}
