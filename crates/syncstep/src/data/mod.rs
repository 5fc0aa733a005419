//! The `data` layer: batches of images and labels, their sharding into R contiguous shards (the
//! first B mod R one example longer), and where batches come from: the seeded synthetic
//! dataset (the embedded default, `synthetic`).

use std::ops::Range;

pub mod cifar;
pub mod dataset;
#[cfg(not(target_arch = "wasm32"))]
pub mod folder;
pub mod loader;
mod records;
pub mod resample;
pub mod schedule;
pub mod source;
pub mod synthetic;
pub mod transform;

pub use synthetic::{synthetic_batch, synthetic_image, PATTERNS};

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum DataError {
    #[error("a batch of {batch} cannot give each of {replicas} replicas an example: use a global batch of at least {replicas}, or fewer replicas")]
    TooFewExamples { batch: usize, replicas: usize },
    #[error("replica count must be at least 1")]
    NoReplicas,
    #[error("label {label} of example {index} is out of range: the model has {classes} classes (labels 0..{classes})")]
    LabelOutOfRange { index: usize, label: i64, classes: u32 },
    #[error("input holds a non-finite value ({value}) at element {index} (example {example}): clean the data first")]
    NonFinite { index: usize, example: usize, value: f32 },
    #[error("input has {got} values but {m} images of 3×{h}×{w} need {expected}")]
    Shape { got: usize, m: usize, h: u32, w: u32, expected: usize },
    #[error(transparent)]
    HostMemory(#[from] crate::host::OutOfMemory),
}

/// Images in NCHW ([m, 3, h, w], f32) and their labels.
#[derive(Clone, Debug, PartialEq)]
pub struct Batch {
    pub images: Vec<f32>,
    pub labels: Vec<u32>,
    pub h: u32,
    pub w: u32,
}

impl Batch {
    pub fn len(&self) -> usize {
        self.labels.len()
    }
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }
    fn image_len(&self) -> usize {
        3 * (self.h * self.w) as usize
    }

    /// Checks what a shader cannot: shape, finite values, labels below `classes`.
    pub fn validate(&self, classes: u32) -> Result<(), DataError> {
        let expected = self.len() * self.image_len();
        if self.images.len() != expected {
            return Err(DataError::Shape {
                got: self.images.len(),
                m: self.len(),
                h: self.h,
                w: self.w,
                expected,
            });
        }
        if let Some((index, &value)) = self.images.iter().enumerate().find(|(_, v)| !v.is_finite())
        {
            return Err(DataError::NonFinite { index, example: index / self.image_len(), value });
        }
        if let Some((index, &label)) = self.labels.iter().enumerate().find(|(_, &l)| l >= classes) {
            return Err(DataError::LabelOutOfRange { index, label: label as i64, classes });
        }
        Ok(())
    }

    /// Examples `range` of the batch.
    pub fn slice(&self, range: Range<usize>) -> Batch {
        let il = self.image_len();
        Batch {
            images: self.images[range.start * il..range.end * il].to_vec(),
            labels: self.labels[range].to_vec(),
            h: self.h,
            w: self.w,
        }
    }

    /// The contiguous shards of `replicas` replicas, in replica order: the first `len mod
    /// replicas` take one example more than the others (`canonical::shards`).
    pub fn shards(&self, replicas: usize) -> Result<Vec<Batch>, DataError> {
        Ok(shard_ranges(self.len(), replicas)?.into_iter().map(|r| self.slice(r)).collect())
    }

    /// The batch with every pixel raised by `delta` (the gates shift shard r by 0.5·r so
    /// per-replica BatchNorm statistics visibly differ from the global ones).
    pub fn shifted(&self, delta: f32) -> Batch {
        Batch { images: self.images.iter().map(|v| v + delta).collect(), ..self.clone() }
    }

    /// Concatenation of batches of one image size, in order.
    pub fn concat(parts: &[Batch]) -> Batch {
        Batch {
            images: parts.iter().flat_map(|b| b.images.iter().copied()).collect(),
            labels: parts.iter().flat_map(|b| b.labels.iter().copied()).collect(),
            h: parts.first().map_or(0, |b| b.h),
            w: parts.first().map_or(0, |b| b.w),
        }
    }
}

/// The examples of each of `replicas` contiguous shards of a batch of `batch`: the first
/// `batch mod replicas` take one more. Every replica needs at least one example.
pub fn shard_ranges(batch: usize, replicas: usize) -> Result<Vec<Range<usize>>, DataError> {
    if replicas == 0 {
        return Err(DataError::NoReplicas);
    }
    if batch < replicas {
        return Err(DataError::TooFewExamples { batch, replicas });
    }
    let ranges = crate::canonical::shards(batch as u64, replicas as u64);
    Ok(ranges.into_iter().map(|r| r.start as usize..r.end as usize).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_are_contiguous_and_concatenate_back() {
        let b = synthetic_batch(1, 0, 8, 32, 32, 10).unwrap();
        for replicas in 1..=8 {
            let shards = b.shards(replicas).unwrap();
            assert_eq!(Batch::concat(&shards), b);
            let sizes: Vec<usize> = shards.iter().map(Batch::len).collect();
            let longer = 8 % replicas;
            assert!(sizes
                .iter()
                .enumerate()
                .all(|(r, &n)| n == 8 / replicas + (r < longer) as usize));
        }
        assert_eq!(b.shards(9), Err(DataError::TooFewExamples { batch: 8, replicas: 9 }));
        assert_eq!(b.shards(0), Err(DataError::NoReplicas));
    }

    #[test]
    fn validate_names_the_bad_example() {
        let mut b = synthetic_batch(1, 0, 4, 32, 32, 10).unwrap();
        b.labels[2] = 10;
        let e = b.validate(10).unwrap_err().to_string();
        assert!(e.contains("label 10 of example 2") && e.contains("10 classes"), "{e}");
        b.labels[2] = 0;
        b.images[3 * 1024 + 5] = f32::NAN;
        let e = b.validate(10).unwrap_err().to_string();
        assert!(e.contains("non-finite") && e.contains("example 1"), "{e}");
        b.images.pop();
        assert!(matches!(b.validate(10), Err(DataError::Shape { .. })));
    }
}
