//! Buffers: creating them (counted in `MemoryStats`), uploads, the kernels' reused scratch,
//! poisoning for tests, and the size and binding checks against the device's limits.

use super::{Gpu, GpuError, Result, Slice};

/// Buffers created through a [`Gpu`] (its storage buffers, uploads, dispatch uniforms and
/// readback staging; not wgpu's own staging behind `queue.write_buffer`), since the last
/// [`Gpu::reset_memory_stats`]. A buffer dropped while a submission still uses it stays
/// allocated until that submission completes, so everything created between two submissions
/// is resident together: `largest_submission_bytes` is the most transient memory one
/// submission held.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryStats {
    pub created_bytes: u64,
    pub largest_submission_bytes: u64,
    pub largest_buffer_bytes: u64,
}

#[derive(Default)]
pub(super) struct MemoryCounter {
    stats: MemoryStats,
    /// Bytes created since the last submission.
    since_submit: u64,
}

/// One of a device's reused scratch buffers ([`Gpu::scratch`]), named by its label. The layer
/// that launches kernels declares each slot once, as a constant, so that the launches sharing a
/// buffer are the ones that name its slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ScratchSlot(pub &'static str);

impl Gpu {
    /// A submission begins: the buffers created since the last one were resident together.
    pub(super) fn count_submission(&self) {
        let mut m = self.memory.lock().unwrap_or_else(|p| p.into_inner());
        m.stats.largest_submission_bytes = m.stats.largest_submission_bytes.max(m.since_submit);
        m.since_submit = 0;
    }

    /// Creates a buffer and counts its bytes in [`MemoryStats`].
    pub(super) fn create_buffer(&self, desc: &wgpu::BufferDescriptor) -> wgpu::Buffer {
        let mut m = self.memory.lock().unwrap_or_else(|p| p.into_inner());
        m.stats.created_bytes += desc.size;
        m.stats.largest_buffer_bytes = m.stats.largest_buffer_bytes.max(desc.size);
        m.since_submit += desc.size;
        drop(m);
        self.device.create_buffer(desc)
    }

    /// What was created since the last reset (the buffers of a submission not yet made count
    /// as one).
    pub fn memory_stats(&self) -> MemoryStats {
        let m = self.memory.lock().unwrap_or_else(|p| p.into_inner());
        MemoryStats {
            largest_submission_bytes: m.stats.largest_submission_bytes.max(m.since_submit),
            ..m.stats
        }
    }

    pub fn reset_memory_stats(&self) {
        *self.memory.lock().unwrap_or_else(|p| p.into_inner()) = MemoryCounter::default();
    }

    /// A zeroed storage buffer of `len` 4-byte elements, usable as copy source and destination.
    pub fn buffer(&self, label: &str, len: u64) -> Result<wgpu::Buffer> {
        let size = (len * 4).max(4);
        self.check_buffer_size(label, size)?;
        Ok(self.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size,
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_SRC
                | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        }))
    }

    /// A storage buffer of at least `len` 4-byte elements for a launch's temporary use in
    /// `slot` (an im2col chunk, weight rows): the same buffer for every launch that asks for
    /// `slot`, replaced by a larger one when a launch needs more. It holds whatever the last
    /// launch left, so a kernel must write what it reads. wgpu orders the launches that share it,
    /// and keeps a replaced buffer until the work recorded on it is done. (Fresh buffers per
    /// launch would all stay resident until their submission completes, and be new memory to
    /// fault in every step.)
    pub fn scratch(&self, slot: ScratchSlot, len: u64) -> Result<wgpu::Buffer> {
        let bytes = (len * 4).max(4);
        let mut scratch = self.scratch.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(b) = scratch.get(&slot).filter(|b| b.size() >= bytes) {
            return Ok(b.clone());
        }
        let b = self.buffer(slot.0, len)?;
        scratch.insert(slot, b.clone());
        Ok(b)
    }

    /// Runs `f`, then puts back the buffers [`Gpu::scratch`] kept before it: for one-off launches
    /// whose sizes the steady work does not need (the autotune's candidates). Those `f` created
    /// are let go (wgpu keeps them while work recorded on them is pending).
    pub fn scratch_as_before<T>(&self, f: impl FnOnce() -> T) -> T {
        let before = self.scratch.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let result = f();
        *self.scratch.lock().unwrap_or_else(|p| p.into_inner()) = before;
        result
    }

    /// Bytes of the buffers [`Gpu::scratch`] keeps.
    pub fn scratch_bytes(&self) -> u64 {
        self.scratch
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .map(wgpu::Buffer::size)
            .sum()
    }

    /// A storage buffer holding the bytes `make` returns, made once on this device for each `key`
    /// (bytes that name what it holds: a launch's op and shape, say) and kept for its life: the
    /// constant tables a kernel reads.
    pub fn constants(&self, key: &[u8], make: impl FnOnce() -> Vec<u8>) -> Result<wgpu::Buffer> {
        let mut constants = self.constants.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(b) = constants.get(key) {
            return Ok(b.clone());
        }
        let b = self.upload("constants", &make())?;
        constants.insert(key.to_vec(), b.clone());
        Ok(b)
    }

    /// A storage buffer holding `data` (f32, u32, …).
    pub fn upload<T: bytemuck::Pod>(&self, label: &str, data: &[T]) -> Result<wgpu::Buffer> {
        let bytes: &[u8] = bytemuck::cast_slice(data);
        self.check_buffer_size(label, bytes.len() as u64)?;
        if bytes.is_empty() {
            return self.buffer(label, 1);
        }
        self.buffer_init(
            label,
            bytes,
            wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_SRC
                | wgpu::BufferUsages::COPY_DST,
        )
    }

    /// A buffer holding `contents`, written through a mapping at creation. Unlike wgpu's
    /// `create_buffer_init`, which panics when the mapping fails (a lost device), this fails
    /// with an error.
    fn buffer_init(
        &self,
        label: &str,
        contents: &[u8],
        usage: wgpu::BufferUsages,
    ) -> Result<wgpu::Buffer> {
        // A buffer mapped at creation must be a multiple of 4 bytes long.
        let size = (contents.len() as u64).div_ceil(wgpu::COPY_BUFFER_ALIGNMENT)
            * wgpu::COPY_BUFFER_ALIGNMENT;
        let buffer = self.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size,
            usage,
            mapped_at_creation: true,
        });
        let mut view = buffer.slice(..).get_mapped_range_mut().map_err(|e| {
            self.lost_or(GpuError::Validation(format!("mapping `{label}` at creation: {e}")))
        })?;
        view.slice(..contents.len()).copy_from_slice(contents);
        drop(view);
        buffer.unmap();
        Ok(buffer)
    }

    /// Overwrites a slice with NaN, so a kernel that leaves an element unwritten fails its test.
    pub fn poison(&self, s: Slice) {
        let nan = vec![f32::NAN; s.len as usize];
        self.queue.write_buffer(s.buffer, s.offset, bytemuck::cast_slice(&nan));
    }

    fn check_buffer_size(&self, label: &str, size: u64) -> Result<()> {
        if size > self.limits.max_buffer_size {
            return Err(GpuError::Limit {
                what: format!("buffer `{label}`"),
                needed: size,
                allowed: self.limits.max_buffer_size,
                limit: "max_buffer_size",
            });
        }
        Ok(())
    }

    /// Checks that `s` can be bound as a storage buffer here: size within
    /// max_storage_buffer_binding_size and offset aligned. `what` names it in the error.
    pub fn check_binding(&self, what: &str, s: &Slice) -> Result<()> {
        let max = self.limits.max_storage_buffer_binding_size;
        if s.bytes() > max {
            return Err(GpuError::Limit {
                what: what.to_string(),
                needed: s.bytes(),
                allowed: max,
                limit: "max_storage_buffer_binding_size (bytes)",
            });
        }
        let align = self.limits.min_storage_buffer_offset_alignment as u64;
        if !s.offset.is_multiple_of(align) {
            return Err(GpuError::Limit {
                what: format!("{what} offset (must be a multiple of {align})"),
                needed: s.offset,
                allowed: s.offset - s.offset % align,
                limit: "min_storage_buffer_offset_alignment",
            });
        }
        if s.offset + s.bytes() > s.buffer.size() {
            return Err(GpuError::Limit {
                what: format!("{what} range end (bytes)"),
                needed: s.offset + s.bytes(),
                allowed: s.buffer.size(),
                limit: "buffer size",
            });
        }
        Ok(())
    }
}
