//! The all-reduce across three devices: sum and mean against the host, the same bytes on every
//! replica, a sub-range that leaves the rest of the buffer alone, and refused ranges; the
//! bucketed all-reduce against it, bitwise, and released when a replica gives up.

mod common;

use common::*;
use syncstep::collective::{
    all_reduce, bucket_rounds, BucketAllReduce, BucketStaging, CollectiveError, Filled, ReduceOp,
};
use syncstep::gpu::{AdapterChoice, Gpu, Slice};

const REPLICAS: usize = 3;

fn devices() -> Option<Vec<Gpu>> {
    gpu()?;
    Some(
        (0..REPLICAS)
            .map(|_| pollster::block_on(Gpu::new(&AdapterChoice::from_env().unwrap())).unwrap())
            .collect(),
    )
}

/// Replica r's buffer of `len` values: uniform, scaled by 10^r so the sums are not exact.
fn local(r: usize, len: usize) -> Vec<f32> {
    uniform(100 + r as u64, len).iter().map(|v| v * 10f32.powi(r as i32)).collect()
}

#[test]
fn sum_and_mean_across_three_devices_match_the_host_on_every_replica() {
    let Some(gpus) = devices() else { return };
    let len = 100_003;
    for op in [ReduceOp::Sum, ReduceOp::Mean] {
        let values: Vec<Vec<f32>> = (0..REPLICAS).map(|r| local(r, len)).collect();
        let buffers: Vec<wgpu::Buffer> =
            gpus.iter().zip(&values).map(|(g, v)| g.upload("local", v).unwrap()).collect();
        let parts: Vec<(&Gpu, Slice)> =
            gpus.iter().zip(&buffers).map(|(g, b)| (g, Slice::whole(b))).collect();
        pollster::block_on(all_reduce(&parts, op)).unwrap();
        // The pairwise order for three parts: (0 + 1) + 2, then ÷3 for the mean.
        let divisor = if op == ReduceOp::Mean { REPLICAS as f32 } else { 1.0 };
        let want: Vec<f32> =
            (0..len).map(|i| ((values[0][i] + values[1][i]) + values[2][i]) / divisor).collect();
        let exact: Vec<f64> = (0..len)
            .map(|i| values.iter().map(|v| v[i] as f64).sum::<f64>() / divisor as f64)
            .collect();
        let first = read(&gpus[0], &buffers[0]);
        assert_eq!(first, want, "{op:?} differs from the host's pairwise sum");
        assert_close(&format!("{op:?} against f64"), &first, &exact, 1e-6);
        for (g, b) in gpus.iter().zip(&buffers).skip(1) {
            let other = read(g, b);
            assert!(
                other.iter().zip(&first).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{op:?}: replicas hold different bytes"
            );
        }
    }
}

#[test]
fn a_sub_range_is_reduced_and_the_rest_left_alone() {
    let Some(gpus) = devices() else { return };
    let (len, offset, range) = (1000, 64, 500);
    let values: Vec<Vec<f32>> = (0..REPLICAS).map(|r| local(r, len)).collect();
    let buffers: Vec<wgpu::Buffer> =
        gpus.iter().zip(&values).map(|(g, v)| g.upload("local", v).unwrap()).collect();
    let parts: Vec<(&Gpu, Slice)> = gpus
        .iter()
        .zip(&buffers)
        .map(|(g, b)| (g, Slice::new(b, offset as u64 * 4, range as u64)))
        .collect();
    pollster::block_on(all_reduce(&parts, ReduceOp::Sum)).unwrap();
    for (r, (g, b)) in gpus.iter().zip(&buffers).enumerate() {
        let got = read(g, b);
        for i in 0..len {
            let want = if (offset..offset + range).contains(&i) {
                (values[0][i] + values[1][i]) + values[2][i]
            } else {
                values[r][i]
            };
            assert_eq!(got[i].to_bits(), want.to_bits(), "replica {r}, element {i}");
        }
    }
}

#[test]
fn mismatched_or_unaligned_ranges_are_refused() {
    let Some(gpus) = devices() else { return };
    let buffers: Vec<wgpu::Buffer> = gpus.iter().map(|g| g.buffer("b", 16).unwrap()).collect();
    let s = |r: usize, offset: u64, len: u64| (&gpus[r], Slice::new(&buffers[r], offset, len));
    let e = pollster::block_on(all_reduce(&[s(0, 0, 8), s(1, 0, 8), s(2, 0, 7)], ReduceOp::Sum))
        .unwrap_err();
    assert!(matches!(e, CollectiveError::RangeMismatch { replica: 2, got: 7, expected: 8 }), "{e}");
    let e = pollster::block_on(all_reduce(&[s(0, 0, 4), s(1, 2, 4)], ReduceOp::Mean)).unwrap_err();
    assert!(matches!(e, CollectiveError::Unaligned { replica: 1, offset: 2 }), "{e}");
    assert!(matches!(
        pollster::block_on(all_reduce(&[], ReduceOp::Sum)),
        Err(CollectiveError::NoReplicas)
    ));
}

/// A bucketed all-reduce of `buffers` as a backward drives it: the final part grows to start
/// at each of `from` (elements, decreasing) in one submission each, reducing what earlier
/// submissions filled; then `finish` does the rest. Replica `fail`, if any, gives up after its
/// first submission instead.
fn bucketed(
    gpus: &[Gpu],
    buffers: &[wgpu::Buffer],
    staging: &[BucketStaging],
    op: ReduceOp,
    from: &[u64],
    fail: Option<usize>,
) -> Vec<Result<(), CollectiveError>> {
    let rounds = bucket_rounds(gpus.len(), op);
    let replica = |r: usize| {
        let (gpu, buffer, rounds) = (&gpus[r], &buffers[r], &rounds);
        async move {
            let side = BucketAllReduce::new(r, &staging[r], rounds);
            let len = buffer.size() / 4;
            for &f in from {
                let mut enc = gpu.encoder();
                side.record(gpu, &mut enc, Slice::new(buffer, f * 4, len - f))?;
                side.submitted(gpu.submit(enc).await.unwrap());
                if fail == Some(r) {
                    rounds.abort(r, "lost on purpose");
                    return Err(CollectiveError::NoReplicas);
                }
                side.reduce(gpu, Filled::AllButLatest).await?;
            }
            side.finish(gpu, Slice::whole(buffer)).await
        }
    };
    pollster::block_on(futures::future::join_all((0..gpus.len()).map(replica)))
}

/// Whole-buffer `all_reduce` of copies of the same parts: what the buckets must give, bitwise.
fn whole(gpus: &[Gpu], values: &[Vec<f32>], op: ReduceOp) -> Vec<f32> {
    let buffers: Vec<wgpu::Buffer> =
        gpus.iter().zip(values).map(|(g, v)| g.upload("whole", v).unwrap()).collect();
    let parts: Vec<(&Gpu, Slice)> =
        gpus.iter().zip(&buffers).map(|(g, b)| (g, Slice::whole(b))).collect();
    pollster::block_on(all_reduce(&parts, op)).unwrap();
    read(&gpus[0], &buffers[0])
}

#[test]
fn buckets_give_the_whole_buffer_all_reduce_bitwise_step_after_step() {
    let Some(gpus) = devices() else { return };
    let len = 100_003;
    let staging: Vec<BucketStaging> = gpus.iter().map(|_| BucketStaging::default()).collect();
    // The same staging serves step after step (and an op change): buckets are kept and remapped.
    for (step, op) in [ReduceOp::Mean, ReduceOp::Sum, ReduceOp::Mean].into_iter().enumerate() {
        let values: Vec<Vec<f32>> = (0..REPLICAS).map(|r| local(r + 10 * step, len)).collect();
        let want = whole(&gpus, &values, op);
        let buffers: Vec<wgpu::Buffer> =
            gpus.iter().zip(&values).map(|(g, v)| g.upload("bucketed", v).unwrap()).collect();
        // 70_001 twice: a site that makes nothing new final adds no bucket.
        for result in
            bucketed(&gpus, &buffers, &staging, op, &[99_000, 70_001, 70_001, 30_000, 12], None)
        {
            result.unwrap();
        }
        for (r, (g, b)) in gpus.iter().zip(&buffers).enumerate() {
            let got = read(g, b);
            assert!(
                got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
                "step {step}, {op:?}: replica {r} differs from all_reduce"
            );
        }
    }
}

#[test]
fn a_replica_giving_up_releases_the_others_and_the_staging_still_works() {
    let Some(gpus) = devices() else { return };
    let len = 5000;
    let staging: Vec<BucketStaging> = gpus.iter().map(|_| BucketStaging::default()).collect();
    let values: Vec<Vec<f32>> = (0..REPLICAS).map(|r| local(r, len)).collect();
    let buffers: Vec<wgpu::Buffer> =
        gpus.iter().zip(&values).map(|(g, v)| g.upload("bucketed", v).unwrap()).collect();
    let results = bucketed(&gpus, &buffers, &staging, ReduceOp::Sum, &[4000, 1000], Some(2));
    for result in &results[..2] {
        assert!(matches!(result, Err(CollectiveError::Aborted { replica: 2, .. })), "{result:?}");
    }
    // Nothing was left mapped: the same staging reduces the next step correctly.
    let values: Vec<Vec<f32>> = (0..REPLICAS).map(|r| local(r + 7, len)).collect();
    let want = whole(&gpus, &values, ReduceOp::Sum);
    let buffers: Vec<wgpu::Buffer> =
        gpus.iter().zip(&values).map(|(g, v)| g.upload("bucketed", v).unwrap()).collect();
    bucketed(&gpus, &buffers, &staging, ReduceOp::Sum, &[4000, 1000], None)
        .into_iter()
        .for_each(|r| r.unwrap());
    for (g, b) in gpus.iter().zip(&buffers) {
        assert_eq!(read(g, b), want);
    }
}

#[test]
fn a_final_part_that_shrinks_is_refused() {
    let Some(gpus) = devices() else { return };
    let staging = BucketStaging::default();
    let rounds = bucket_rounds(1, ReduceOp::Sum);
    let side = BucketAllReduce::new(0, &staging, &rounds);
    let buffer = gpus[0].buffer("b", 64).unwrap();
    let mut enc = gpus[0].encoder();
    side.record(&gpus[0], &mut enc, Slice::new(&buffer, 128, 32)).unwrap();
    let e = side.record(&gpus[0], &mut enc, Slice::new(&buffer, 192, 16)).unwrap_err();
    assert!(matches!(e, CollectiveError::Shrunk { replica: 0, offset: 192, before: 128 }), "{e}");
}
