//! Host memory: large allocations that come back as errors instead of aborting the process, and
//! the address space a limit (`ulimit -v`) leaves.
//!
//! The bottom layer: what every layer above needs of the host machine, and nothing of the GPU.

#[cfg(not(target_arch = "wasm32"))]
pub mod files;

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

/// This process's soft limit on its address space (Linux's RLIMIT_AS), in bytes; None where
/// there is none or the system does not say.
pub fn address_space_limit() -> Option<u64> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = limits.lines().find(|l| l.starts_with("Max address space"))?;
    line.split_whitespace().nth(3)?.parse().ok()
}

/// The address space this process may still map under its limit, in bytes; None where there is
/// no limit or the system does not say.
pub fn address_space_left() -> Option<u64> {
    let limit = address_space_limit()?;
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmSize:"))?;
    let used_kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(limit.saturating_sub(used_kib.saturating_mul(1024)))
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

    #[test]
    fn the_address_space_left_is_below_the_limit() {
        match (address_space_limit(), address_space_left()) {
            (Some(limit), Some(left)) => assert!(left < limit, "{left} of {limit}"),
            (limit, left) => assert_eq!(left, None, "limit {limit:?}"),
        }
    }
}
