//! BatchNorm's kernels as GPUs run them (a workgroup per (example, channel) plane, a workgroup
//! per channel) against the CPU drivers' (an invocation per plane, per channel): the same bits,
//! held to the f64 reference; and one device's statistics and sums taken in one launch give the
//! bits of the rows taken first and given.

use crate::common::*;
use syncstep::gpu::Slice;
use syncstep::kernels::batchnorm::{self as k, BnShape};
use syncstep::kernels::conv2d::{runs_gpu_kernels, KernelPlan, KernelPolicy};
use syncstep::kernels::Device;
use syncstep::reference::batchnorm::{self as r, BnDims, BnStats};

const EPS: f32 = 1e-5;

/// Planes of one block, of part of a round, of one round exactly (64 blocks of 32 positions),
/// and of several rounds ending in a partial block.
const SHAPES: [BnShape; 5] = [
    BnShape { n: 3, c: 5, hw: 1 },
    BnShape { n: 2, c: 7, hw: 49 },
    BnShape { n: 2, c: 3, hw: 2048 },
    BnShape { n: 2, c: 3, hw: 3136 },
    BnShape { n: 1, c: 2, hw: 12549 },
];

/// Per-example rows of one device: [mean | M2] of x, and [Σdy | Σdy·x̂] with and without the
/// ReLU's gate, x̂ from `stats`.
fn example_rows(
    gpu: &Device,
    s: &BnShape,
    x: &[f32],
    dy: &[f32],
    gate: &[f32],
    stats: &[f32],
) -> [Vec<f32>; 3] {
    let up = |label, v: &[f32]| gpu.upload(label, v).unwrap();
    let (bx, bdy, bgate, bstats) = (up("x", x), up("dy", dy), up("gate", gate), up("stats", stats));
    let rows: [_; 3] = std::array::from_fn(|_| poisoned(gpu, "rows", s.rows_len() as usize));
    let w = Slice::whole;
    let count = s.positions() as u32;
    let mut enc = gpu.encoder();
    k::bn_example_stats(gpu, &mut enc, s, w(&bx), w(&rows[0])).unwrap();
    for (gated, out) in [(Some(w(&bgate)), &rows[1]), (None, &rows[2])] {
        let (dy, x, stats) = (w(&bdy), w(&bx), w(&bstats));
        k::bn_example_sums(gpu, &mut enc, s, count, EPS, dy, gated, x, stats, w(out)).unwrap();
    }
    submit(gpu, enc);
    rows.map(|b| read(gpu, &b))
}

/// The f64 reference's rows for the same inputs, example by example.
fn reference_rows(
    s: &BnShape,
    x: &[f64],
    dy: &[f64],
    gate: &[f64],
    stats: &BnStats,
) -> [Vec<f64>; 3] {
    let (c, plane) = (s.c as usize, s.c as usize * s.hw as usize);
    let one = BnDims { n: 1, c, hw: s.hw as usize };
    let masked: Vec<f64> =
        dy.iter().zip(gate).map(|(d, g)| if *g > 0.0 { *d } else { 0.0 }).collect();
    let mut rows: [Vec<f64>; 3] = Default::default();
    for b in 0..s.n as usize {
        let at = |v: &[f64]| v[b * plane..(b + 1) * plane].to_vec();
        let own = r::bn_forward_stats(one, &at(x));
        rows[0].extend(own.mean.iter().chain(&own.m2));
        for (out, dy) in [(1, &masked), (2, &dy.to_vec())] {
            let sums = r::bn_backward_sums(one, &at(dy), &at(x), stats, EPS as f64);
            rows[out].extend(sums.dy.iter().chain(&sums.dy_xhat));
        }
    }
    rows
}

fn the_gpus_per_example_kernels_give_the_cpu_drivers_bits_and_match_the_reference() {
    let per_invocation = fresh_gpu();
    let gpu_plan = KernelPolicy::new(KernelPlan::Gpu, None, None);
    let per_workgroup = device_with(gpu_plan);
    assert!(runs_gpu_kernels(&per_workgroup));
    assert!(
        !runs_gpu_kernels(&per_invocation),
        "this test needs a CPU adapter (lavapipe) to run both variants"
    );
    for (i, s) in SHAPES.iter().enumerate() {
        let seed = 40 + 10 * i as u64;
        let len = s.tensor_len() as usize;
        let x: Vec<f32> = uniform(seed, len).iter().map(|v| v + 3.0).collect();
        let (dy, gate) = (uniform(seed + 1, len), uniform(seed + 2, len));
        let dims = BnDims { n: s.n as usize, c: s.c as usize, hw: s.hw as usize };
        let stats = r::bn_forward_stats(dims, &to_f64(&x));
        let packed: Vec<f32> = stats.mean.iter().chain(&stats.m2).map(|&v| v as f32).collect();
        let ours = example_rows(&per_workgroup, s, &x, &dy, &gate, &packed);
        let theirs = example_rows(&per_invocation, s, &x, &dy, &gate, &packed);
        let expected = reference_rows(s, &to_f64(&x), &to_f64(&dy), &to_f64(&gate), &stats);
        for (((what, a), b), e) in
            ["stats", "gated sums", "sums"].iter().zip(&ours).zip(&theirs).zip(&expected)
        {
            let differ = a.iter().zip(b).filter(|(p, q)| p.to_bits() != q.to_bits()).count();
            assert_eq!(differ, 0, "{what} rows at {s:?}: {differ} of {} differ bitwise", a.len());
            assert_close(&format!("{what} rows at {s:?}"), a, e, 1e-5);
        }
    }
}

/// What `bn_stats` (with the running statistics) and `bn_sums` (gated) give on `gpu`: taking
/// their rows themselves, and given the rows `bn_example_stats` and `bn_example_sums` took.
fn channel_results(
    gpu: &Device,
    s: &BnShape,
    x: &[f32],
    dy: &[f32],
    gate: &[f32],
) -> Vec<Vec<f32>> {
    let up = |label, v: &[f32]| gpu.upload(label, v).unwrap();
    let (bx, bdy, bgate) = (up("x", x), up("dy", dy), up("gate", gate));
    let count = s.positions() as u32;
    let mut results = Vec::new();
    for given in [false, true] {
        let w = Slice::whole;
        let (rows, stats, sums) = (
            poisoned(gpu, "rows", s.rows_len() as usize),
            poisoned(gpu, "stats", s.packed_len() as usize),
            poisoned(gpu, "sums", s.packed_len() as usize),
        );
        let (mean, var) =
            (up("mean", &vec![0.5; s.c as usize]), up("var", &vec![2.0; s.c as usize]));
        let srows = poisoned(gpu, "sums rows", s.rows_len() as usize);
        let mut enc = gpu.encoder();
        let e = &mut enc;
        let (stats_rows, sums_rows) = match given {
            true => {
                k::bn_example_stats(gpu, e, s, w(&bx), w(&rows)).unwrap();
                (k::Rows::Given(w(&rows)), k::Rows::Given(w(&srows)))
            }
            false => (k::Rows::Take(w(&rows)), k::Rows::Take(w(&srows))),
        };
        let running = k::Running { momentum: 0.1, mean: w(&mean), var: w(&var) };
        k::bn_stats(gpu, e, s, w(&bx), stats_rows, w(&stats), Some(running)).unwrap();
        if given {
            let (dy, g) = (w(&bdy), Some(w(&bgate)));
            k::bn_example_sums(gpu, e, s, count, EPS, dy, g, w(&bx), w(&stats), w(&srows)).unwrap();
        }
        let (dy, g, st) = (w(&bdy), Some(w(&bgate)), w(&stats));
        k::bn_sums(gpu, e, s, count, EPS, dy, g, w(&bx), st, sums_rows, w(&sums)).unwrap();
        submit(gpu, enc);
        results.extend([&stats, &mean, &var, &sums].map(|b| read(gpu, b)));
    }
    results
}

/// Batches of one example, of a few, of several chunks of 32 with a tail, of a power of two;
/// planes of one position, of a few blocks, of many rounds; rows taken in one round, in
/// several (examples side by side, idle invocations beside them), in a launch before, and
/// from planes of more blocks than a workgroup has invocations.
fn the_per_channel_kernels_take_or_are_given_rows_with_one_set_of_bits() {
    let per_invocation = fresh_gpu();
    let per_workgroup = device_with(KernelPolicy::new(KernelPlan::Gpu, None, None));
    let shapes = [
        BnShape { n: 1, c: 3, hw: 49 },
        BnShape { n: 5, c: 4, hw: 1 },
        BnShape { n: 70, c: 3, hw: 4 },
        BnShape { n: 64, c: 2, hw: 33 },
        BnShape { n: 300, c: 2, hw: 49 },
        BnShape { n: 9, c: 2, hw: 1056 },
        BnShape { n: 3, c: 2, hw: 3136 },
        BnShape { n: 10, c: 2, hw: 3136 },
        BnShape { n: 2, c: 2, hw: 8230 },
    ];
    for (i, s) in shapes.iter().enumerate() {
        let seed = 90 + 10 * i as u64;
        let len = s.tensor_len() as usize;
        let x: Vec<f32> = uniform(seed, len).iter().map(|v| v + 3.0).collect();
        let (dy, gate) = (uniform(seed + 1, len), uniform(seed + 2, len));
        let all =
            [&per_invocation, &per_workgroup].map(|gpu| channel_results(gpu, s, &x, &dy, &gate));
        let first = &all[0][..4];
        for (d, results) in all.iter().enumerate() {
            for (r, got) in results.iter().enumerate() {
                let what = ["stats", "running mean", "running var", "sums"][r % 4];
                let how = if r < 4 { "taken" } else { "given" };
                assert_eq!(
                    bits(got),
                    bits(&first[r % 4]),
                    "{what} at {s:?}, device {d}, rows {how}"
                );
            }
        }
        let dims = BnDims { n: s.n as usize, c: s.c as usize, hw: s.hw as usize };
        let stats = r::bn_forward_stats(dims, &to_f64(&x));
        let want: Vec<f64> = stats.mean.iter().chain(&stats.m2).copied().collect();
        assert_close(&format!("stats at {s:?}"), &first[0], &want, 1e-5);
    }
}

tests![
    the_gpus_per_example_kernels_give_the_cpu_drivers_bits_and_match_the_reference,
    the_per_channel_kernels_take_or_are_given_rows_with_one_set_of_bits,
];
