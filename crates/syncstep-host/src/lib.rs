//! Host memory: large allocations that come back as errors instead of aborting the process, and
//! the address space a limit (`ulimit -v`) leaves; and sizes as every layer writes them
//! ([`format_bytes`]).
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

/// How [`format_bytes`] writes a size: binary units (1 KiB = 1024 B) either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ByteScale {
    /// The largest unit the size reaches, with two decimals, or whole bytes under 1 KiB ("512 B",
    /// "1.50 KiB", "81.06 MiB", "68.72 GiB"): a size on its own, as a message states it. The text
    /// of indicatif's `HumanBytes`.
    Fit,
    /// MiB with one decimal, however large or small ("0.2 MiB", "1286.5 MiB"): the figures of a
    /// report, in one unit so that a line's figures add up and compare with the next line's and
    /// the next run's (bench's memory and all-reduce lines, the bytes a rank receives a step).
    MiB,
}

/// `bytes` as text, in the one convention every layer writes sizes in: binary units, scaled to
/// fit ([`ByteScale::Fit`]) or in MiB ([`ByteScale::MiB`]).
pub fn format_bytes(bytes: u64, scale: ByteScale) -> String {
    const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    match scale {
        ByteScale::MiB => format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64),
        ByteScale::Fit => {
            let (mut value, mut unit) = (bytes as f64, None);
            while value >= 1024.0 {
                value /= 1024.0;
                unit = Some(unit.map_or(0, |u| u + 1));
            }
            match unit {
                None => format!("{value:.0} B"),
                Some(u) => format!("{value:.2} {}", UNITS[u]),
            }
        }
    }
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

    /// Scaled to fit: indicatif's `HumanBytes` text (these are its outputs), up to u64::MAX;
    /// in MiB: one decimal, however small or large.
    #[test]
    fn sizes_are_written_in_binary_units() {
        let fit = [
            (0, "0 B"),
            (512, "512 B"),
            (1023, "1023 B"),
            (1024, "1.00 KiB"),
            (1536, "1.50 KiB"),
            ((1 << 20) - 1, "1024.00 KiB"),
            (85_000_000, "81.06 MiB"),
            (73_786_976_294, "68.72 GiB"),
            (1 << 40, "1.00 TiB"),
            (u64::MAX, "16.00 EiB"),
        ];
        for (bytes, text) in fit {
            assert_eq!(format_bytes(bytes, ByteScale::Fit), text, "{bytes}");
        }
        let mib = [(0, "0.0 MiB"), (200 << 10, "0.2 MiB"), (85_000_000, "81.1 MiB")];
        for (bytes, text) in mib.into_iter().chain([(1349 << 20, "1349.0 MiB")]) {
            assert_eq!(format_bytes(bytes, ByteScale::MiB), text, "{bytes}");
        }
    }
}
