use crate::common::*;
use syncstep::gpu::Slice;
use syncstep::kernels::{elementwise as k, KernelError};
use syncstep::reference::elementwise as r;

fn relu_forward_backward_and_add_match_reference() {
    let gpu = gpu();
    // Not a multiple of the workgroup size, and a gate different from x to exercise the mask.
    for &len in &[1usize, 1000, 70_001] {
        let x = uniform(1, len);
        let gate = uniform(2, len);
        let dy = uniform(3, len);
        let (bx, bg, bdy) = (
            gpu.upload("x", &x).unwrap(),
            gpu.upload("g", &gate).unwrap(),
            gpu.upload("dy", &dy).unwrap(),
        );
        let (y, dx, sum) =
            (poisoned(gpu, "y", len), poisoned(gpu, "dx", len), poisoned(gpu, "sum", len));
        let mut enc = gpu.encoder();
        let s = Slice::whole;
        k::relu_forward(gpu, &mut enc, s(&bx), s(&bg), s(&y)).unwrap();
        k::relu_backward(gpu, &mut enc, s(&bdy), s(&bg), s(&dx)).unwrap();
        k::add(gpu, &mut enc, s(&bx), s(&bdy), s(&sum)).unwrap();
        submit(gpu, enc);
        let (x64, g64, dy64) = (to_f64(&x), to_f64(&gate), to_f64(&dy));
        assert_close("relu_forward", &read(gpu, &y), &r::relu_forward(&x64, &g64), 1e-7);
        assert_close("relu_backward", &read(gpu, &dx), &r::relu_backward(&dy64, &g64), 1e-7);
        assert_close("add", &read(gpu, &sum), &r::add(&x64, &dy64), 1e-7);
    }
}

/// add_relu_backward against the reference and, bit for bit, against relu_backward then add.
fn add_relu_backward_is_relu_backward_then_add_bitwise_and_matches_reference() {
    let gpu = gpu();
    for &len in &[1usize, 1000, 70_001] {
        let (a, dy, gate) = (uniform(4, len), uniform(5, len), uniform(6, len));
        let (ba, bdy, bg) = (
            gpu.upload("a", &a).unwrap(),
            gpu.upload("dy", &dy).unwrap(),
            gpu.upload("g", &gate).unwrap(),
        );
        let (fused, masked, unfused) = (
            poisoned(gpu, "fused", len),
            poisoned(gpu, "masked", len),
            poisoned(gpu, "unfused", len),
        );
        let mut enc = gpu.encoder();
        let s = Slice::whole;
        k::add_relu_backward(gpu, &mut enc, s(&ba), s(&bdy), s(&bg), s(&fused)).unwrap();
        k::relu_backward(gpu, &mut enc, s(&bdy), s(&bg), s(&masked)).unwrap();
        k::add(gpu, &mut enc, s(&ba), s(&masked), s(&unfused)).unwrap();
        submit(gpu, enc);
        let out = read(gpu, &fused);
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&out), bits(&read(gpu, &unfused)), "len {len}");
        assert_close(
            "add_relu_backward",
            &out,
            &r::add_relu_backward(&to_f64(&a), &to_f64(&dy), &to_f64(&gate)),
            1e-7,
        );
    }
    let (a, b) = (gpu.buffer("a", 10).unwrap(), gpu.buffer("b", 9).unwrap());
    let mut enc = gpu.encoder();
    let s = Slice::whole;
    assert_arg_errors([
        (
            "add_relu_backward",
            "gate",
            k::add_relu_backward(gpu, &mut enc, s(&a), s(&a), s(&b), s(&a)),
            "expected 10",
        ),
        (
            "add_relu_backward",
            "dy",
            k::add_relu_backward(gpu, &mut enc, s(&a), s(&b), s(&a), s(&a)),
            "expected 10",
        ),
    ]);
}

fn relu_forward_rejects_mismatched_lengths() {
    let gpu = gpu();
    let a = gpu.buffer("a", 10).unwrap();
    let b = gpu.buffer("b", 9).unwrap();
    let mut enc = gpu.encoder();
    let err = k::relu_forward(gpu, &mut enc, Slice::whole(&a), Slice::whole(&b), Slice::whole(&a))
        .unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, KernelError::Arg { op: "relu_forward", arg: "gate", .. }), "{msg}");
    assert!(msg.contains("expected 10"), "{msg}");
}

fn add_refuses_a_binding_over_the_device_limit() {
    let gpu = gpu_with_binding_limit(1 << 20);
    let len = (1 << 20) / 4 + 1;
    let (a, b, c) = (
        gpu.buffer("a", len).unwrap(),
        gpu.buffer("b", len).unwrap(),
        gpu.buffer("c", len).unwrap(),
    );
    let mut enc = gpu.encoder();
    let msg = k::add(&gpu, &mut enc, Slice::whole(&a), Slice::whole(&b), Slice::whole(&c))
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("add")
            && msg.contains("`a`")
            && msg.contains("max_storage_buffer_binding_size"),
        "{msg}"
    );
}

tests![
    relu_forward_backward_and_add_match_reference,
    add_relu_backward_is_relu_backward_then_add_bitwise_and_matches_reference,
    relu_forward_rejects_mismatched_lengths,
    add_refuses_a_binding_over_the_device_limit,
];
