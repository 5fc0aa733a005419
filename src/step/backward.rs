//! The backward of one replica's step: the loss and its cotangent through the head, then every
//! unit's BatchNorm (sums through the sync hook) and convolution, block by block in reverse.

use std::collections::HashMap;
use std::ops::Range;

use super::{
    block_name, bn_shape, conv_shape, pool_shape, BnRows, BnSync, Dims, Pass, Replica, Result,
    BN_EPS,
};
use crate::gpu::{Encoder, Slice};
use crate::kernels::conv2d::{self, Conv2dOp};
use crate::kernels::{avgpool, batchnorm, cross_entropy, dense, elementwise, maxpool};

/// A unit's backward, for [`Replica::units_backward`].
pub(super) struct UnitGrad<'a> {
    pub(super) unit: usize,
    /// The cotangent of the ReLU after the unit's BN, and that ReLU's site.
    pub(super) dr: &'a wgpu::Buffer,
    pub(super) relu_site: usize,
    /// The conv's input.
    pub(super) x: &'a wgpu::Buffer,
    /// Whether the cotangent of the conv's input is wanted (not for the stem: it is the image).
    pub(super) input_grad: bool,
}

/// Examples of a per-example buffer as a kernel can bind them (see [`Replica::examples`]).
pub(super) struct Examples {
    buffer: wgpu::Buffer,
    offset: u64,
    len: u64,
    /// Whether `buffer` is a scratch copy, given back by [`Replica::done_with`].
    copied: bool,
}

impl Examples {
    fn slice(&self) -> Slice<'_> {
        Slice::new(&self.buffer, self.offset, self.len)
    }
}

impl Replica {
    /// Examples `range` of `buffer`, which holds `per_example` elements for each: the buffer's
    /// own range where its offset is one a storage binding may start at, else a copy of it into
    /// scratch (recorded into `enc`). A whole buffer is always its own.
    pub(super) fn examples(
        &mut self,
        enc: &mut Encoder,
        buffer: &wgpu::Buffer,
        per_example: u64,
        range: &Range<u64>,
    ) -> Result<Examples> {
        let (offset, len) =
            (range.start * per_example * 4, (range.end - range.start) * per_example);
        let align = self.gpu.limits.min_storage_buffer_offset_alignment as u64;
        if offset.is_multiple_of(align) {
            return Ok(Examples { buffer: buffer.clone(), offset, len, copied: false });
        }
        let copy = self.scratch.take(&self.gpu, len)?;
        enc.copy_buffer_to_buffer(buffer, offset, &copy, 0, len * 4);
        Ok(Examples { buffer: copy, offset: 0, len, copied: true })
    }

    /// `examples` is no longer read by anything recorded later.
    pub(super) fn done_with(&mut self, examples: Examples) {
        if examples.copied {
            self.scratch.give_back(&examples.buffer);
        }
    }

    /// The per-example losses (returned), then the backward through fc and the pool: returns
    /// the losses and the cotangent of the last block's output (scratch), where the blocks'
    /// backward starts. fc's weight and bias gradients go into each piece's slab.
    pub(super) fn loss_backward<S>(
        &mut self,
        pass: &mut Pass<S>,
        feat: &wgpu::Buffer,
        logits: &wgpu::Buffer,
        d: Dims,
        labels: &wgpu::Buffer,
    ) -> Result<(wgpu::Buffer, wgpu::Buffer)> {
        let (n, c, k) = (d.n, d.c, self.model.classes);
        let cs = cross_entropy::CrossEntropyShape { m: n, k };
        let losses = self.act("losses", n as u64)?;
        let (lg, lb, eps) = (Slice::whole(logits), Slice::whole(labels), pass.cfg.label_smoothing);
        let ls = Slice::whole(&losses);
        cross_entropy::cross_entropy_forward(&self.gpu, &mut pass.enc, &cs, eps, lg, lb, ls)?;
        let dlogits = self.act("logits.grad", (n * k) as u64)?;
        cross_entropy::cross_entropy_backward(
            &self.gpu,
            &mut pass.enc,
            &cs,
            eps,
            pass.divisor,
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
        for (piece, range) in pass.pieces.clone().iter().enumerate() {
            let dl = self.examples(&mut pass.enc, &dlogits, k as u64, range)?;
            let x = self.examples(&mut pass.enc, feat, c as u64, range)?;
            let ds = dense::DenseShape { m: (range.end - range.start) as u32, ..ds };
            let (gpu, enc) = (&self.gpu, &mut pass.enc);
            dense::dense_backward_weight(
                gpu,
                enc,
                &ds,
                dl.slice(),
                x.slice(),
                self.grad(fw, piece),
            )?;
            dense::dense_backward_bias(gpu, enc, &ds, dl.slice(), self.grad(fb, piece))?;
            self.done_with(dl);
            self.done_with(x);
        }
        let dx = self.scratch.take(&self.gpu, d.len())?;
        avgpool::global_avgpool_backward(
            &self.gpu,
            &mut pass.enc,
            &avgpool::AvgPoolShape { n, c, hw: d.hw() },
            Slice::whole(&dfeat),
            Slice::whole(&dx),
        )?;
        Ok((losses, dx))
    }

    /// The backward of `units` (in reverse layout order), each given the cotangent `dr` of the
    /// ReLU after its BN, whose site is `relu_site` (the BN kernels mask `dr` with that ReLU's
    /// gate as they read it), and its conv's input `x`: BN (the sums of all of them through the
    /// sync hook in one trip), then each conv's weight gradient and, where `input_grad`, the
    /// cotangent of its input (scratch), returned in the units' order.
    pub(super) async fn units_backward<S: BnSync, const K: usize>(
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
            let global = batchnorm::BnShape { n: pass.sync.examples(out.n), ..bs };
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
            // dβ = Σdy and dγ = Σdy·x̂ over each piece of this replica's own examples
            // (docs/design.md: they stay local until the gradient all-reduce); then Σdy, Σdy·x̂
            // over every replica's for dx.
            let sums = self.act(&format!("{name}.sums"), 2 * out.c as u64)?;
            let c4 = out.c as u64 * 4;
            for (piece, range) in pass.pieces.clone().iter().enumerate() {
                let piece_rows = self.examples(&mut pass.enc, &rows, 2 * out.c as u64, range)?;
                let shape = batchnorm::BnShape { n: (range.end - range.start) as u32, ..bs };
                let (gpu, enc) = (&self.gpu, &mut pass.enc);
                batchnorm::bn_sum_examples(
                    gpu,
                    enc,
                    &shape,
                    piece_rows.slice(),
                    Slice::whole(&sums),
                )?;
                let (gb, gg) = (self.grad(bn.bias, piece), self.grad(bn.weight, piece));
                pass.enc.copy_buffer_to_buffer(&sums, 0, gb.buffer, gb.offset, c4);
                pass.enc.copy_buffer_to_buffer(&sums, c4, gg.buffer, gg.offset, c4);
                self.done_with(piece_rows);
            }
            read.push((y, stats, gate, rows, sums));
        }
        // Units go backward in reverse forward order, which is the layout's: every later unit's
        // gradients are final, and so are the first unit's dγ, dβ just copied. The rest is later.
        let first = &pass.units[units[0].unit];
        let from = self.model.params[first.bn.weight].offset as u64;
        let done = Slice::new(&self.grads, from * 4, self.model.param_len as u64 - from);
        // The sums just taken are the ones dx needs only where one piece holds the whole batch.
        let summed_all = pass.pieces.len() == 1;
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
            let global = batchnorm::BnShape { n: pass.sync.examples(out.n), ..bs };
            if global.n > bs.n || !summed_all {
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
            let (dy_len, x_len) = (out.len() / out.n as u64, input.len() / input.n as u64);
            for (piece, range) in pass.pieces.clone().iter().enumerate() {
                let dyp = self.examples(&mut pass.enc, &dy, dy_len, range)?;
                let xp = self.examples(&mut pass.enc, g.x, x_len, range)?;
                let shape = conv2d::Conv2dShape { n: (range.end - range.start) as u32, ..shape };
                let (gpu, enc) = (&self.gpu, &mut pass.enc);
                let dw = self.grad(conv.weight, piece);
                conv2d::conv2d_backward_weight(gpu, enc, &shape, dyp.slice(), xp.slice(), dw)?;
                self.done_with(dyp);
                self.done_with(xp);
            }
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
    pub(super) async fn backward<S: BnSync>(
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
