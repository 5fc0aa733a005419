// ---------------------------------------------------------------------------------------------
// Input-VJP: dx[n,ci,iy,ix] = Σ dy[n,co,oy,ox] · w[co,ci,ky,kx] over oy·s − p + ky = iy,
//
// - backward_input is a GATHER (the transposed correlation): dx[n,ci,iy,ix] sums
//   dy[n,co,oy,ox]·w[co,ci,ky,kx] over the taps with oy·stride − pad + ky = iy. Only
//   ky ≡ iy + pad (mod stride) solve that, so the blocked kernel runs once per phase
//   (iy mod stride, ix mod stride): all pixels of one invocation then share the same taps.
//   A phase that no tap reaches (1×1 kernel, stride 2) gets zeros, still written.
// ox·s − p + kx = ix.

@group(0) @binding(1) var<storage, read> bd_dy: array<f32>;
@group(0) @binding(2) var<storage, read> bd_w: array<f32>;
@group(0) @binding(3) var<storage, read_write> bd_dx: array<f32>;

// The output coordinate whose tap k reads input i, or -1 when there is none.
fn output_at(i: u32, k: u32, size: u32) -> i32 {
    let t = i32(i + p.pad) - i32(k);
    if (t < 0 || t % i32(p.stride) != 0 || t / i32(p.stride) >= i32(size)) { return -1; }
    return t / i32(p.stride);
}

@compute @workgroup_size(WG)
fn conv2d_backward_input_direct(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = linear_index(gid, nwg);
    if (i >= p.n * p.c_in * p.h * p.w) { return; }
    let ix = i % p.w;
    let iy = (i / p.w) % p.h;
    let ci = (i / (p.w * p.h)) % p.c_in;
    let n = i / (p.w * p.h * p.c_in);
    var total = 0.0;
    for (var c0 = 0u; c0 < p.c_out; c0 += p.seg_channels) {
        var acc = 0.0;
        for (var co = c0; co < min(c0 + p.seg_channels, p.c_out); co++) {
            for (var ky = 0u; ky < p.kh; ky++) {
                let oy = output_at(iy, ky, p.out_h);
                if (oy < 0) { continue; }
                for (var kx = 0u; kx < p.kw; kx++) {
                    let ox = output_at(ix, kx, p.out_w);
                    if (ox < 0) { continue; }
                    acc += bd_dy[y_index(n, co, u32(oy), u32(ox))] * bd_w[w_index(co, ci, ky, kx)];
                }
            }
        }
        total += acc;
    }
    bd_dx[i] = total;
}

// Tile: input channels ci0..ci0+3 × four pixels of one phase, flattened over (n, a, b) with
// iy = phase_y + s·a, ix = phase_x + s·b. The taps are ky = ky0 + s·t; tap t of pixel a reads
// output row oy = qy + a − t, where qy = (phase_y + pad − ky0) / s (exact).
@group(0) @binding(1) var<storage, read> bb_dy: array<f32>;
@group(0) @binding(2) var<storage, read> bb_w: array<f32>;
@group(0) @binding(3) var<storage, read_write> bb_dx: array<f32>;

fn bb_load_dy(idx: vec4<i32>, ok: vec4<bool>) -> vec4<f32> {
    let s = vec4<u32>(select(vec4<i32>(0), idx, ok));
    return select(vec4<f32>(0.0), vec4<f32>(bb_dy[s.x], bb_dy[s.y], bb_dy[s.z], bb_dy[s.w]), ok);
}

@compute @workgroup_size(WG)
fn conv2d_backward_input_blocked(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let t = linear_index(gid, nwg);
    let phw = p.phase_h * p.phase_w;
    let npix = p.n * phw;
    let pix_tiles = (npix + 3u) / 4u;
    if (t >= pix_tiles * ((p.c_in + 3u) / 4u)) { return; }
    let ci0 = (t / pix_tiles) * 4u;
    let q0 = (t % pix_tiles) * 4u;
    let q = min(vec4<u32>(q0) + vec4<u32>(0u, 1u, 2u, 3u), vec4<u32>(npix - 1u));
    let nb = q / phw;
    let iy = p.phase_y + p.stride * ((q % phw) / p.phase_w);
    let ix = p.phase_x + p.stride * (q % p.phase_w);
    let ky0 = (p.phase_y + p.pad) % p.stride;
    let kx0 = (p.phase_x + p.pad) % p.stride;
    // Output coordinates read by the first tap (t = 0); later taps step back by one.
    let oy0 = vec4<i32>((iy + p.pad - ky0) / p.stride);
    let ox0 = vec4<i32>((ix + p.pad - kx0) / p.stride);
    let ohw = i32(p.out_h * p.out_w);
    let base = vec4<i32>(nb * p.c_out) * ohw + oy0 * i32(p.out_w) + ox0;
    let khw = p.kh * p.kw;
    let ci = min(vec4<u32>(ci0) + vec4<u32>(0u, 1u, 2u, 3u), vec4<u32>(p.c_in - 1u));
    var total = array<vec4<f32>, 4>();
    for (var c0 = 0u; c0 < p.c_out; c0 += p.seg_channels) {
        var acc0 = vec4<f32>(0.0);
        var acc1 = vec4<f32>(0.0);
        var acc2 = vec4<f32>(0.0);
        var acc3 = vec4<f32>(0.0);
        for (var co = c0; co < min(c0 + p.seg_channels, p.c_out); co++) {
            let wrow = (co * p.c_in + ci) * khw;
            var oy = oy0;
            var row = base + i32(co) * ohw;
            for (var ky = ky0; ky < p.kh; ky += p.stride) {
                let row_ok = inside4(oy, p.out_h);
                var ox = ox0;
                var idx = row;
                for (var kx = kx0; kx < p.kw; kx += p.stride) {
                    let dyv = bb_load_dy(idx, row_ok & inside4(ox, p.out_w));
                    let k = ky * p.kw + kx;
                    acc0 += bb_w[wrow.x + k] * dyv;
                    acc1 += bb_w[wrow.y + k] * dyv;
                    acc2 += bb_w[wrow.z + k] * dyv;
                    acc3 += bb_w[wrow.w + k] * dyv;
                    ox -= vec4<i32>(1);
                    idx -= vec4<i32>(1);
                }
                oy -= vec4<i32>(1);
                row -= vec4<i32>(i32(p.out_w));
            }
        }
        total[0] += acc0;
        total[1] += acc1;
        total[2] += acc2;
        total[3] += acc3;
    }
    let acc = total;
    for (var i = 0u; i < 4u && ci0 + i < p.c_in; i++) {
        for (var j = 0u; j < 4u && q0 + j < npix; j++) {
            bb_dx[x_index(nb[j], ci0 + i, iy[j], ix[j])] = acc[i][j];
        }
    }
}
