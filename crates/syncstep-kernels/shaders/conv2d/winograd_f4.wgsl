// F(4×4, 3×3): 4×4 outputs from 6×6 patches, Lavin and Gray's matrices (interpolation points
// 0, ±1, ±2 and ∞). The kernels of winograd.wgsl apply these along the columns, then the rows.
const TILE_OUT: u32 = 4u;
const TILE_IN: u32 = 6u;
const PATCH: u32 = 36u;

// Bᵀ z for six values z (a column or a row of a patch), four channels at once.
fn input_1d(z: array<vec4<f32>, 6>) -> array<vec4<f32>, 6> {
    let d31 = z[3] - z[1];
    let d42 = z[4] - z[2];
    return array<vec4<f32>, 6>(
        (4.0 * z[0] - 5.0 * z[2]) + z[4],
        (z[3] + z[4]) - 4.0 * (z[1] + z[2]),
        (z[4] - z[3]) + 4.0 * (z[1] - z[2]),
        d42 + 2.0 * d31,
        d42 - 2.0 * d31,
        (4.0 * z[1] - 5.0 * z[3]) + z[5],
    );
}

// G z for three values z (a column or a row of a kernel), four kernels at once.
fn weights_1d(z: array<vec4<f32>, 3>) -> array<vec4<f32>, 6> {
    let even = z[0] + z[2];
    let quarter = z[0] + 4.0 * z[2];
    return array<vec4<f32>, 6>(
        0.25 * z[0],
        -(even + z[1]) / 6.0,
        -(even - z[1]) / 6.0,
        (quarter + 2.0 * z[1]) / 24.0,
        (quarter - 2.0 * z[1]) / 24.0,
        z[2],
    );
}

// Aᵀ z for six values z (a column or a row of the products).
fn output_1d(z: array<f32, 6>) -> array<f32, 4> {
    let sum12 = z[1] + z[2];
    let diff12 = z[1] - z[2];
    let sum34 = z[3] + z[4];
    let diff34 = z[3] - z[4];
    return array<f32, 4>(
        (z[0] + sum12) + sum34,
        diff12 + 2.0 * diff34,
        sum12 + 4.0 * sum34,
        (diff12 + 8.0 * diff34) + z[5],
    );
}

// A z for four values z (a column or a row of a dy tile), four channels at once: the weight
// gradient's transform of dy.
fn grad_output_1d(z: array<vec4<f32>, 4>) -> array<vec4<f32>, 6> {
    let even1 = z[0] + z[2];
    let odd1 = z[1] + z[3];
    let even2 = z[0] + 4.0 * z[2];
    let odd2 = 2.0 * z[1] + 8.0 * z[3];
    return array<vec4<f32>, 6>(z[0], even1 + odd1, even1 - odd1, even2 + odd2, even2 - odd2, z[3]);
}

// Gᵀ z for six values z (a column or a row of a position's gradient): the weight gradient's
// transform back to the kernel's taps.
fn grad_weights_1d(z: array<f32, 6>) -> array<f32, 3> {
    let sum12 = z[1] + z[2];
    let sum34 = z[3] + z[4];
    return array<f32, 3>(
        (0.25 * z[0] - sum12 / 6.0) + sum34 / 24.0,
        (z[2] - z[1]) / 6.0 + (z[3] - z[4]) / 12.0,
        (sum34 - sum12) / 6.0 + z[5],
    );
}
