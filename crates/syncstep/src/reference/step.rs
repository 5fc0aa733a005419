//! The certified gradient: a ResNet's whole training step (forward, label-smoothed loss,
//! backward to every parameter, BN running statistics) in f64, built from the reference ops.
//! It walks the model's layer list itself and shares no code with the GPU step.

use super::avgpool::{global_avgpool_backward, global_avgpool_forward};
use super::batchnorm::{
    bn_backward_input, bn_backward_sums, bn_forward_apply, bn_forward_stats, bn_update_running,
    BnDims, BnStats,
};
use super::conv2d::{conv2d_backward_input, conv2d_backward_weight, conv2d_forward, ConvGeometry};
use super::cross_entropy::{cross_entropy_backward, cross_entropy_forward};
use super::dense::{
    dense_backward_bias, dense_backward_input, dense_backward_weight, dense_forward,
};
use super::elementwise::{add, relu_backward, relu_forward};
use super::maxpool::{maxpool_backward, maxpool_forward, maxpool_forward_with_argmax, Pool};
use crate::data::Batch;
use crate::model::{ActivationPattern, BatchNorm, Conv, ResNet, POOL_K, POOL_PAD, POOL_STRIDE};

/// The step's scalars: label smoothing ε, loss divisor D, BN momentum and eps.
#[derive(Clone, Copy, Debug)]
pub struct StepConfig {
    pub label_smoothing: f64,
    pub divisor: f64,
    pub bn_momentum: f64,
    pub bn_eps: f64,
}

/// What a step computes: the loss (Σℓ/D), logits, the flat gradient in the model's layout,
/// the updated running statistics, and the activation pattern it used.
#[derive(Clone, Debug)]
pub struct StepResult {
    pub loss: f64,
    pub logits: Vec<f64>,
    pub grads: Vec<f64>,
    pub running: Vec<f64>,
    pub pattern: ActivationPattern,
}

/// The loss alone, for finite differences.
pub fn training_loss(
    model: &ResNet,
    params: &[f64],
    batch: &Batch,
    cfg: &StepConfig,
    impose: Option<&ActivationPattern>,
) -> f64 {
    let mut s = State::new(
        model,
        params,
        model.init_buffers().iter().map(|&v| v as f64).collect(),
        impose,
        cfg,
    );
    s.forward(batch).0
}

/// Inference: the logits of `batch` with BatchNorm normalising by the running statistics.
pub fn predict(model: &ResNet, params: &[f64], running: &[f64], batch: &Batch) -> Vec<f64> {
    let cfg = StepConfig { label_smoothing: 0.0, divisor: 1.0, bn_momentum: 0.0, bn_eps: 1e-5 };
    let mut s = State::new(model, params, running.to_vec(), None, &cfg);
    s.eval = true;
    s.forward(batch).1
}

/// One step on `batch` (its f32 images widened to f64); `impose` fixes the ReLU and pool
/// choices.
pub fn training_step(
    model: &ResNet,
    params: &[f64],
    running: &[f64],
    batch: &Batch,
    cfg: &StepConfig,
    impose: Option<&ActivationPattern>,
) -> StepResult {
    let mut s = State::new(model, params, running.to_vec(), impose, cfg);
    let (loss, logits, feat) = s.forward(batch);
    s.backward(&logits, &batch.labels, &feat);
    StepResult { loss, logits, grads: s.grads, running: s.running, pattern: s.pattern }
}

/// A Conv→BN unit's saved forward values.
struct Unit {
    conv: Conv,
    bn: BatchNorm,
    geom: ConvGeometry,
    x: Vec<f64>,
    conv_out: Vec<f64>,
    dims: BnDims,
    stats: BnStats,
}

struct State<'a> {
    model: &'a ResNet,
    params: &'a [f64],
    grads: Vec<f64>,
    running: Vec<f64>,
    impose: Option<&'a ActivationPattern>,
    pattern: ActivationPattern,
    cfg: StepConfig,
    units: Vec<Unit>,
    /// Each ReLU's gate (its input, or the imposed mask), forward order.
    gates: Vec<Vec<f64>>,
    pool: Option<(Pool, Vec<u32>)>,
    block_inputs: Vec<Vec<f64>>,
    m: usize,
    eval: bool,
}

impl<'a> State<'a> {
    fn new(
        model: &'a ResNet,
        params: &'a [f64],
        running: Vec<f64>,
        impose: Option<&'a ActivationPattern>,
        cfg: &StepConfig,
    ) -> Self {
        State {
            model,
            params,
            grads: vec![0.0; model.param_len],
            running,
            impose,
            pattern: ActivationPattern::default(),
            cfg: *cfg,
            units: Vec::new(),
            gates: Vec::new(),
            pool: None,
            block_inputs: Vec::new(),
            m: 0,
            eval: false,
        }
    }

    fn param(&self, i: usize) -> &'a [f64] {
        &self.params[self.model.params[i].range()]
    }

    fn relu(&mut self, x: &[f64]) -> Vec<f64> {
        let site = self.gates.len();
        let gate = match self.impose {
            Some(p) => p.relu[site].iter().map(|&b| b as f64).collect(),
            None => x.to_vec(),
        };
        self.pattern.relu.push(gate.iter().map(|&g| (g > 0.0) as u8).collect());
        let y = relu_forward(x, &gate);
        self.gates.push(gate);
        y
    }

    fn conv_bn(
        &mut self,
        conv: Conv,
        bn: BatchNorm,
        x: &[f64],
        (h, w): (usize, usize),
    ) -> (Vec<f64>, (usize, usize)) {
        let geom = ConvGeometry {
            n: self.m,
            c_in: conv.c_in as usize,
            h,
            w,
            c_out: conv.c_out as usize,
            kh: conv.k as usize,
            kw: conv.k as usize,
            stride: conv.stride as usize,
            pad: conv.pad as usize,
        };
        let (oh, ow) = (geom.out_h(), geom.out_w());
        let conv_out = conv2d_forward(&geom, x, self.param(conv.weight));
        let dims = BnDims { n: self.m, c: conv.c_out as usize, hw: oh * ow };
        let (rm, rv) = (
            self.model.buffers[bn.running_mean].range(),
            self.model.buffers[bn.running_var].range(),
        );
        let stats = if self.eval {
            let count = dims.n * dims.hw;
            BnStats {
                count,
                mean: self.running[rm].to_vec(),
                m2: self.running[rv].iter().map(|v| v * count as f64).collect(),
            }
        } else {
            let stats = bn_forward_stats(dims, &conv_out);
            let (mean, var) = split_two(&mut self.running, rm, rv);
            bn_update_running(&stats, self.cfg.bn_momentum, mean, var);
            stats
        };
        let z = bn_forward_apply(
            dims,
            &conv_out,
            &stats,
            self.cfg.bn_eps,
            self.param(bn.weight),
            self.param(bn.bias),
        );
        self.units.push(Unit { conv, bn, geom, x: x.to_vec(), conv_out, dims, stats });
        (z, (oh, ow))
    }

    /// Returns the loss, the logits and the pooled features.
    fn forward(&mut self, batch: &Batch) -> (f64, Vec<f64>, Vec<f64>) {
        let model = self.model;
        let labels = &batch.labels;
        self.m = labels.len();
        let images: Vec<f64> = batch.images.iter().map(|&v| v as f64).collect();
        let (z, (h, w)) = self.conv_bn(
            model.stem_conv,
            model.stem_bn,
            &images,
            (batch.h as usize, batch.w as usize),
        );
        let r = self.relu(&z);
        let pool = Pool {
            n: self.m,
            c: 64,
            h,
            w,
            k: POOL_K as usize,
            stride: POOL_STRIDE as usize,
            pad: POOL_PAD as usize,
        };
        let (mut x, argmax) = match self.impose {
            Some(p) => {
                (maxpool_forward_with_argmax(&r, pool, &p.pool_argmax), p.pool_argmax.clone())
            }
            None => maxpool_forward(&r, pool),
        };
        self.pattern.pool_argmax = argmax.clone();
        let mut size = (pool.out_h(), pool.out_w());
        self.pool = Some((pool, argmax));
        for b in &model.blocks {
            self.block_inputs.push(x.clone());
            // The main path: a ReLU after each BN but the last.
            let (mut z, mut s) = self.conv_bn(b.units[0].0, b.units[0].1, &x, size);
            for &(c, bn) in &b.units[1..] {
                let r = self.relu(&z);
                (z, s) = self.conv_bn(c, bn, &r, s);
            }
            let shortcut = match b.downsample {
                Some((c, bn)) => self.conv_bn(c, bn, &x, size).0,
                None => x.clone(),
            };
            x = self.relu(&add(&z, &shortcut));
            size = s;
        }
        let features = model.arch.features() as usize;
        let feat = global_avgpool_forward(self.m, features, size.0 * size.1, &x);
        let k = model.classes as usize;
        let logits = dense_forward(
            self.m,
            features,
            k,
            &feat,
            self.param(model.fc_weight),
            self.param(model.fc_bias),
        );
        let (_, loss) = cross_entropy_forward(
            self.m,
            k,
            self.cfg.label_smoothing,
            self.cfg.divisor,
            &logits,
            labels,
        );
        self.block_inputs.push(x);
        (loss, logits, feat)
    }

    fn set_grad(&mut self, i: usize, g: &[f64]) {
        self.grads[self.model.params[i].range()].copy_from_slice(g);
    }

    /// BN and conv backward of unit `u` from the BN output's cotangent; returns the input's.
    fn conv_bn_backward(&mut self, u: usize, dz: &[f64]) -> Vec<f64> {
        let unit = &self.units[u];
        let (dims, eps) = (unit.dims, self.cfg.bn_eps);
        let sums = bn_backward_sums(dims, dz, &unit.conv_out, &unit.stats, eps);
        let dy = bn_backward_input(
            dims,
            dz,
            &unit.conv_out,
            &unit.stats,
            eps,
            self.param(unit.bn.weight),
            &sums,
        );
        let dw = conv2d_backward_weight(&unit.geom, &dy, &unit.x);
        let dx = conv2d_backward_input(&unit.geom, &dy, self.param(unit.conv.weight));
        let (bn, conv) = (unit.bn, unit.conv);
        self.set_grad(bn.bias, &sums.dy);
        self.set_grad(bn.weight, &sums.dy_xhat);
        self.set_grad(conv.weight, &dw);
        dx
    }

    fn backward(&mut self, logits: &[f64], labels: &[u32], feat: &[f64]) {
        let model = self.model;
        let (m, k) = (self.m, model.classes as usize);
        let dlogits = cross_entropy_backward(
            m,
            k,
            self.cfg.label_smoothing,
            self.cfg.divisor,
            logits,
            labels,
        );
        let f = model.arch.features() as usize;
        self.set_grad(model.fc_weight, &dense_backward_weight(m, f, k, &dlogits, feat));
        self.set_grad(model.fc_bias, &dense_backward_bias(m, k, &dlogits));
        let dfeat = dense_backward_input(m, f, k, &dlogits, self.param(model.fc_weight));
        let last = self.block_inputs.last().map_or(0, |x| x.len());
        let mut dx = global_avgpool_backward(m, f, last / (m * f), &dfeat);
        // Units in forward order: stem, then per block its main path's, then its downsample.
        let mut unit_index = Vec::new();
        let mut next = 1;
        for b in &model.blocks {
            unit_index.push(next);
            next += b.units.len() + b.downsample.is_some() as usize;
        }
        for (i, b) in model.blocks.iter().enumerate().rev() {
            let (u, sites, len) = (unit_index[i], model.relu_sites(i), b.units.len());
            let ds = relu_backward(&dx, &self.gates[sites.end - 1]);
            let mut dz = self.conv_bn_backward(u + len - 1, &ds);
            for j in (0..len - 1).rev() {
                let dr = relu_backward(&dz, &self.gates[sites.start + j]);
                dz = self.conv_bn_backward(u + j, &dr);
            }
            let dx2 = match b.downsample {
                Some(_) => self.conv_bn_backward(u + len, &ds),
                None => ds,
            };
            dx = add(&dz, &dx2);
        }
        let (pool, argmax) = self.pool.take().expect("forward ran");
        let dr = maxpool_backward(&dx, pool, &argmax);
        let dz = relu_backward(&dr, &self.gates[0]);
        self.conv_bn_backward(0, &dz);
    }
}

/// Two disjoint mutable ranges of one vector (running mean and variance of one BN site).
fn split_two(
    v: &mut [f64],
    a: std::ops::Range<usize>,
    b: std::ops::Range<usize>,
) -> (&mut [f64], &mut [f64]) {
    assert!(a.end <= b.start, "running mean precedes running var");
    let (lo, hi) = v.split_at_mut(b.start);
    (&mut lo[a], &mut hi[..b.end - b.start])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::synthetic_batch;
    use crate::model::Arch;
    use rand::{Rng, SeedableRng};

    /// The whole step's gradient against central differences of the loss, at a few seeded
    /// coordinates in every kind of tensor, with the activation pattern held fixed (so the
    /// loss is smooth in the parameters and f64 differences are exact to ~1e-7).
    #[test]
    fn step_gradient_matches_finite_differences() {
        let model = ResNet::new(Arch::ResNet34, 10).unwrap();
        let mut p32 = model.init_params(1);
        model.randomize_batchnorm(&mut p32, 2);
        let params: Vec<f64> = p32.iter().map(|&v| v as f64).collect();
        let batch = synthetic_batch(3, 0, 4, 32, 32, 10).unwrap();
        let cfg = StepConfig { label_smoothing: 0.1, divisor: 4.0, bn_momentum: 0.1, bn_eps: 1e-5 };
        let running: Vec<f64> = model.init_buffers().iter().map(|&v| v as f64).collect();
        let base = training_step(&model, &params, &running, &batch, &cfg, None);
        let pattern = base.pattern.clone();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(4);
        let names = [
            "conv1.weight",
            "bn1.weight",
            "bn1.bias",
            "layer1.1.conv2.weight",
            "layer2.0.downsample.0.weight",
            "layer3.2.bn1.weight",
            "layer3.3.conv1.weight",
            "layer4.0.conv1.weight",
            "layer4.2.bn2.bias",
            "fc.weight",
            "fc.bias",
        ];
        for name in names {
            let spec = model.param(name).unwrap();
            let i = spec.offset + rng.random_range(0..spec.len());
            let h = 1e-6 * params[i].abs().max(0.1);
            let mut p = params.clone();
            p[i] += h;
            let up = training_loss(&model, &p, &batch, &cfg, Some(&pattern));
            p[i] -= 2.0 * h;
            let down = training_loss(&model, &p, &batch, &cfg, Some(&pattern));
            let fd = (up - down) / (2.0 * h);
            let g = base.grads[i];
            let err = (fd - g).abs() / g.abs().max(1e-6);
            assert!(
                err < 1e-5,
                "{name}[{}]: analytic {g:e} vs finite difference {fd:e} (rel {err:e})",
                i - spec.offset
            );
        }
    }
}
