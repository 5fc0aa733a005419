use crate::common::*;
use syncstep::gpu::Slice;
use syncstep::kernels::dense::{self as k, DenseShape};
use syncstep::reference::dense as r;

/// GPU outputs of all four kernels on seeded data: (y, dx, dw, db), and the reference's.
struct Run {
    gpu: [Vec<f32>; 4],
    reference: [Vec<f64>; 4],
}

fn run(s: DenseShape, seed: u64) -> Run {
    let gpu = gpu();
    let (m, k_in, k_out) = (s.m as usize, s.k_in as usize, s.k_out as usize);
    let x = uniform(seed, m * k_in);
    let w = uniform(seed + 1, k_out * k_in);
    let b = uniform(seed + 2, k_out);
    let dy = uniform(seed + 3, m * k_out);
    let up = |name, v: &[f32]| gpu.upload(name, v).unwrap();
    let (bx, bw, bb, bdy) = (up("x", &x), up("w", &w), up("b", &b), up("dy", &dy));
    let y = poisoned(gpu, "y", m * k_out);
    let dx = poisoned(gpu, "dx", m * k_in);
    let dw = poisoned(gpu, "dw", k_out * k_in);
    let db = poisoned(gpu, "db", k_out);
    let sl = Slice::whole;
    let mut enc = gpu.encoder();
    k::dense_forward(gpu, &mut enc, &s, sl(&bx), sl(&bw), sl(&bb), sl(&y)).unwrap();
    k::dense_backward_input(gpu, &mut enc, &s, sl(&bdy), sl(&bw), sl(&dx)).unwrap();
    k::dense_backward_weight(gpu, &mut enc, &s, sl(&bdy), sl(&bx), sl(&dw)).unwrap();
    k::dense_backward_bias(gpu, &mut enc, &s, sl(&bdy), sl(&db)).unwrap();
    submit(gpu, enc);
    let (x, w, b, dy) = (to_f64(&x), to_f64(&w), to_f64(&b), to_f64(&dy));
    Run {
        gpu: [read(gpu, &y), read(gpu, &dx), read(gpu, &dw), read(gpu, &db)],
        reference: [
            r::dense_forward(m, k_in, k_out, &x, &w, &b),
            r::dense_backward_input(m, k_in, k_out, &dy, &w),
            r::dense_backward_weight(m, k_in, k_out, &dy, &x),
            r::dense_backward_bias(m, k_out, &dy),
        ],
    }
}

fn dense_forward_and_backward_match_reference() {
    needs_adapter();
    // ResNet-34's fc (k_in 512) at 10, 1000 and an odd 7 classes, batch 1 to 32; and the other
    // widths as k_in. Output counts such as 70, 1000, 10·32 are not multiples of 256.
    let shapes = [
        (1, 512, 10),
        (32, 512, 10),
        (7, 512, 1000),
        (3, 512, 7),
        (2, 3, 7),
        (5, 64, 10),
        (4, 128, 13),
        (1, 256, 1000),
    ];
    let names =
        ["dense_forward", "dense_backward_input", "dense_backward_weight", "dense_backward_bias"];
    // The matrix products of the forward and the input gradient are held to the forward
    // tolerance; the weight and bias gradients reduce over the batch.
    let tols = [1e-5, 1e-5, 1e-4, 1e-4];
    for (i, &(m, k_in, k_out)) in shapes.iter().enumerate() {
        let s = DenseShape { m, k_in, k_out };
        let run = run(s, 10 * i as u64);
        for j in 0..4 {
            assert_close(&format!("{} {s:?}", names[j]), &run.gpu[j], &run.reference[j], tols[j]);
        }
    }
}

fn dense_backward_weight_and_bias_are_deterministic() {
    needs_adapter();
    let s = DenseShape { m: 32, k_in: 512, k_out: 10 };
    let (a, b) = (run(s, 3), run(s, 3));
    for j in 2..4 {
        assert!(
            a.gpu[j].iter().zip(&b.gpu[j]).all(|(a, b)| a.to_bits() == b.to_bits()),
            "output {j} differs between runs"
        );
    }
}

fn dense_rejects_wrong_lengths_and_zero_dimensions() {
    let gpu = gpu();
    let s = DenseShape { m: 2, k_in: 3, k_out: 5 }; // x 6, w 15, b 5, y 10
    let bufs: Vec<wgpu::Buffer> =
        [4, 5, 6, 10, 15].iter().map(|&n| gpu.buffer("t", n).unwrap()).collect();
    let [b4, b5, b6, b10, b15] = [0, 1, 2, 3, 4].map(|i| Slice::whole(&bufs[i]));
    let zero_m = DenseShape { m: 0, ..s };
    let zero_k_in = DenseShape { k_in: 0, ..s };
    let zero_k_out = DenseShape { k_out: 0, ..s };
    let mut enc = gpu.encoder();
    let e = &mut enc;
    let cases = [
        (
            "dense_forward",
            "x",
            k::dense_forward(gpu, e, &s, b5, b15, b5, b10),
            "expected 6 (m*k_in)",
        ),
        (
            "dense_forward",
            "w",
            k::dense_forward(gpu, e, &s, b6, b10, b5, b10),
            "expected 15 (k_out*k_in)",
        ),
        (
            "dense_forward",
            "b",
            k::dense_forward(gpu, e, &s, b6, b15, b4, b10),
            "expected 5 (k_out)",
        ),
        (
            "dense_forward",
            "y",
            k::dense_forward(gpu, e, &s, b6, b15, b5, b6),
            "expected 10 (m*k_out)",
        ),
        ("dense_forward", "k_in", k::dense_forward(gpu, e, &zero_k_in, b6, b15, b5, b10), "is 0"),
        (
            "dense_backward_input",
            "dy",
            k::dense_backward_input(gpu, e, &s, b6, b15, b6),
            "expected 10 (m*k_out)",
        ),
        (
            "dense_backward_input",
            "w",
            k::dense_backward_input(gpu, e, &s, b10, b6, b6),
            "expected 15 (k_out*k_in)",
        ),
        (
            "dense_backward_input",
            "dx",
            k::dense_backward_input(gpu, e, &s, b10, b15, b10),
            "expected 6 (m*k_in)",
        ),
        (
            "dense_backward_input",
            "k_out",
            k::dense_backward_input(gpu, e, &zero_k_out, b10, b15, b6),
            "is 0",
        ),
        (
            "dense_backward_weight",
            "dy",
            k::dense_backward_weight(gpu, e, &s, b15, b6, b15),
            "expected 10 (m*k_out)",
        ),
        (
            "dense_backward_weight",
            "x",
            k::dense_backward_weight(gpu, e, &s, b10, b10, b15),
            "expected 6 (m*k_in)",
        ),
        (
            "dense_backward_weight",
            "dw",
            k::dense_backward_weight(gpu, e, &s, b10, b6, b10),
            "expected 15 (k_out*k_in)",
        ),
        (
            "dense_backward_weight",
            "m",
            k::dense_backward_weight(gpu, e, &zero_m, b10, b6, b15),
            "is 0",
        ),
        (
            "dense_backward_bias",
            "dy",
            k::dense_backward_bias(gpu, e, &s, b6, b5),
            "expected 10 (m*k_out)",
        ),
        (
            "dense_backward_bias",
            "db",
            k::dense_backward_bias(gpu, e, &s, b10, b4),
            "expected 5 (k_out)",
        ),
        ("dense_backward_bias", "m", k::dense_backward_bias(gpu, e, &zero_m, b10, b5), "is 0"),
    ];
    assert_arg_errors(cases);
}

fn dense_backward_weight_refuses_a_binding_over_the_device_limit() {
    let gpu = gpu_with_binding_limit(1 << 20);
    // x is [1, 2^18 + 1]: one element over 1 MiB.
    let s = DenseShape { m: 1, k_in: (1 << 18) + 1, k_out: 1 };
    let (dy, x, dw) = (
        gpu.buffer("dy", 1).unwrap(),
        gpu.buffer("x", s.input_len()).unwrap(),
        gpu.buffer("dw", s.weight_len()).unwrap(),
    );
    let mut enc = gpu.encoder();
    let msg = k::dense_backward_weight(
        &gpu,
        &mut enc,
        &s,
        Slice::whole(&dy),
        Slice::whole(&x),
        Slice::whole(&dw),
    )
    .unwrap_err()
    .to_string();
    assert!(
        msg.contains("dense_backward_weight")
            && msg.contains("`x`")
            && msg.contains("max_storage_buffer_binding_size"),
        "{msg}"
    );
}

/// Shards of 2^k examples: their weight and bias gradients, added in the all-reduce's pairwise
/// order, are the whole batch's bit for bit (the kernels sum the batch pairwise).
fn gradients_of_any_shards_add_up_to_the_whole_batch_bitwise() {
    let gpu = gpu();
    let (m, k_in, k_out) = (12usize, 64usize, 10usize);
    let x = uniform(90, m * k_in);
    let dy = uniform(91, m * k_out);
    let grads = |rows: std::ops::Range<usize>| {
        let s = DenseShape { m: rows.len() as u32, k_in: k_in as u32, k_out: k_out as u32 };
        let (bx, bdy) = (
            gpu.upload("x", &x[rows.start * k_in..rows.end * k_in]).unwrap(),
            gpu.upload("dy", &dy[rows.start * k_out..rows.end * k_out]).unwrap(),
        );
        let (dw, db) = (poisoned(gpu, "dw", k_out * k_in), poisoned(gpu, "db", k_out));
        let mut enc = gpu.encoder();
        k::dense_backward_weight(
            gpu,
            &mut enc,
            &s,
            Slice::whole(&bdy),
            Slice::whole(&bx),
            Slice::whole(&dw),
        )
        .unwrap();
        k::dense_backward_bias(gpu, &mut enc, &s, Slice::whole(&bdy), Slice::whole(&db)).unwrap();
        submit(gpu, enc);
        [read(gpu, &dw), read(gpu, &db)].concat()
    };
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    let want = grads(0..m);
    for replicas in [1, 2, 3, 4, 5, 7, 12] {
        let got = summed_in_pieces(m, replicas, grads);
        assert_eq!(bits(&got), bits(&want), "{m} examples over {replicas} replicas");
    }
}

/// At batch sizes that need each pairwise stack size: the weight gradient is the pairwise sum
/// over examples of dy[t, j]·x[t, i], the bias gradient that of dy[t, j], which the host takes
/// in the same order.
fn weight_and_bias_gradients_sum_the_batch_pairwise_at_every_stack_size() {
    let gpu = gpu();
    let (k_in, k_out) = (2usize, 3usize);
    for m in pairwise_counts() {
        let s = DenseShape { m, k_in: k_in as u32, k_out: k_out as u32 };
        let x = uniform(110 + m as u64, m as usize * k_in);
        let dy = uniform(111 + m as u64, m as usize * k_out);
        let (bx, bdy) = (gpu.upload("x", &x).unwrap(), gpu.upload("dy", &dy).unwrap());
        let (dw, db) = (poisoned(gpu, "dw", k_out * k_in), poisoned(gpu, "db", k_out));
        let mut enc = gpu.encoder();
        k::dense_backward_weight(
            gpu,
            &mut enc,
            &s,
            Slice::whole(&bdy),
            Slice::whole(&bx),
            Slice::whole(&dw),
        )
        .unwrap();
        k::dense_backward_bias(gpu, &mut enc, &s, Slice::whole(&bdy), Slice::whole(&db)).unwrap();
        submit(gpu, enc);
        let rows = 0..m as usize;
        let products = rows
            .clone()
            .map(|t| {
                (0..k_out)
                    .flat_map(|j| (0..k_in).map(move |i| (j, i)))
                    .map(|(j, i)| dy[t * k_out + j] * x[t * k_in + i])
                    .collect()
            })
            .collect();
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&read(gpu, &dw)),
            bits(&pairwise_sum(products)),
            "dense_backward_weight, batch of {m}"
        );
        let terms = rows.map(|t| dy[t * k_out..(t + 1) * k_out].to_vec()).collect();
        assert_eq!(
            bits(&read(gpu, &db)),
            bits(&pairwise_sum(terms)),
            "dense_backward_bias, batch of {m}"
        );
    }
}

tests![
    dense_forward_and_backward_match_reference,
    dense_backward_weight_and_bias_are_deterministic,
    dense_rejects_wrong_lengths_and_zero_dimensions,
    dense_backward_weight_refuses_a_binding_over_the_device_limit,
    gradients_of_any_shards_add_up_to_the_whole_batch_bitwise,
    weight_and_bias_gradients_sum_the_batch_pairwise_at_every_stack_size,
];
