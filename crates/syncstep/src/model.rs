//! The `model` layer: torchvision's ResNets (18, 34, 50, 101) as data. Parameter and buffer
//! specs carry torchvision's `state_dict` names and their place in ONE flat parameter buffer
//! (and one flat buffer of BatchNorm running statistics). The step walks `stem` and `blocks`;
//! nothing here knows wgpu.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Every tensor starts at a multiple of this many bytes: WebGPU's largest allowed
/// `min_storage_buffer_offset_alignment`, so the same layout binds on every adapter, native or
/// in a browser, and replicas on different adapters share it.
pub const ALIGN_BYTES: usize = 256;
const ALIGN: usize = ALIGN_BYTES / 4;

/// The smallest input side the network takes: five stride-2 stages leave at least 1×1.
pub const MIN_IMAGE_SIZE: u32 = 32;

/// The most classes a classifier may have: past ImageNet-21k's 21,843 with room to spare, and
/// checked before its weights (classes × 2048 for a Bottleneck ResNet) are allocated.
pub const MAX_CLASSES: u32 = 100_000;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("image size {h}×{w} is too small: a ResNet needs at least {MIN_IMAGE_SIZE}×{MIN_IMAGE_SIZE}")]
    ImageTooSmall { h: u32, w: u32 },
    #[error("{0} classes: the classifier needs at least 2")]
    TooFewClasses(u32),
    #[error("{0} classes: a classifier has at most {MAX_CLASSES}")]
    TooManyClasses(u32),
    #[error("a training batch of {batch} image(s) of {h}×{w} leaves BatchNorm {values} value(s) per channel at its smallest maps ({map}×{map}), and a variance needs more than 1 (PyTorch: \"Expected more than 1 value per channel when training\"): use a global batch of at least 2, or larger images")]
    DegenerateBatchNorm { batch: u64, h: u32, w: u32, values: u64, map: u32 },
}

/// A named tensor inside a flat buffer: `len()` f32s starting at element `offset`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub offset: usize,
}

impl TensorSpec {
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn range(&self) -> std::ops::Range<usize> {
        self.offset..self.offset + self.len()
    }
}

/// A convolution (no bias): its weight is `params[weight]`, shape [c_out, c_in, k, k].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Conv {
    pub weight: usize,
    pub c_in: u32,
    pub c_out: u32,
    pub k: u32,
    pub stride: u32,
    pub pad: u32,
}

impl Conv {
    pub fn out_size(&self, h: u32) -> u32 {
        (h + 2 * self.pad - self.k) / self.stride + 1
    }
}

/// A convolution and the side of its input for one image size (see [`ResNet::conv_inputs`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConvInput {
    pub conv: Conv,
    pub h: u32,
    pub w: u32,
}

impl ConvInput {
    /// Forward FLOPs for one image (multiply-add = 2).
    pub fn flops(&self) -> f64 {
        let c = &self.conv;
        2.0 * (c.c_out * c.out_size(self.h) * c.out_size(self.w)) as f64
            * (c.c_in * c.k * c.k) as f64
    }
}

/// A BatchNorm site: γ = `params[weight]`, β = `params[bias]`, running statistics in `buffers`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchNorm {
    pub weight: usize,
    pub bias: usize,
    pub running_mean: usize,
    pub running_var: usize,
    pub c: u32,
}

/// torchvision's residual block: its main path of conv → BN units, a ReLU after each BN but
/// the last, whose output is added to the shortcut (the identity, or a 1×1 projection and its
/// BN) before the block's ReLU. BasicBlock: 3×3 (carrying the stride), 3×3. Bottleneck: 1×1,
/// 3×3 (carrying the stride: torchvision's "ResNet V1.5"), 1×1 to four times the width.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Block {
    pub units: Vec<(Conv, BatchNorm)>,
    pub downsample: Option<(Conv, BatchNorm)>,
}

/// Max-pool of the stem: 3×3, stride 2, padding 1.
pub const POOL_K: u32 = 3;
pub const POOL_STRIDE: u32 = 2;
pub const POOL_PAD: u32 = 1;

/// The stages' widths: each stage's first block halves the map (but layer1's: the max-pool did).
pub const STAGE_WIDTHS: [u32; 4] = [64, 128, 256, 512];

/// One of torchvision's ImageNet ResNets (`torchvision.models.resnet18` …).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Arch {
    ResNet18,
    #[default]
    ResNet34,
    ResNet50,
    ResNet101,
}

impl Arch {
    pub const ALL: [Arch; 4] = [Arch::ResNet18, Arch::ResNet34, Arch::ResNet50, Arch::ResNet101];

    /// The name as `--arch` takes it and a checkpoint records it: torchvision's function name.
    pub fn name(self) -> &'static str {
        match self {
            Arch::ResNet18 => "resnet18",
            Arch::ResNet34 => "resnet34",
            Arch::ResNet50 => "resnet50",
            Arch::ResNet101 => "resnet101",
        }
    }

    /// The name as the papers write it: "ResNet-34".
    pub fn title(self) -> String {
        format!("ResNet-{}", self.name().trim_start_matches("resnet"))
    }

    /// Blocks per stage.
    pub fn blocks(self) -> [usize; 4] {
        match self {
            Arch::ResNet18 => [2, 2, 2, 2],
            Arch::ResNet34 | Arch::ResNet50 => [3, 4, 6, 3],
            Arch::ResNet101 => [3, 4, 23, 3],
        }
    }

    /// Whether its blocks are Bottlenecks (else BasicBlocks).
    pub fn bottleneck(self) -> bool {
        matches!(self, Arch::ResNet50 | Arch::ResNet101)
    }

    /// A block's output channels over its stage's width: torchvision's `expansion`.
    pub fn expansion(self) -> u32 {
        if self.bottleneck() {
            4
        } else {
            1
        }
    }

    /// The channels of the last block's output: fc's `in_features`.
    pub fn features(self) -> u32 {
        STAGE_WIDTHS[3] * self.expansion()
    }
}

impl std::fmt::Display for Arch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// In files (golden summaries) by its name, as `--arch` takes it.
impl serde::Serialize for Arch {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl<'de> serde::Deserialize<'de> for Arch {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Arch, D::Error> {
        String::deserialize(d)?.parse().map_err(serde::de::Error::custom)
    }
}

/// A name that is no [`Arch`]'s.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown architecture {name:?}: one of {}", Arch::ALL.map(Arch::name).join(", "))]
pub struct UnknownArch {
    pub name: String,
}

impl std::str::FromStr for Arch {
    type Err = UnknownArch;
    fn from_str(s: &str) -> Result<Arch, UnknownArch> {
        Arch::ALL.into_iter().find(|a| a.name() == s).ok_or(UnknownArch { name: s.into() })
    }
}

/// A ResNet of `arch` for `classes` outputs: stem (conv 7×7/s2/p3, bn, relu, max-pool
/// 3×3/s2/p1), the arch's blocks in four stages, global average pool, fc.
#[derive(Clone, Debug)]
pub struct ResNet {
    pub arch: Arch,
    pub classes: u32,
    pub stem_conv: Conv,
    pub stem_bn: BatchNorm,
    pub blocks: Vec<Block>,
    pub fc_weight: usize,
    pub fc_bias: usize,
    /// Trainable tensors in `state_dict` order, laid out in one flat buffer of `param_len`.
    pub params: Vec<TensorSpec>,
    pub param_len: usize,
    /// BatchNorm running statistics in `state_dict` order, in one flat buffer of `buffer_len`.
    pub buffers: Vec<TensorSpec>,
    pub buffer_len: usize,
}

struct Builder {
    params: Vec<TensorSpec>,
    param_len: usize,
    buffers: Vec<TensorSpec>,
    buffer_len: usize,
}

fn push(list: &mut Vec<TensorSpec>, len: &mut usize, name: String, shape: Vec<usize>) -> usize {
    let spec = TensorSpec { name, shape, offset: *len };
    *len = (spec.offset + spec.len()).div_ceil(ALIGN) * ALIGN;
    list.push(spec);
    list.len() - 1
}

impl Builder {
    fn param(&mut self, name: String, shape: Vec<usize>) -> usize {
        push(&mut self.params, &mut self.param_len, name, shape)
    }
    fn conv(&mut self, name: &str, c_in: u32, c_out: u32, k: u32, stride: u32, pad: u32) -> Conv {
        let weight = self.param(
            format!("{name}.weight"),
            vec![c_out as usize, c_in as usize, k as usize, k as usize],
        );
        Conv { weight, c_in, c_out, k, stride, pad }
    }
    fn bn(&mut self, name: &str, c: u32) -> BatchNorm {
        let weight = self.param(format!("{name}.weight"), vec![c as usize]);
        let bias = self.param(format!("{name}.bias"), vec![c as usize]);
        let running_mean = push(
            &mut self.buffers,
            &mut self.buffer_len,
            format!("{name}.running_mean"),
            vec![c as usize],
        );
        let running_var = push(
            &mut self.buffers,
            &mut self.buffer_len,
            format!("{name}.running_var"),
            vec![c as usize],
        );
        BatchNorm { weight, bias, running_mean, running_var, c }
    }

    /// Block `p` (`layer2.0`, …) of `arch` from `c_in` channels at `width`, in torchvision's
    /// `state_dict` order: conv1, bn1, conv2, bn2 (conv3, bn3), downsample.
    fn block(&mut self, arch: Arch, p: &str, c_in: u32, width: u32, stride: u32) -> Block {
        let c_out = width * arch.expansion();
        // (c_in, c_out, k, stride, pad) of each conv of the main path.
        let convs = if arch.bottleneck() {
            vec![(c_in, width, 1, 1, 0), (width, width, 3, stride, 1), (width, c_out, 1, 1, 0)]
        } else {
            vec![(c_in, width, 3, stride, 1), (width, width, 3, 1, 1)]
        };
        let units = convs
            .into_iter()
            .enumerate()
            .map(|(j, (ci, co, k, s, pad))| {
                let conv = self.conv(&format!("{p}.conv{}", j + 1), ci, co, k, s, pad);
                (conv, self.bn(&format!("{p}.bn{}", j + 1), co))
            })
            .collect();
        let downsample = (stride != 1 || c_in != c_out).then(|| {
            (
                self.conv(&format!("{p}.downsample.0"), c_in, c_out, 1, stride, 0),
                self.bn(&format!("{p}.downsample.1"), c_out),
            )
        });
        Block { units, downsample }
    }
}

impl ResNet {
    pub fn new(arch: Arch, classes: u32) -> Result<ResNet, ModelError> {
        if classes < 2 {
            return Err(ModelError::TooFewClasses(classes));
        }
        if classes > MAX_CLASSES {
            return Err(ModelError::TooManyClasses(classes));
        }
        let mut b =
            Builder { params: Vec::new(), param_len: 0, buffers: Vec::new(), buffer_len: 0 };
        let stem_conv = b.conv("conv1", 3, 64, 7, 2, 3);
        let stem_bn = b.bn("bn1", 64);
        let mut blocks = Vec::new();
        let mut c_in = 64;
        for (stage, (&width, count)) in STAGE_WIDTHS.iter().zip(arch.blocks()).enumerate() {
            for i in 0..count {
                let stride = if stage > 0 && i == 0 { 2 } else { 1 };
                let block = b.block(arch, &format!("layer{}.{i}", stage + 1), c_in, width, stride);
                c_in = width * arch.expansion();
                blocks.push(block);
            }
        }
        let features = arch.features() as usize;
        let fc_weight = b.param("fc.weight".into(), vec![classes as usize, features]);
        let fc_bias = b.param("fc.bias".into(), vec![classes as usize]);
        Ok(ResNet {
            arch,
            classes,
            stem_conv,
            stem_bn,
            blocks,
            fc_weight,
            fc_bias,
            params: b.params,
            param_len: b.param_len,
            buffers: b.buffers,
            buffer_len: b.buffer_len,
        })
    }

    /// The ReLU sites of block `i` in forward order: one after each BN of its main path but
    /// the last, then its output's. Site 0 is the stem's.
    pub fn relu_sites(&self, i: usize) -> std::ops::Range<usize> {
        let first = 1 + self.blocks[..i].iter().map(|b| b.units.len()).sum::<usize>();
        first..first + self.blocks[i].units.len()
    }

    /// Fails when the network cannot take an input of this size.
    pub fn check_image_size(h: u32, w: u32) -> Result<(), ModelError> {
        if h < MIN_IMAGE_SIZE || w < MIN_IMAGE_SIZE {
            return Err(ModelError::ImageTooSmall { h, w });
        }
        Ok(())
    }

    /// Refuses a training batch that leaves some BatchNorm site one value per channel (the
    /// global batch, all replicas' examples: synchronised statistics are taken over all of
    /// them). Its variance would be 0 and its unbiased running variance undefined.
    pub fn check_training_batch(&self, batch: u64, h: u32, w: u32) -> Result<(), ModelError> {
        let (values, map) = self.fewest_batchnorm_values(batch, h, w);
        if values <= 1 {
            return Err(ModelError::DegenerateBatchNorm { batch, h, w, values, map });
        }
        Ok(())
    }

    /// The fewest values per channel any BatchNorm site of a training batch of `batch` images
    /// of `h`×`w` takes its statistics over (batch × the smallest map), and that map's side.
    pub fn fewest_batchnorm_values(&self, batch: u64, h: u32, w: u32) -> (u64, u32) {
        let (area, side) = self
            .conv_inputs(h, w)
            .iter()
            .map(|i| {
                (i.conv.out_size(i.h) as u64 * i.conv.out_size(i.w) as u64, i.conv.out_size(i.h))
            })
            .min()
            .unwrap_or((1, 1));
        (batch.saturating_mul(area), side)
    }

    /// Elements of the largest activation a training step of `batch` images of `h`×`w` keeps
    /// (a convolution's input or output), in 64 bits; None past u64.
    pub fn largest_activation(&self, batch: u64, h: u32, w: u32) -> Option<u64> {
        let mut largest = batch.checked_mul(3)?.checked_mul(h as u64)?.checked_mul(w as u64)?;
        for i in self.conv_inputs(h, w) {
            let (oh, ow) = (i.conv.out_size(i.h) as u64, i.conv.out_size(i.w) as u64);
            let input =
                batch.checked_mul(i.conv.c_in as u64)?.checked_mul(i.h as u64 * i.w as u64)?;
            let output = batch.checked_mul(i.conv.c_out as u64)?.checked_mul(oh * ow)?;
            largest = largest.max(input).max(output);
        }
        Some(largest)
    }

    /// All BatchNorm sites in forward order: the stem's, then per block its main path's and its
    /// downsample's.
    pub fn batchnorms(&self) -> Vec<BatchNorm> {
        let mut v = vec![self.stem_bn];
        for b in &self.blocks {
            v.extend(b.units.iter().map(|&(_, bn)| bn));
            v.extend(b.downsample.map(|(_, bn)| bn));
        }
        v
    }

    /// All convolutions in forward order.
    pub fn convs(&self) -> Vec<Conv> {
        let mut v = vec![self.stem_conv];
        for b in &self.blocks {
            v.extend(b.units.iter().map(|&(c, _)| c));
            v.extend(b.downsample.map(|(c, _)| c));
        }
        v
    }

    pub fn param(&self, name: &str) -> Option<&TensorSpec> {
        self.params.iter().find(|p| p.name == name)
    }

    /// Number of trainable scalars (without alignment padding).
    pub fn param_count(&self) -> usize {
        self.params.iter().map(|p| p.len()).sum()
    }

    /// torchvision's name of a convolution: `conv1`, `layer2.0.downsample.0`, ….
    pub fn conv_name(&self, conv: &Conv) -> &str {
        let weight = &self.params[conv.weight].name;
        weight.strip_suffix(".weight").unwrap_or(weight)
    }

    /// Every convolution in forward order ([`ResNet::convs`]) with the side of its input
    /// for an `h`×`w` image.
    pub fn conv_inputs(&self, h: u32, w: u32) -> Vec<ConvInput> {
        let at = |conv: Conv, (h, w): (u32, u32)| ConvInput { conv, h, w };
        let stem = at(self.stem_conv, (h, w));
        let pool = |s: u32| (s + 2 * POOL_PAD - POOL_K) / POOL_STRIDE + 1;
        let mut x = (pool(self.stem_conv.out_size(h)), pool(self.stem_conv.out_size(w)));
        let mut v = vec![stem];
        for b in &self.blocks {
            let mut y = x;
            for &(c, _) in &b.units {
                v.push(at(c, y));
                y = (c.out_size(y.0), c.out_size(y.1));
            }
            v.extend(b.downsample.map(|(c, _)| at(c, x)));
            x = y;
        }
        v
    }

    /// Forward FLOPs of one image (multiply-add = 2): convs and fc.
    pub fn forward_flops(&self, h: u32, w: u32) -> f64 {
        let convs: f64 = self.conv_inputs(h, w).iter().map(|i| i.flops()).sum();
        convs + 2.0 * self.arch.features() as f64 * self.classes as f64
    }

    /// Seeded initialisation as torchvision's: convs Kaiming-normal (fan_out, relu gain),
    /// BN γ = 1 and β = 0, fc weight and bias uniform ±1/√fan_in. Padding stays 0. Uses only
    /// ChaCha8 and libm, so it is bit-identical on every platform, wasm included.
    pub fn init_params(&self, seed: u64) -> Vec<f32> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut flat = vec![0.0f32; self.param_len];
        for conv in self.convs() {
            let spec = &self.params[conv.weight];
            let std = (2.0 / (conv.c_out * conv.k * conv.k) as f64).sqrt();
            for v in &mut flat[spec.range()] {
                *v = (std * standard_normal(&mut rng)) as f32;
            }
        }
        for bn in self.batchnorms() {
            flat[self.params[bn.weight].range()].fill(1.0);
        }
        let bound = 1.0 / (self.arch.features() as f64).sqrt();
        for idx in [self.fc_weight, self.fc_bias] {
            for v in &mut flat[self.params[idx].range()] {
                *v = rng.random_range(-bound..bound) as f32;
            }
        }
        flat
    }

    /// Random BN γ ∈ [0.5, 1.5) and β ∈ [−0.5, 0.5), so checks exercise every BN term
    /// (at γ = 1, β = 0 some errors would cancel).
    pub fn randomize_batchnorm(&self, params: &mut [f32], seed: u64) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        for bn in self.batchnorms() {
            for v in &mut params[self.params[bn.weight].range()] {
                *v = rng.random_range(0.5..1.5);
            }
            for v in &mut params[self.params[bn.bias].range()] {
                *v = rng.random_range(-0.5..0.5);
            }
        }
    }

    /// Fresh running statistics: mean 0, variance 1.
    pub fn init_buffers(&self) -> Vec<f32> {
        let mut flat = vec![0.0f32; self.buffer_len];
        for bn in self.batchnorms() {
            flat[self.buffers[bn.running_var].range()].fill(1.0);
        }
        flat
    }
}

/// The discrete choices a forward made: which ReLU units passed (per ReLU site in forward
/// order, 1 = passed) and which cell each max-pool window took. A run given another run's
/// pattern makes the same choices, so two runs can be compared without ReLU-flip chaos.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ActivationPattern {
    pub relu: Vec<Vec<u8>>,
    pub pool_argmax: Vec<u32>,
}

impl ActivationPattern {
    /// The patterns of consecutive shards of one batch, joined into the global batch's.
    pub fn concat(parts: &[ActivationPattern]) -> ActivationPattern {
        let sites = parts.first().map_or(0, |p| p.relu.len());
        ActivationPattern {
            relu: (0..sites)
                .map(|s| parts.iter().flat_map(|p| p.relu[s].iter().copied()).collect())
                .collect(),
            pool_argmax: parts.iter().flat_map(|p| p.pool_argmax.iter().copied()).collect(),
        }
    }

    /// The pattern as bytes ([`from_bytes`](Self::from_bytes) reads them back): to send it to
    /// other processes.
    pub fn to_bytes(&self) -> Vec<u8> {
        postcard::to_allocvec(self).expect("a pattern serialises")
    }

    /// The pattern [`to_bytes`](Self::to_bytes) wrote; None if `bytes` is not one.
    pub fn from_bytes(bytes: &[u8]) -> Option<ActivationPattern> {
        postcard::from_bytes(bytes).ok()
    }

    /// Units whose choice differs between two patterns (ReLU units + pool windows).
    pub fn flips(&self, other: &ActivationPattern) -> usize {
        let relu: usize = self
            .relu
            .iter()
            .zip(&other.relu)
            .map(|(a, b)| a.iter().zip(b).filter(|(x, y)| x != y).count())
            .sum();
        relu + self.pool_argmax.iter().zip(&other.pool_argmax).filter(|(a, b)| a != b).count()
    }
}

/// A standard normal draw by Box–Muller with libm, identical on every target.
pub fn standard_normal(rng: &mut ChaCha8Rng) -> f64 {
    let u1: f64 = 1.0 - rng.random::<f64>(); // (0, 1]: ln is finite
    let u2: f64 = rng.random::<f64>();
    libm::sqrt(-2.0 * libm::log(u1)) * libm::cos(2.0 * std::f64::consts::PI * u2)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pattern crosses to another process whole, and a cut one is refused, not misread.
    #[test]
    fn an_activation_pattern_round_trips_through_bytes() {
        let pattern = ActivationPattern {
            relu: vec![vec![1, 0, 1], Vec::new(), vec![0; 300]],
            pool_argmax: vec![0, 8, 70_000],
        };
        let bytes = pattern.to_bytes();
        assert_eq!(ActivationPattern::from_bytes(&bytes), Some(pattern));
        assert_eq!(ActivationPattern::from_bytes(&bytes[..bytes.len() / 2]), None);
    }

    #[test]
    fn resnet34_has_torchvisions_parameters() {
        let m = ResNet::new(Arch::ResNet34, 1000).unwrap();
        // torchvision.models.resnet34().parameters(): 21,797,672 scalars in 110 tensors.
        assert_eq!(m.param_count(), 21_797_672);
        assert_eq!(m.params.len(), 110);
        assert_eq!(m.batchnorms().len(), 36);
        assert_eq!(m.buffers.len(), 72);
        assert_eq!(m.params[0].name, "conv1.weight");
        assert_eq!(m.params[0].shape, vec![64, 3, 7, 7]);
        assert_eq!(m.param("layer2.0.downsample.0.weight").unwrap().shape, vec![128, 64, 1, 1]);
        assert_eq!(m.param("layer4.2.bn2.bias").unwrap().shape, vec![512]);
        assert_eq!(m.params.last().unwrap().name, "fc.bias");
        assert!(m.buffers.iter().any(|b| b.name == "layer3.0.downsample.1.running_var"));
    }

    #[test]
    fn every_arch_has_torchvisions_parameters() {
        // torchvision.models.<arch>(): its parameters' scalars and tensors, its BatchNorms,
        // its blocks' last conv and the fc's in_features.
        let cases = [
            (Arch::ResNet18, 11_689_512, 62, 20, "layer4.1.conv2.weight", [512, 512, 3, 3]),
            (Arch::ResNet34, 21_797_672, 110, 36, "layer4.2.conv2.weight", [512, 512, 3, 3]),
            (Arch::ResNet50, 25_557_032, 161, 53, "layer4.2.conv3.weight", [2048, 512, 1, 1]),
            (Arch::ResNet101, 44_549_160, 314, 104, "layer3.22.conv3.weight", [1024, 256, 1, 1]),
        ];
        for (arch, scalars, tensors, bns, last, shape) in cases {
            let m = ResNet::new(arch, 1000).unwrap();
            assert_eq!(m.arch.to_string().parse::<Arch>(), Ok(arch));
            assert_eq!((m.param_count(), m.params.len()), (scalars, tensors), "{arch}");
            assert_eq!((m.batchnorms().len(), m.buffers.len()), (bns, 2 * bns), "{arch}");
            assert_eq!(m.param(last).unwrap().shape, shape, "{arch}");
            let features = arch.features() as usize;
            assert_eq!(m.param("fc.weight").unwrap().shape, [1000, features], "{arch}");
            assert_eq!(m.conv_inputs(224, 224).len(), m.convs().len());
            let sites: usize = (0..m.blocks.len()).map(|i| m.relu_sites(i).len()).sum();
            assert_eq!(m.relu_sites(m.blocks.len() - 1).end, 1 + sites, "{arch}");
        }
        let m = ResNet::new(Arch::ResNet50, 10).unwrap();
        // Bottleneck V1.5: the stride on the 3×3; layer1.0 projects 64 → 256 at stride 1.
        let layer2 = &m.blocks[3];
        assert_eq!(
            layer2.units.iter().map(|(c, _)| (c.k, c.stride)).collect::<Vec<_>>(),
            [(1, 1), (3, 2), (1, 1)]
        );
        assert_eq!(
            m.blocks[0].downsample.map(|(c, _)| (c.c_in, c.c_out, c.stride)),
            Some((64, 256, 1))
        );
        assert!(m.blocks[1].downsample.is_none());
        assert_eq!(Arch::ResNet101.title(), "ResNet-101");
        let e = "resnet152".parse::<Arch>().unwrap_err().to_string();
        assert!(e.contains("resnet152") && e.contains("resnet101"), "{e}");
    }

    #[test]
    fn every_tensor_is_aligned_and_disjoint() {
        let m = ResNet::new(Arch::ResNet34, 10).unwrap();
        let mut end = 0;
        for p in &m.params {
            assert_eq!(p.offset * 4 % ALIGN_BYTES, 0, "{}", p.name);
            assert!(p.offset >= end);
            end = p.offset + p.len();
        }
        assert!(end <= m.param_len);
    }

    #[test]
    fn flops_match_the_published_figures() {
        // Forward FLOPs per image (multiply-add = 2), docs/performance.md: 7.33 G at 224² with
        // 1000 classes (torchvision's resnet34), 0.150 G at 32² and 0.598 G at 64² with 10.
        let near = |got: f64, giga: f64, within: f64| {
            assert!((got / 1e9 - giga).abs() < within, "{got} FLOPs, not {giga} G");
        };
        let m = ResNet::new(Arch::ResNet34, 1000).unwrap();
        near(m.forward_flops(224, 224), 7.33, 0.01);
        let m10 = ResNet::new(Arch::ResNet34, 10).unwrap();
        near(m10.forward_flops(32, 32), 0.150, 0.002);
        near(m10.forward_flops(64, 64), 0.598, 0.002);
        // torchvision's figures for the others (its GFLOPS count multiply-adds: 1.81, 4.09, 7.80).
        for (arch, giga) in
            [(Arch::ResNet18, 3.63), (Arch::ResNet50, 8.18), (Arch::ResNet101, 15.6)]
        {
            near(ResNet::new(arch, 1000).unwrap().forward_flops(224, 224), giga, 0.03);
        }
        // A training step counts 2.97 forwards: the forward, every weight gradient (as many
        // FLOPs again), every input gradient but the stem's (its input is the image).
        for (m, size) in [(&m10, 32), (&m10, 64), (&m, 224)] {
            let forward = m.forward_flops(size, size);
            let step = 3.0 * forward - m.conv_inputs(size, size)[0].flops();
            let per_forward = step / forward;
            assert!((per_forward - 2.97).abs() < 0.005, "{size}²: {per_forward}");
        }
    }

    #[test]
    fn conv_inputs_follow_the_stages() {
        let m = ResNet::new(Arch::ResNet34, 10).unwrap();
        let inputs = m.conv_inputs(64, 64);
        assert_eq!(inputs.len(), m.convs().len());
        assert_eq!(inputs.iter().map(|i| i.conv).collect::<Vec<_>>(), m.convs());
        let named = |name: &str| inputs.iter().find(|i| m.conv_name(&i.conv) == name).unwrap();
        assert_eq!((named("conv1").h, named("conv1").w), (64, 64));
        // 64 → stem /2 → pool /2 = 16; layer2.0 takes 16 and halves it; layer4 runs at 2×2.
        assert_eq!(named("layer1.0.conv1").h, 16);
        assert_eq!(named("layer2.0.downsample.0").h, 16);
        assert_eq!(named("layer2.0.conv2").h, 8);
        assert_eq!(named("layer4.2.conv2").h, 2);
    }

    #[test]
    fn init_is_seeded_and_kaiming_scaled() {
        let m = ResNet::new(Arch::ResNet34, 10).unwrap();
        let a = m.init_params(7);
        assert_eq!(a, m.init_params(7));
        assert_ne!(a, m.init_params(8));
        let w = &a[m.param("layer4.0.conv2.weight").unwrap().range()];
        let var = w.iter().map(|&x| (x as f64).powi(2)).sum::<f64>() / w.len() as f64;
        let expected = 2.0 / (512.0 * 9.0);
        assert!((var / expected - 1.0).abs() < 0.02, "variance {var} vs {expected}");
        assert!(a[m.param("bn1.weight").unwrap().range()].iter().all(|&g| g == 1.0));
    }

    #[test]
    fn bad_configurations_are_errors() {
        assert!(ResNet::new(Arch::ResNet34, 1).is_err());
        let e = ResNet::check_image_size(16, 64).unwrap_err().to_string();
        assert!(e.contains("16×64") && e.contains("32"), "{e}");
        let model = ResNet::new(Arch::ResNet34, 10).unwrap();
        let e = model.check_training_batch(1, 32, 32).unwrap_err().to_string();
        assert!(e.contains("1 value(s) per channel") && e.contains("(1×1)"), "{e}");
        model.check_training_batch(2, 32, 32).unwrap();
        model.check_training_batch(1, 64, 64).unwrap();
    }
}
