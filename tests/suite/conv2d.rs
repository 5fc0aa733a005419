use crate::common::*;
use syncstep::gpu::{Encoder, Gpu, Slice};
use syncstep::kernels::conv2d::{
    self as k, Conv2dAlgo, Conv2dOp, Conv2dShape, GemmTile, WinogradTile,
};
use syncstep::kernels::{Device, KernelError};
use syncstep::reference::conv2d::{self as r, ConvGeometry};

#[allow(clippy::too_many_arguments)]
fn shape(
    n: u32,
    c_in: u32,
    h: u32,
    w: u32,
    c_out: u32,
    kh: u32,
    kw: u32,
    stride: u32,
    pad: u32,
) -> Conv2dShape {
    Conv2dShape { n, c_in, h, w, c_out, kh, kw, stride, pad }
}

fn geometry(s: &Conv2dShape) -> ConvGeometry {
    let u = |v: u32| v as usize;
    ConvGeometry {
        n: u(s.n),
        c_in: u(s.c_in),
        h: u(s.h),
        w: u(s.w),
        c_out: u(s.c_out),
        kh: u(s.kh),
        kw: u(s.kw),
        stride: u(s.stride),
        pad: u(s.pad),
    }
}

/// The three outputs of one algorithm, read back; None where the algorithm has no kernel for
/// that op.
struct Outputs {
    y: Option<Vec<f32>>,
    dx: Vec<f32>,
    dw: Option<Vec<f32>>,
}

/// Runs forward, input-VJP and weight gradient with `algo` into NaN-poisoned outputs.
fn run(
    gpu: &Device,
    algo: Conv2dAlgo,
    s: &Conv2dShape,
    x: &[f32],
    w: &[f32],
    dy: &[f32],
) -> Outputs {
    let (bx, bw, bdy) =
        (gpu.upload("x", x).unwrap(), gpu.upload("w", w).unwrap(), gpu.upload("dy", dy).unwrap());
    let y = poisoned(gpu, "y", s.y_len() as usize);
    let dx = poisoned(gpu, "dx", s.x_len() as usize);
    let dw = poisoned(gpu, "dw", s.w_len() as usize);
    let whole = Slice::whole;
    let mut enc = gpu.encoder();
    if algo.has(Conv2dOp::Forward) {
        k::conv2d_forward_with(gpu, &mut enc, algo, s, whole(&bx), whole(&bw), whole(&y)).unwrap();
    }
    k::conv2d_backward_input_with(gpu, &mut enc, algo, s, whole(&bdy), whole(&bw), whole(&dx))
        .unwrap();
    if algo.has(Conv2dOp::BackwardWeight) {
        k::conv2d_backward_weight_with(gpu, &mut enc, algo, s, whole(&bdy), whole(&bx), whole(&dw))
            .unwrap();
    }
    submit(gpu, enc);
    let has = |op| algo.has(op);
    Outputs {
        y: has(Conv2dOp::Forward).then(|| read(gpu, &y)),
        dx: read(gpu, &dx),
        dw: has(Conv2dOp::BackwardWeight).then(|| read(gpu, &dw)),
    }
}

/// Every op, both algorithms, against the f64 reference on seeded data in [-1, 1).
/// Forward and input-VJP are held to 1e-5 norm-rel, the weight gradient (a reduction over
/// batch and space) to 1e-4.
fn check_against_reference(s: Conv2dShape, seed: u64) {
    let gpu = gpu();
    let x = uniform(seed, s.x_len() as usize);
    let w = uniform(seed + 1, s.w_len() as usize);
    let dy = uniform(seed + 2, s.y_len() as usize);
    let g = geometry(&s);
    let (x64, w64, dy64) = (to_f64(&x), to_f64(&w), to_f64(&dy));
    let y_ref = r::conv2d_forward(&g, &x64, &w64);
    let dx_ref = r::conv2d_backward_input(&g, &dy64, &w64);
    let dw_ref = r::conv2d_backward_weight(&g, &dy64, &x64);
    for (name, v) in [("y", &y_ref), ("dx", &dx_ref), ("dw", &dw_ref)] {
        assert!(
            v.iter().any(|&e| e != 0.0),
            "{s:?}: reference {name} is all zero, a test that cannot fail"
        );
    }
    let plain = run(gpu, Conv2dAlgo::Direct, &s, &x, &w, &dy);
    for algo in Conv2dAlgo::all() {
        let out = run(gpu, algo, &s, &x, &w, &dy);
        let error = |v: &Option<Vec<f32>>, r: &[f64]| {
            v.as_ref().map_or(String::from("-"), |v| format!("{:.2e}", norm_rel(v, r)))
        };
        println!(
            "{algo} {s:?}: norm-rel y {} dx {:.2e} dw {}",
            error(&out.y, &y_ref),
            norm_rel(&out.dx, &dx_ref),
            error(&out.dw, &dw_ref)
        );
        if let Some(y) = &out.y {
            assert_close(&format!("conv2d_forward {algo} {s:?}"), y, &y_ref, 1e-5);
            // Every variant sums each output in the direct kernel's order: the autotune's
            // choice cannot change a result.
            assert_eq!(
                bits(y),
                bits(plain.y.as_ref().unwrap()),
                "conv2d_forward {algo} {s:?} differs from Direct in some bit"
            );
        }
        assert_close(&format!("conv2d_backward_input {algo} {s:?}"), &out.dx, &dx_ref, 1e-5);
        assert_eq!(
            bits(&out.dx),
            bits(&plain.dx),
            "conv2d_backward_input {algo} {s:?} differs from Direct in some bit"
        );
        if let Some(dw) = &out.dw {
            assert_close(&format!("conv2d_backward_weight {algo} {s:?}"), dw, &dw_ref, 1e-4);
            assert_eq!(
                bits(dw),
                bits(plain.dw.as_ref().unwrap()),
                "conv2d_backward_weight {algo} {s:?} differs from Direct in some bit"
            );
        }
    }
}

// The ResNets' convolutions at small spatial sizes. No output count below is a multiple of the
// workgroup size (64) or of the 4×4 tiles everywhere, and odd spatial sizes leave ragged edges.

fn stem_7x7_s2_p3_matches_reference() {
    check_against_reference(shape(2, 3, 13, 11, 64, 7, 7, 2, 3), 10);
}

fn conv3x3_s1_p1_matches_reference() {
    check_against_reference(shape(2, 64, 5, 5, 64, 3, 3, 1, 1), 20);
    check_against_reference(shape(1, 512, 2, 2, 512, 3, 3, 1, 1), 21);
}

fn conv3x3_s2_p1_matches_reference_at_batch_1() {
    check_against_reference(shape(1, 128, 5, 5, 256, 3, 3, 2, 1), 30);
    check_against_reference(shape(1, 256, 3, 3, 512, 3, 3, 2, 1), 31);
}

fn conv1x1_s2_p0_matches_reference() {
    // The downsample projections; odd input rows and columns are read by no tap.
    check_against_reference(shape(3, 64, 7, 7, 128, 1, 1, 2, 0), 40);
    check_against_reference(shape(2, 256, 3, 3, 512, 1, 1, 2, 0), 41);
}

fn conv1x1_s1_p0_matches_reference() {
    // Bottleneck's 1×1 convolutions: reducing to the block's width, and expanding to 4× it.
    check_against_reference(shape(3, 256, 5, 5, 64, 1, 1, 1, 0), 45);
    check_against_reference(shape(2, 128, 3, 3, 512, 1, 1, 1, 0), 46);
}

fn other_geometries_match_reference() {
    // Channel counts that are not multiples of 4; kh ≠ kw; stride 3 with padding reaching past
    // the kernel; a stride larger than the input; a kernel exactly as large as the padded input.
    check_against_reference(shape(3, 5, 9, 7, 6, 3, 2, 3, 2), 50);
    check_against_reference(shape(2, 3, 2, 3, 7, 2, 3, 4, 1), 51);
    check_against_reference(shape(1, 2, 3, 4, 3, 5, 6, 1, 1), 52);
    check_against_reference(shape(1, 1, 1, 1, 1, 1, 1, 1, 0), 53);
}

fn backward_weight_and_input_are_bitwise_deterministic() {
    let gpu = gpu();
    let s = shape(4, 16, 9, 9, 32, 3, 3, 1, 1);
    let x = uniform(60, s.x_len() as usize);
    let w = uniform(61, s.w_len() as usize);
    let dy = uniform(62, s.y_len() as usize);
    for algo in Conv2dAlgo::all() {
        let (a, b) = (run(gpu, algo, &s, &x, &w, &dy), run(gpu, algo, &s, &x, &w, &dy));
        assert_eq!(
            a.dw.as_deref().map(bits),
            b.dw.as_deref().map(bits),
            "{algo} conv2d_backward_weight differs between two runs"
        );
        assert_eq!(
            bits(&a.dx),
            bits(&b.dx),
            "{algo} conv2d_backward_input differs between two runs"
        );
        assert_eq!(
            a.y.as_deref().map(bits),
            b.y.as_deref().map(bits),
            "{algo} conv2d_forward differs between two runs"
        );
    }
}

/// A storage buffer of `len` NaNs without COPY_DST, poisoned by a kernel since the queue
/// cannot write it: a 1×1 convolution of NaNs whose output has `len` elements.
fn poisoned_without_copy_dst(gpu: &Device, len: u64) -> wgpu::Buffer {
    let out = gpu.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("output without COPY_DST"),
        size: len * 4,
        usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
        mapped_at_creation: false,
    });
    let same = shape(1, 1, 1, len as u32, 1, 1, 1, 1, 0);
    let nan = gpu.upload("nan", &vec![f32::NAN; len as usize]).unwrap();
    let one = gpu.upload("w", &[1.0f32]).unwrap();
    let mut enc = gpu.encoder();
    k::conv2d_forward_with(
        gpu,
        &mut enc,
        Conv2dAlgo::Direct,
        &same,
        Slice::whole(&nan),
        Slice::whole(&one),
        Slice::whole(&out),
    )
    .unwrap();
    submit(gpu, enc);
    out
}

fn input_vjp_zeroes_phases_no_tap_reaches_without_copy_dst() {
    // The GEMM variants clear dx for the phases a 1×1 stride-2 kernel never reaches, when dx's
    // buffer allows copies; into a buffer that does not, they must still write those zeros.
    let gpu = gpu();
    let s = shape(2, 8, 5, 5, 12, 1, 1, 2, 0);
    let dy = gpu.upload("dy", &uniform(70, s.y_len() as usize)).unwrap();
    let w = gpu.upload("w", &uniform(71, s.w_len() as usize)).unwrap();
    let run = |algo: Conv2dAlgo| {
        let dx = poisoned_without_copy_dst(gpu, s.x_len());
        let mut enc = gpu.encoder();
        k::conv2d_backward_input_with(
            gpu,
            &mut enc,
            algo,
            &s,
            Slice::whole(&dy),
            Slice::whole(&w),
            Slice::whole(&dx),
        )
        .unwrap();
        submit(gpu, enc);
        bits(&read(gpu, &dx))
    };
    let plain = run(Conv2dAlgo::Direct);
    assert!(
        plain.iter().any(|&b| b != 0) && plain.contains(&0),
        "the test needs zero and nonzero cells"
    );
    for algo in Conv2dAlgo::all().into_iter().filter(|a| a.has(Conv2dOp::BackwardInput)) {
        assert_eq!(run(algo), plain, "{algo}");
    }
}

/// Where some taps read only padding (layer4's 3×3 kernels on 1×1 maps), the plain launchers
/// run the kept taps alone (Conv2dShape::crop). Into poisoned outputs they must give the whole
/// kernel's bits, +0 for the dropped taps' weight gradient, also into a dw without COPY_DST
/// (which they do not crop: the dropped taps are zeroed by a clear), and so must the forward
/// and input-VJP from kept weights copied once (crop_weights, conv2d_launch_kept).
fn cropped_kernels_give_the_whole_kernels_bits() {
    let gpu = gpu();
    // Centre tap of 3×3 on 1×1 maps; a 2×2 corner of a strided 3×3 (2×2 → 1×1); centre of 5×5;
    // more (co, ci) pairs than one crop workgroup copies (1024), the last workgroup ragged.
    let shapes = [
        shape(3, 5, 1, 1, 6, 3, 3, 1, 1),
        shape(2, 6, 2, 2, 5, 3, 3, 2, 1),
        shape(2, 4, 1, 1, 3, 5, 5, 1, 2),
        shape(1, 40, 1, 1, 37, 3, 3, 1, 1),
    ];
    for (i, s) in shapes.into_iter().enumerate() {
        let crop = s.crop().unwrap_or_else(|| panic!("{s:?} should crop"));
        let seed = 80 + 3 * i as u64;
        let (x, w, dy) = (
            uniform(seed, s.x_len() as usize),
            uniform(seed + 1, s.w_len() as usize),
            uniform(seed + 2, s.y_len() as usize),
        );
        let whole = run(gpu, Conv2dAlgo::Direct, &s, &x, &w, &dy);
        let g = geometry(&s);
        let y_ref = r::conv2d_forward(&g, &to_f64(&x), &to_f64(&w));
        let dx_ref = r::conv2d_backward_input(&g, &to_f64(&dy), &to_f64(&w));
        let dw_ref = r::conv2d_backward_weight(&g, &to_f64(&dy), &to_f64(&x));
        let (bx, bw, bdy) = (
            gpu.upload("x", &x).unwrap(),
            gpu.upload("w", &w).unwrap(),
            gpu.upload("dy", &dy).unwrap(),
        );
        let (y, dx, dw) = (
            poisoned(gpu, "y", s.y_len() as usize),
            poisoned(gpu, "dx", s.x_len() as usize),
            poisoned(gpu, "dw", s.w_len() as usize),
        );
        let dw_fixed = poisoned_without_copy_dst(gpu, s.w_len());
        let whole_slice = Slice::whole;
        let mut enc = gpu.encoder();
        k::conv2d_forward(gpu, &mut enc, &s, whole_slice(&bx), whole_slice(&bw), whole_slice(&y))
            .unwrap();
        k::conv2d_backward_input(
            gpu,
            &mut enc,
            &s,
            whole_slice(&bdy),
            whole_slice(&bw),
            whole_slice(&dx),
        )
        .unwrap();
        k::conv2d_backward_weight(
            gpu,
            &mut enc,
            &s,
            whole_slice(&bdy),
            whole_slice(&bx),
            whole_slice(&dw),
        )
        .unwrap();
        k::conv2d_backward_weight(
            gpu,
            &mut enc,
            &s,
            whole_slice(&bdy),
            whole_slice(&bx),
            whole_slice(&dw_fixed),
        )
        .unwrap();
        submit(gpu, enc);
        let kept = crop.shape.kh * crop.shape.kw;
        println!("{s:?}: keeps {kept} of {} taps", s.kh * s.kw);
        // As a step runs them: the kept taps copied once for the forward and the input-VJP.
        let kept_w = poisoned(gpu, "kept", crop.shape.w_len() as usize);
        let (y_kept, dx_kept) =
            (poisoned(gpu, "y", s.y_len() as usize), poisoned(gpu, "dx", s.x_len() as usize));
        let mut enc = gpu.encoder();
        k::crop_weights(gpu, &mut enc, &s, &crop, whole_slice(&bw), whole_slice(&kept_w)).unwrap();
        k::conv2d_launch_kept(
            gpu,
            &mut enc,
            Conv2dOp::Forward,
            &crop,
            whole_slice(&bx),
            whole_slice(&kept_w),
            whole_slice(&y_kept),
        )
        .unwrap();
        k::conv2d_launch_kept(
            gpu,
            &mut enc,
            Conv2dOp::BackwardInput,
            &crop,
            whole_slice(&bdy),
            whole_slice(&kept_w),
            whole_slice(&dx_kept),
        )
        .unwrap();
        submit(gpu, enc);
        let (y, dx, dw) = (read(gpu, &y), read(gpu, &dx), read(gpu, &dw));
        assert_eq!(bits(&read(gpu, &y_kept)), bits(&y), "conv2d_launch_kept forward {s:?}");
        assert_eq!(bits(&read(gpu, &dx_kept)), bits(&dx), "conv2d_launch_kept input-VJP {s:?}");
        assert_close(&format!("conv2d_forward {s:?}"), &y, &y_ref, 1e-5);
        assert_close(&format!("conv2d_backward_input {s:?}"), &dx, &dx_ref, 1e-5);
        assert_eq!(bits(&y), bits(whole.y.as_ref().unwrap()), "conv2d_forward {s:?}");
        assert_eq!(bits(&dx), bits(&whole.dx), "conv2d_backward_input {s:?}");
        assert_eq!(bits(&dw), bits(whole.dw.as_ref().unwrap()), "conv2d_backward_weight {s:?}");
        assert_eq!(
            bits(&read(gpu, &dw_fixed)),
            bits(&dw),
            "conv2d_backward_weight without COPY_DST {s:?}"
        );
        assert_close(&format!("conv2d_backward_weight {s:?}"), &dw, &dw_ref, 1e-4);
        let zeros = dw.iter().filter(|&&v| v.to_bits() == 0).count() as u64;
        assert_eq!(
            zeros,
            s.w_len() / (s.kh * s.kw) as u64 * (s.kh * s.kw - kept) as u64,
            "{s:?}: +0 at the dropped taps only"
        );
        // Whichever variant runs the crop (Blocked writes the kept taps straight into dw, the
        // others through a kept-taps buffer), the same bits; without COPY_DST, an error.
        for algo in Conv2dAlgo::all().into_iter().filter(|a| a.has(Conv2dOp::BackwardWeight)) {
            let dw_algo = poisoned(gpu, "dw", s.w_len() as usize);
            let mut enc = gpu.encoder();
            k::conv2d_launch_cropped(
                gpu,
                &mut enc,
                Conv2dOp::BackwardWeight,
                algo,
                &s,
                Some(&crop),
                Slice::whole(&bdy),
                Slice::whole(&bx),
                Slice::whole(&dw_algo),
            )
            .unwrap();
            submit(gpu, enc);
            assert_eq!(bits(&read(gpu, &dw_algo)), bits(&dw), "{algo} on the crop of {s:?}");
            let err = k::conv2d_launch_cropped(
                gpu,
                &mut gpu.encoder(),
                Conv2dOp::BackwardWeight,
                algo,
                &s,
                Some(&crop),
                Slice::whole(&bdy),
                Slice::whole(&bx),
                Slice::whole(&dw_fixed),
            )
            .unwrap_err()
            .to_string();
            assert!(err.contains("COPY_DST"), "{err}");
        }
    }
}

/// The kernels that load what others broadcast (browsers, devices without subgroups) give
/// Direct's bits, as the broadcasting ones do (`check_against_reference`): at ragged edges, a
/// batch of 1, 1×1 and 7×7 kernels, and a batch of 16 that closes a pairwise stack level.
/// Direct and the implicit-GEMM family never broadcast: they are the same kernels on both
/// devices.
fn kernels_that_load_give_the_broadcasting_kernels_bits() {
    let gpu = gpu();
    let loading = gpu_that_loads();
    println!(
        "{}: subgroups of {}–{}, broadcasts: {}",
        gpu.info.name, gpu.info.subgroup_min_size, gpu.info.subgroup_max_size, gpu.broadcasts
    );
    // CI's lavapipe has subgroups of 8: the other tests here run the kernels that broadcast.
    if gpu.info.name.contains("llvmpipe") && gpu.info.backend == wgpu::Backend::Vulkan {
        assert!(gpu.broadcasts, "lavapipe should broadcast");
    }
    for (i, s) in [
        shape(2, 3, 13, 11, 64, 7, 7, 2, 3),
        shape(2, 64, 5, 5, 64, 3, 3, 1, 1),
        shape(1, 128, 5, 5, 256, 3, 3, 2, 1),
        shape(3, 64, 7, 7, 128, 1, 1, 2, 0),
        shape(3, 5, 9, 7, 6, 3, 2, 3, 2),
        shape(16, 8, 6, 5, 12, 3, 3, 2, 1),
    ]
    .into_iter()
    .enumerate()
    {
        let seed = 140 + 3 * i as u64;
        let x = uniform(seed, s.x_len() as usize);
        let w = uniform(seed + 1, s.w_len() as usize);
        let dy = uniform(seed + 2, s.y_len() as usize);
        let plain = run(gpu, Conv2dAlgo::Direct, &s, &x, &w, &dy);
        let loads = |a: &Conv2dAlgo| !matches!(a, Conv2dAlgo::Direct | Conv2dAlgo::Implicit);
        for algo in Conv2dAlgo::all().into_iter().filter(loads) {
            let out = run(&loading, algo, &s, &x, &w, &dy);
            let has = |op| algo.has(op);
            let want = |v: &Option<Vec<f32>>, op| v.as_deref().filter(|_| has(op)).map(bits);
            assert_eq!(
                out.y.as_deref().map(bits),
                want(&plain.y, Conv2dOp::Forward),
                "{algo} {s:?}: y"
            );
            assert_eq!(bits(&out.dx), bits(&plain.dx), "{algo} {s:?}: dx");
            assert_eq!(
                out.dw.as_deref().map(bits),
                want(&plain.dw, Conv2dOp::BackwardWeight),
                "{algo} {s:?}: dw"
            );
        }
    }
}

fn the_launchers_choice_is_a_timed_candidate_and_stays_put() {
    let gpu = gpu();
    let s = shape(2, 16, 6, 6, 24, 3, 3, 1, 1);
    for op in [Conv2dOp::Forward, Conv2dOp::BackwardInput, Conv2dOp::BackwardWeight] {
        let first = k::autotuned_algo(gpu, op, &s).unwrap();
        assert!(k::candidates(gpu, op).contains(&first) && first.has(op), "{op:?}: {first}");
        let again = k::autotuned_algo(gpu, op, &s).unwrap();
        assert_eq!(again, first, "{op:?}: the choice is remembered");
    }
}

/// `--retune` on a device's clock: a settled choice in the cache file, with no timings, is timed
/// again and replaced by one that carries each candidate's timings.
fn a_retuning_device_replaces_a_settled_choice_with_its_timings() {
    let s = shape(2, 16, 6, 6, 24, 3, 3, 1, 1);
    let op = Conv2dOp::Forward;
    let dir = tempfile::Builder::new().prefix("syncstep-retune-").tempdir().unwrap();
    let file = dir.path().join("autotune.json");
    let device = |retune| {
        let policy = k::KernelPolicy::new(k::KernelPlan::Timed, None, Some(file.clone()));
        device_with(policy.with_retune(retune))
    };
    let read =
        || -> serde_json::Value { serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap() };
    let first = device(false);
    k::autotuned_algo(&first, op, &s).unwrap();
    let mut doc = read();
    doc["choices"][0]["settled"] = true.into();
    doc["choices"][0]["timings"] = serde_json::json!([]);
    std::fs::write(&file, doc.to_string()).unwrap();

    let retuning = device(true);
    let algo = k::autotuned_algo(&retuning, op, &s).unwrap();
    let replaced = read()["choices"][0].clone();
    let timed: Vec<&str> =
        replaced["timings"].as_array().unwrap().iter().filter_map(|t| t["algo"].as_str()).collect();
    let candidates = k::candidates(&retuning, op);
    assert!(timed.len() > 1 && timed.len() <= candidates.len(), "{replaced}");
    assert!(timed.iter().all(|t| candidates.iter().any(|c| c.to_string() == *t)), "{replaced}");
    assert_eq!(replaced["algo"].as_str(), Some(algo.to_string().as_str()), "{replaced}");
}

/// The kernel policy is each device's, given when it is made: in one process, a device on the
/// GPU plan, one forced to Blocked and one taking the browser's guess choose apart.
fn each_device_chooses_by_its_own_kernel_policy() {
    let s = shape(8, 64, 8, 8, 64, 3, 3, 1, 1);
    let ops = [Conv2dOp::Forward, Conv2dOp::BackwardInput, Conv2dOp::BackwardWeight];
    let policies = [
        (k::KernelPolicy::new(k::KernelPlan::Gpu, None, None), Conv2dAlgo::Implicit),
        (
            k::KernelPolicy::new(
                k::KernelPlan::Gpu,
                Some(k::Forced::Algo(Conv2dAlgo::Blocked)),
                None,
            ),
            Conv2dAlgo::Blocked,
        ),
    ];
    let mut devices = Vec::new();
    for (policy, expected) in policies {
        let gpu = device_with(policy);
        devices.push((gpu, Some(expected)));
    }
    let guess = k::KernelPolicy::new(k::KernelPlan::Timed, Some(k::Forced::Guess), None);
    let guessing = device_with(guess);
    devices.push((guessing, None));
    for (gpu, expected) in &devices {
        for op in ops {
            let chosen = k::conv2d_algo(gpu, op, &s).unwrap();
            match expected {
                Some(expected) => assert_eq!(chosen, *expected, "{op:?}"),
                // The clockless guess: the implicit-GEMM family on a GPU and only there.
                None => {
                    let cpu = gpu.info.device_type == wgpu::DeviceType::Cpu;
                    assert_eq!(chosen == Conv2dAlgo::Implicit, !cpu, "{op:?}: {chosen}");
                }
            }
        }
    }
}

type Launcher =
    fn(&Device, &mut Encoder, &Conv2dShape, Slice, Slice, Slice) -> syncstep::kernels::Result<()>;

/// Each launcher's three arguments: names and lengths, in the order it takes them.
type Args = [(&'static str, u64); 3];

/// Each launcher with its op name and its arguments for `s`.
fn launchers(s: &Conv2dShape) -> [(Launcher, &'static str, Args); 3] {
    [
        (
            k::conv2d_forward,
            "conv2d_forward",
            [("x", s.x_len()), ("w", s.w_len()), ("y", s.y_len())],
        ),
        (
            k::conv2d_backward_input,
            "conv2d_backward_input",
            [("dy", s.y_len()), ("w", s.w_len()), ("dx", s.x_len())],
        ),
        (
            k::conv2d_backward_weight,
            "conv2d_backward_weight",
            [("dy", s.y_len()), ("x", s.x_len()), ("dw", s.w_len())],
        ),
    ]
}

fn launchers_reject_a_wrong_length_naming_op_and_argument() {
    let gpu = gpu();
    let s = shape(2, 3, 8, 8, 4, 3, 3, 2, 1);
    for (launch, op, args) in launchers(&s) {
        for wrong in 0..3 {
            let bufs: Vec<_> = args
                .iter()
                .enumerate()
                .map(|(i, &(_, len))| {
                    gpu.buffer("b", if i == wrong { len + 1 } else { len }).unwrap()
                })
                .collect();
            let mut enc = gpu.encoder();
            let err = launch(
                gpu,
                &mut enc,
                &s,
                Slice::whole(&bufs[0]),
                Slice::whole(&bufs[1]),
                Slice::whole(&bufs[2]),
            )
            .unwrap_err();
            let msg = err.to_string();
            let (arg, len) = args[wrong];
            assert!(
                matches!(err, KernelError::Arg { op: o, arg: a, .. } if o == op && a == arg),
                "{msg}"
            );
            assert!(msg.contains(&format!("expected {len}")), "{msg}");
        }
    }
}

fn launchers_reject_zero_dimensions_stride_0_and_kernels_larger_than_the_padded_input() {
    let gpu = gpu();
    let good = shape(2, 3, 8, 8, 4, 3, 3, 2, 1);
    let mut bad: Vec<(Conv2dShape, &str)> = Vec::new();
    for (arg, set) in [
        ("n", (|s: &mut Conv2dShape| s.n = 0) as fn(&mut Conv2dShape)),
        ("c_in", |s| s.c_in = 0),
        ("h", |s| s.h = 0),
        ("w", |s| s.w = 0),
        ("c_out", |s| s.c_out = 0),
        ("kh", |s| s.kh = 0),
        ("kw", |s| s.kw = 0),
        ("stride", |s| s.stride = 0),
        ("kh", |s| s.kh = 11), // 8 + 2·1 = 10 < 11
        ("kw", |s| s.kw = 11),
        ("pad", |s| (s.pad, s.stride) = (50_000, 100_000)), // small y, but a padded plane past i32 indices
    ] {
        let mut s = good;
        set(&mut s);
        bad.push((s, arg));
    }
    let buf = gpu.buffer("b", 4096).unwrap();
    let b = Slice::whole(&buf);
    for (s, arg) in bad {
        for (launch, op, _) in launchers(&s) {
            let mut enc = gpu.encoder();
            let err = launch(gpu, &mut enc, &s, b, b, b).unwrap_err();
            let msg = err.to_string();
            assert!(
                matches!(err, KernelError::Arg { op: o, arg: a, .. } if o == op && a == arg),
                "{s:?}: {msg}"
            );
        }
    }
}

fn conv2d_forward_refuses_a_binding_over_the_device_limit() {
    let gpu = gpu_with_binding_limit(1 << 20);
    // x is 4·64·33·33·4 bytes ≈ 1.06 MiB, just over the 1 MiB cap; w and y fit.
    let s = shape(4, 64, 33, 33, 1, 1, 1, 8, 0);
    let (x, w, y) = (
        gpu.buffer("x", s.x_len()).unwrap(),
        gpu.buffer("w", s.w_len()).unwrap(),
        gpu.buffer("y", s.y_len()).unwrap(),
    );
    let mut enc = gpu.encoder();
    let msg =
        k::conv2d_forward(&gpu, &mut enc, &s, Slice::whole(&x), Slice::whole(&w), Slice::whole(&y))
            .unwrap_err()
            .to_string();
    assert!(
        msg.contains("conv2d_forward")
            && msg.contains("`x`")
            && msg.contains("max_storage_buffer_binding_size"),
        "{msg}"
    );
}

fn shape_sizes_match_resnet34_layers() {
    let stem = shape(8, 3, 32, 32, 64, 7, 7, 2, 3);
    assert_eq!((stem.out_h(), stem.out_w()), (16, 16));
    assert_eq!(
        (stem.x_len(), stem.w_len(), stem.y_len()),
        (8 * 3 * 32 * 32, 64 * 3 * 49, 8 * 64 * 16 * 16)
    );
    assert_eq!(stem.flops(), 2 * 8 * 64 * 16 * 16 * 3 * 49);
    let down = shape(8, 128, 4, 4, 256, 1, 1, 2, 0);
    assert_eq!((down.out_h(), down.out_w()), (2, 2));
    let odd = shape(1, 1, 7, 6, 1, 3, 3, 2, 1);
    assert_eq!((odd.out_h(), odd.out_w()), (4, 3));
}

/// Data-parallel replicas each take the weight gradient of each canonical piece of their shard;
/// the all-reduce adds those along the canonical tree. For any shards that must rebuild the
/// whole batch's weight gradient bit for bit (the kernels sum examples pairwise), with every
/// algorithm.
fn backward_weight_of_any_shards_adds_up_to_the_whole_batch_bitwise() {
    let gpu = gpu();
    // 16: the Blocked kernel closes the sum at the last example (a stack level fewer); 8 not.
    let whole = shape(16, 8, 6, 5, 12, 3, 3, 2, 1);
    let x = uniform(70, whole.x_len() as usize);
    let w = uniform(71, whole.w_len() as usize);
    let dy = uniform(72, whole.y_len() as usize);
    let direct = run(gpu, Conv2dAlgo::Direct, &whole, &x, &w, &dy).dw.unwrap();
    for algo in Conv2dAlgo::all().into_iter().filter(|a| a.has(Conv2dOp::BackwardWeight)) {
        let want = run(gpu, algo, &whole, &x, &w, &dy).dw.unwrap();
        assert_eq!(
            bits(&want),
            bits(&direct),
            "{algo}: the batch of 16 differs from Direct in some bit"
        );
        let (xl, yl) = ((whole.x_len() / 16) as usize, (whole.y_len() / 16) as usize);
        let piece = |e: std::ops::Range<usize>| {
            let s = Conv2dShape { n: e.len() as u32, ..whole };
            let (x, dy) = (&x[e.start * xl..e.end * xl], &dy[e.start * yl..e.end * yl]);
            run(gpu, algo, &s, x, &w, dy).dw.unwrap()
        };
        for replicas in [2, 3, 5, 16] {
            let got = summed_in_pieces(16, replicas, piece);
            assert_eq!(bits(&got), bits(&want), "{algo:?}: 16 examples over {replicas} replicas");
        }
    }
}

/// At batch sizes that need each pairwise stack size: with 1×1 maps and kernels each example
/// adds one product per weight, so the gradient is the pairwise sum of those products, which the
/// host takes in the same order. Every variant must give its bits.
fn backward_weight_sums_examples_pairwise_at_every_stack_size() {
    let gpu = gpu();
    let (c_in, c_out) = (2usize, 3usize);
    for n in pairwise_counts() {
        let s = shape(n, c_in as u32, 1, 1, c_out as u32, 1, 1, 1, 0);
        let x = uniform(100 + n as u64, s.x_len() as usize);
        let w = uniform(101, s.w_len() as usize);
        let dy = uniform(102 + n as u64, s.y_len() as usize);
        let products = (0..n as usize)
            .map(|b| {
                (0..c_out)
                    .flat_map(|co| (0..c_in).map(move |ci| (co, ci)))
                    .map(|(co, ci)| dy[b * c_out + co] * x[b * c_in + ci])
                    .collect()
            })
            .collect();
        let want = pairwise_sum(products);
        for algo in Conv2dAlgo::all().into_iter().filter(|a| a.has(Conv2dOp::BackwardWeight)) {
            let dw = run(gpu, algo, &s, &x, &w, &dy).dw.unwrap();
            assert_eq!(bits(&dw), bits(&want), "{algo}: batch of {n}");
        }
    }
}

/// The largest pairwise stack, 32 levels, with the GEMMs' pushes and
/// conv2d_backward_weight_total: the register tiles split the batch into chunks of at most
/// 16384 pixels, which keeps each invocation's loops under lavapipe's limit (see
/// `pairwise_counts`); one loop over all 65537 examples would be cut short there. The
/// implicit-GEMM family sums nodes of examples a workgroup, then the nodes. One register tile of each lane kind: every tile's
/// pushes are written by the same generator (and run at the smaller stacks in
/// `backward_weight_sums_examples_pairwise_at_every_stack_size`), and LLVM takes 25 s to
/// minutes to compile each tile at 32 levels.
fn backward_weight_gemms_sum_the_largest_batches_pairwise() {
    let gpu = gpu();
    let n = PAIRWISE_LARGEST;
    assert_eq!(syncstep::kernels::pairwise_levels(n), 32);
    let s = shape(n, 1, 1, 1, 1, 1, 1, 1, 0);
    let x = uniform(120, n as usize);
    let dy = uniform(121, n as usize);
    let want = pairwise_sum(x.iter().zip(&dy).map(|(x, dy)| vec![dy * x]).collect());
    let (bx, bdy) = (gpu.upload("x", &x).unwrap(), gpu.upload("dy", &dy).unwrap());
    let small_tile = |t: &GemmTile| t.per_invocation == 4 && t.per_workgroup == 8;
    for algo in Conv2dAlgo::all().into_iter().filter(|a| match a {
        Conv2dAlgo::Gemm(t) => small_tile(t) && a.has(Conv2dOp::BackwardWeight),
        _ => *a == Conv2dAlgo::Implicit,
    }) {
        let dw = poisoned(gpu, "dw", 1);
        let mut enc = gpu.encoder();
        k::conv2d_backward_weight_with(
            gpu,
            &mut enc,
            algo,
            &s,
            Slice::whole(&bdy),
            Slice::whole(&bx),
            Slice::whole(&dw),
        )
        .unwrap();
        submit(gpu, enc);
        assert_eq!(bits(&read(gpu, &dw)), bits(&want), "{algo}: batch of {n}");
    }
}

/// A scratch cap small enough to split the GEMM variants' im2col into chunks, some ending inside
/// an output row's example (the weight gradient carries its running sum across them): every
/// op and variant must still give Direct's bits.
fn chunked_gemms_give_the_unchunked_bits() {
    let small = gpu_with_binding_limit(32 << 10);
    let gpu = gpu();
    // 9×9 outputs per example, im2col rows of 144 floats: 32 KiB holds 56 pixels, so the weight
    // gradient's chunks are 6 output rows (54 pixels) and the forward's 56 pixels.
    let s = shape(4, 16, 9, 9, 8, 3, 3, 1, 1);
    assert!(
        s.y_len() / s.c_out as u64 * (s.w_len() / s.c_out as u64) * 4 > 5 * (32 << 10),
        "the im2col must need several chunks"
    );
    let x = uniform(80, s.x_len() as usize);
    let w = uniform(81, s.w_len() as usize);
    let dy = uniform(82, s.y_len() as usize);
    let plain = run(gpu, Conv2dAlgo::Direct, &s, &x, &w, &dy);
    for algo in Conv2dAlgo::all().into_iter().filter(|a| matches!(a, Conv2dAlgo::Gemm(_))) {
        let out = run(&small, algo, &s, &x, &w, &dy);
        assert_eq!(
            out.y.as_deref().map(bits),
            plain.y.as_deref().map(bits).filter(|_| algo.has(Conv2dOp::Forward)),
            "{algo}: y"
        );
        assert_eq!(bits(&out.dx), bits(&plain.dx), "{algo}: dx");
        assert_eq!(
            out.dw.as_deref().map(bits),
            plain.dw.as_deref().map(bits).filter(|_| algo.has(Conv2dOp::BackwardWeight)),
            "{algo}: dw"
        );
    }
}

/// llvmpipe silently stops an invocation's loops after 65535 iterations in all. Direct and
/// Blocked weight gradients loop over every output pixel of the batch in one invocation (Blocked
/// once per tap), so
/// past that they are refused there (naming the limit), and the plain launcher takes a GEMM
/// whose chunks stay short: the gradient is still right. Elsewhere they run.
fn weight_gradient_past_llvmpipes_loop_limit_is_refused_or_right() {
    let gpu = gpu();
    let llvmpipe = gpu.info.name.contains("llvmpipe");
    // One example each. A 1×1 conv over 300×300 pixels: ~90,000 iterations for Direct and
    // Blocked. A 3×3 conv over 100×100: ~10,000 for Direct, ~91,000 for Blocked, which loops
    // over the taps too.
    for (i, (s, past)) in [
        (shape(1, 2, 300, 300, 3, 1, 1, 1, 0), [true, true]),
        (shape(1, 2, 100, 100, 3, 3, 3, 1, 1), [false, true]),
    ]
    .into_iter()
    .enumerate()
    {
        let seed = 130 + 2 * i as u64;
        let (x, dy) = (uniform(seed, s.x_len() as usize), uniform(seed + 1, s.y_len() as usize));
        let (bx, bdy) = (gpu.upload("x", &x).unwrap(), gpu.upload("dy", &dy).unwrap());
        let dw_ref = r::conv2d_backward_weight(&geometry(&s), &to_f64(&dy), &to_f64(&x));
        for (algo, past) in [Conv2dAlgo::Direct, Conv2dAlgo::Blocked].into_iter().zip(past) {
            let dw = poisoned(gpu, "dw", s.w_len() as usize);
            let mut enc = gpu.encoder();
            let out = k::conv2d_backward_weight_with(
                gpu,
                &mut enc,
                algo,
                &s,
                Slice::whole(&bdy),
                Slice::whole(&bx),
                Slice::whole(&dw),
            );
            match out {
                Err(KernelError::Arg { arg: "algo", problem, .. }) if llvmpipe && past => {
                    assert!(problem.contains("65535"), "{algo}: {problem}")
                }
                Ok(()) if !(llvmpipe && past) => {
                    submit(gpu, enc);
                    assert_close(&format!("{algo} {s:?}"), &read(gpu, &dw), &dw_ref, 1e-4);
                }
                other => panic!("{algo} {s:?} on {}: {other:?}", gpu.info.name),
            }
        }
        let dw = poisoned(gpu, "dw", s.w_len() as usize);
        let mut enc = gpu.encoder();
        k::conv2d_backward_weight(
            gpu,
            &mut enc,
            &s,
            Slice::whole(&bdy),
            Slice::whole(&bx),
            Slice::whole(&dw),
        )
        .unwrap();
        submit(gpu, enc);
        assert_close(&format!("the launchers' choice {s:?}"), &read(gpu, &dw), &dw_ref, 1e-4);
    }
}

/// wgpu's GL backend has no weight-gradient GEMM to fall back to (they are refused there), so a
/// weight gradient past llvmpipe's loop limit on GL is refused with advice that can be followed
/// there, another adapter, by the plain launcher as by the Blocked one.
fn weight_gradient_past_the_loop_limit_on_gl_points_to_another_adapter() {
    needs_adapter();
    let choice = syncstep::gpu::AdapterChoice::parse("gl").unwrap();
    let gl = match pollster::block_on(Gpu::new(&choice)) {
        Ok(gl) if gl.info.name.contains("llvmpipe") => Device::new(gl, &device_config()),
        other => {
            let found = other.map(|g| g.info.name.clone());
            unavailable(&format!("no llvmpipe GL adapter ({found:?})"));
        }
    };
    // One example, a 3×3 conv over 100×100: ~91,000 iterations for Blocked.
    let s = shape(1, 2, 100, 100, 3, 3, 3, 1, 1);
    let x = gl.upload("x", &uniform(150, s.x_len() as usize)).unwrap();
    let dy = gl.upload("dy", &uniform(151, s.y_len() as usize)).unwrap();
    let dw = poisoned(&gl, "dw", s.w_len() as usize);
    let (dy, x, dw) = (Slice::whole(&dy), Slice::whole(&x), Slice::whole(&dw));
    let mut enc = gl.encoder();
    for out in [
        k::conv2d_backward_weight_with(&gl, &mut enc, Conv2dAlgo::Blocked, &s, dy, x, dw),
        k::conv2d_backward_weight(&gl, &mut enc, &s, dy, x, dw),
    ] {
        match out {
            Err(KernelError::Arg { arg: "algo", problem, .. }) => assert!(
                problem.contains("65535")
                    && problem.contains("use a Vulkan adapter")
                    && !problem.contains("gemm"),
                "{problem}"
            ),
            other => panic!("{s:?} on {}: {other:?}", gl.info.name),
        }
    }
}
/// The GEMM variants Winograd's GEMMs run as.
fn winograd_gemms() -> Vec<Conv2dAlgo> {
    Conv2dAlgo::all()
        .into_iter()
        .filter(|a| matches!(a, Conv2dAlgo::Gemm(_)))
        .filter(|a| a.has(Conv2dOp::Forward))
        .collect()
}

/// Winograd's forward and input-VJP into NaN-poisoned outputs, its GEMMs by `algo`.
fn run_winograd(
    gpu: &Gpu,
    algo: Conv2dAlgo,
    s: &Conv2dShape,
    x: &[f32],
    w: &[f32],
    dy: &[f32],
) -> [Vec<f32>; 2] {
    let (bx, bw, bdy) =
        (gpu.upload("x", x).unwrap(), gpu.upload("w", w).unwrap(), gpu.upload("dy", dy).unwrap());
    let y = poisoned(gpu, "y", s.y_len() as usize);
    let dx = poisoned(gpu, "dx", s.x_len() as usize);
    let whole = Slice::whole;
    let mut enc = gpu.encoder();
    for (op, a, out) in [(Conv2dOp::Forward, &bx, &y), (Conv2dOp::BackwardInput, &bdy, &dx)] {
        k::conv2d_winograd_with(gpu, &mut enc, op, algo, s, whole(a), whole(&bw), whole(out))
            .unwrap();
    }
    submit(gpu, enc);
    [read(gpu, &y), read(gpu, &dx)]
}

/// Winograd rounds otherwise than the plain sum, so it is held to the f64 reference (1e-5
/// norm-rel, as every variant) rather than to Direct's bits; among its own GEMM variants it has
/// one set of bits (broadcasting their shared rows or loading them), and an example's outputs are
/// the same bits in a batch of one and in chunks of one image, so the batch, the shards and the
/// chunks never change a bit.
fn winograd_matches_reference_with_one_set_of_bits_at_any_batch() {
    let gpu = gpu();
    let gemms = winograd_gemms();
    // F(2×2, 3×3) on 7×5 (partial tiles) and 8×8 maps, F(4×4, 3×3) on 15×14 (partial tiles).
    let cases = [
        (shape(3, 8, 7, 5, 12, 3, 3, 1, 1), true),
        (shape(2, 64, 8, 8, 64, 3, 3, 1, 1), true),
        (shape(2, 32, 15, 14, 24, 3, 3, 1, 1), true),
    ];
    let tiles: Vec<_> = cases.iter().map(|(s, _)| s.winograd(Conv2dOp::Forward)).collect();
    assert_eq!(tiles, [Some(WinogradTile::F2), Some(WinogradTile::F2), Some(WinogradTile::F4)]);
    // 128 channels of 64×64: one image a chunk, whose products (4.7 MB) fill more than half the cap.
    let chunked = shape(3, 128, 64, 64, 128, 3, 3, 1, 1);
    assert_eq!(k::winograd_chunk_images(&chunked, Conv2dOp::Forward, 64 << 20), 1);
    for (s, with_reference) in cases.into_iter().chain([(chunked, false)]) {
        let x = uniform(31, s.x_len() as usize);
        let w = uniform(32, s.w_len() as usize);
        let dy = uniform(33, s.y_len() as usize);
        let algos = if with_reference { &gemms[..] } else { &gemms[..1] };
        let first = run_winograd(gpu, algos[0], &s, &x, &w, &dy);
        if with_reference {
            let (x64, w64, dy64) = (to_f64(&x), to_f64(&w), to_f64(&dy));
            let y_ref = r::conv2d_forward(&geometry(&s), &x64, &w64);
            let dx_ref = r::conv2d_backward_input(&geometry(&s), &dy64, &w64);
            println!(
                "winograd {s:?}: norm-rel y {:.2e} dx {:.2e}",
                norm_rel(&first[0], &y_ref),
                norm_rel(&first[1], &dx_ref)
            );
            assert_close(&format!("winograd forward {s:?}"), &first[0], &y_ref, 1e-5);
            assert_close(&format!("winograd input-VJP {s:?}"), &first[1], &dx_ref, 1e-5);
        }
        for &algo in &algos[1..] {
            let out = run_winograd(gpu, algo, &s, &x, &w, &dy);
            assert_eq!(bits(&out[0]), bits(&first[0]), "winograd forward {algo} {s:?}");
            assert_eq!(bits(&out[1]), bits(&first[1]), "winograd input-VJP {algo} {s:?}");
        }
        // The GEMMs that load their shared rows rather than broadcast them.
        if with_reference {
            let loads = gpu_that_loads();
            for &algo in algos {
                let out = run_winograd(&loads, algo, &s, &x, &w, &dy);
                assert_eq!(bits(&out[0]), bits(&first[0]), "forward {algo} loading, {s:?}");
                assert_eq!(bits(&out[1]), bits(&first[1]), "input-VJP {algo} loading, {s:?}");
            }
        }
        let one = Conv2dShape { n: 1, ..s };
        let (x1, y1) = (s.x_len() as usize / s.n as usize, s.y_len() as usize / s.n as usize);
        for e in 0..s.n as usize {
            let alone =
                run_winograd(gpu, algos[0], &one, &x[e * x1..][..x1], &w, &dy[e * y1..][..y1]);
            assert_eq!(
                bits(&alone[0]),
                bits(&first[0][e * y1..][..y1]),
                "forward, example {e} of {s:?}"
            );
            assert_eq!(
                bits(&alone[1]),
                bits(&first[1][e * x1..][..x1]),
                "input-VJP, example {e} of {s:?}"
            );
        }
    }
}

/// Winograd's weight gradient into a NaN-poisoned dw, its GEMMs by `algo`.
fn run_winograd_weight(
    gpu: &Gpu,
    algo: Conv2dAlgo,
    s: &Conv2dShape,
    x: &[f32],
    dy: &[f32],
) -> Vec<f32> {
    let (bx, bdy) = (gpu.upload("x", x).unwrap(), gpu.upload("dy", dy).unwrap());
    let dw = poisoned(gpu, "dw", s.w_len() as usize);
    let whole = Slice::whole;
    let mut enc = gpu.encoder();
    k::conv2d_winograd_weight_with(gpu, &mut enc, algo, s, whole(&bdy), whole(&bx), whole(&dw))
        .unwrap();
    submit(gpu, enc);
    read(gpu, &dw)
}

/// Winograd's weight gradient (F(4×4, 3×3), on maps of 28 and more a side) is held to the f64
/// reference at the weight gradients' 1e-4 norm-rel; its GEMM variants give one set of bits; and
/// since each example's gradient is its own and the examples are summed pairwise, the canonical
/// all-reduce of any shards' pieces rebuilds the whole batch's bits, also where the launch takes
/// the batch in several chunks.
fn winograd_weight_gradient_matches_reference_and_sums_examples_canonically() {
    let gpu = gpu();
    let gemms = winograd_gemms();
    // 28×33: partial tiles, and 7×9 = 63 tiles an example, padded to 64. 128 channels: the
    // products of 3 examples fill a chunk, so 5 take two.
    let cases = [
        (shape(6, 8, 28, 33, 12, 3, 3, 1, 1), true),
        (shape(5, 128, 28, 28, 128, 3, 3, 1, 1), false),
    ];
    for (s, with_reference) in cases {
        assert_eq!(s.winograd(Conv2dOp::BackwardWeight), Some(WinogradTile::F4), "{s:?}");
        let x = uniform(41, s.x_len() as usize);
        let dy = uniform(43, s.y_len() as usize);
        let first = run_winograd_weight(gpu, gemms[0], &s, &x, &dy);
        if with_reference {
            let dw_ref = r::conv2d_backward_weight(&geometry(&s), &to_f64(&dy), &to_f64(&x));
            println!("winograd weight gradient {s:?}: norm-rel {:.2e}", norm_rel(&first, &dw_ref));
            assert_close(&format!("winograd weight gradient {s:?}"), &first, &dw_ref, 1e-4);
            for &algo in &gemms[1..] {
                let out = run_winograd_weight(gpu, algo, &s, &x, &dy);
                assert_eq!(bits(&out), bits(&first), "winograd weight gradient {algo} {s:?}");
            }
        }
        let (xl, yl) = ((s.x_len() / s.n as u64) as usize, (s.y_len() / s.n as u64) as usize);
        let piece = |e: std::ops::Range<usize>| {
            let p = Conv2dShape { n: e.len() as u32, ..s };
            let (x, dy) = (&x[e.start * xl..e.end * xl], &dy[e.start * yl..e.end * yl]);
            run_winograd_weight(gpu, gemms[0], &p, x, dy)
        };
        for replicas in [2, s.n as usize] {
            let got = summed_in_pieces(s.n as usize, replicas, piece);
            assert_eq!(bits(&got), bits(&first), "{s:?} over {replicas} replicas");
        }
    }
}

/// Every configuration of the implicit-GEMM family, in slices of 16 k and of 8, summing all of
/// k in a workgroup or (where the shape has segments) one segment per workgroup into slabs:
/// Direct's bits, forward and input-VJP, on shapes with ragged tiles, padding taps, stride
/// phases (one with no tap) and segments with a short last one.
fn implicit_gemm_gives_direct_bits_in_every_configuration() {
    use syncstep::kernels::conv2d::implicit::{self as ig, GatherPlan, Table, TileConfig};
    let gpu = gpu();
    let shapes = [
        shape(3, 5, 9, 7, 70, 3, 3, 1, 1),
        shape(2, 3, 13, 11, 20, 7, 7, 2, 3),
        shape(3, 12, 7, 7, 40, 1, 1, 2, 0),
        shape(3, 72, 4, 4, 40, 3, 3, 1, 1),
        shape(2, 40, 3, 3, 48, 3, 3, 2, 1),
    ];
    let configs: Vec<TileConfig> = ig::FAMILY
        .iter()
        .filter(|&&c| ig::gathers(c))
        .flat_map(|&c| [c, TileConfig { bk: 8, ..c }])
        .collect();
    // The plans that ran, each at some shape: a large tile whose one tap row a slice outgrows
    // this device's workgroup memory at the stem runs at the others.
    let mut ran = std::collections::HashSet::new();
    for (i, s) in shapes.into_iter().enumerate() {
        let seed = 300 + 3 * i as u64;
        let x = uniform(seed, s.x_len() as usize);
        let w = uniform(seed + 1, s.w_len() as usize);
        let dy = uniform(seed + 2, s.y_len() as usize);
        let plain = run(gpu, Conv2dAlgo::Direct, &s, &x, &w, &dy);
        let (bx, bw, bdy) = (
            gpu.upload("x", &x).unwrap(),
            gpu.upload("w", &w).unwrap(),
            gpu.upload("dy", &dy).unwrap(),
        );
        for op in [Conv2dOp::Forward, Conv2dOp::BackwardInput] {
            let table = Table::of(op, &s);
            let (a, len, want) = match op {
                Conv2dOp::Forward => (&bx, s.y_len(), plain.y.as_deref().unwrap()),
                _ => (&bdy, s.x_len(), &plain.dx[..]),
            };
            let splits: &[bool] = if table.segments > 1 { &[false, true] } else { &[false] };
            for &config in &configs {
                for &split in splits {
                    let plan = GatherPlan { config, split };
                    if ig::kernels(plan, &table, ig::shared_limit(gpu)).is_none() {
                        continue;
                    }
                    ran.insert((op, config.name()));
                    let out = poisoned(gpu, "out", len as usize);
                    let mut enc = gpu.encoder();
                    let whole = Slice::whole;
                    let operands = (whole(a), whole(&bw), whole(&out));
                    ig::gather_gemm_with(gpu, &mut enc, op, &s, (&table, plan), operands).unwrap();
                    submit(gpu, enc);
                    assert_eq!(
                        bits(&read(gpu, &out)),
                        bits(want),
                        "{op:?} {s:?} {} split {split}: differs from Direct",
                        config.name()
                    );
                }
            }
        }
    }
    for op in [Conv2dOp::Forward, Conv2dOp::BackwardInput] {
        for config in &configs {
            assert!(ran.contains(&(op, config.name())), "{op:?} {}: never ran", config.name());
        }
    }
}

/// The implicit-GEMM weight gradient in every configuration, with nodes of 1 to 2^levels
/// examples (one node for the batch, or several added as the tree above them, the last a tail):
/// Direct's bits, on rows that end inside a slice, rows longer than a slice that no part
/// divides, padding taps, dropped taps, and batches that are and are not powers of two.
fn implicit_weight_gradient_gives_direct_bits_in_every_configuration() {
    use syncstep::kernels::conv2d::implicit::{self as ig, TileConfig, WeightPlan};
    let gpu = gpu();
    let shapes = [
        shape(5, 5, 9, 7, 70, 3, 3, 1, 1),
        shape(3, 3, 13, 11, 20, 7, 7, 2, 3),
        shape(6, 12, 7, 7, 40, 1, 1, 2, 0),
        shape(8, 36, 2, 2, 40, 3, 3, 1, 1),
        shape(7, 20, 1, 1, 24, 3, 3, 1, 1),
        shape(2, 3, 5, 37, 8, 3, 3, 1, 1),
    ];
    let configs: Vec<TileConfig> = ig::FAMILY
        .iter()
        .flat_map(|&c| [c, TileConfig { bk: 8, ..c }])
        .filter(|&c| ig::weight_runs(c))
        .collect();
    for (i, s) in shapes.into_iter().enumerate() {
        let seed = 400 + 3 * i as u64;
        let x = uniform(seed, s.x_len() as usize);
        let w = uniform(seed + 1, s.w_len() as usize);
        let dy = uniform(seed + 2, s.y_len() as usize);
        let want = run(gpu, Conv2dAlgo::Direct, &s, &x, &w, &dy).dw.unwrap();
        let (bx, bdy) = (gpu.upload("x", &x).unwrap(), gpu.upload("dy", &dy).unwrap());
        let mut ran = 0;
        for &config in &configs {
            for levels in 0..=ig::most_levels(config, s.n) {
                let plan = WeightPlan { config, levels };
                if ig::weight_kernel(plan, &s, ig::shared_limit(gpu)).is_none() {
                    continue;
                }
                ran += 1;
                let dw = poisoned(gpu, "dw", s.w_len() as usize);
                let mut enc = gpu.encoder();
                let whole = Slice::whole;
                ig::weight_gradient_with(
                    gpu,
                    &mut enc,
                    &s,
                    plan,
                    (whole(&bdy), whole(&bx), whole(&dw)),
                )
                .unwrap();
                submit(gpu, enc);
                assert_eq!(
                    bits(&read(gpu, &dw)),
                    bits(&want),
                    "{s:?} {} levels {levels}: differs from Direct",
                    config.name()
                );
            }
        }
        assert!(ran >= configs.len(), "{s:?}: {ran} plans fit the device");
    }
}

/// The pipelines compiled without wgpu's bounds checks and loop counters (the default on native
/// GPU adapters) give the bits of those compiled with them, for every op of the implicit-GEMM family and a
/// register tile: a kernel that read past a binding would read something else than the checked
/// one's clamped index.
fn unchecked_pipelines_give_the_checked_ones_bits() {
    let mut unchecked = gpu_with_limits(|_| {});
    let mut checked = gpu_with_limits(|_| {});
    unchecked.checked_shaders = false;
    checked.checked_shaders = true;
    let gpu = &unchecked;
    let s = shape(3, 24, 7, 5, 40, 3, 3, 2, 1);
    let x = uniform(500, s.x_len() as usize);
    let w = uniform(501, s.w_len() as usize);
    let dy = uniform(502, s.y_len() as usize);
    let tile = Conv2dAlgo::Gemm(GemmTile {
        lanes: k::GemmLanes::Pixels,
        per_invocation: 4,
        per_workgroup: 8,
    });
    for algo in [Conv2dAlgo::Implicit, tile] {
        let (a, b) = (run(gpu, algo, &s, &x, &w, &dy), run(&checked, algo, &s, &x, &w, &dy));
        assert_eq!(a.y.as_deref().map(bits), b.y.as_deref().map(bits), "{algo}: y");
        assert_eq!(bits(&a.dx), bits(&b.dx), "{algo}: dx");
        assert_eq!(a.dw.as_deref().map(bits), b.dw.as_deref().map(bits), "{algo}: dw");
    }
}

/// A step's weights laid out once (conv2d::WeightRows) give the plain launchers' bits for the
/// forward and the input-VJP of every kind of convolution, in one dispatch or in several, and
/// are read as they were when laid out: weights overwritten after it change nothing (a launch
/// that found no laid-out rows would read them).
fn laid_out_weights_give_the_launchers_bits() {
    let gpu = device_with(k::KernelPolicy::new(k::KernelPlan::Gpu, None, None));
    let shapes = [
        shape(2, 3, 16, 16, 8, 7, 7, 2, 3),
        shape(2, 8, 8, 8, 16, 3, 3, 1, 1),
        shape(2, 16, 8, 8, 24, 3, 3, 2, 1),
        shape(2, 16, 8, 8, 24, 1, 1, 2, 0),
        shape(2, 24, 4, 4, 24, 3, 3, 1, 1),
    ];
    // Each conv's weights from a binding's alignment, as the model lays its parameters out.
    let (mut at, mut weights) = (Vec::new(), Vec::new());
    for (i, s) in shapes.iter().enumerate() {
        at.push(weights.len() as u64);
        weights.extend(uniform(600 + i as u64, s.w_len() as usize));
        weights.resize(weights.len().next_multiple_of(64), 0.5);
    }
    let convs: Vec<(Conv2dOp, Conv2dShape, u64)> = shapes
        .iter()
        .zip(&at)
        .flat_map(|(s, &w)| [Conv2dOp::Forward, Conv2dOp::BackwardInput].map(|op| (op, *s, w)))
        .collect();
    let nan = gpu.upload("nan", &vec![f32::NAN; weights.len()]).unwrap();
    for room in [None, Some(1 << 16)] {
        let w = gpu.upload("w", &weights).unwrap();
        let rows = match room {
            None => k::WeightRows::new(&gpu, &w, &convs).unwrap(),
            Some(room) => k::WeightRows::within(&gpu, &w, &convs, room).unwrap(),
        };
        assert_eq!(rows.dispatches() > 1, room.is_some(), "{} dispatches", rows.dispatches());
        let mut enc = gpu.encoder();
        rows.lay_out(&gpu, &mut enc).unwrap();
        enc.copy_buffer_to_buffer(&nan, 0, &w, 0, 4 * weights.len() as u64);
        let mut runs = Vec::new();
        for (i, &(op, s, w_at)) in convs.iter().enumerate() {
            let [a, _, out] = s.operand_lens(op);
            let a = gpu.upload("a", &uniform(700 + i as u64, a as usize)).unwrap();
            let (plain, laid) =
                (poisoned(&gpu, "out", out as usize), poisoned(&gpu, "laid", out as usize));
            let ws = Slice::new(&w, w_at * 4, s.w_len());
            rows.launch(&gpu, &mut enc, op, &s, Slice::whole(&a), ws, Slice::whole(&laid)).unwrap();
            runs.push((a, plain, laid));
        }
        submit(&gpu, enc);
        let fresh = gpu.upload("w", &weights).unwrap();
        for ((op, s, w_at), (a, plain, laid)) in convs.iter().zip(&runs) {
            let mut enc = gpu.encoder();
            let ws = Slice::new(&fresh, w_at * 4, s.w_len());
            k::conv2d_launch(&gpu, &mut enc, *op, s, Slice::whole(a), ws, Slice::whole(plain))
                .unwrap();
            submit(&gpu, enc);
            let (want, got) = (read(&gpu, plain), read(&gpu, laid));
            assert!(want.iter().all(|v| v.is_finite()), "{op:?} {s:?}");
            let differ = got.iter().zip(&want).filter(|(g, w)| g.to_bits() != w.to_bits());
            assert_eq!(differ.count(), 0, "{op:?} {s:?} (room {room:?})");
        }
    }
}

tests![
    stem_7x7_s2_p3_matches_reference,
    conv3x3_s1_p1_matches_reference,
    conv3x3_s2_p1_matches_reference_at_batch_1,
    conv1x1_s2_p0_matches_reference,
    conv1x1_s1_p0_matches_reference,
    other_geometries_match_reference,
    backward_weight_and_input_are_bitwise_deterministic,
    input_vjp_zeroes_phases_no_tap_reaches_without_copy_dst,
    cropped_kernels_give_the_whole_kernels_bits,
    kernels_that_load_give_the_broadcasting_kernels_bits,
    the_launchers_choice_is_a_timed_candidate_and_stays_put,
    a_retuning_device_replaces_a_settled_choice_with_its_timings,
    each_device_chooses_by_its_own_kernel_policy,
    launchers_reject_a_wrong_length_naming_op_and_argument,
    launchers_reject_zero_dimensions_stride_0_and_kernels_larger_than_the_padded_input,
    conv2d_forward_refuses_a_binding_over_the_device_limit,
    shape_sizes_match_resnet34_layers,
    backward_weight_of_any_shards_adds_up_to_the_whole_batch_bitwise,
    backward_weight_sums_examples_pairwise_at_every_stack_size,
    backward_weight_gemms_sum_the_largest_batches_pairwise,
    chunked_gemms_give_the_unchunked_bits,
    weight_gradient_past_llvmpipes_loop_limit_is_refused_or_right,
    weight_gradient_past_the_loop_limit_on_gl_points_to_another_adapter,
    winograd_matches_reference_with_one_set_of_bits_at_any_batch,
    winograd_weight_gradient_matches_reference_and_sums_examples_canonically,
    implicit_gemm_gives_direct_bits_in_every_configuration,
    implicit_weight_gradient_gives_direct_bits_in_every_configuration,
    unchecked_pipelines_give_the_checked_ones_bits,
    laid_out_weights_give_the_launchers_bits,
];
