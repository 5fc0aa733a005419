//! Readback from several threads at once on one device: each read gets its own buffer's bytes,
//! whichever thread's poll runs its map callback, with maps that wait in place (CPU adapters)
//! and on helper threads (GPUs; see `Gpu::blocking_maps`).

use crate::common::*;
use syncstep::gpu::{Gpu, Slice};

fn reads_from_threads_get_their_own_bytes(gpu: &Gpu) {
    std::thread::scope(|scope| {
        for t in 0..4u32 {
            scope.spawn(move || {
                for i in 0..200u32 {
                    let want: Vec<f32> =
                        (0..1000).map(|k| (t * 100_000 + i * 1000 + k) as f32).collect();
                    let b = gpu.upload("readback", &want).unwrap();
                    let got = pollster::block_on(gpu.read_f32(Slice::whole(&b))).unwrap();
                    assert_eq!(got, want, "thread {t}, read {i}");
                }
            });
        }
    });
}

fn reads_from_several_threads_at_once_get_their_own_bytes() {
    let mut gpu = fresh_gpu();
    for blocking in [true, false] {
        gpu.blocking_maps = blocking;
        reads_from_threads_get_their_own_bytes(&gpu);
    }
}

tests![reads_from_several_threads_at_once_get_their_own_bytes,];
