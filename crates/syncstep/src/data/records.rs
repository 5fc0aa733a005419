//! CIFAR's records: the binary versions' byte layout (a label byte, CIFAR-100's coarse then fine
//! label byte, then the 32×32 red, green and blue planes, each row-major) and a split's records,
//! bytes shared between subsets, an image made from its record on demand. A leaf: the datasets
//! (`dataset`) hold records, and `cifar` reads the files into them.

use std::sync::Arc;

use image::RgbImage;

pub(super) const SIDE: u32 = 32;
pub(super) const PLANE: usize = (SIDE * SIDE) as usize;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CifarKind {
    Ten,
    Hundred,
}

impl CifarKind {
    pub fn classes(self) -> u32 {
        match self {
            CifarKind::Ten => 10,
            CifarKind::Hundred => 100,
        }
    }

    /// Bytes of one record: the label bytes, then the three planes.
    pub fn record_len(self) -> usize {
        self.label_offset() + 1 + 3 * PLANE
    }

    /// CIFAR-100's second label byte is the fine label (100 classes), the one trained on.
    pub(super) fn label_offset(self) -> usize {
        match self {
            CifarKind::Ten => 0,
            CifarKind::Hundred => 1,
        }
    }

    pub fn train_files(self) -> &'static [&'static str] {
        match self {
            CifarKind::Ten => &[
                "data_batch_1.bin",
                "data_batch_2.bin",
                "data_batch_3.bin",
                "data_batch_4.bin",
                "data_batch_5.bin",
            ],
            CifarKind::Hundred => &["train.bin"],
        }
    }

    pub fn val_files(self) -> &'static [&'static str] {
        match self {
            CifarKind::Ten => &["test_batch.bin"],
            CifarKind::Hundred => &["test.bin"],
        }
    }

    /// The file of class names, one a line, that the archive ships beside the records.
    pub fn names_file(self) -> &'static str {
        match self {
            CifarKind::Ten => "batches.meta.txt",
            CifarKind::Hundred => "fine_label_names.txt",
        }
    }

    #[cfg(not(target_arch = "wasm32"))]
    pub(super) fn title(self) -> &'static str {
        match self {
            CifarKind::Ten => "CIFAR-10",
            CifarKind::Hundred => "CIFAR-100",
        }
    }
}

struct CifarFile {
    name: String,
    bytes: Vec<u8>,
}

/// A split's records: (file, record within the file) into bytes shared between subsets.
pub(super) struct Records {
    kind: CifarKind,
    files: Arc<Vec<CifarFile>>,
    records: Vec<(u32, u32)>,
}

impl Records {
    /// The records `records` ((file, record within the file)) of `files` (names and bytes).
    pub(super) fn new(
        kind: CifarKind,
        files: Vec<(String, Vec<u8>)>,
        records: Vec<(u32, u32)>,
    ) -> Records {
        let files = files.into_iter().map(|(name, bytes)| CifarFile { name, bytes }).collect();
        Records { kind, files: Arc::new(files), records }
    }

    pub(super) fn len(&self) -> usize {
        self.records.len()
    }

    fn bytes(&self, i: usize) -> &[u8] {
        let (f, r) = self.records[i];
        let len = self.kind.record_len();
        &self.files[f as usize].bytes[r as usize * len..][..len]
    }

    /// Feeds `hasher` every record's bytes, in order.
    pub(super) fn hash_into(&self, hasher: &mut sha2::Sha256) {
        use sha2::Digest;
        for i in 0..self.len() {
            hasher.update(self.bytes(i));
        }
    }

    pub(super) fn label(&self, i: usize) -> u32 {
        self.bytes(i)[self.kind.label_offset()] as u32
    }

    pub(super) fn name(&self, i: usize) -> String {
        let (f, r) = self.records[i];
        record_name(&self.files[f as usize].name, r as usize)
    }

    pub(super) fn decode(&self, i: usize) -> RgbImage {
        let planes = &self.bytes(i)[self.kind.label_offset() + 1..];
        RgbImage::from_fn(SIDE, SIDE, |x, y| {
            let p = (y * SIDE + x) as usize;
            image::Rgb([planes[p], planes[PLANE + p], planes[2 * PLANE + p]])
        })
    }

    pub(super) fn subset(&self, indices: &[usize]) -> Records {
        Records {
            kind: self.kind,
            files: Arc::clone(&self.files),
            records: indices.iter().map(|&i| self.records[i]).collect(),
        }
    }
}

pub(super) fn record_name(file: &str, record: usize) -> String {
    format!("{file}, record {record}")
}
