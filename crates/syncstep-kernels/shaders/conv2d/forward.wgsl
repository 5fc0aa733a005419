// ---------------------------------------------------------------------------------------------
// Forward: y[n,co,oy,ox] = Σ_{ci,ky,kx} x[n,ci,oy·s−p+ky,ox·s−p+kx] · w[co,ci,ky,kx]

@group(0) @binding(1) var<storage, read> fd_x: array<f32>;
@group(0) @binding(2) var<storage, read> fd_w: array<f32>;
@group(0) @binding(3) var<storage, read_write> fd_y: array<f32>;

@compute @workgroup_size(WG)
fn conv2d_forward_direct(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = linear_index(gid, nwg);
    if (i >= p.n * p.c_out * p.out_h * p.out_w) { return; }
    let ox = i % p.out_w;
    let oy = (i / p.out_w) % p.out_h;
    let co = (i / (p.out_w * p.out_h)) % p.c_out;
    let n = i / (p.out_w * p.out_h * p.c_out);
    var total = 0.0;
    for (var c0 = 0u; c0 < p.c_in; c0 += p.seg_channels) {
        var acc = 0.0;
        for (var ci = c0; ci < min(c0 + p.seg_channels, p.c_in); ci++) {
            for (var ky = 0u; ky < p.kh; ky++) {
                let iy = input_at(oy, ky);
                if (!inside(iy, p.h)) { continue; }
                for (var kx = 0u; kx < p.kw; kx++) {
                    let ix = input_at(ox, kx);
                    if (!inside(ix, p.w)) { continue; }
                    acc += fd_x[x_index(n, ci, u32(iy), u32(ix))] * fd_w[w_index(co, ci, ky, kx)];
                }
            }
        }
        total += acc;
    }
    fd_y[i] = total;
}

// Tile: output channels co0..co0+3 × flattened output positions q0..q0+3 of (n, oy, ox).
@group(0) @binding(1) var<storage, read> fb_x: array<f32>;
@group(0) @binding(2) var<storage, read> fb_w: array<f32>;
@group(0) @binding(3) var<storage, read_write> fb_y: array<f32>;

fn fb_load_x(idx: vec4<i32>, ok: vec4<bool>) -> vec4<f32> {
    let s = vec4<u32>(select(vec4<i32>(0), idx, ok));
    return select(vec4<f32>(0.0), vec4<f32>(fb_x[s.x], fb_x[s.y], fb_x[s.z], fb_x[s.w]), ok);
}

@compute @workgroup_size(WG)
fn conv2d_forward_blocked(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let t = linear_index(gid, nwg);
    let ohw = p.out_h * p.out_w;
    let npix = p.n * ohw;
    let pix_tiles = (npix + 3u) / 4u;
    if (t >= pix_tiles * ((p.c_out + 3u) / 4u)) { return; }
    let co0 = (t / pix_tiles) * 4u;
    let q0 = (t % pix_tiles) * 4u;
    let q = min(vec4<u32>(q0) + vec4<u32>(0u, 1u, 2u, 3u), vec4<u32>(npix - 1u));
    let nb = q / ohw;
    let oy = (q % ohw) / p.out_w;
    let ox = q % p.out_w;
    // Each pixel's window corner in the input (may lie in the padding) and its offset in x.
    let y0 = vec4<i32>(oy * p.stride) - i32(p.pad);
    let x0 = vec4<i32>(ox * p.stride) - i32(p.pad);
    let hw = i32(p.h * p.w);
    let base = vec4<i32>(nb * p.c_in) * hw + y0 * i32(p.w) + x0;
    let k_len = p.c_in * p.kh * p.kw;
    let wrow = min(vec4<u32>(co0) + vec4<u32>(0u, 1u, 2u, 3u), vec4<u32>(p.c_out - 1u)) * k_len;
    var total = array<vec4<f32>, 4>();
    var k = 0u;
    for (var c0 = 0u; c0 < p.c_in; c0 += p.seg_channels) {
        var acc0 = vec4<f32>(0.0);
        var acc1 = vec4<f32>(0.0);
        var acc2 = vec4<f32>(0.0);
        var acc3 = vec4<f32>(0.0);
        for (var ci = c0; ci < min(c0 + p.seg_channels, p.c_in); ci++) {
            for (var ky = 0u; ky < p.kh; ky++) {
                let row_ok = inside4(y0 + i32(ky), p.h);
                let row = base + i32(ci) * hw + i32(ky * p.w);
                for (var kx = 0u; kx < p.kw; kx++) {
                    let xv = fb_load_x(row + i32(kx), row_ok & inside4(x0 + i32(kx), p.w));
                    acc0 += fb_w[wrow.x + k] * xv;
                    acc1 += fb_w[wrow.y + k] * xv;
                    acc2 += fb_w[wrow.z + k] * xv;
                    acc3 += fb_w[wrow.w + k] * xv;
                    k++;
                }
            }
        }
        total[0] += acc0;
        total[1] += acc1;
        total[2] += acc2;
        total[3] += acc3;
    }
    let acc = total;
    for (var i = 0u; i < 4u && co0 + i < p.c_out; i++) {
        for (var j = 0u; j < 4u && q0 + j < npix; j++) {
            fb_y[(nb[j] * p.c_out + co0 + i) * ohw + oy[j] * p.out_w + ox[j]] = acc[i][j];
        }
    }
}
