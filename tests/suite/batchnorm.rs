use crate::common::*;
use syncstep::gpu::{Encoder, Slice};
use syncstep::kernels::batchnorm::{self as k, BnShape};
use syncstep::kernels::Device;
use syncstep::reference::batchnorm::{self as r, BnDims, BnStats, BnSums};

const EPS: f32 = 1e-5;
const MOMENTUM: f32 = 0.1;

fn dims(s: &BnShape) -> BnDims {
    BnDims { n: s.n as usize, c: s.c as usize, hw: s.hw as usize }
}

/// Inputs around +3 (per-channel offsets too), so the mean is large against the spread and a
/// variance by E[x²] − μ² would lose digits.
fn activations(seed: u64, s: &BnShape) -> Vec<f32> {
    let offsets = uniform_in(seed + 1000, s.c as usize, 2.0, 4.0);
    let x = uniform(seed, s.tensor_len() as usize);
    x.iter().enumerate().map(|(i, v)| v + offsets[(i / s.hw as usize) % s.c as usize]).collect()
}

/// `stats` = [mean | M2] over the batch, through per-example rows as one device takes them (in
/// the same launch), and with `running` the running statistics updated.
fn forward_stats(
    gpu: &Device,
    enc: &mut Encoder,
    shape: &BnShape,
    x: Slice,
    stats: Slice,
    running: Option<k::Running>,
) {
    let rows = poisoned(gpu, "stats rows", shape.rows_len() as usize);
    let rows = k::Rows::Take(Slice::whole(&rows));
    k::bn_stats(gpu, enc, shape, x, rows, stats, running).unwrap();
}

/// `sums` = [Σdy | Σdy·x̂] over the batch, through per-example rows as one device takes them.
#[allow(clippy::too_many_arguments)]
fn backward_sums(
    gpu: &Device,
    enc: &mut Encoder,
    shape: &BnShape,
    count: u32,
    dy: Slice,
    x: Slice,
    stats: Slice,
    sums: Slice,
) {
    let rows = poisoned(gpu, "sums rows", shape.rows_len() as usize);
    let rows = k::Rows::Take(Slice::whole(&rows));
    k::bn_sums(gpu, enc, shape, count, EPS, dy, None, x, stats, rows, sums).unwrap();
}

/// [mean | M2] as the GPU packs them, and back.
fn pack(a: &[f64], b: &[f64]) -> Vec<f32> {
    a.iter().chain(b).map(|&v| v as f32).collect()
}

fn unpack_stats(count: usize, packed: &[f32]) -> BnStats {
    let (mean, m2) = packed.split_at(packed.len() / 2);
    BnStats { count, mean: to_f64(mean), m2: to_f64(m2) }
}

fn unpack_sums(packed: &[f32]) -> BnSums {
    let (dy, dy_xhat) = packed.split_at(packed.len() / 2);
    BnSums { dy: to_f64(dy), dy_xhat: to_f64(dy_xhat) }
}

/// Per-channel norm-rel of the two halves, so a small half (M2 near 0, Σdy vs Σdy·x̂) is not
/// hidden behind a large one.
fn assert_packed_close(what: &str, gpu: &[f32], a: &[f64], b: &[f64], tol: f64) {
    let (ga, gb) = gpu.split_at(a.len());
    assert_close(&format!("{what} (first half)"), ga, a, tol);
    assert_close(&format!("{what} (second half)"), gb, b, tol);
}

/// Forward, running stats and backward on one device (count = n·hw), each kernel against the
/// reference fed what the kernel was fed.
fn check_single_device(gpu: &Device, shape: BnShape, seed: u64) {
    let d = dims(&shape);
    let (len, c) = (shape.tensor_len() as usize, shape.c as usize);
    let count = shape.positions() as u32;
    let x = activations(seed, &shape);
    let dy = uniform(seed + 1, len);
    let gamma = uniform_in(seed + 2, c, 0.5, 1.5);
    let beta = uniform(seed + 3, c);
    let (run_mean0, run_var0) = (uniform(seed + 4, c), uniform_in(seed + 5, c, 0.5, 1.5));
    let up = |label, v: &[f32]| gpu.upload(label, v).unwrap();
    let (bx, bdy, bgamma, bbeta) =
        (up("x", &x), up("dy", &dy), up("gamma", &gamma), up("beta", &beta));
    let (brun_mean, brun_var) = (up("running_mean", &run_mean0), up("running_var", &run_var0));
    let (stats, y, sums, dx) = (
        poisoned(gpu, "stats", 2 * c),
        poisoned(gpu, "y", len),
        poisoned(gpu, "sums", 2 * c),
        poisoned(gpu, "dx", len),
    );
    let s = Slice::whole;
    let mut enc = gpu.encoder();
    let running = (count >= 2).then(|| k::Running {
        momentum: MOMENTUM,
        mean: s(&brun_mean),
        var: s(&brun_var),
    });
    forward_stats(gpu, &mut enc, &shape, s(&bx), s(&stats), running);
    k::bn_forward_apply(
        gpu,
        &mut enc,
        &shape,
        count,
        EPS,
        s(&bx),
        s(&stats),
        s(&bgamma),
        s(&bbeta),
        s(&y),
    )
    .unwrap();
    backward_sums(gpu, &mut enc, &shape, count, s(&bdy), s(&bx), s(&stats), s(&sums));
    k::bn_backward_input(
        gpu,
        &mut enc,
        &shape,
        count,
        EPS,
        s(&bdy),
        None,
        s(&bx),
        s(&stats),
        s(&bgamma),
        s(&sums),
        k::BnDx::Into(s(&dx)),
    )
    .unwrap();
    submit(gpu, enc);

    let (x64, dy64, gamma64, beta64) = (to_f64(&x), to_f64(&dy), to_f64(&gamma), to_f64(&beta));
    let eps = EPS as f64;
    let what = |k: &str| format!("{shape:?} {k}");
    let ref_stats = r::bn_forward_stats(d, &x64);
    let gpu_stats_raw = read(gpu, &stats);
    assert_packed_close(
        &what("forward stats"),
        &gpu_stats_raw,
        &ref_stats.mean,
        &ref_stats.m2,
        1e-4,
    );
    // Downstream kernels are checked against the reference fed the GPU's own stats and sums.
    let gpu_stats = unpack_stats(count as usize, &gpu_stats_raw);
    let ref_y = r::bn_forward_apply(d, &x64, &gpu_stats, eps, &gamma64, &beta64);
    assert_close(&what("bn_forward_apply"), &read(gpu, &y), &ref_y, 1e-5);
    if count >= 2 {
        let (mut mean, mut var) = (to_f64(&run_mean0), to_f64(&run_var0));
        r::bn_update_running(&gpu_stats, MOMENTUM as f64, &mut mean, &mut var);
        assert_close(&what("running_mean"), &read(gpu, &brun_mean), &mean, 1e-5);
        assert_close(&what("running_var"), &read(gpu, &brun_var), &var, 1e-5);
    }
    let ref_sums = r::bn_backward_sums(d, &dy64, &x64, &gpu_stats, eps);
    let gpu_sums_raw = read(gpu, &sums);
    assert_packed_close(
        &what("backward sums"),
        &gpu_sums_raw,
        &ref_sums.dy,
        &ref_sums.dy_xhat,
        1e-4,
    );
    let ref_dx = r::bn_backward_input(
        d,
        &dy64,
        &x64,
        &gpu_stats,
        eps,
        &gamma64,
        &unpack_sums(&gpu_sums_raw),
    );
    assert_close(&what("bn_backward_input"), &read(gpu, &dx), &ref_dx, 1e-5);
    // And the whole chain against the all-f64 chain.
    let ref_sums_all = r::bn_backward_sums(d, &dy64, &x64, &ref_stats, eps);
    let ref_dx_all = r::bn_backward_input(d, &dy64, &x64, &ref_stats, eps, &gamma64, &ref_sums_all);
    assert_close(
        &what("forward chain"),
        &read(gpu, &y),
        &r::bn_forward_apply(d, &x64, &ref_stats, eps, &gamma64, &beta64),
        1e-5,
    );
    assert_close(&what("backward chain"), &read(gpu, &dx), &ref_dx_all, 1e-4);
}

fn single_device_matches_reference_at_resnet_channel_counts() {
    let gpu = gpu();
    // Not count 2: there x̂ = ±1 and dx ≈ 0, so the all-f64 chain check would measure the
    // problem's conditioning rather than the kernels.
    let cases = [(64, 2, 9), (128, 3, 25), (256, 1, 1), (512, 4, 1), (64, 1, 49), (128, 2, 300)];
    for (i, &(c, n, hw)) in cases.iter().enumerate() {
        check_single_device(gpu, BnShape { n, c, hw }, 10 * i as u64);
    }
}

fn large_count_reduction_is_accurate() {
    let gpu = gpu();
    // The stem's 112×112 plane at batch 8: 12 544 positions per example in 392 blocks, values
    // around +3.
    check_single_device(gpu, BnShape { n: 8, c: 4, hw: 112 * 112 }, 77);
}

/// Data-parallel use: this replica holds shard 0 of a batch whose other shard (shifted by
/// +0.5, as the gates shard) lives elsewhere. Stats come from a merge, count is global, sums
/// are all-reduced by sum; each kernel is held to the reference on the same inputs.
fn backward_with_merged_stats_and_global_count_matches_reference() {
    let gpu = gpu();
    for (i, &(c, n, hw)) in [(64, 2, 9), (256, 3, 4), (512, 1, 1)].iter().enumerate() {
        let seed = 300 + 10 * i as u64;
        let shape = BnShape { n, c, hw };
        let d = dims(&shape);
        let (len, cu) = (shape.tensor_len() as usize, c as usize);
        let x = activations(seed, &shape);
        let other: Vec<f32> = activations(seed + 5, &shape).iter().map(|v| v + 0.5).collect();
        let (dy, dy_other) = (uniform(seed + 1, len), uniform(seed + 6, len));
        let gamma = uniform_in(seed + 2, cu, 0.5, 1.5);
        let beta = uniform(seed + 3, cu);
        let (x64, other64, dy64, gamma64, beta64) =
            (to_f64(&x), to_f64(&other), to_f64(&dy), to_f64(&gamma), to_f64(&beta));
        let eps = EPS as f64;
        // The merged stats, rounded to f32 as a replica would receive them.
        let merged =
            r::bn_merge_stats(&[r::bn_forward_stats(d, &x64), r::bn_forward_stats(d, &other64)]);
        let stats32 = pack(&merged.mean, &merged.m2);
        let global = unpack_stats(merged.count, &stats32);
        let count = global.count as u32;
        let other_sums = r::bn_backward_sums(d, &to_f64(&dy_other), &other64, &global, eps);

        let up = |label, v: &[f32]| gpu.upload(label, v).unwrap();
        let (bx, bdy, bstats, bgamma, bbeta) = (
            up("x", &x),
            up("dy", &dy),
            up("stats", &stats32),
            up("gamma", &gamma),
            up("beta", &beta),
        );
        let (y, sums) = (poisoned(gpu, "y", len), poisoned(gpu, "sums", 2 * cu));
        let s = Slice::whole;
        let mut enc = gpu.encoder();
        k::bn_forward_apply(
            gpu,
            &mut enc,
            &shape,
            count,
            EPS,
            s(&bx),
            s(&bstats),
            s(&bgamma),
            s(&bbeta),
            s(&y),
        )
        .unwrap();
        backward_sums(gpu, &mut enc, &shape, count, s(&bdy), s(&bx), s(&bstats), s(&sums));
        submit(gpu, enc);
        let what = |k: &str| format!("{shape:?} count {count} {k}");
        assert_close(
            &what("bn_forward_apply"),
            &read(gpu, &y),
            &r::bn_forward_apply(d, &x64, &global, eps, &gamma64, &beta64),
            1e-5,
        );
        let local = read(gpu, &sums);
        let ref_local = r::bn_backward_sums(d, &dy64, &x64, &global, eps);
        assert_packed_close(
            &what("backward sums"),
            &local,
            &ref_local.dy,
            &ref_local.dy_xhat,
            1e-4,
        );

        // The all-reduce: local + other, in f32, as the collective would.
        let other32 = pack(&other_sums.dy, &other_sums.dy_xhat);
        let total: Vec<f32> = local.iter().zip(&other32).map(|(a, b)| a + b).collect();
        let (bsums, dx) = (up("total", &total), poisoned(gpu, "dx", len));
        let mut enc = gpu.encoder();
        k::bn_backward_input(
            gpu,
            &mut enc,
            &shape,
            count,
            EPS,
            s(&bdy),
            None,
            s(&bx),
            s(&bstats),
            s(&bgamma),
            s(&bsums),
            k::BnDx::Into(s(&dx)),
        )
        .unwrap();
        submit(gpu, enc);
        let ref_dx =
            r::bn_backward_input(d, &dy64, &x64, &global, eps, &gamma64, &unpack_sums(&total));
        assert_close(&what("bn_backward_input"), &read(gpu, &dx), &ref_dx, 1e-5);
    }
}

fn reductions_are_bitwise_deterministic() {
    let gpu = gpu();
    let shape = BnShape { n: 4, c: 64, hw: 1000 };
    let (x, dy) = (activations(1, &shape), uniform(2, shape.tensor_len() as usize));
    let (bx, bdy) = (gpu.upload("x", &x).unwrap(), gpu.upload("dy", &dy).unwrap());
    let run = || {
        let (stats, sums) = (poisoned(gpu, "stats", 128), poisoned(gpu, "sums", 128));
        let s = Slice::whole;
        let mut enc = gpu.encoder();
        forward_stats(gpu, &mut enc, &shape, s(&bx), s(&stats), None);
        backward_sums(
            gpu,
            &mut enc,
            &shape,
            shape.positions() as u32,
            s(&bdy),
            s(&bx),
            s(&stats),
            s(&sums),
        );
        submit(gpu, enc);
        let bits = |b| read(gpu, b).iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        (bits(&stats), bits(&sums))
    };
    assert_eq!(run(), run());
}

/// What a data-parallel step relies on: shards' per-example rows, gathered in order, merge into
/// exactly the whole batch's statistics; and the sums over power-of-two shards' own rows
/// (their dβ, dγ), added in the all-reduce's pairwise order, are exactly the whole batch's.
fn shards_rows_rebuild_the_whole_batch_bitwise() {
    let gpu = gpu();
    let whole = BnShape { n: 8, c: 64, hw: 9 };
    let (x, dy) = (activations(400, &whole), uniform(401, whole.tensor_len() as usize));
    let count = whole.positions() as u32;
    // (stats rows, stats, sums rows, sums) of examples `ex`, sums taken with `stats` if given.
    let run = |ex: std::ops::Range<usize>, stats: Option<&[f32]>| {
        let s = Slice::whole;
        let shape = BnShape { n: ex.len() as u32, ..whole };
        let len = shape.tensor_len() as usize;
        let (bx, bdy) = (
            gpu.upload("x", &x[ex.start * len / ex.len()..][..len]).unwrap(),
            gpu.upload("dy", &dy[ex.start * len / ex.len()..][..len]).unwrap(),
        );
        let (rows, own_stats, srows, sums) = (
            poisoned(gpu, "rows", shape.rows_len() as usize),
            poisoned(gpu, "stats", 128),
            poisoned(gpu, "srows", shape.rows_len() as usize),
            poisoned(gpu, "sums", 128),
        );
        let mut enc = gpu.encoder();
        k::bn_example_stats(gpu, &mut enc, &shape, s(&bx), s(&rows)).unwrap();
        let given = k::Rows::Given(s(&rows));
        k::bn_stats(gpu, &mut enc, &shape, s(&bx), given, s(&own_stats), None).unwrap();
        submit(gpu, enc);
        let stats = gpu.upload("given stats", stats.unwrap_or(&read(gpu, &own_stats))).unwrap();
        let mut enc = gpu.encoder();
        k::bn_example_sums(
            gpu,
            &mut enc,
            &shape,
            count,
            EPS,
            s(&bdy),
            None,
            s(&bx),
            s(&stats),
            s(&srows),
        )
        .unwrap();
        let given = k::Rows::Given(s(&srows));
        let (dy, x, st) = (s(&bdy), s(&bx), s(&stats));
        k::bn_sums(gpu, &mut enc, &shape, count, EPS, dy, None, x, st, given, s(&sums)).unwrap();
        submit(gpu, enc);
        (read(gpu, &rows), read(gpu, &own_stats), read(gpu, &srows), read(gpu, &sums))
    };
    let (rows, stats, srows, sums) = run(0..8, None);
    for n in [1, 2, 4] {
        let shards: Vec<_> = (0..8 / n).map(|r| run(r * n..(r + 1) * n, Some(&stats))).collect();
        let gathered: Vec<f32> = shards.iter().flat_map(|sh| sh.0.clone()).collect();
        assert_eq!(bits(&gathered), bits(&rows), "stats rows, shards of {n}");
        let (gathered_buf, merged) =
            (gpu.upload("gathered", &gathered).unwrap(), poisoned(gpu, "merged", 128));
        // The rows are given: x is bound, not read.
        let unread = gpu.upload("x", &x).unwrap();
        let (given, merged_slice) =
            (k::Rows::Given(Slice::whole(&gathered_buf)), Slice::whole(&merged));
        let mut enc = gpu.encoder();
        k::bn_stats(gpu, &mut enc, &whole, Slice::whole(&unread), given, merged_slice, None)
            .unwrap();
        submit(gpu, enc);
        assert_eq!(bits(&read(gpu, &merged)), bits(&stats), "merged stats, shards of {n}");
        let gathered: Vec<f32> = shards.iter().flat_map(|sh| sh.2.clone()).collect();
        assert_eq!(bits(&gathered), bits(&srows), "sums rows, shards of {n}");
    }
    // dγ, dβ: each replica's canonical pieces summed alone, added along the canonical tree.
    for replicas in [2, 3, 5, 8] {
        let total = summed_in_pieces(8, replicas, |e| run(e, Some(&stats)).3);
        assert_eq!(bits(&total), bits(&sums), "own sums of 8 examples over {replicas} replicas");
    }
}

/// Shapes for the fused kernels: ResNet-like channel counts, and a tensor length that is not a
/// multiple of the workgroup size; hw not a multiple of 4 (one element an invocation) and a
/// multiple of 4 (four, in vec4s).
const FUSED_SHAPES: [BnShape; 5] = [
    BnShape { n: 2, c: 64, hw: 9 },
    BnShape { n: 1, c: 128, hw: 49 },
    BnShape { n: 3, c: 5, hw: 301 },
    BnShape { n: 3, c: 7, hw: 4 },
    BnShape { n: 2, c: 6, hw: 64 },
];

/// bn_apply_relu against bn_forward_apply, add (y first) and relu_forward on the GPU: the same
/// bits, for each of {no shortcut, shortcut} × {own gate, imposed gate}; and against the
/// reference composed of the same ops, fed the GPU's statistics.
fn bn_apply_relu_is_the_unfused_sequence_bitwise_and_matches_reference() {
    let gpu = gpu();
    for (i, shape) in FUSED_SHAPES.iter().enumerate() {
        let seed = 500 + 10 * i as u64;
        let d = dims(shape);
        let (len, c) = (shape.tensor_len() as usize, shape.c as usize);
        let count = shape.positions() as u32;
        let x = activations(seed, shape);
        let (gamma, beta) = (uniform_in(seed + 1, c, 0.5, 1.5), uniform(seed + 2, c));
        let (shortcut, gate) = (uniform(seed + 3, len), uniform(seed + 4, len));
        let up = |label, v: &[f32]| gpu.upload(label, v).unwrap();
        let (bx, bgamma, bbeta, bshortcut, bgate) = (
            up("x", &x),
            up("gamma", &gamma),
            up("beta", &beta),
            up("shortcut", &shortcut),
            up("gate", &gate),
        );
        let stats = poisoned(gpu, "stats", 2 * c);
        let s = Slice::whole;
        let mut enc = gpu.encoder();
        forward_stats(gpu, &mut enc, shape, s(&bx), s(&stats), None);
        submit(gpu, enc);
        let gpu_stats = unpack_stats(count as usize, &read(gpu, &stats));
        let (x64, gamma64, beta64, shortcut64, gate64) =
            (to_f64(&x), to_f64(&gamma), to_f64(&beta), to_f64(&shortcut), to_f64(&gate));
        for residual in [false, true] {
            for imposed in [false, true] {
                let what = format!("{shape:?} residual {residual} imposed gate {imposed}");
                let s = Slice::whole;
                let (fused, y, sum, unfused) = (
                    poisoned(gpu, "fused", len),
                    poisoned(gpu, "y", len),
                    poisoned(gpu, "sum", len),
                    poisoned(gpu, "unfused", len),
                );
                let mut enc = gpu.encoder();
                let e = &mut enc;
                let (given_shortcut, given_gate) =
                    (residual.then(|| s(&bshortcut)), imposed.then(|| s(&bgate)));
                k::bn_apply_relu(
                    gpu,
                    e,
                    shape,
                    count,
                    EPS,
                    s(&bx),
                    s(&stats),
                    s(&bgamma),
                    s(&bbeta),
                    given_shortcut,
                    given_gate,
                    s(&fused),
                )
                .unwrap();
                k::bn_forward_apply(
                    gpu,
                    e,
                    shape,
                    count,
                    EPS,
                    s(&bx),
                    s(&stats),
                    s(&bgamma),
                    s(&bbeta),
                    s(&y),
                )
                .unwrap();
                let v = if residual {
                    syncstep::kernels::elementwise::add(gpu, e, s(&y), s(&bshortcut), s(&sum))
                        .unwrap();
                    &sum
                } else {
                    &y
                };
                let relu_gate = if imposed { &bgate } else { v };
                syncstep::kernels::elementwise::relu_forward(
                    gpu,
                    e,
                    s(v),
                    s(relu_gate),
                    s(&unfused),
                )
                .unwrap();
                submit(gpu, enc);
                let out = read(gpu, &fused);
                assert_eq!(bits(&out), bits(&read(gpu, &unfused)), "{what}: fused vs unfused bits");
                let zeros = out.iter().filter(|&&v| v == 0.0).count();
                assert!(
                    zeros > len / 10 && zeros < len * 9 / 10,
                    "{what}: {zeros} of {len} zero, the ReLU is barely exercised"
                );
                let want = r::bn_apply_relu(
                    d,
                    &x64,
                    &gpu_stats,
                    EPS as f64,
                    &gamma64,
                    &beta64,
                    residual.then_some(&shortcut64[..]),
                    imposed.then_some(&gate64[..]),
                );
                assert_close(&what, &out, &want, 1e-5);
            }
        }
    }
}

/// bn_example_sums and bn_backward_input with a gate against relu_backward followed by the
/// ungated kernels: the same bits (rows, sums, dx); dx written over dy the bits of dx into a
/// buffer of its own, gated and not; and against the reference composition.
fn gated_backward_is_relu_backward_then_the_ungated_kernels_bitwise() {
    let gpu = gpu();
    for (i, shape) in FUSED_SHAPES.iter().enumerate() {
        let seed = 600 + 10 * i as u64;
        let d = dims(shape);
        let (len, c) = (shape.tensor_len() as usize, shape.c as usize);
        let count = shape.positions() as u32;
        let (x, dy, gate) =
            (activations(seed, shape), uniform(seed + 1, len), uniform(seed + 2, len));
        let gamma = uniform_in(seed + 3, c, 0.5, 1.5);
        let up = |label, v: &[f32]| gpu.upload(label, v).unwrap();
        let (bx, bdy, bgate, bgamma) =
            (up("x", &x), up("dy", &dy), up("gate", &gate), up("gamma", &gamma));
        let stats = poisoned(gpu, "stats", 2 * c);
        let s = Slice::whole;
        let mut enc = gpu.encoder();
        forward_stats(gpu, &mut enc, shape, s(&bx), s(&stats), None);
        submit(gpu, enc);
        // (rows, sums, dx) of dy through the gate: fused, or relu_backward first.
        let run = |gated: bool| {
            let s = Slice::whole;
            let p = |label| poisoned(gpu, label, len);
            let (dz, rows, sums, dx) = (
                p("dz"),
                poisoned(gpu, "rows", shape.rows_len() as usize),
                poisoned(gpu, "sums", 2 * c),
                p("dx"),
            );
            let mut enc = gpu.encoder();
            let e = &mut enc;
            let (dy, gate) = if gated {
                (s(&bdy), Some(s(&bgate)))
            } else {
                syncstep::kernels::elementwise::relu_backward(gpu, e, s(&bdy), s(&bgate), s(&dz))
                    .unwrap();
                (s(&dz), None)
            };
            let take = k::Rows::Take(s(&rows));
            k::bn_sums(gpu, e, shape, count, EPS, dy, gate, s(&bx), s(&stats), take, s(&sums))
                .unwrap();
            let over = p("dy, then dx");
            e.copy_buffer_to_buffer(dy.buffer, 0, &over, 0, dy.bytes());
            let (x, st, g, su) = (s(&bx), s(&stats), s(&bgamma), s(&sums));
            k::bn_backward_input(
                gpu,
                e,
                shape,
                count,
                EPS,
                dy,
                gate,
                x,
                st,
                g,
                su,
                k::BnDx::Into(s(&dx)),
            )
            .unwrap();
            k::bn_backward_input(
                gpu,
                e,
                shape,
                count,
                EPS,
                s(&over),
                gate,
                x,
                st,
                g,
                su,
                k::BnDx::OverDy,
            )
            .unwrap();
            submit(gpu, enc);
            let dx = read(gpu, &dx);
            assert_eq!(bits(&read(gpu, &over)), bits(&dx), "{shape:?} gated {gated}: over dy");
            (read(gpu, &rows), read(gpu, &sums), dx)
        };
        let (fused, unfused) = (run(true), run(false));
        assert_eq!(bits(&fused.0), bits(&unfused.0), "{shape:?} rows");
        assert_eq!(bits(&fused.1), bits(&unfused.1), "{shape:?} sums");
        assert_eq!(bits(&fused.2), bits(&unfused.2), "{shape:?} dx");

        let gpu_stats = unpack_stats(count as usize, &read(gpu, &stats));
        let (x64, gamma64, eps) = (to_f64(&x), to_f64(&gamma), EPS as f64);
        let dz64 = syncstep::reference::elementwise::relu_backward(&to_f64(&dy), &to_f64(&gate));
        let ref_sums = r::bn_backward_sums(d, &dz64, &x64, &gpu_stats, eps);
        assert_packed_close(
            &format!("{shape:?} gated sums"),
            &fused.1,
            &ref_sums.dy,
            &ref_sums.dy_xhat,
            1e-4,
        );
        let ref_dx =
            r::bn_backward_input(d, &dz64, &x64, &gpu_stats, eps, &gamma64, &unpack_sums(&fused.1));
        assert_close(&format!("{shape:?} gated dx"), &fused.2, &ref_dx, 1e-5);
    }
}

/// At batch sizes that need each pairwise stack size, bn_sums is the pairwise sum of the rows it
/// is given, which the host takes in the same order.
fn sums_add_given_rows_pairwise_at_every_stack_size() {
    let gpu = gpu();
    let c = 3;
    for n in pairwise_counts() {
        let shape = BnShape { n, c, hw: 1 };
        let rows = uniform(410 + n as u64, shape.rows_len() as usize);
        let (brows, sums) =
            (gpu.upload("rows", &rows).unwrap(), poisoned(gpu, "sums", 2 * c as usize));
        // Bound, not read: the rows are given.
        let (dy, stats) =
            (gpu.buffer("dy", shape.tensor_len()).unwrap(), gpu.buffer("stats", 6).unwrap());
        let (dy, stats, given) =
            (Slice::whole(&dy), Slice::whole(&stats), k::Rows::Given(Slice::whole(&brows)));
        let mut enc = gpu.encoder();
        k::bn_sums(gpu, &mut enc, &shape, n, EPS, dy, None, dy, stats, given, Slice::whole(&sums))
            .unwrap();
        submit(gpu, enc);
        let want = pairwise_sum(rows.chunks(2 * c as usize).map(<[f32]>::to_vec).collect());
        assert_eq!(bits(&read(gpu, &sums)), bits(&want), "batch of {n}");
    }
}

tests![
    single_device_matches_reference_at_resnet_channel_counts,
    large_count_reduction_is_accurate,
    backward_with_merged_stats_and_global_count_matches_reference,
    reductions_are_bitwise_deterministic,
    shards_rows_rebuild_the_whole_batch_bitwise,
    bn_apply_relu_is_the_unfused_sequence_bitwise_and_matches_reference,
    gated_backward_is_relu_backward_then_the_ungated_kernels_bitwise,
    sums_add_given_rows_pairwise_at_every_stack_size,
];
