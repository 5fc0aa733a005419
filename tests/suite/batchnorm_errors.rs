//! BatchNorm's launchers refuse what they cannot run, before any work: wrong lengths, zero
//! dimensions, bad counts, bindings over the device's limit; and the kernels with the most
//! bindings fit WebGPU's default limit.

use crate::common::*;
use syncstep::gpu::{Encoder, Slice};
use syncstep::kernels::batchnorm::{self as k, BnShape};
use syncstep::kernels::KernelError;

const EPS: f32 = 1e-5;
const MOMENTUM: f32 = 0.1;

fn fused_launchers_reject_wrong_lengths() {
    let gpu = gpu();
    let shape = BnShape { n: 2, c: 3, hw: 5 };
    let b = |len| gpu.buffer("b", len).unwrap();
    let (x, out, dy, dx, stats, sums, gamma, beta, rows, short) =
        (b(30), b(30), b(30), b(30), b(6), b(6), b(3), b(3), b(12), b(29));
    let s = Slice::whole;
    let mut enc = gpu.encoder();
    let e = &mut enc;
    let apply = |e: &mut Encoder, shortcut, gate, out| {
        k::bn_apply_relu(
            gpu,
            e,
            &shape,
            10,
            EPS,
            s(&x),
            s(&stats),
            s(&gamma),
            s(&beta),
            shortcut,
            gate,
            out,
        )
    };
    apply(e, Some(s(&dy)), Some(s(&dx)), s(&out)).unwrap();
    let sums_of = |e: &mut Encoder, gate| {
        k::bn_example_sums(gpu, e, &shape, 10, EPS, s(&dy), gate, s(&x), s(&stats), s(&rows))
    };
    let input_of = |e: &mut Encoder, gate| {
        k::bn_backward_input(
            gpu,
            e,
            &shape,
            10,
            EPS,
            s(&dy),
            gate,
            s(&x),
            s(&stats),
            s(&gamma),
            s(&sums),
            k::BnDx::Into(s(&dx)),
        )
    };
    sums_of(e, Some(s(&out))).unwrap();
    input_of(e, Some(s(&out))).unwrap();
    assert_arg_errors([
        (
            "bn_apply_relu",
            "shortcut",
            apply(e, Some(s(&short)), None, s(&out)),
            "expected 30 (n·c·hw)",
        ),
        ("bn_apply_relu", "gate", apply(e, None, Some(s(&short)), s(&out)), "expected 30 (n·c·hw)"),
        ("bn_apply_relu", "out", apply(e, None, None, s(&short)), "expected 30 (n·c·hw)"),
        ("bn_example_sums", "gate", sums_of(e, Some(s(&short))), "expected 30 (n·c·hw)"),
        ("bn_backward_input", "gate", input_of(e, Some(s(&short))), "expected 30 (n·c·hw)"),
    ]);
}

/// The kernels with the most bindings (7) launch on a device held to WebGPU's default of 8
/// storage buffers per shader stage (browsers' SwiftShader allows 10).
fn fused_kernels_fit_webgpus_default_storage_buffer_count() {
    let gpu = gpu_with_limits(|l| l.max_storage_buffers_per_shader_stage = 8);
    let shape = BnShape { n: 2, c: 3, hw: 5 };
    let b = |len| gpu.buffer("b", len).unwrap();
    let (x, shortcut, gate, out, dy, dx, stats, sums, gamma, beta, rows) =
        (b(30), b(30), b(30), b(30), b(30), b(30), b(6), b(6), b(3), b(3), b(12));
    let s = Slice::whole;
    let mut enc = gpu.encoder();
    k::bn_apply_relu(
        &gpu,
        &mut enc,
        &shape,
        10,
        EPS,
        s(&x),
        s(&stats),
        s(&gamma),
        s(&beta),
        Some(s(&shortcut)),
        Some(s(&gate)),
        s(&out),
    )
    .unwrap();
    k::bn_example_sums(
        &gpu,
        &mut enc,
        &shape,
        10,
        EPS,
        s(&dy),
        Some(s(&gate)),
        s(&x),
        s(&stats),
        s(&rows),
    )
    .unwrap();
    k::bn_backward_input(
        &gpu,
        &mut enc,
        &shape,
        10,
        EPS,
        s(&dy),
        Some(s(&gate)),
        s(&x),
        s(&stats),
        s(&gamma),
        s(&sums),
        k::BnDx::Into(s(&dx)),
    )
    .unwrap();
    submit(&gpu, enc);
}

#[track_caller]
fn expect_arg(res: syncstep::kernels::Result<()>, op: &str, arg: &str, needle: &str) {
    let err = res.unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, KernelError::Arg { op: o, arg: a, .. } if o == op && a == arg), "{msg}");
    assert!(msg.contains(needle), "{msg}");
}

fn launchers_reject_wrong_lengths_zero_dimensions_and_bad_counts() {
    let gpu = gpu();
    let shape = BnShape { n: 2, c: 3, hw: 5 };
    let zero = BnShape { hw: 0, ..shape };
    let b = |len| gpu.buffer("b", len).unwrap();
    // Distinct buffers everywhere, so the valid launches are valid dispatches too.
    let (x, y, dy, dx, stats, sums, gamma, beta, run_mean, run_var, short) =
        (b(30), b(30), b(30), b(30), b(6), b(6), b(3), b(3), b(3), b(3), b(5));
    let (rows, rows2) = (b(12), b(12));
    let s = Slice::whole;
    let mut enc = gpu.encoder();
    let e = &mut enc;

    k::bn_example_stats(gpu, e, &shape, s(&x), s(&rows)).unwrap();
    expect_arg(
        k::bn_example_stats(gpu, e, &shape, s(&x), s(&stats)),
        "bn_example_stats",
        "rows",
        "expected 12 (n·2·c",
    );
    expect_arg(
        k::bn_example_stats(gpu, e, &zero, s(&x), s(&rows)),
        "bn_example_stats",
        "shape.hw",
        "is 0",
    );
    k::bn_stats(gpu, e, &shape, s(&x), k::Rows::Take(s(&rows)), s(&stats), None).unwrap();
    expect_arg(
        k::bn_stats(gpu, e, &shape, s(&x), k::Rows::Given(s(&rows)), s(&short), None),
        "bn_stats",
        "stats",
        "expected 6 (2·c",
    );
    expect_arg(
        k::bn_stats(gpu, e, &shape, s(&short), k::Rows::Take(s(&rows)), s(&stats), None),
        "bn_stats",
        "x",
        "expected 30 (n·c·hw)",
    );

    let apply = |e: &mut Encoder, shape: &BnShape, count, g| {
        k::bn_forward_apply(gpu, e, shape, count, EPS, s(&x), s(&stats), g, s(&beta), s(&y))
    };
    apply(e, &shape, 10, s(&gamma)).unwrap();
    expect_arg(apply(e, &shape, 10, s(&short)), "bn_forward_apply", "gamma", "expected 3 (c)");
    expect_arg(apply(e, &zero, 10, s(&gamma)), "bn_forward_apply", "shape.hw", "is 0");
    expect_arg(
        apply(e, &shape, 9, s(&gamma)),
        "bn_forward_apply",
        "count",
        "expected at least n·hw = 10",
    );

    let example_sums = |e: &mut Encoder, shape: &BnShape, count, d| {
        k::bn_example_sums(gpu, e, shape, count, EPS, d, None, s(&x), s(&stats), s(&rows2))
    };
    example_sums(e, &shape, 20, s(&dy)).unwrap();
    expect_arg(
        example_sums(e, &shape, 20, s(&short)),
        "bn_example_sums",
        "dy",
        "expected 30 (n·c·hw)",
    );
    expect_arg(example_sums(e, &zero, 20, s(&dy)), "bn_example_sums", "shape.hw", "is 0");
    expect_arg(example_sums(e, &shape, 1, s(&dy)), "bn_example_sums", "count", "expected at least");
    let sums_of = |e: &mut Encoder, rows| {
        k::bn_sums(gpu, e, &shape, 20, EPS, s(&dy), None, s(&x), s(&stats), rows, s(&sums))
    };
    sums_of(e, k::Rows::Given(s(&rows2))).unwrap();
    sums_of(e, k::Rows::Take(s(&rows2))).unwrap();
    expect_arg(sums_of(e, k::Rows::Given(s(&short))), "bn_sums", "rows", "expected 12 (n·2·c");

    let input = |e: &mut Encoder, shape: &BnShape, count, sm| {
        k::bn_backward_input(
            gpu,
            e,
            shape,
            count,
            EPS,
            s(&dy),
            None,
            s(&x),
            s(&stats),
            s(&gamma),
            sm,
            k::BnDx::Into(s(&dx)),
        )
    };
    input(e, &shape, 10, s(&sums)).unwrap();
    expect_arg(
        input(e, &shape, 10, s(&short)),
        "bn_backward_input",
        "sums",
        "expected 6 (2·c: [Σdy | Σdy·x̂])",
    );
    expect_arg(input(e, &zero, 10, s(&sums)), "bn_backward_input", "shape.hw", "is 0");
    expect_arg(input(e, &shape, 0, s(&sums)), "bn_backward_input", "count", "expected at least");

    // The merge with the running statistics: one position per channel has no unbiased variance.
    let merge_running = |e: &mut Encoder, shape: &BnShape, rows, var| {
        let running = k::Running { momentum: MOMENTUM, mean: s(&run_mean), var };
        k::bn_stats(gpu, e, shape, s(&x), k::Rows::Given(rows), s(&stats), Some(running))
    };
    merge_running(e, &shape, s(&rows), s(&run_var)).unwrap();
    expect_arg(
        merge_running(e, &shape, s(&rows), s(&short)),
        "bn_stats",
        "running_var",
        "expected 3 (c)",
    );
    let one = BnShape { n: 1, hw: 1, ..shape };
    let one_row = b(6);
    k::bn_stats(gpu, e, &one, s(&x), k::Rows::Given(s(&one_row)), s(&stats), None).unwrap();
    expect_arg(
        merge_running(e, &one, s(&one_row), s(&run_var)),
        "bn_stats",
        "shape",
        "n·hw is 1, expected 2",
    );
}

fn bn_forward_apply_refuses_a_binding_over_the_device_limit() {
    let gpu = gpu_with_binding_limit(1 << 20);
    let shape = BnShape { n: 1, c: 1, hw: (1 << 20) / 4 + 1 };
    let x = gpu.buffer("x", shape.tensor_len()).unwrap();
    let (stats, per_c) = (gpu.buffer("stats", 2).unwrap(), gpu.buffer("per_c", 1).unwrap());
    let s = Slice::whole;
    let mut enc = gpu.encoder();
    let count = shape.positions() as u32;
    let msg = k::bn_forward_apply(
        &gpu,
        &mut enc,
        &shape,
        count,
        EPS,
        s(&x),
        s(&stats),
        s(&per_c),
        s(&per_c),
        s(&x),
    )
    .unwrap_err()
    .to_string();
    assert!(
        msg.contains("bn_forward_apply")
            && msg.contains("`x`")
            && msg.contains("max_storage_buffer_binding_size"),
        "{msg}"
    );
}

tests![
    fused_launchers_reject_wrong_lengths,
    fused_kernels_fit_webgpus_default_storage_buffer_count,
    launchers_reject_wrong_lengths_zero_dimensions_and_bad_counts,
    bn_forward_apply_refuses_a_binding_over_the_device_limit,
];
