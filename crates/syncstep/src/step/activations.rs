//! The activation buffers a replica keeps from pass to pass, each named by a typed handle
//! ([`Act`]): what the forward saves for the backward, the per-site BatchNorm statistics and
//! sums, the BatchNorm rows each communicator trip merges, and the imposed activation pattern. A
//! handle is data the compiler checks; a buffer is made on first use and reused while the batch's
//! geometry keeps its size (the rows: while it is large enough).

use std::collections::HashMap;

use super::{Result, Transient};
use crate::gpu::Gpu;

/// A conv → BatchNorm unit of the network, by its place.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum UnitId {
    Stem,
    /// Block `i`'s `j`-th conv and BN of its main path.
    Main(usize, usize),
    /// Block `i`'s projection shortcut.
    Downsample(usize),
}

/// An activation buffer of one replica.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum Act {
    Input,
    Labels,
    /// A unit's conv output: its BatchNorm's input.
    Conv(UnitId),
    /// The taps of a cropped conv's weights, copied once for its forward and input-VJP.
    KeptWeights(UnitId),
    /// Per-example `[mean | M2]` rows of every replica's examples, for the `k`-th unit of a
    /// communicator trip: merged within the trip, so the next trip reuses the buffer.
    StatsRows(usize),
    /// The merged `[mean | M2]` statistics.
    Stats(UnitId),
    /// Per-example `[Σdy | Σdy·x̂]` rows of every replica's examples, for the `k`-th unit of a
    /// trip, as [`Act::StatsRows`].
    SumsRows(usize),
    /// `[Σdy | Σdy·x̂]` summed.
    Sums(UnitId),
    Pool,
    PoolArgmax,
    /// Block `i`'s output, after the residual add and its ReLU.
    BlockOut(usize),
    /// The globally average-pooled features.
    Gap,
    Logits,
    Losses,
    LogitsGrad,
    GapGrad,
    /// ReLU site `i`'s imposed gate.
    ImposedRelu(usize),
    /// ReLU site `i`'s output, copied for a captured pattern (the pass may not keep it).
    CapturedRelu(usize),
    ImposedPool,
}

/// Every activation buffer of one replica, by handle.
#[derive(Default)]
pub(super) struct Activations {
    buffers: HashMap<Act, wgpu::Buffer>,
}

impl Activations {
    /// The buffer `act` of `len` elements, made on first use or when its size changes.
    pub(super) fn sized(&mut self, gpu: &Gpu, act: Act, len: u64) -> Result<wgpu::Buffer> {
        self.kept_while(gpu, act, len, |bytes, wanted| bytes == wanted)
    }

    /// The first `len` elements of buffer `act`, replaced by a larger one when a use needs more:
    /// for the buffers the units of a pass take in turn, each at its own size.
    pub(super) fn at_least(&mut self, gpu: &Gpu, act: Act, len: u64) -> Result<Transient> {
        let buffer = self.kept_while(gpu, act, len, |bytes, wanted| bytes >= wanted)?;
        Ok(Transient { buffer, len })
    }

    /// The buffer `act`, made anew for `len` elements unless `keeps(its bytes, the bytes wanted)`.
    fn kept_while(
        &mut self,
        gpu: &Gpu,
        act: Act,
        len: u64,
        keeps: impl Fn(u64, u64) -> bool,
    ) -> Result<wgpu::Buffer> {
        if let Some(b) = self.buffers.get(&act).filter(|b| keeps(b.size(), len.max(1) * 4)) {
            return Ok(b.clone());
        }
        let b = gpu.buffer(&format!("{act:?}"), len)?;
        self.buffers.insert(act, b.clone());
        Ok(b)
    }

    /// The buffer `act` as this pass made it: an earlier kernel of the pass wrote it.
    pub(super) fn saved(&self, act: Act) -> wgpu::Buffer {
        match self.buffers.get(&act) {
            Some(b) => b.clone(),
            None => unreachable!("{act:?} is read before this pass made it"),
        }
    }

    pub(super) fn bytes(&self) -> u64 {
        self.buffers.values().map(wgpu::Buffer::size).sum()
    }
}
