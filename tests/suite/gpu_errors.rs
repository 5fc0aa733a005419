//! How the device reports what wgpu reported: an allocation that failed earlier is what a later
//! validation error is blamed on.

use crate::common::*;
use syncstep::gpu::GpuError;

/// A failed allocation outside any scope (as under a memory limit) comes back as GPU memory from
/// the next scope, even though what that scope caught is the validation error it caused. On a
/// device of its own: the shared one's errors are every test's.
fn an_earlier_failed_allocation_is_reported_as_memory_not_validation() {
    let gpu = fresh_gpu();
    let invalid = wgpu::BufferDescriptor {
        label: Some("storage that maps for reading: invalid"),
        size: 4,
        usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::STORAGE,
        mapped_at_creation: false,
    };
    let make = || pollster::block_on(gpu.scoped(|| gpu.device.create_buffer(&invalid)));
    assert!(matches!(make(), Err(GpuError::Validation(_))));
    gpu.record_out_of_memory("Out of Memory (creating buffer 'activations')".into());
    let e = make().unwrap_err();
    assert!(matches!(e, GpuError::OutOfMemory(_)), "{e}");
    assert!(e.to_string().contains("GPU out of memory"), "{e}");
}

tests![an_earlier_failed_allocation_is_reported_as_memory_not_validation];
