// F(2×2, 3×3): 2×2 outputs from 4×4 patches, Lavin and Gray's matrices (interpolation points
// 0, ±1 and ∞). The kernels of winograd.wgsl apply these along the columns, then the rows.
const TILE_OUT: u32 = 2u;
const TILE_IN: u32 = 4u;
const PATCH: u32 = 16u;

// Bᵀ z for four values z (a column or a row of a patch), four channels at once.
fn input_1d(z: array<vec4<f32>, 4>) -> array<vec4<f32>, 4> {
    return array<vec4<f32>, 4>(z[0] - z[2], z[1] + z[2], z[2] - z[1], z[1] - z[3]);
}

// G z for three values z (a column or a row of a kernel), four kernels at once.
fn weights_1d(z: array<vec4<f32>, 3>) -> array<vec4<f32>, 4> {
    return array<vec4<f32>, 4>(z[0], 0.5 * (z[0] + z[1] + z[2]), 0.5 * (z[0] - z[1] + z[2]), z[2]);
}

// Aᵀ z for four values z (a column or a row of the products).
fn output_1d(z: array<f32, 4>) -> array<f32, 2> {
    return array<f32, 2>(z[0] + z[1] + z[2], z[1] - z[2] - z[3]);
}

// A z for two values z (a column or a row of a dy tile), four channels at once: the weight
// gradient's transform of dy.
fn grad_output_1d(z: array<vec4<f32>, 2>) -> array<vec4<f32>, 4> {
    return array<vec4<f32>, 4>(z[0], z[0] + z[1], z[0] - z[1], -z[1]);
}

// Gᵀ z for four values z (a column or a row of a position's gradient): the weight gradient's
// transform back to the kernel's taps.
fn grad_weights_1d(z: array<f32, 4>) -> array<f32, 3> {
    let sum12 = z[1] + z[2];
    return array<f32, 3>(z[0] + 0.5 * sum12, 0.5 * (z[1] - z[2]), 0.5 * sum12 + z[3]);
}
