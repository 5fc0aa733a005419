use crate::common::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use syncstep::gpu::{Gpu, Slice};
use syncstep::kernels::sgd::{self as k, SgdParams};
use syncstep::kernels::KernelError;
use syncstep::reference::sgd as r;

/// Gradients with a fixed sign per element (from `signs`) and a magnitude in [0.1, 1), so the
/// velocity never cancels and every element moves by at least lr·0.09 each step.
fn grads(seed: u64, signs: &[f32]) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    signs.iter().map(|s| s.signum() * rng.random_range(0.1f32..1.0)).collect()
}

/// Checks one step element by element: the reference runs in f64 from the GPU's f32 state
/// before the step, and each element must land within ~16 f32 ulps of it.
#[track_caller]
fn assert_step(h: &SgdParams, before: (&[f32], &[f32]), grad: &[f32], after: (&[f32], &[f32])) {
    let (mut p, mut v) = (to_f64(before.0), to_f64(before.1));
    r::sgd_update(
        &mut p,
        &to_f64(grad),
        &mut v,
        h.lr as f64,
        h.momentum as f64,
        h.weight_decay as f64,
    );
    for i in 0..p.len() {
        let (pg, vg) = (after.0[i] as f64, after.1[i] as f64);
        assert!(
            (pg - p[i]).abs() <= 1e-6 * (1.0 + p[i].abs()),
            "param[{i}]: gpu {pg} vs reference {}",
            p[i]
        );
        assert!(
            (vg - v[i]).abs() <= 1e-6 * (1.0 + v[i].abs()),
            "velocity[{i}]: gpu {vg} vs reference {}",
            v[i]
        );
    }
}

fn read_slice(gpu: &Gpu, s: Slice) -> Vec<f32> {
    pollster::block_on(gpu.read_f32(s)).unwrap()
}

fn sgd_update_matches_reference_over_several_steps_on_a_sub_range() {
    let gpu = gpu();
    // A sub-range of a larger flat buffer, as the model binds one tensor: sentinels on both
    // sides must survive. The length is not a multiple of the workgroup size, and the last
    // `zeros` elements are alignment padding (all zero), which must stay zero.
    let (len, zeros) = (70_004usize, 37usize);
    let pad = gpu.limits.min_storage_buffer_offset_alignment as usize / 4;
    let mut p0 = vec![7.0f32; pad];
    p0.extend(uniform(1, len - zeros));
    p0.extend(vec![0.0; zeros]);
    p0.extend(vec![7.0; pad]);
    let signs = uniform(2, len - zeros);
    let (bp, bg, bv) = (
        gpu.upload("param", &p0).unwrap(),
        gpu.buffer("grad", len as u64).unwrap(),
        gpu.buffer("velocity", len as u64).unwrap(),
    );
    let param = Slice::new(&bp, (pad * 4) as u64, len as u64);
    let (grad, velocity) = (Slice::whole(&bg), Slice::whole(&bv));
    let h = SgdParams { lr: 0.1, momentum: 0.9, weight_decay: 1e-2 };
    for step in 0..4 {
        let before = (read_slice(gpu, param), read(gpu, &bv));
        let mut g = grads(10 + step, &signs);
        g.extend(vec![0.0; zeros]);
        gpu.queue.write_buffer(&bg, 0, bytemuck::cast_slice(&g));
        let mut enc = gpu.encoder();
        k::sgd_update(gpu, &mut enc, &h, param, grad, velocity).unwrap();
        submit(gpu, enc);
        let after = (read_slice(gpu, param), read(gpu, &bv));
        assert_step(&h, (&before.0, &before.1), &g, (&after.0, &after.1));
        let moved = (0..len - zeros).filter(|&i| after.0[i] != before.0[i]).count();
        assert_eq!(moved, len - zeros, "step {step}: every parameter must move");
        assert!(
            after.0[len - zeros..].iter().chain(&after.1[len - zeros..]).all(|&x| x == 0.0),
            "padding left zero"
        );
    }
    let whole = read(gpu, &bp);
    assert!(
        whole[..pad].iter().chain(&whole[pad + len..]).all(|&x| x == 7.0),
        "wrote outside its slice"
    );
}

fn sgd_update_covers_a_large_buffer_to_its_last_element() {
    let gpu = gpu();
    // 65535·256 + 1000 elements, ending inside one invocation's run of vec4s: every element up
    // to the last must be updated.
    let len = 65_535 * 256 + 1000;
    let (p, v, signs) = (uniform(1, len), uniform(2, len), uniform(3, len));
    let g = grads(4, &signs);
    let (bp, bg, bv) = (
        gpu.upload("param", &p).unwrap(),
        gpu.upload("grad", &g).unwrap(),
        gpu.upload("velocity", &v).unwrap(),
    );
    let h = SgdParams { lr: 0.05, momentum: 0.9, weight_decay: 5e-4 };
    let mut enc = gpu.encoder();
    k::sgd_update(gpu, &mut enc, &h, Slice::whole(&bp), Slice::whole(&bg), Slice::whole(&bv))
        .unwrap();
    submit(gpu, enc);
    let (p1, v1) = (read(gpu, &bp), read(gpu, &bv));
    for start in (0..len).step_by(1 << 20) {
        let end = (start + (1 << 20)).min(len);
        assert_step(
            &h,
            (&p[start..end], &v[start..end]),
            &g[start..end],
            (&p1[start..end], &v1[start..end]),
        );
    }
}

fn sgd_update_rejects_bad_arguments() {
    let gpu = gpu();
    let (b4, b5) = (gpu.buffer("a", 4).unwrap(), gpu.buffer("b", 5).unwrap());
    let (s4, s5, empty) = (Slice::whole(&b4), Slice::whole(&b5), Slice::new(&b4, 0, 0));
    let h = SgdParams { lr: 0.1, momentum: 0.9, weight_decay: 1e-4 };
    let mut enc = gpu.encoder();
    let e = &mut enc;
    let cases = [
        ("grad", k::sgd_update(gpu, e, &h, s4, s5, s4), "expected 4 (same length as param)"),
        ("velocity", k::sgd_update(gpu, e, &h, s4, s4, s5), "expected 4 (same length as param)"),
        ("param", k::sgd_update(gpu, e, &h, empty, empty, empty), "has 0 elements"),
        (
            "param",
            k::sgd_update(gpu, e, &h, s5, s5, s5),
            "has 5 elements, expected a multiple of 4",
        ),
        ("lr", k::sgd_update(gpu, e, &SgdParams { lr: f32::NAN, ..h }, s4, s4, s4), "finite"),
        (
            "momentum",
            k::sgd_update(gpu, e, &SgdParams { momentum: f32::INFINITY, ..h }, s4, s4, s4),
            "finite",
        ),
        (
            "weight_decay",
            k::sgd_update(gpu, e, &SgdParams { weight_decay: f32::NEG_INFINITY, ..h }, s4, s4, s4),
            "finite",
        ),
    ];
    for (arg, result, text) in cases {
        let err = result.unwrap_err();
        let msg = err.to_string();
        assert!(
            matches!(err, KernelError::Arg { op: "sgd_update", arg: a, .. } if a == arg),
            "{arg}: {msg}"
        );
        assert!(msg.contains(text), "{msg}");
    }
}

fn sgd_update_refuses_a_binding_over_the_device_limit() {
    let gpu = gpu_with_binding_limit(1 << 20);
    let len = (1 << 18) + 4;
    let (p, g, v) = (
        gpu.buffer("p", len).unwrap(),
        gpu.buffer("g", len).unwrap(),
        gpu.buffer("v", len).unwrap(),
    );
    let h = SgdParams { lr: 0.1, momentum: 0.9, weight_decay: 0.0 };
    let mut enc = gpu.encoder();
    let msg =
        k::sgd_update(&gpu, &mut enc, &h, Slice::whole(&p), Slice::whole(&g), Slice::whole(&v))
            .unwrap_err()
            .to_string();
    assert!(
        msg.contains("sgd_update")
            && msg.contains("`param`")
            && msg.contains("max_storage_buffer_binding_size"),
        "{msg}"
    );
}

tests![
    sgd_update_matches_reference_over_several_steps_on_a_sub_range,
    sgd_update_covers_a_large_buffer_to_its_last_element,
    sgd_update_rejects_bad_arguments,
    sgd_update_refuses_a_binding_over_the_device_limit,
];
