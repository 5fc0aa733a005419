//! The backward of one replica's step: the loss and its cotangent through the head, then every
//! unit's BatchNorm (sums through the communicator) and convolution, block by block in reverse.

use std::ops::Range;

use super::activations::{Act, UnitId};
use super::{
    bn_shape, conv_shape, pool_shape, BnRows, Communicator, Dims, Pass, Replica, Result, Transient,
    BN_EPS,
};
use crate::gpu::{Encoder, Slice};
use crate::kernels::batchnorm::{self, BnDx};
use crate::kernels::conv2d::{self, Conv2dOp};
use crate::kernels::{avgpool, cross_entropy, dense, elementwise, maxpool};

/// A unit's backward, for [`Replica::units_backward`].
pub(super) struct UnitGrad<'a> {
    pub(super) unit: usize,
    /// The cotangent of the ReLU after the unit's BN, and that ReLU's gate unless the cotangent
    /// was masked already: its output (> 0 exactly where its input was), or an imposed mask.
    pub(super) dr: &'a Transient,
    pub(super) gate: Option<Slice<'a>>,
    /// Whether the unit's BatchNorm is the last to read `dr`: the conv's output cotangent is
    /// then written over it, and given back once the conv's gradients are recorded.
    pub(super) dr_read_last: bool,
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
    /// The scratch copy `buffer` is, given back by [`Replica::done_with`].
    copy: Option<Transient>,
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
            return Ok(Examples { buffer: buffer.clone(), offset, len, copy: None });
        }
        let copy = self.scratch.take(&self.gpu, len)?;
        enc.copy_buffer_to_buffer(buffer, offset, &copy.buffer, 0, len * 4);
        Ok(Examples { buffer: copy.buffer.clone(), offset: 0, len, copy: Some(copy) })
    }

    /// `examples` is no longer read by anything recorded later.
    pub(super) fn done_with(&mut self, examples: Examples) {
        if let Some(copy) = examples.copy {
            self.scratch.give_back(&copy);
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
    ) -> Result<(wgpu::Buffer, Transient)> {
        let (n, c, k) = (d.n, d.c, self.model.classes);
        let cs = cross_entropy::CrossEntropyShape { m: n, k };
        let losses = self.act(Act::Losses, n as u64)?;
        let (lg, lb, eps) = (Slice::whole(logits), Slice::whole(labels), pass.cfg.label_smoothing);
        let ls = Slice::whole(&losses);
        cross_entropy::cross_entropy_forward(&self.gpu, &mut pass.enc, &cs, eps, lg, lb, ls)?;
        let dlogits = self.act(Act::LogitsGrad, (n * k) as u64)?;
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
        let dfeat = self.act(Act::GapGrad, (n * c) as u64)?;
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
            dx.slice(),
        )?;
        Ok((losses, dx))
    }

    /// The backward of `units` (in reverse layout order), each given the cotangent `dr` of the
    /// ReLU after its BN, whose site is `relu_site` (the BN kernels mask `dr` with that ReLU's
    /// gate as they read it), and its conv's input `x`: BN (the sums of all of them through the
    /// communicator in one trip), then each conv's weight gradient and, where `input_grad`, the
    /// cotangent of its input (scratch), returned in the units' order.
    pub(super) async fn units_backward<S: Communicator, const K: usize>(
        &mut self,
        pass: &mut Pass<'_, S>,
        units: [UnitGrad<'_>; K],
    ) -> Result<[Option<Transient>; K]> {
        let mut rows = Vec::with_capacity(K);
        for g in &units {
            rows.push(self.example_sums(pass, rows.len(), g)?);
        }
        // Units go backward in reverse forward order, which is the layout's: every later unit's
        // gradients are final, and so are the first unit's dγ, dβ just copied. The rest is later.
        let first = &pass.units[units[0].unit];
        let from = self.model.params[first.bn.weight].offset as u64;
        let done = Slice::new(&self.grads, from * 4, self.model.param_len as u64 - from);
        let sites: Vec<BnRows> = units
            .iter()
            .zip(&rows)
            .map(|(g, rows)| {
                let u = &pass.units[g.unit];
                BnRows { site: u.site, rows: rows.slice(), local: u.out.n }
            })
            .collect();
        pass.comm.gradients_final(&self.gpu, &mut pass.enc, done)?;
        pass.comm.bn_sums(&self.gpu, &mut pass.enc, &sites).await?;
        let mut dxs = Vec::with_capacity(K);
        for (g, rows) in units.iter().zip(&rows) {
            dxs.push(self.unit_backward(pass, g, rows)?);
        }
        Ok(dxs.try_into().unwrap_or_else(|_| unreachable!("one cotangent per unit")))
    }

    /// Unit `g`'s per-example `[Σdy | Σdy·x̂]` rows, the `slot`-th of its trip, this device's
    /// first in room for every replica's; and dβ = Σdy, dγ = Σdy·x̂ over each piece of this
    /// replica's own examples into the piece's slab (docs/design.md: they stay local until the
    /// gradient all-reduce).
    fn example_sums<S: Communicator>(
        &mut self,
        pass: &mut Pass<'_, S>,
        slot: usize,
        g: &UnitGrad,
    ) -> Result<Transient> {
        let u = &pass.units[g.unit];
        let (id, conv, bn, out, count) = (u.id, u.conv, u.bn, u.out, u.count);
        let (y, stats) = self.saved(u);
        self.gpu.profile_scope(&format!("{} backward", self.model.conv_name(&conv)));
        let bs = bn_shape(out);
        let global = batchnorm::BnShape { n: pass.comm.examples(out.n), ..bs };
        let rows = self.acts.at_least(&self.gpu, Act::SumsRows(slot), global.rows_len())?;
        let sums = self.act(Act::Sums(id), 2 * out.c as u64)?;
        let (dr, y, stats) = (g.dr.slice(), Slice::whole(&y), Slice::whole(&stats));
        let local_rows = Slice::new(&rows.buffer, 0, bs.rows_len());
        let c4 = out.c as u64 * 4;
        let grads = |replica: &Self, enc: &mut Encoder, piece: usize| {
            let (gb, gg) = (replica.grad(bn.bias, piece), replica.grad(bn.weight, piece));
            enc.copy_buffer_to_buffer(&sums, 0, gb.buffer, gb.offset, c4);
            enc.copy_buffer_to_buffer(&sums, c4, gg.buffer, gg.offset, c4);
        };
        // One device, one piece: its rows taken and summed in one launch.
        if !pass.comm.gathers_rows() && pass.pieces.len() == 1 {
            let (gpu, enc, take) = (&self.gpu, &mut pass.enc, batchnorm::Rows::Take(local_rows));
            let sums_slice = Slice::whole(&sums);
            batchnorm::bn_sums(
                gpu, enc, &bs, count, BN_EPS, dr, g.gate, y, stats, take, sums_slice,
            )?;
            grads(self, &mut pass.enc, 0);
            return Ok(rows);
        }
        let (gpu, enc) = (&self.gpu, &mut pass.enc);
        batchnorm::bn_example_sums(gpu, enc, &bs, count, BN_EPS, dr, g.gate, y, stats, local_rows)?;
        for (piece, range) in pass.pieces.clone().iter().enumerate() {
            let piece_rows = self.examples(&mut pass.enc, &rows.buffer, 2 * out.c as u64, range)?;
            let shape = batchnorm::BnShape { n: (range.end - range.start) as u32, ..bs };
            let (gpu, enc, given) =
                (&self.gpu, &mut pass.enc, batchnorm::Rows::Given(piece_rows.slice()));
            let sums_slice = Slice::whole(&sums);
            batchnorm::bn_sums(
                gpu, enc, &shape, count, BN_EPS, dr, g.gate, y, stats, given, sums_slice,
            )?;
            grads(self, &mut pass.enc, piece);
            self.done_with(piece_rows);
        }
        Ok(rows)
    }

    /// Unit `g`'s BatchNorm input-VJP from every replica's sum `rows`, then its conv's weight
    /// gradient per piece and, where `input_grad`, the cotangent of its input (scratch).
    fn unit_backward<S: Communicator>(
        &mut self,
        pass: &mut Pass<'_, S>,
        g: &UnitGrad,
        rows: &Transient,
    ) -> Result<Option<Transient>> {
        let u = &pass.units[g.unit];
        let (id, conv, bn, input, out, count) = (u.id, u.conv, u.bn, u.input, u.out, u.count);
        let (y, stats) = self.saved(u);
        self.gpu.profile_scope(&format!("{} backward", self.model.conv_name(&conv)));
        let sums = self.acts.saved(Act::Sums(id));
        let bs = bn_shape(out);
        let global = batchnorm::BnShape { n: pass.comm.examples(out.n), ..bs };
        // The sums [`Replica::example_sums`] took are the ones dx needs only where this
        // device's one piece is the whole batch; else sum over every replica's rows.
        if global.n > bs.n || pass.pieces.len() != 1 {
            let (gpu, enc, given) =
                (&self.gpu, &mut pass.enc, batchnorm::Rows::Given(rows.slice()));
            let (dr, ys, ss) = (g.dr.slice(), Slice::whole(&y), Slice::whole(&stats));
            let sums = Slice::whole(&sums);
            batchnorm::bn_sums(gpu, enc, &global, count, BN_EPS, dr, g.gate, ys, ss, given, sums)?;
        }
        // The conv's output cotangent goes over dr where nothing later reads dr.
        let dy = match g.dr_read_last {
            true => g.dr.clone(),
            false => self.scratch.take(&self.gpu, out.len())?,
        };
        let (gpu, enc, gamma) = (&self.gpu, &mut pass.enc, self.param(bn.weight));
        let (y, stats, sums) = (Slice::whole(&y), Slice::whole(&stats), Slice::whole(&sums));
        let dx = match g.dr_read_last {
            true => BnDx::OverDy,
            false => BnDx::Into(dy.slice()),
        };
        let dr = g.dr.slice();
        let backward = batchnorm::bn_backward_input;
        backward(gpu, enc, &bs, count, BN_EPS, dr, g.gate, y, stats, gamma, sums, dx)?;
        let shape = conv_shape(&conv, input);
        self.conv_weight_grads(pass, &shape, conv.weight, &dy, g.x)?;
        let dx = match g.input_grad {
            true => Some(self.conv_input_grad(pass, id, conv.weight, &shape, &dy)?),
            false => None,
        };
        self.scratch.give_back(&dy);
        Ok(dx)
    }

    /// The gradient of conv weight `weight` at `shape` from its output's cotangent `dy` and its
    /// input `x`: over each piece of this replica's examples, into the piece's slab.
    fn conv_weight_grads<S>(
        &mut self,
        pass: &mut Pass<'_, S>,
        shape: &conv2d::Conv2dShape,
        weight: usize,
        dy: &Transient,
        x: &wgpu::Buffer,
    ) -> Result<()> {
        let (dy_len, x_len) = (shape.y_len() / shape.n as u64, shape.x_len() / shape.n as u64);
        for (piece, range) in pass.pieces.clone().iter().enumerate() {
            let dyp = self.examples(&mut pass.enc, &dy.buffer, dy_len, range)?;
            let xp = self.examples(&mut pass.enc, x, x_len, range)?;
            let shape = conv2d::Conv2dShape { n: (range.end - range.start) as u32, ..*shape };
            let (gpu, enc) = (&self.gpu, &mut pass.enc);
            let dw = self.grad(weight, piece);
            conv2d::conv2d_backward_weight(gpu, enc, &shape, dyp.slice(), xp.slice(), dw)?;
            self.done_with(dyp);
            self.done_with(xp);
        }
        Ok(())
    }

    /// The cotangent of unit `id`'s conv input (scratch) from its output's cotangent `dy`; the
    /// conv's weight is parameter `weight`.
    fn conv_input_grad<S>(
        &mut self,
        pass: &mut Pass<'_, S>,
        id: UnitId,
        weight: usize,
        shape: &conv2d::Conv2dShape,
        dy: &Transient,
    ) -> Result<Transient> {
        let dx = self.scratch.take(&self.gpu, shape.x_len())?;
        let (dy, dxs) = (dy.slice(), dx.slice());
        let op = Conv2dOp::BackwardInput;
        // Where the forward copied the kept taps' weights (conv_forward).
        match conv2d::conv2d_choice(&self.gpu, Conv2dOp::Forward, shape)?.1 {
            Some(crop) => {
                let (gpu, enc) = (&self.gpu, &mut pass.enc);
                let kept = self.acts.saved(Act::KeptWeights(id));
                conv2d::conv2d_launch_kept(gpu, enc, op, &crop, dy, Slice::whole(&kept), dxs)?;
            }
            None => self.conv_launch(pass, op, shape, (dy, weight, dxs))?,
        }
        Ok(dx)
    }

    /// The blocks' and the stem's backward from `dout`, the cotangent of the last block's
    /// output. Every cotangent is scratch, given back after its last reader.
    pub(super) async fn backward<S: Communicator>(
        &mut self,
        pass: &mut Pass<'_, S>,
        mut dout: Transient,
    ) -> Result<()> {
        for i in (0..self.model.blocks.len()).rev() {
            dout = self.block_backward(pass, i, dout).await?;
        }
        self.stem_backward(pass, dout).await
    }

    /// Block `i`'s backward from `dout`, the cotangent of its output (given back): returns the
    /// cotangent of the block's input.
    async fn block_backward<S: Communicator>(
        &mut self,
        pass: &mut Pass<'_, S>,
        i: usize,
        dout: Transient,
    ) -> Result<Transient> {
        let block_input = self.block_input(i);
        let sites = self.model.relu_sites(i);
        let last = self.model.blocks[i].units.len() - 1;
        let out_gate = self.relu_gate(pass, sites.end - 1, Act::BlockOut(i));
        // The ReLU outputs inside the block, each made again where the backward first reads it:
        // the input of the unit after it, then the gate of its own unit.
        let mut relu = self.relu_again(pass, i, last - 1)?;
        let main = UnitGrad {
            unit: pass.unit(UnitId::Main(i, last)),
            dr: &dout,
            gate: Some(Slice::whole(&out_gate)),
            dr_read_last: false,
            x: &relu.buffer,
            input_grad: true,
        };
        // The downsample (last in the layout) first: units go backward in reverse layout
        // order, so the gradients final at each BN site are one suffix of the layout. It
        // and the last unit read the same cotangent: their BN sums travel together.
        let (dx2, dr) = match self.model.blocks[i].downsample {
            Some(_) => {
                let ds = UnitGrad {
                    unit: pass.unit(UnitId::Downsample(i)),
                    dr: &dout,
                    gate: Some(Slice::whole(&out_gate)),
                    dr_read_last: false,
                    x: &block_input,
                    input_grad: true,
                };
                let [dx2, dr] = self.units_backward(pass, [ds, main]).await?;
                (dx2, dr)
            }
            None => {
                let [dr] = self.units_backward(pass, [main]).await?;
                (None, dr)
            }
        };
        let mut dr = dr.expect("the main path's input cotangents are asked for");
        for j in (0..last).rev() {
            let input = match j {
                0 => None,
                j => Some(self.relu_again(pass, i, j - 1)?),
            };
            let imposed = self.imposed_gate(pass, sites.start + j);
            let unit = UnitGrad {
                unit: pass.unit(UnitId::Main(i, j)),
                dr: &dr,
                gate: Some(imposed.as_ref().map_or(relu.slice(), Slice::whole)),
                dr_read_last: true,
                x: input.as_ref().map_or(&block_input, |r| &r.buffer),
                input_grad: true,
            };
            let [dx] = self.units_backward(pass, [unit]).await?;
            dr = dx.expect("the main path's input cotangents are asked for");
            self.scratch.give_back(&relu);
            match input {
                Some(input) => relu = input,
                None => break,
            }
        }
        self.block_input_grad(pass, dr, dx2, dout, &out_gate)
    }

    /// Block `i`'s input: the pool's output or the block before it's.
    fn block_input(&self, i: usize) -> wgpu::Buffer {
        self.acts.saved(match i {
            0 => Act::Pool,
            i => Act::BlockOut(i - 1),
        })
    }

    /// The output of the ReLU after block `i`'s `j`-th unit, which the forward did not keep,
    /// made again into scratch by the forward's kernel from the same saved conv output,
    /// statistics and parameters: the same bits.
    fn relu_again<S>(&mut self, pass: &mut Pass<S>, i: usize, j: usize) -> Result<Transient> {
        let unit = pass.unit(UnitId::Main(i, j));
        let r = self.scratch.take(&self.gpu, pass.units[unit].out.len())?;
        let site = self.model.relu_sites(i).start + j;
        self.bn_relu_at(pass, unit, site, None, r.slice())?;
        Ok(r)
    }

    /// ReLU site `site`'s imposed mask, where the pass imposes a pattern.
    fn imposed_gate<S>(&self, pass: &Pass<S>, site: usize) -> Option<wgpu::Buffer> {
        pass.impose.map(|_| self.acts.saved(Act::ImposedRelu(site)))
    }

    /// ReLU site `site`'s gate for the backward: its imposed mask, or its saved output `own`.
    fn relu_gate<S>(&self, pass: &Pass<S>, site: usize, own: Act) -> wgpu::Buffer {
        self.imposed_gate(pass, site).unwrap_or_else(|| self.acts.saved(own))
    }

    /// A block input's cotangent (scratch): the main path's `dx1` plus the shortcut's, which is
    /// the downsample's `dx2` or the cotangent `dout` of the block's output masked by its ReLU's
    /// `gate`. Gives back the three.
    fn block_input_grad<S>(
        &mut self,
        pass: &mut Pass<S>,
        dx1: Transient,
        dx2: Option<Transient>,
        dout: Transient,
        gate: &wgpu::Buffer,
    ) -> Result<Transient> {
        let dx = self.scratch.take(&self.gpu, dx1.len)?;
        let (gpu, enc) = (&self.gpu, &mut pass.enc);
        let (dx1s, dxs) = (dx1.slice(), dx.slice());
        match dx2 {
            Some(dx2) => {
                elementwise::add(gpu, enc, dx1s, dx2.slice(), dxs)?;
                self.scratch.give_back(&dx2);
            }
            None => {
                let (dout, gate) = (dout.slice(), Slice::whole(gate));
                elementwise::add_relu_backward(gpu, enc, dx1s, dout, gate, dxs)?;
            }
        }
        self.scratch.give_back(&dx1);
        self.scratch.give_back(&dout);
        Ok(dx)
    }

    /// The max-pool's and the stem's backward from `dout`, the cotangent of the pool's output
    /// (given back). The stem's ReLU output was not kept: the pool's backward masks with it
    /// (a window's maximum is > 0 exactly where the ReLU passed the cell it chose), or, under an
    /// imposed pattern, the stem's BatchNorm with the imposed mask. The stem's input is the
    /// image: no cotangent of it is taken.
    async fn stem_backward<S: Communicator>(
        &mut self,
        pass: &mut Pass<'_, S>,
        dout: Transient,
    ) -> Result<()> {
        let stem = &pass.units[pass.unit(UnitId::Stem)];
        let ps = pool_shape(stem.out);
        let dr = self.scratch.take(&self.gpu, stem.out.len())?;
        let (argmax, pooled) = (self.acts.saved(pass.pool_argmax), self.acts.saved(Act::Pool));
        let (argmax, y) = (Slice::whole(&argmax), Slice::whole(&pooled));
        let imposed = self.imposed_gate(pass, 0);
        let (gpu, enc, dy) = (&self.gpu, &mut pass.enc, dout.slice());
        match imposed {
            Some(_) => maxpool::maxpool_backward(gpu, enc, &ps, dy, argmax, dr.slice())?,
            None => maxpool::maxpool_relu_backward(gpu, enc, &ps, dy, argmax, y, dr.slice())?,
        }
        self.scratch.give_back(&dout);
        let input = self.acts.saved(Act::Input);
        let stem = UnitGrad {
            unit: pass.unit(UnitId::Stem),
            dr: &dr,
            gate: imposed.as_ref().map(Slice::whole),
            dr_read_last: true,
            x: &input,
            input_grad: false,
        };
        self.units_backward(pass, [stem]).await?;
        Ok(())
    }
}
