use crate::common::*;
use syncstep::gpu::Slice;
use syncstep::kernels::avgpool::{self as k, AvgPoolShape};
use syncstep::reference::avgpool as r;

/// A GPU output beside the reference's.
type Outcome = (Vec<f32>, Vec<f64>);

/// Runs forward and backward on seeded data: (y, dx).
fn run(s: AvgPoolShape, seed: u64) -> (Outcome, Outcome) {
    let gpu = gpu();
    let (n, c, hw) = (s.n as usize, s.c as usize, s.hw as usize);
    let x = uniform(seed, n * c * hw);
    let dy = uniform(seed + 1, n * c);
    let (bx, bdy) = (gpu.upload("x", &x).unwrap(), gpu.upload("dy", &dy).unwrap());
    let (y, dx) = (poisoned(gpu, "y", n * c), poisoned(gpu, "dx", n * c * hw));
    let mut enc = gpu.encoder();
    k::global_avgpool_forward(gpu, &mut enc, &s, Slice::whole(&bx), Slice::whole(&y)).unwrap();
    k::global_avgpool_backward(gpu, &mut enc, &s, Slice::whole(&bdy), Slice::whole(&dx)).unwrap();
    submit(gpu, enc);
    (
        (read(gpu, &y), r::global_avgpool_forward(n, c, hw, &to_f64(&x))),
        (read(gpu, &dx), r::global_avgpool_backward(n, c, hw, &to_f64(&dy))),
    )
}

fn global_avgpool_forward_and_backward_match_reference() {
    needs_adapter();
    // ResNet-34's channel counts (and the stem's 3); hw = 1 is the head at 32×32 input, 49 at
    // 224×224; plane counts such as 3, 64, 384, 768 are not multiples of the workgroup size.
    let shapes = [(1, 3, 49), (1, 64, 49), (3, 128, 9), (3, 256, 5), (2, 512, 1), (1, 512, 49)];
    for (i, &(n, c, hw)) in shapes.iter().enumerate() {
        let s = AvgPoolShape { n, c, hw };
        let ((y, y_ref), (dx, dx_ref)) = run(s, 10 * i as u64);
        assert_close(&format!("global_avgpool_forward {s:?}"), &y, &y_ref, 1e-5);
        assert_close(&format!("global_avgpool_backward {s:?}"), &dx, &dx_ref, 1e-5);
    }
}

fn global_avgpool_forward_is_deterministic() {
    needs_adapter();
    let s = AvgPoolShape { n: 3, c: 256, hw: 49 };
    let ((a, _), _) = run(s, 7);
    let ((b, _), _) = run(s, 7);
    assert!(a.iter().zip(&b).all(|(a, b)| a.to_bits() == b.to_bits()), "two runs differ");
}

fn global_avgpool_rejects_wrong_lengths_and_zero_dimensions() {
    let gpu = gpu();
    let (b10, b20) = (gpu.buffer("a", 10).unwrap(), gpu.buffer("b", 20).unwrap());
    let (s10, s20) = (Slice::whole(&b10), Slice::whole(&b20));
    let s = AvgPoolShape { n: 2, c: 5, hw: 2 }; // x 20, y 10
    let mut enc = gpu.encoder();
    let cases = [
        (
            "global_avgpool_forward",
            "x",
            k::global_avgpool_forward(gpu, &mut enc, &s, s10, s10),
            "expected 20 (n*c*hw)",
        ),
        (
            "global_avgpool_forward",
            "y",
            k::global_avgpool_forward(gpu, &mut enc, &s, s20, s20),
            "expected 10 (n*c)",
        ),
        (
            "global_avgpool_backward",
            "dy",
            k::global_avgpool_backward(gpu, &mut enc, &s, s20, s20),
            "expected 10 (n*c)",
        ),
        (
            "global_avgpool_backward",
            "dx",
            k::global_avgpool_backward(gpu, &mut enc, &s, s10, s10),
            "expected 20 (n*c*hw)",
        ),
        (
            "global_avgpool_forward",
            "hw",
            k::global_avgpool_forward(gpu, &mut enc, &AvgPoolShape { hw: 0, ..s }, s20, s10),
            "is 0",
        ),
        (
            "global_avgpool_backward",
            "n",
            k::global_avgpool_backward(gpu, &mut enc, &AvgPoolShape { n: 0, ..s }, s10, s20),
            "is 0",
        ),
        (
            "global_avgpool_backward",
            "c",
            k::global_avgpool_backward(gpu, &mut enc, &AvgPoolShape { c: 0, ..s }, s10, s20),
            "is 0",
        ),
    ];
    assert_arg_errors(cases);
}

fn global_avgpool_backward_refuses_a_binding_over_the_device_limit() {
    let gpu = gpu_with_binding_limit(1 << 20);
    // dx is 1 MiB + 4 bytes; dy is small.
    let s = AvgPoolShape { n: 1, c: 1, hw: (1 << 18) + 1 };
    let (dy, dx) = (gpu.buffer("dy", 1).unwrap(), gpu.buffer("dx", s.input_len()).unwrap());
    let mut enc = gpu.encoder();
    let msg = k::global_avgpool_backward(&gpu, &mut enc, &s, Slice::whole(&dy), Slice::whole(&dx))
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("global_avgpool_backward")
            && msg.contains("`dx`")
            && msg.contains("max_storage_buffer_binding_size"),
        "{msg}"
    );
}

tests![
    global_avgpool_forward_and_backward_match_reference,
    global_avgpool_forward_is_deterministic,
    global_avgpool_rejects_wrong_lengths_and_zero_dimensions,
    global_avgpool_backward_refuses_a_binding_over_the_device_limit,
];
