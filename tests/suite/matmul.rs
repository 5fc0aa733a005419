use crate::common::*;
use syncstep::gpu::{Gpu, Slice};
use syncstep::kernels::matmul::{self as k, MatmulAlgo, MatmulShape, MATMUL_TILES};
use syncstep::kernels::KernelError;
use syncstep::reference::matmul as r;

/// `algo` at `s` on seeded data in [-1, 1) into a NaN-poisoned C, against the f64 reference.
fn check(algo: MatmulAlgo, s: MatmulShape, seed: u64) {
    let gpu = gpu();
    let (m, kk, n) = (s.m as usize, s.k as usize, s.n as usize);
    let a = uniform(seed, m * kk);
    let b = uniform(seed + 1, kk * n);
    let (ba, bb) = (gpu.upload("a", &a).unwrap(), gpu.upload("b", &b).unwrap());
    let c = poisoned(gpu, "c", m * n);
    let mut enc = gpu.encoder();
    k::matmul(gpu, &mut enc, algo, &s, Slice::whole(&ba), Slice::whole(&bb), Slice::whole(&c))
        .unwrap();
    submit(gpu, enc);
    let got = read(gpu, &c);
    let want = r::matmul(m, kk, n, &to_f64(&a), &to_f64(&b));
    println!("{algo:?} {s:?}: norm-rel {:.2e}", norm_rel(&got, &want));
    assert_close(&format!("matmul {algo:?} {s:?}"), &got, &want, 1e-5);
}

fn shape(m: u32, k: u32, n: u32) -> MatmulShape {
    MatmulShape { m, k, n }
}

fn simple_matches_reference_at_odd_sizes() {
    for (i, s) in [shape(1, 1, 1), shape(7, 13, 5), shape(33, 65, 17), shape(70, 3, 129)]
        .into_iter()
        .enumerate()
    {
        check(MatmulAlgo::Simple, s, 10 + i as u64);
    }
}

fn every_tile_matches_reference_with_ragged_edges() {
    // k and n multiples of 4, as the tiled kernel needs; m odd and n not a multiple of any
    // tile's columns or of the 64-invocation workgroup's, so tiles hang over every edge.
    for algo in MATMUL_TILES {
        for (i, s) in [shape(1, 4, 4), shape(13, 20, 36), shape(37, 64, 260), shape(70, 132, 12)]
            .into_iter()
            .enumerate()
        {
            check(algo, s, 20 + i as u64);
        }
    }
}

fn tiles_agree_with_simple_bit_for_bit() {
    // Every kernel sums each element over k in increasing order, whether it loads or broadcasts.
    let gpu = gpu();
    let loading = gpu_that_loads();
    let s = shape(29, 48, 52);
    let a = uniform(30, (s.m * s.k) as usize);
    let b = uniform(31, (s.k * s.n) as usize);
    let run = |gpu: &Gpu, algo| {
        let (ba, bb) = (gpu.upload("a", &a).unwrap(), gpu.upload("b", &b).unwrap());
        let c = poisoned(gpu, "c", (s.m * s.n) as usize);
        let mut enc = gpu.encoder();
        k::matmul(gpu, &mut enc, algo, &s, Slice::whole(&ba), Slice::whole(&bb), Slice::whole(&c))
            .unwrap();
        submit(gpu, enc);
        read(gpu, &c).iter().map(|v| v.to_bits()).collect::<Vec<_>>()
    };
    let simple = run(gpu, MatmulAlgo::Simple);
    for algo in MATMUL_TILES {
        assert_eq!(run(gpu, algo), simple, "{algo:?} differs from Simple");
        assert_eq!(run(&loading, algo), simple, "{algo:?} that loads differs from Simple");
    }
}

fn launches_refuse_wrong_lengths_zero_sizes_and_tiles_they_cannot_run() {
    let gpu = gpu();
    let buf = gpu.buffer("b", 4096).unwrap();
    let refused = |algo, s: MatmulShape, lens: [u64; 3]| {
        let bufs = lens.map(|len| Slice::new(&buf, 0, len));
        let mut enc = gpu.encoder();
        match k::matmul(gpu, &mut enc, algo, &s, bufs[0], bufs[1], bufs[2]).unwrap_err() {
            KernelError::Arg { op: "matmul", arg, .. } => arg,
            e => panic!("{e}"),
        }
    };
    let tile = MATMUL_TILES[0];
    assert_eq!(refused(MatmulAlgo::Simple, shape(2, 3, 4), [6, 12, 9]), "c");
    assert_eq!(refused(MatmulAlgo::Simple, shape(2, 3, 4), [7, 12, 8]), "a");
    assert_eq!(refused(MatmulAlgo::Simple, shape(0, 3, 4), [0, 12, 0]), "m");
    assert_eq!(refused(tile, shape(2, 3, 4), [6, 12, 8]), "k");
    assert_eq!(refused(tile, shape(2, 4, 6), [8, 24, 12]), "n");
    assert_eq!(refused(MatmulAlgo::Tiled { rows: 3, cols: 4 }, shape(2, 4, 4), [8, 16, 8]), "algo");
}

tests![
    simple_matches_reference_at_odd_sizes,
    every_tile_matches_reference_with_ragged_edges,
    tiles_agree_with_simple_bit_for_bit,
    launches_refuse_wrong_lengths_zero_sizes_and_tiles_they_cannot_run,
];
