//! Host memory: large allocations that come back as errors instead of aborting the process.

/// A host allocation that failed: what it was for and how many bytes it asked for.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{what} needs {bytes} bytes of host memory, which could not be allocated; use a smaller batch or image size, or a machine with more memory")]
pub struct OutOfMemory {
    pub what: &'static str,
    /// Saturates at `u64::MAX`.
    pub bytes: u64,
}

/// An empty vector with room for `len` elements, or the error naming `what` it was for.
pub fn vec_with_capacity<T>(len: usize, what: &'static str) -> Result<Vec<T>, OutOfMemory> {
    let mut v = Vec::new();
    v.try_reserve_exact(len).map_err(|_| OutOfMemory {
        what,
        bytes: (len as u64).saturating_mul(size_of::<T>() as u64),
    })?;
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_impossible_allocation_is_an_error() {
        let e = vec_with_capacity::<f32>(usize::MAX / 2, "a test").unwrap_err();
        assert_eq!(e.bytes, u64::MAX);
        assert!(e.to_string().starts_with("a test needs"), "{e}");
        assert_eq!(vec_with_capacity::<f32>(10, "a test").unwrap().capacity(), 10);
    }
}
