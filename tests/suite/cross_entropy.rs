use crate::common::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use syncstep::gpu::{Encoder, Gpu, Slice};
use syncstep::kernels::cross_entropy::{self as k, CrossEntropyShape};
use syncstep::reference::cross_entropy as r;

fn labels(seed: u64, m: usize, k: u32) -> Vec<u32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..m).map(|_| rng.random_range(0..k)).collect()
}

/// GPU (losses, loss, dlogits) for the given logits and labels; the loss is the step's: the
/// losses summed in the canonical order on the host, divided by `divisor`.
fn run(
    gpu: &Gpu,
    s: CrossEntropyShape,
    smoothing: f32,
    divisor: f32,
    logits: &[f32],
    labels: &[u32],
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (bz, by) = (gpu.upload("logits", logits).unwrap(), gpu.upload("labels", labels).unwrap());
    let losses = poisoned(gpu, "losses", s.m as usize);
    let dz = poisoned(gpu, "dlogits", logits.len());
    let sl = Slice::whole;
    let mut enc = gpu.encoder();
    k::cross_entropy_forward(gpu, &mut enc, &s, smoothing, sl(&bz), sl(&by), sl(&losses)).unwrap();
    k::cross_entropy_backward(gpu, &mut enc, &s, smoothing, divisor, sl(&bz), sl(&by), sl(&dz))
        .unwrap();
    submit(gpu, enc);
    let losses = read(gpu, &losses);
    let loss = vec![syncstep::canonical::sum(&losses) / divisor];
    (losses, loss, read(gpu, &dz))
}

fn cross_entropy_forward_and_backward_match_reference() {
    let gpu = gpu();
    // 10 classes (typical), 1000 and odd 7/3, batch 1 to 100. Divisor: the batch, or the global
    // batch of which this is a replica's shard.
    // Logits in ±scale; ±100 overflows exp in f32 unless the row max is subtracted.
    let cases = [
        (1, 10, 1.0, 4.0),
        (32, 10, 32.0, 4.0),
        (7, 1000, 7.0, 4.0),
        (3, 7, 12.0, 4.0),
        (100, 3, 100.0, 4.0),
        (5, 257, 2.0, 4.0),
        (4, 10, 4.0, 100.0),
    ];
    for (i, &(m, kk, divisor, scale)) in cases.iter().enumerate() {
        for smoothing in [0.1f32, 0.0] {
            let s = CrossEntropyShape { m, k: kk };
            let seed = 10 * i as u64;
            let logits = uniform_in(seed, (m * kk) as usize, -scale, scale);
            let y = labels(seed + 1, m as usize, kk);
            let (losses, loss, dz) = run(gpu, s, smoothing, divisor, &logits, &y);
            let (eps, d) = (smoothing as f64, divisor as f64);
            let (losses_ref, loss_ref) =
                r::cross_entropy_forward(m as usize, kk as usize, eps, d, &to_f64(&logits), &y);
            let dz_ref =
                r::cross_entropy_backward(m as usize, kk as usize, eps, d, &to_f64(&logits), &y);
            let what = format!("{s:?} ε={smoothing} D={divisor}");
            assert_close(
                &format!("cross_entropy_forward losses {what}"),
                &losses,
                &losses_ref,
                1e-5,
            );
            assert_close(&format!("cross_entropy_forward loss {what}"), &loss, &[loss_ref], 1e-5);
            assert_close(&format!("cross_entropy_backward {what}"), &dz, &dz_ref, 1e-5);
        }
    }
}

fn cross_entropy_marks_an_out_of_range_label_with_nan() {
    let gpu = gpu();
    let s = CrossEntropyShape { m: 3, k: 10 };
    let logits = uniform(5, 30);
    let (losses, loss, dz) = run(gpu, s, 0.1, 3.0, &logits, &[2, 10, 9]);
    assert!(losses[0].is_finite() && losses[1].is_nan() && losses[2].is_finite(), "{losses:?}");
    assert!(loss[0].is_nan(), "{loss:?}");
    assert!(
        dz[..10].iter().chain(&dz[20..]).all(|g| g.is_finite())
            && dz[10..20].iter().all(|g| g.is_nan()),
        "{dz:?}"
    );
}

fn cross_entropy_forward_is_deterministic() {
    let gpu = gpu();
    let s = CrossEntropyShape { m: 100, k: 1000 };
    let logits = uniform_in(3, 100_000, -4.0, 4.0);
    let y = labels(4, 100, 1000);
    let a = run(gpu, s, 0.1, 100.0, &logits, &y);
    let b = run(gpu, s, 0.1, 100.0, &logits, &y);
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&a.0), bits(&b.0), "losses differ between runs");
    assert_eq!(bits(&a.1), bits(&b.1), "loss differs between runs");
    assert_eq!(bits(&a.2), bits(&b.2), "dlogits differ between runs");
}

fn cross_entropy_rejects_bad_arguments() {
    let gpu = gpu();
    let s = CrossEntropyShape { m: 2, k: 3 }; // logits 6, labels 2
    let bufs: Vec<wgpu::Buffer> =
        [1, 2, 3, 6].iter().map(|&n| gpu.buffer("t", n).unwrap()).collect();
    let [b1, b2, b3, b6] = [0, 1, 2, 3].map(|i| Slice::whole(&bufs[i]));
    let mut enc = gpu.encoder();
    let e = &mut enc;
    let fwd = |e: &mut Encoder, s: &CrossEntropyShape, eps, z, y, ls| {
        k::cross_entropy_forward(gpu, e, s, eps, z, y, ls)
    };
    let cases = [
        ("cross_entropy_forward", "logits", fwd(e, &s, 0.1, b3, b2, b2), "expected 6 (m*k)"),
        ("cross_entropy_forward", "labels", fwd(e, &s, 0.1, b6, b3, b2), "expected 2 (m)"),
        ("cross_entropy_forward", "losses", fwd(e, &s, 0.1, b6, b2, b1), "expected 2 (m)"),
        (
            "cross_entropy_forward",
            "m",
            fwd(e, &CrossEntropyShape { m: 0, ..s }, 0.1, b6, b2, b2),
            "is 0",
        ),
        (
            "cross_entropy_forward",
            "k",
            fwd(e, &CrossEntropyShape { k: 0, ..s }, 0.1, b6, b2, b2),
            "is 0",
        ),
        ("cross_entropy_forward", "smoothing", fwd(e, &s, 1.0, b6, b2, b2), "0 <= smoothing < 1"),
        ("cross_entropy_forward", "smoothing", fwd(e, &s, -0.1, b6, b2, b2), "0 <= smoothing < 1"),
        (
            "cross_entropy_forward",
            "smoothing",
            fwd(e, &s, f32::NAN, b6, b2, b2),
            "0 <= smoothing < 1",
        ),
        (
            "cross_entropy_backward",
            "dlogits",
            k::cross_entropy_backward(gpu, e, &s, 0.1, 2.0, b6, b2, b3),
            "expected 6 (m*k)",
        ),
        (
            "cross_entropy_backward",
            "logits",
            k::cross_entropy_backward(gpu, e, &s, 0.1, 2.0, b2, b2, b6),
            "expected 6 (m*k)",
        ),
        (
            "cross_entropy_backward",
            "labels",
            k::cross_entropy_backward(gpu, e, &s, 0.1, 2.0, b6, b1, b6),
            "expected 2 (m)",
        ),
        (
            "cross_entropy_backward",
            "m",
            k::cross_entropy_backward(
                gpu,
                e,
                &CrossEntropyShape { m: 0, ..s },
                0.1,
                2.0,
                b6,
                b2,
                b6,
            ),
            "is 0",
        ),
        (
            "cross_entropy_backward",
            "divisor",
            k::cross_entropy_backward(gpu, e, &s, 0.1, -1.0, b6, b2, b6),
            "finite value > 0",
        ),
        (
            "cross_entropy_backward",
            "smoothing",
            k::cross_entropy_backward(gpu, e, &s, 1.5, 2.0, b6, b2, b6),
            "0 <= smoothing < 1",
        ),
    ];
    assert_arg_errors(cases);
}

fn cross_entropy_backward_refuses_a_binding_over_the_device_limit() {
    let gpu = gpu_with_binding_limit(1 << 20);
    let s = CrossEntropyShape { m: 1, k: (1 << 18) + 1 };
    let (z, y, dz) = (
        gpu.buffer("logits", s.logits_len()).unwrap(),
        gpu.buffer("labels", 1).unwrap(),
        gpu.buffer("dlogits", s.logits_len()).unwrap(),
    );
    let mut enc = gpu.encoder();
    let msg = k::cross_entropy_backward(
        &gpu,
        &mut enc,
        &s,
        0.1,
        1.0,
        Slice::whole(&z),
        Slice::whole(&y),
        Slice::whole(&dz),
    )
    .unwrap_err()
    .to_string();
    assert!(
        msg.contains("cross_entropy_backward")
            && msg.contains("`logits`")
            && msg.contains("max_storage_buffer_binding_size"),
        "{msg}"
    );
}

tests![
    cross_entropy_forward_and_backward_match_reference,
    cross_entropy_marks_an_out_of_range_label_with_nan,
    cross_entropy_forward_is_deterministic,
    cross_entropy_rejects_bad_arguments,
    cross_entropy_backward_refuses_a_binding_over_the_device_limit,
];
