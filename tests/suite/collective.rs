//! The all-reduce across three devices: sum and mean against the host, the same bytes on every
//! replica, a sub-range that leaves the rest of the buffer alone, and refused ranges; the
//! bucketed all-reduce against it, bitwise, and released when a replica gives up.

use crate::common::*;
use syncstep::canonical::Plan;
use syncstep::collective::{
    all_reduce, bucket_rounds, BucketAllReduce, BucketStaging, CollectiveError, Filled, Peers,
    Pieces, ReduceOp,
};
use syncstep::gpu::{Gpu, Slice};

const REPLICAS: usize = 3;

/// Devices of their own, one per replica.
fn devices() -> Vec<Gpu> {
    needs_adapter();
    (0..REPLICAS)
        .map(|_| pollster::block_on(Gpu::new(&crate::common::environment().adapter())).unwrap())
        .collect()
}

/// Replica r's buffer of `len` values: uniform, scaled by 10^r so the sums are not exact.
fn local(r: usize, len: usize) -> Vec<f32> {
    uniform(100 + r as u64, len).iter().map(|v| v * 10f32.powi(r as i32)).collect()
}

fn sum_and_mean_across_three_devices_match_the_host_on_every_replica() {
    let gpus = devices();
    let len = 100_003;
    for op in [ReduceOp::Sum, ReduceOp::Mean] {
        let values: Vec<Vec<f32>> = (0..REPLICAS).map(|r| local(r, len)).collect();
        let buffers: Vec<wgpu::Buffer> =
            gpus.iter().zip(&values).map(|(g, v)| g.upload("local", v).unwrap()).collect();
        let parts: Vec<(&Gpu, Vec<Slice>)> =
            gpus.iter().zip(&buffers).map(|(g, b)| (g, vec![Slice::whole(b)])).collect();
        pollster::block_on(all_reduce(
            &parts,
            &Plan::one_piece_each(REPLICAS),
            op,
            &Peers::InProcess,
        ))
        .unwrap();
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

fn a_sub_range_is_reduced_and_the_rest_left_alone() {
    let gpus = devices();
    let (len, offset, range) = (1000, 64, 500);
    let values: Vec<Vec<f32>> = (0..REPLICAS).map(|r| local(r, len)).collect();
    let buffers: Vec<wgpu::Buffer> =
        gpus.iter().zip(&values).map(|(g, v)| g.upload("local", v).unwrap()).collect();
    let parts: Vec<(&Gpu, Vec<Slice>)> = gpus
        .iter()
        .zip(&buffers)
        .map(|(g, b)| (g, vec![Slice::new(b, offset as u64 * 4, range as u64)]))
        .collect();
    pollster::block_on(all_reduce(
        &parts,
        &Plan::one_piece_each(REPLICAS),
        ReduceOp::Sum,
        &Peers::InProcess,
    ))
    .unwrap();
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

fn mismatched_or_unaligned_ranges_are_refused() {
    let gpus = devices();
    let buffers: Vec<wgpu::Buffer> = gpus.iter().map(|g| g.buffer("b", 16).unwrap()).collect();
    let s =
        |r: usize, offset: u64, len: u64| (&gpus[r], vec![Slice::new(&buffers[r], offset, len)]);
    let (three, two) = (Plan::one_piece_each(3), Plan::one_piece_each(2));
    let e = pollster::block_on(all_reduce(
        &[s(0, 0, 8), s(1, 0, 8), s(2, 0, 7)],
        &three,
        ReduceOp::Sum,
        &Peers::InProcess,
    ))
    .unwrap_err();
    assert!(matches!(e, CollectiveError::RangeMismatch { replica: 2, got: 7, expected: 8 }), "{e}");
    let e = pollster::block_on(all_reduce(
        &[s(0, 0, 4), s(1, 2, 4)],
        &two,
        ReduceOp::Mean,
        &Peers::InProcess,
    ))
    .unwrap_err();
    assert!(matches!(e, CollectiveError::Unaligned { replica: 1, offset: 2 }), "{e}");
    let e = pollster::block_on(all_reduce(
        &[s(0, 0, 4), s(1, 0, 4)],
        &three,
        ReduceOp::Sum,
        &Peers::InProcess,
    ))
    .unwrap_err();
    assert!(matches!(e, CollectiveError::ReplicaCount { got: 2, expected: 3 }), "{e}");
    let nine = Plan::new(&syncstep::canonical::shards(9, 3), 9); // two pieces each
    let e = pollster::block_on(all_reduce(
        &[s(0, 0, 4), s(1, 0, 4), s(2, 0, 4)],
        &nine,
        ReduceOp::Sum,
        &Peers::InProcess,
    ))
    .unwrap_err();
    assert!(matches!(e, CollectiveError::PieceCount { replica: 0, got: 1, expected: 2 }), "{e}");
    assert!(matches!(
        pollster::block_on(all_reduce(&[], &three, ReduceOp::Sum, &Peers::InProcess)),
        Err(CollectiveError::NoReplicas)
    ));
}

/// A bucketed all-reduce of `buffers` along `plan`, as a backward drives it: replica r's buffer
/// holds its pieces, slabs of `len` elements `STRIDE` bytes apart; the final part grows to start
/// at each of `from` (elements, decreasing) in one submission each, reducing what earlier
/// submissions filled, in buckets of at least `bucket_bytes`; then `finish` does the rest.
/// Replica `fail`, if any, gives up after its first submission instead.
#[allow(clippy::too_many_arguments)]
fn bucketed(
    gpus: &[Gpu],
    buffers: &[wgpu::Buffer],
    staging: &[BucketStaging],
    plan: &Plan,
    len: u64,
    op: ReduceOp,
    from: &[u64],
    bucket_bytes: u64,
    fail: Option<usize>,
) -> Vec<Result<(), CollectiveError>> {
    let rounds = bucket_rounds(plan.clone(), op, gpus.len(), Peers::InProcess);
    let replica = |r: usize| {
        let (gpu, buffer, rounds) = (&gpus[r], &buffers[r], &rounds);
        let pieces = Pieces { count: plan.pieces_of(r) as u64, stride: STRIDE };
        async move {
            let side = BucketAllReduce::new(r, pieces, &staging[r], rounds, bucket_bytes);
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
            side.finish(gpu, Slice::new(buffer, 0, len)).await
        }
    };
    pollster::block_on(futures::future::join_all((0..gpus.len()).map(replica)))
}

/// Bytes from one piece's slab to the next in these tests.
const STRIDE: u64 = 400_128;

/// Replica r's pieces, slab after slab, as a buffer holds them.
fn slabs(values: &[Vec<f32>]) -> Vec<f32> {
    let mut out = Vec::new();
    for v in values {
        out.resize((out.len() as u64 * 4).next_multiple_of(STRIDE) as usize / 4, 0.0);
        out.extend_from_slice(v);
    }
    out
}

/// `all_reduce` of copies of the same pieces (`values[r]`: replica r's, `len` each): what the
/// buckets must give, bitwise.
fn whole(gpus: &[Gpu], values: &[Vec<Vec<f32>>], plan: &Plan, len: u64, op: ReduceOp) -> Vec<f32> {
    let buffers: Vec<wgpu::Buffer> =
        gpus.iter().zip(values).map(|(g, v)| g.upload("whole", &slabs(v)).unwrap()).collect();
    let parts: Vec<(&Gpu, Vec<Slice>)> = gpus
        .iter()
        .zip(&buffers)
        .zip(values)
        .map(|((g, b), v)| {
            (g, (0..v.len() as u64).map(|p| Slice::new(b, p * STRIDE, len)).collect())
        })
        .collect();
    pollster::block_on(all_reduce(&parts, plan, op, &Peers::InProcess)).unwrap();
    read(&gpus[0], &buffers[0])[..len as usize].to_vec()
}

/// Each replica's pieces for `plan`, `len` values each, seeded by `seed`.
fn pieces(plan: &Plan, len: usize, seed: usize) -> Vec<Vec<Vec<f32>>> {
    (0..REPLICAS)
        .map(|r| (0..plan.pieces_of(r)).map(|p| local(r + 10 * p + seed, len)).collect())
        .collect()
}

fn buckets_give_the_whole_buffer_all_reduce_bitwise_step_after_step() {
    let gpus = devices();
    let len = 100_003;
    let staging: Vec<BucketStaging> = gpus.iter().map(|_| BucketStaging::default()).collect();
    // One piece each, then two each (9 examples over 3 replicas: [0, 2) [2, 3) | [3, 4) [4, 6) |
    // [6, 8) [8, 9)). The same staging serves step after step (and an op change): buckets are
    // kept and remapped. Buckets of any size give the same bits: one per new final part, parts
    // gathered until 30_000 elements are final (the last ones at `finish`), or one at `finish`.
    let (one, two) =
        (Plan::one_piece_each(REPLICAS), Plan::new(&syncstep::canonical::shards(9, 3), 9));
    for (step, (op, plan, bucket_bytes)) in [
        (ReduceOp::Mean, &one, 0),
        (ReduceOp::Sum, &two, 120_000),
        (ReduceOp::Sum, &one, 1 << 40),
        (ReduceOp::Sum, &two, 0),
    ]
    .into_iter()
    .enumerate()
    {
        let values = pieces(plan, len, 100 * step);
        let want = whole(&gpus, &values, plan, len as u64, op);
        let buffers: Vec<wgpu::Buffer> = gpus
            .iter()
            .zip(&values)
            .map(|(g, v)| g.upload("bucketed", &slabs(v)).unwrap())
            .collect();
        // 70_001 twice: a site that makes nothing new final adds no bucket.
        let from = [99_000, 70_001, 70_001, 30_000, 12];
        let n = len as u64;
        for result in bucketed(&gpus, &buffers, &staging, plan, n, op, &from, bucket_bytes, None) {
            result.unwrap();
        }
        for (r, (g, b)) in gpus.iter().zip(&buffers).enumerate() {
            let got = read(g, b);
            assert!(
                got[..len].iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
                "step {step}, {op:?}, buckets of {bucket_bytes} B: replica {r} differs from all_reduce"
            );
        }
    }
}

fn a_replica_giving_up_releases_the_others_and_the_staging_still_works() {
    let gpus = devices();
    let len = 5000;
    let staging: Vec<BucketStaging> = gpus.iter().map(|_| BucketStaging::default()).collect();
    let plan = Plan::one_piece_each(REPLICAS);
    let values: Vec<Vec<f32>> = (0..REPLICAS).map(|r| local(r, len)).collect();
    let buffers: Vec<wgpu::Buffer> =
        gpus.iter().zip(&values).map(|(g, v)| g.upload("bucketed", v).unwrap()).collect();
    let (sum, from) = (ReduceOp::Sum, [4000, 1000]);
    let results = bucketed(&gpus, &buffers, &staging, &plan, len as u64, sum, &from, 0, Some(2));
    for result in &results[..2] {
        assert!(matches!(result, Err(CollectiveError::Aborted { replica: 2, .. })), "{result:?}");
    }
    // Nothing was left mapped: the same staging reduces the next step correctly.
    let values = pieces(&plan, len, 7);
    let want = whole(&gpus, &values, &plan, len as u64, sum);
    let buffers: Vec<wgpu::Buffer> =
        gpus.iter().zip(&values).map(|(g, v)| g.upload("bucketed", &slabs(v)).unwrap()).collect();
    bucketed(&gpus, &buffers, &staging, &plan, len as u64, sum, &from, 0, None)
        .into_iter()
        .for_each(|r| r.unwrap());
    for (g, b) in gpus.iter().zip(&buffers) {
        assert_eq!(read(g, b), want);
    }
}

fn a_final_part_that_shrinks_is_refused() {
    let gpus = devices();
    let staging = BucketStaging::default();
    let rounds = bucket_rounds(Plan::single(), ReduceOp::Sum, 1, Peers::InProcess);
    let side = BucketAllReduce::new(0, Pieces::ONE, &staging, &rounds, 0);
    let buffer = gpus[0].buffer("b", 64).unwrap();
    let mut enc = gpus[0].encoder();
    side.record(&gpus[0], &mut enc, Slice::new(&buffer, 128, 32)).unwrap();
    let e = side.record(&gpus[0], &mut enc, Slice::new(&buffer, 192, 16)).unwrap_err();
    assert!(matches!(e, CollectiveError::Shrunk { replica: 0, offset: 192, before: 128 }), "{e}");
}

tests![
    sum_and_mean_across_three_devices_match_the_host_on_every_replica,
    a_sub_range_is_reduced_and_the_rest_left_alone,
    mismatched_or_unaligned_ranges_are_refused,
    buckets_give_the_whole_buffer_all_reduce_bitwise_step_after_step,
    a_replica_giving_up_releases_the_others_and_the_staging_still_works,
    a_final_part_that_shrinks_is_refused,
];
