//! Deliberate breakages of the equivalence, so that tests and `syncstep check --sabotage` see
//! the TEST gate fail: a wrapper around a replica's [`Communicator`], never part of the step that
//! trains.

use super::{write_rows, ReplicaLink};
use crate::gpu::{Encoder, Gpu, Slice};
use crate::step::{self, BnRows, Communicator};

/// A way to break the equivalence.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum Sabotage {
    /// What the equivalence would be without the global divisor: each replica divides its loss
    /// by its own shard and the all-reduce takes the mean, which in f32 is not the single
    /// device's division unless R and the shards are powers of two.
    LocalDivisor,
    /// Never merge BN statistics: each replica takes its own rows in place of every replica's
    /// (its own mean and variance), while the backward sums stay synchronised.
    UnmergedStats,
}

/// A replica's link to the others, broken as `sabotage` says.
pub struct Sabotaged<'a> {
    pub link: ReplicaLink<'a>,
    pub sabotage: Sabotage,
}

impl Sabotaged<'_> {
    /// Every replica's rows replaced by this replica's own, cycled to each replica's count.
    async fn own_stats_only(
        &self,
        gpu: &Gpu,
        enc: &mut Encoder,
        sites: &[BnRows<'_>],
    ) -> step::Result<()> {
        let mine = self.link.own_rows(gpu, enc, sites).await?;
        let counts = self.link.counts();
        let global = counts.iter().sum::<u32>() as u64;
        let own_of_site = |at: &mut usize, site: &BnRows| {
            let width = site.width(global);
            let own = &mine[*at..*at + width * site.local as usize];
            *at += own.len();
            (width, own)
        };
        let all: Vec<Vec<f32>> = counts
            .iter()
            .map(|&count| {
                let mut at = 0;
                sites
                    .iter()
                    .flat_map(|site| {
                        let (width, own) = own_of_site(&mut at, site);
                        own.chunks(width).cycle().take(count as usize).flatten().copied()
                    })
                    .collect()
            })
            .collect();
        write_rows(gpu, sites, counts, &all)
    }
}

impl Communicator for Sabotaged<'_> {
    fn examples(&self, local: u32) -> u32 {
        self.link.examples(local)
    }

    async fn bn_stats(
        &self,
        gpu: &Gpu,
        enc: &mut Encoder,
        sites: &[BnRows<'_>],
    ) -> step::Result<()> {
        match self.sabotage {
            Sabotage::UnmergedStats => self.own_stats_only(gpu, enc, sites).await,
            Sabotage::LocalDivisor => self.link.bn_stats(gpu, enc, sites).await,
        }
    }

    async fn bn_sums(
        &self,
        gpu: &Gpu,
        enc: &mut Encoder,
        sites: &[BnRows<'_>],
    ) -> step::Result<()> {
        self.link.bn_sums(gpu, enc, sites).await
    }

    fn gradients_final(&self, gpu: &Gpu, enc: &mut Encoder, done: Slice<'_>) -> step::Result<()> {
        self.link.gradients_final(gpu, enc, done)
    }

    async fn land_rows(&self, gpu: &Gpu) -> step::Result<()> {
        self.link.land_rows(gpu).await
    }

    async fn finish_gradients(&self, gpu: &Gpu, gradient: Slice<'_>) -> step::Result<()> {
        self.link.finish_gradients(gpu, gradient).await?;
        if self.sabotage == Sabotage::LocalDivisor {
            // The all-reduce's mean: the sum over the replicas divided by their number.
            let replicas = self.link.counts().len() as f32;
            let mean: Vec<f32> =
                gpu.read_f32(gradient).await?.iter().map(|g| g / replicas).collect();
            gpu.queue.write_buffer(gradient.buffer, gradient.offset, bytemuck::cast_slice(&mean));
        }
        Ok(())
    }

    fn loss_divisor(&self, local: u32, global: u64) -> f32 {
        match self.sabotage {
            Sabotage::LocalDivisor => local as f32,
            Sabotage::UnmergedStats => self.link.loss_divisor(local, global),
        }
    }
}
