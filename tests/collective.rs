//! The all-reduce across three devices: sum and mean against the host, the same bytes on every
//! replica, a sub-range that leaves the rest of the buffer alone, and refused ranges.

mod common;

use common::*;
use syncstep::collective::{all_reduce, CollectiveError, ReduceOp};
use syncstep::gpu::{AdapterChoice, Gpu, Slice};

const REPLICAS: usize = 3;

fn devices() -> Option<Vec<Gpu>> {
    gpu()?;
    Some((0..REPLICAS).map(|_| pollster::block_on(Gpu::new(&AdapterChoice::from_env().unwrap())).unwrap()).collect())
}

/// Replica r's buffer of `len` values: uniform, scaled by 10^r so the sums are not exact.
fn local(r: usize, len: usize) -> Vec<f32> {
    uniform(100 + r as u64, len).iter().map(|v| v * 10f32.powi(r as i32)).collect()
}

#[test]
fn sum_and_mean_across_three_devices_match_the_host_on_every_replica() {
    let Some(gpus) = devices() else { return };
    let len = 100_003;
    for op in [ReduceOp::Sum, ReduceOp::Mean] {
        let values: Vec<Vec<f32>> = (0..REPLICAS).map(|r| local(r, len)).collect();
        let buffers: Vec<wgpu::Buffer> = gpus.iter().zip(&values).map(|(g, v)| g.upload("local", v).unwrap()).collect();
        let parts: Vec<(&Gpu, Slice)> = gpus.iter().zip(&buffers).map(|(g, b)| (g, Slice::whole(b))).collect();
        pollster::block_on(all_reduce(&parts, op)).unwrap();
        // The pairwise order for three parts: (0 + 1) + 2, then ÷3 for the mean.
        let divisor = if op == ReduceOp::Mean { REPLICAS as f32 } else { 1.0 };
        let want: Vec<f32> = (0..len).map(|i| ((values[0][i] + values[1][i]) + values[2][i]) / divisor).collect();
        let exact: Vec<f64> = (0..len).map(|i| values.iter().map(|v| v[i] as f64).sum::<f64>() / divisor as f64).collect();
        let first = read(&gpus[0], &buffers[0]);
        assert_eq!(first, want, "{op:?} differs from the host's pairwise sum");
        assert_close(&format!("{op:?} against f64"), &first, &exact, 1e-6);
        for (g, b) in gpus.iter().zip(&buffers).skip(1) {
            let other = read(g, b);
            assert!(other.iter().zip(&first).all(|(a, b)| a.to_bits() == b.to_bits()), "{op:?}: replicas hold different bytes");
        }
    }
}

#[test]
fn a_sub_range_is_reduced_and_the_rest_left_alone() {
    let Some(gpus) = devices() else { return };
    let (len, offset, range) = (1000, 64, 500);
    let values: Vec<Vec<f32>> = (0..REPLICAS).map(|r| local(r, len)).collect();
    let buffers: Vec<wgpu::Buffer> = gpus.iter().zip(&values).map(|(g, v)| g.upload("local", v).unwrap()).collect();
    let parts: Vec<(&Gpu, Slice)> = gpus.iter().zip(&buffers).map(|(g, b)| (g, Slice::new(b, offset as u64 * 4, range as u64))).collect();
    pollster::block_on(all_reduce(&parts, ReduceOp::Sum)).unwrap();
    for (r, (g, b)) in gpus.iter().zip(&buffers).enumerate() {
        let got = read(g, b);
        for i in 0..len {
            let want = if (offset..offset + range).contains(&i) { (values[0][i] + values[1][i]) + values[2][i] } else { values[r][i] };
            assert_eq!(got[i].to_bits(), want.to_bits(), "replica {r}, element {i}");
        }
    }
}

#[test]
fn mismatched_or_unaligned_ranges_are_refused() {
    let Some(gpus) = devices() else { return };
    let buffers: Vec<wgpu::Buffer> = gpus.iter().map(|g| g.buffer("b", 16).unwrap()).collect();
    let s = |r: usize, offset: u64, len: u64| (&gpus[r], Slice::new(&buffers[r], offset, len));
    let e = pollster::block_on(all_reduce(&[s(0, 0, 8), s(1, 0, 8), s(2, 0, 7)], ReduceOp::Sum)).unwrap_err();
    assert!(matches!(e, CollectiveError::RangeMismatch { replica: 2, got: 7, expected: 8 }), "{e}");
    let e = pollster::block_on(all_reduce(&[s(0, 0, 4), s(1, 2, 4)], ReduceOp::Mean)).unwrap_err();
    assert!(matches!(e, CollectiveError::Unaligned { replica: 1, offset: 2 }), "{e}");
    assert!(matches!(pollster::block_on(all_reduce(&[], ReduceOp::Sum)), Err(CollectiveError::NoReplicas)));
}
