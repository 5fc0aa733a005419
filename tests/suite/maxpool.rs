use crate::common::*;
use syncstep::gpu::{Encoder, Gpu, Slice};
use syncstep::kernels::maxpool::{self as k, MaxPoolShape};
use syncstep::kernels::KernelError;
use syncstep::reference::maxpool::{self as r, Pool};

fn pool(s: &MaxPoolShape) -> Pool {
    let u = |v: u32| v as usize;
    Pool {
        n: u(s.n),
        c: u(s.c),
        h: u(s.h),
        w: u(s.w),
        k: u(s.k),
        stride: u(s.stride),
        pad: u(s.pad),
    }
}

fn resnet_pool(n: u32, c: u32, h: u32, w: u32) -> MaxPoolShape {
    MaxPoolShape { n, c, h, w, k: 3, stride: 2, pad: 1 }
}

fn read_u32(gpu: &Gpu, b: &wgpu::Buffer) -> Vec<u32> {
    pollster::block_on(gpu.read::<u32>(Slice::whole(b))).unwrap()
}

/// A u32 buffer filled with a value no argmax can hold, so an unwritten element shows up.
fn poisoned_u32(gpu: &Gpu, len: usize) -> wgpu::Buffer {
    gpu.upload("argmax", &vec![u32::MAX; len]).unwrap()
}

/// dx as the backward must sum it in f32: each window's dy onto the cell it names, the windows
/// of a plane rows, then columns, ascending, onto +0.
fn backward_in_window_order(shape: &MaxPoolShape, dy: &[f32], argmax: &[u32]) -> Vec<f32> {
    let plane_in = shape.h as usize * shape.w as usize;
    let plane_out = shape.out_h() as usize * shape.out_w() as usize;
    let mut dx = vec![0.0f32; shape.input_len() as usize];
    for (o, (&d, &at)) in dy.iter().zip(argmax).enumerate() {
        dx[o / plane_out * plane_in + at as usize] += d;
    }
    dx
}

/// Runs forward, forward_with_argmax (with the saved argmax) and backward on `x`, and checks
/// each against the reference: argmax exactly, y and dx to 1e-5, the replayed y bitwise, and
/// dx bitwise the sums in window order.
fn check_against_reference(gpu: &Gpu, shape: MaxPoolShape, x: &[f32], seed: u64) {
    let (in_len, out_len) = (shape.input_len() as usize, shape.output_len() as usize);
    // Magnitudes over a range, so that sums of a few dy round, and their order shows in dx's bits.
    let dy: Vec<f32> = uniform(seed, out_len)
        .iter()
        .zip(uniform_in(seed + 1, out_len, -6.0, 6.0))
        .map(|(v, e)| v * e.exp2())
        .collect();
    let (bx, bdy) = (gpu.upload("x", x).unwrap(), gpu.upload("dy", &dy).unwrap());
    let (y, argmax, replay, dx) = (
        poisoned(gpu, "y", out_len),
        poisoned_u32(gpu, out_len),
        poisoned(gpu, "replay", out_len),
        poisoned(gpu, "dx", in_len),
    );
    let s = Slice::whole;
    let mut enc = gpu.encoder();
    k::maxpool_forward(gpu, &mut enc, &shape, s(&bx), s(&y), s(&argmax)).unwrap();
    k::maxpool_forward_with_argmax(gpu, &mut enc, &shape, s(&bx), s(&argmax), s(&replay)).unwrap();
    k::maxpool_backward(gpu, &mut enc, &shape, s(&bdy), s(&argmax), s(&dx)).unwrap();
    submit(gpu, enc);

    let (ry, rargmax) = r::maxpool_forward(&to_f64(x), pool(&shape));
    let gpu_argmax = read_u32(gpu, &argmax);
    let first_diff = gpu_argmax.iter().zip(&rargmax).position(|(a, b)| a != b);
    assert_eq!(first_diff, None, "{shape:?}: argmax differs from the reference");
    let gpu_y = read(gpu, &y);
    assert_close(&format!("{shape:?} y"), &gpu_y, &ry, 1e-5);
    assert_eq!(read(gpu, &replay), gpu_y, "{shape:?}: y replayed from the saved argmax");
    assert_close(
        &format!("{shape:?} dx"),
        &read(gpu, &dx),
        &r::maxpool_backward(&to_f64(&dy), pool(&shape), &rargmax),
        1e-5,
    );
    assert_eq!(
        bits(&read(gpu, &dx)),
        bits(&backward_in_window_order(&shape, &dy, &gpu_argmax)),
        "{shape:?}: dx is not summed in window order"
    );
}

fn forward_argmax_and_backward_match_reference() {
    let gpu = gpu();
    let shapes = [
        resnet_pool(8, 64, 16, 16), // ResNet-34's pool at 32×32 input
        resnet_pool(1, 4, 70, 70),  // rows of three chunks, the last ragged
        resnet_pool(1, 64, 7, 7),
        resnet_pool(1, 3, 5, 9),
        resnet_pool(2, 5, 1, 1),
        // Other windows: overlapping (a cell in up to 9 windows), non-overlapping, wide padding.
        MaxPoolShape { n: 1, c: 4, h: 6, w: 5, k: 3, stride: 1, pad: 1 },
        MaxPoolShape { n: 1, c: 2, h: 4, w: 65, k: 3, stride: 1, pad: 1 },
        MaxPoolShape { n: 2, c: 3, h: 7, w: 8, k: 2, stride: 2, pad: 0 },
        MaxPoolShape { n: 1, c: 2, h: 9, w: 7, k: 5, stride: 3, pad: 2 },
    ];
    for (i, shape) in shapes.into_iter().enumerate() {
        let x = uniform(10 + i as u64, shape.input_len() as usize);
        check_against_reference(gpu, shape, &x, 100 + i as u64);
    }
}

/// The pool after a ReLU, its backward gated by the pool's output (what the step runs, keeping
/// no ReLU output): bitwise the plain backward masked by the ReLU's output > 0, and the f64
/// reference's. Half the ReLU's outputs are 0, so many windows hold only zeros (their maximum
/// is 0, and the cell they name gets nothing) and many cells are named by several windows.
fn relu_backward_through_the_pool_output_is_the_masked_backward() {
    let gpu = gpu();
    let shapes = [
        resnet_pool(4, 16, 16, 16),
        resnet_pool(2, 3, 7, 9),
        MaxPoolShape { n: 1, c: 4, h: 6, w: 5, k: 3, stride: 1, pad: 1 },
    ];
    for (i, shape) in shapes.into_iter().enumerate() {
        let (in_len, out_len) = (shape.input_len() as usize, shape.output_len() as usize);
        let r: Vec<f32> = uniform(30 + i as u64, in_len).iter().map(|v| v.max(0.0)).collect();
        let dy = uniform(40 + i as u64, out_len);
        let (br, bdy) = (gpu.upload("r", &r).unwrap(), gpu.upload("dy", &dy).unwrap());
        let (y, argmax) = (poisoned(gpu, "y", out_len), poisoned_u32(gpu, out_len));
        let (plain, gated) = (poisoned(gpu, "plain", in_len), poisoned(gpu, "gated", in_len));
        let s = Slice::whole;
        let mut enc = gpu.encoder();
        k::maxpool_forward(gpu, &mut enc, &shape, s(&br), s(&y), s(&argmax)).unwrap();
        k::maxpool_backward(gpu, &mut enc, &shape, s(&bdy), s(&argmax), s(&plain)).unwrap();
        k::maxpool_relu_backward(gpu, &mut enc, &shape, s(&bdy), s(&argmax), s(&y), s(&gated))
            .unwrap();
        submit(gpu, enc);

        let gate = |v: &[f32]| -> Vec<f32> {
            v.iter().zip(&r).map(|(&d, &r)| if r > 0.0 { d } else { 0.0 }).collect()
        };
        let gated = read(gpu, &gated);
        assert_eq!(bits(&gated), bits(&gate(&read(gpu, &plain))), "{shape:?}");
        assert!(gated.iter().any(|&d| d != 0.0), "{shape:?}: some cotangent passes");
        let (_, rargmax) = r::maxpool_forward(&to_f64(&r), pool(&shape));
        let want = r::maxpool_backward(&to_f64(&dy), pool(&shape), &rargmax);
        let want: Vec<f64> =
            want.iter().zip(&r).map(|(&d, &r)| if r > 0.0 { d } else { 0.0 }).collect();
        assert_close(&format!("{shape:?} dx"), &gated, &want, 1e-5);
    }
}

fn ties_choose_the_first_maximum_in_scan_order() {
    let gpu = gpu();
    // Integer values in {-2, …, 1}: most windows hold a tie, and all-negative windows next to
    // the padding check that padding is never chosen.
    for (i, shape) in [
        resnet_pool(2, 64, 9, 9),
        resnet_pool(1, 8, 40, 67),
        MaxPoolShape { n: 1, c: 8, h: 7, w: 6, k: 3, stride: 1, pad: 1 },
        MaxPoolShape { n: 1, c: 8, h: 5, w: 70, k: 3, stride: 1, pad: 1 },
    ]
    .into_iter()
    .enumerate()
    {
        let x: Vec<f32> = uniform_in(20 + i as u64, shape.input_len() as usize, -2.0, 2.0)
            .iter()
            .map(|v| v.floor())
            .collect();
        check_against_reference(gpu, shape, &x, 200 + i as u64);
    }
}

/// Peaks every third row and column, above noise: every window holds one peak and names it, so
/// a peak gets the dy of up to k·k windows (4 of ResNet's, 9 at stride 1), and only the window
/// order gives dx's bits.
fn a_cell_named_by_many_windows_sums_them_in_window_order() {
    let gpu = gpu();
    let shapes = [
        resnet_pool(2, 4, 40, 70),
        MaxPoolShape { n: 1, c: 3, h: 10, w: 70, k: 3, stride: 1, pad: 1 },
    ];
    for (i, shape) in shapes.into_iter().enumerate() {
        let noise = uniform_in(50 + i as u64, shape.input_len() as usize, 0.0, 0.5);
        let w = shape.w as usize;
        let x: Vec<f32> = noise
            .iter()
            .enumerate()
            .map(|(at, &v)| {
                let (row, col) = (at / w % shape.h as usize, at % w);
                if row % 3 == 1 && col % 3 == 1 {
                    10.0 + v
                } else {
                    v
                }
            })
            .collect();
        check_against_reference(gpu, shape, &x, 300 + i as u64);
    }
}

fn forward_with_argmax_imposes_another_runs_choices() {
    let gpu = gpu();
    let shape = resnet_pool(2, 64, 7, 7);
    let (in_len, out_len) = (shape.input_len() as usize, shape.output_len() as usize);
    let (x, other) = (uniform(30, in_len), uniform(31, in_len));
    let (_, other_argmax) = r::maxpool_forward(&to_f64(&other), pool(&shape));
    let (bx, bargmax) =
        (gpu.upload("x", &x).unwrap(), gpu.upload("argmax", &other_argmax).unwrap());
    let y = poisoned(gpu, "y", out_len);
    let mut enc = gpu.encoder();
    k::maxpool_forward_with_argmax(
        gpu,
        &mut enc,
        &shape,
        Slice::whole(&bx),
        Slice::whole(&bargmax),
        Slice::whole(&y),
    )
    .unwrap();
    submit(gpu, enc);
    let expected = r::maxpool_forward_with_argmax(&to_f64(&x), pool(&shape), &other_argmax);
    assert_close("y at another run's argmax", &read(gpu, &y), &expected, 0.0);
    assert_ne!(
        expected,
        r::maxpool_forward(&to_f64(&x), pool(&shape)).0,
        "the imposed argmax must differ from x's own"
    );
}

fn launchers_reject_wrong_lengths_and_bad_shapes() {
    let gpu = gpu();
    let shape = resnet_pool(1, 2, 5, 5); // out 3×3
    let (x, out, argmax) = (
        gpu.buffer("x", 50).unwrap(),
        gpu.buffer("out", 18).unwrap(),
        gpu.buffer("argmax", 18).unwrap(),
    );
    let short = gpu.buffer("short", 17).unwrap();
    let s = Slice::whole;
    type Launch =
        fn(&Gpu, &mut Encoder, &MaxPoolShape, Slice, Slice, Slice) -> syncstep::kernels::Result<()>;
    let launchers: [(&str, Launch, [&wgpu::Buffer; 3], usize, &str); 3] = [
        ("maxpool_forward", k::maxpool_forward, [&x, &out, &argmax], 1, "y"),
        (
            "maxpool_forward_with_argmax",
            k::maxpool_forward_with_argmax,
            [&x, &argmax, &out],
            1,
            "argmax",
        ),
        ("maxpool_backward", k::maxpool_backward, [&out, &argmax, &x], 0, "dy"),
    ];
    let expect = |res: syncstep::kernels::Result<()>, op: &str, arg: &str, needle: &str| {
        let err = res.unwrap_err();
        let msg = err.to_string();
        assert!(
            matches!(err, KernelError::Arg { op: o, arg: a, .. } if o == op && a == arg),
            "{msg}"
        );
        assert!(msg.contains(needle), "{msg}");
    };
    for (op, launch, bufs, short_at, short_arg) in launchers {
        let mut enc = gpu.encoder();
        let mut args = bufs.map(s);
        launch(gpu, &mut enc, &shape, args[0], args[1], args[2]).unwrap();
        args[short_at] = s(&short);
        expect(
            launch(gpu, &mut enc, &shape, args[0], args[1], args[2]),
            op,
            short_arg,
            "expected 18 (n·c·out_h·out_w)",
        );
        let args = bufs.map(s);
        let zero = MaxPoolShape { h: 0, ..shape };
        expect(launch(gpu, &mut enc, &zero, args[0], args[1], args[2]), op, "shape.h", "is 0");
        let blind = MaxPoolShape { k: 1, pad: 1, ..shape };
        expect(
            launch(gpu, &mut enc, &blind, args[0], args[1], args[2]),
            op,
            "shape.pad",
            "expected less than k = 1",
        );
        let too_wide = MaxPoolShape { k: 8, pad: 1, ..shape };
        expect(
            launch(gpu, &mut enc, &too_wide, args[0], args[1], args[2]),
            op,
            "shape.k",
            "expected at most",
        );
    }
}

/// An invocation loops over a row: on llvmpipe, whose loop limiter would cut a very long row
/// short, such rows are refused with the reason; elsewhere they run.
fn rows_past_llvmpipes_loop_limit_are_refused_there() {
    let gpu = gpu();
    let shape = MaxPoolShape { n: 1, c: 1, h: 2, w: 20000, k: 3, stride: 1, pad: 1 };
    let len = shape.input_len();
    let (x, y, argmax) = (
        gpu.buffer("x", len).unwrap(),
        gpu.buffer("y", len).unwrap(),
        gpu.buffer("argmax", len).unwrap(),
    );
    let s = Slice::whole;
    let mut enc = gpu.encoder();
    let results = [
        k::maxpool_forward(gpu, &mut enc, &shape, s(&x), s(&y), s(&argmax)),
        k::maxpool_backward(gpu, &mut enc, &shape, s(&y), s(&argmax), s(&x)),
    ];
    for result in results {
        if gpu.info.name.contains("llvmpipe") {
            let msg = result.unwrap_err().to_string();
            assert!(
                msg.contains("shape.w") && msg.contains("llvmpipe stops loops after 65535"),
                "{msg}"
            );
        } else {
            result.unwrap();
        }
    }
}

fn maxpool_forward_refuses_a_binding_over_the_device_limit() {
    let gpu = gpu_with_binding_limit(1 << 20);
    let shape = resnet_pool(1, 1, 512, 513); // x is just over 1 MiB
    let x = gpu.buffer("x", shape.input_len()).unwrap();
    let (y, argmax) = (
        gpu.buffer("y", shape.output_len()).unwrap(),
        gpu.buffer("argmax", shape.output_len()).unwrap(),
    );
    let mut enc = gpu.encoder();
    let msg = k::maxpool_forward(
        &gpu,
        &mut enc,
        &shape,
        Slice::whole(&x),
        Slice::whole(&y),
        Slice::whole(&argmax),
    )
    .unwrap_err()
    .to_string();
    assert!(
        msg.contains("maxpool_forward")
            && msg.contains("`x`")
            && msg.contains("max_storage_buffer_binding_size"),
        "{msg}"
    );
}

tests![
    forward_argmax_and_backward_match_reference,
    relu_backward_through_the_pool_output_is_the_masked_backward,
    ties_choose_the_first_maximum_in_scan_order,
    a_cell_named_by_many_windows_sums_them_in_window_order,
    forward_with_argmax_imposes_another_runs_choices,
    launchers_reject_wrong_lengths_and_bad_shapes,
    rows_past_llvmpipes_loop_limit_are_refused_there,
    maxpool_forward_refuses_a_binding_over_the_device_limit,
];
