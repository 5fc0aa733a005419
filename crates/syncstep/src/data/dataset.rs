//! A dataset's splits and their examples: images decoded only when a batch asks for one (an
//! image folder can hold a million files; a scan reads names, never pixels), what a dataset is
//! (its fingerprint), and the errors of reading one. Image folders (`folder`) and CIFAR's files
//! (`cifar`) are opened into these; `source` says which from `--data`.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use image::RgbImage;

use super::records::Records;

/// One split of a dataset: its images (decoded on demand) and labels.
pub struct Dataset {
    pub class_names: Vec<String>,
    items: Items,
}

enum Items {
    /// Image files and their labels.
    #[cfg(not(target_arch = "wasm32"))]
    Files(Vec<(PathBuf, u32)>),
    Cifar(Records),
    /// Decoded images and the files they came from, each its path and size (none: "image
    /// i"), shared between subsets; `order` picks this set's examples.
    Memory {
        images: Arc<Vec<(RgbImage, u32)>>,
        files: Arc<Vec<(String, u64)>>,
        order: Vec<usize>,
    },
}

impl Dataset {
    pub fn len(&self) -> usize {
        match &self.items {
            #[cfg(not(target_arch = "wasm32"))]
            Items::Files(files) => files.len(),
            Items::Cifar(records) => records.len(),
            Items::Memory { order, .. } => order.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn classes(&self) -> u32 {
        self.class_names.len() as u32
    }

    /// The label of example `i` (panics past `len`, as slice indexing does).
    pub fn label(&self, i: usize) -> u32 {
        match &self.items {
            #[cfg(not(target_arch = "wasm32"))]
            Items::Files(files) => files[i].1,
            Items::Cifar(records) => records.label(i),
            Items::Memory { images, order, .. } => images[order[i]].1,
        }
    }

    /// What a user would look for to find example `i`: its file, or its CIFAR file and record.
    pub fn name(&self, i: usize) -> String {
        match &self.items {
            #[cfg(not(target_arch = "wasm32"))]
            Items::Files(files) => files[i].0.display().to_string(),
            Items::Cifar(records) => records.name(i),
            Items::Memory { files, order, .. } => match files.get(order[i]) {
                Some((path, _)) => path.clone(),
                None => format!("image {}", order[i]),
            },
        }
    }

    /// Example `i`'s image as 8-bit RGB, whatever the file held (grayscale, alpha, palette and
    /// 16-bit images are converted; alpha is dropped, not composited).
    pub fn decode(&self, i: usize) -> Result<RgbImage, DatasetError> {
        match &self.items {
            #[cfg(not(target_arch = "wasm32"))]
            Items::Files(files) => decode_file(&files[i].0),
            Items::Cifar(records) => Ok(records.decode(i)),
            Items::Memory { images, order, .. } => {
                with_pixels(images[order[i]].0.clone(), || self.name(i))
            }
        }
    }

    /// A dataset of images already decoded (the browser's uploads, tests). Labels are checked
    /// against the class count where batches are made (`Batch::validate`).
    pub fn from_images(class_names: Vec<String>, images: Vec<(RgbImage, u32)>) -> Dataset {
        Dataset::from_images_of_files(class_names, images, Vec::new())
    }

    /// The same, each image from the file `files` names (its path, in messages and `name`, and
    /// its size in bytes: with them, the dataset's fingerprint is that of the same files on
    /// disk).
    pub fn from_images_of_files(
        class_names: Vec<String>,
        images: Vec<(RgbImage, u32)>,
        files: Vec<(String, u64)>,
    ) -> Dataset {
        let order = (0..images.len()).collect();
        let items = Items::Memory { images: Arc::new(images), files: Arc::new(files), order };
        Dataset { class_names, items }
    }

    /// The examples at `indices`, in that order. Image bytes are shared, not copied.
    pub fn subset(&self, indices: &[usize]) -> Dataset {
        let items = match &self.items {
            #[cfg(not(target_arch = "wasm32"))]
            Items::Files(files) => {
                Items::Files(indices.iter().map(|&i| files[i].clone()).collect())
            }
            Items::Cifar(records) => Items::Cifar(records.subset(indices)),
            Items::Memory { images, files, order } => Items::Memory {
                images: Arc::clone(images),
                files: Arc::clone(files),
                order: indices.iter().map(|&i| order[i]).collect(),
            },
        };
        Dataset { class_names: self.class_names.clone(), items }
    }

    /// Feeds `hasher` what this split is: each example's label and its image file's path below
    /// `root` and size (the same for a file read into memory), a CIFAR record's bytes, or a
    /// decoded image's name. The image files are not read (a folder may hold a million). Feeds
    /// `times`, while it is Some, each image file's path, size and modification time from the
    /// same look at it; a split of other examples (CIFAR's records, images in memory) sets it
    /// None.
    fn hash_into(
        &self,
        root: &Path,
        hasher: &mut sha2::Sha256,
        times: &mut Option<sha2::Sha256>,
    ) -> Result<(), DatasetError> {
        use sha2::Digest;
        let field = |hasher: &mut sha2::Sha256, path: &Path, size: Option<u64>, tail: String| {
            let name = path.strip_prefix(root).unwrap_or(path).to_string_lossy();
            let text = match size {
                Some(size) => format!("{name} {size} {tail}"),
                None => format!("{name} {tail}"),
            };
            hasher.update((text.len() as u64).to_le_bytes());
            hasher.update(text.as_bytes());
        };
        match &self.items {
            #[cfg(not(target_arch = "wasm32"))]
            Items::Files(files) => {
                for (path, label) in files {
                    let io = |source| DatasetError::Io { path: path.clone(), source };
                    let meta = std::fs::metadata(path).map_err(io)?;
                    field(hasher, path, Some(meta.len()), label.to_string());
                    match (times.as_mut(), meta.modified().ok().map(nanoseconds)) {
                        (Some(times), Some(ns)) => field(times, path, Some(meta.len()), ns),
                        _ => *times = None,
                    }
                }
            }
            Items::Cifar(records) => {
                records.hash_into(hasher);
                *times = None;
            }
            Items::Memory { files, order, .. } => {
                for (i, &at) in order.iter().enumerate() {
                    let label = self.label(i).to_string();
                    match files.get(at) {
                        Some((path, size)) => field(hasher, Path::new(path), Some(*size), label),
                        None => field(hasher, Path::new(&self.name(i)), None, label),
                    }
                }
                *times = None;
            }
        }
        Ok(())
    }

    #[cfg(not(target_arch = "wasm32"))]
    pub(super) fn from_files(class_names: Vec<String>, files: Vec<(PathBuf, u32)>) -> Dataset {
        Dataset { class_names, items: Items::Files(files) }
    }

    pub(super) fn from_records(class_names: Vec<String>, records: Records) -> Dataset {
        Dataset { class_names, items: Items::Cifar(records) }
    }
}

/// Not derived: a derived `Debug` would print every pixel.
impl fmt::Debug for Dataset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Dataset")
            .field("examples", &self.len())
            .field("classes", &self.class_names.len())
            .finish()
    }
}

/// The image file at `path` as 8-bit RGB, as `Dataset::decode` reads it. The format comes
/// from the bytes, not the extension: a PNG named .jpg still decodes.
#[cfg(not(target_arch = "wasm32"))]
pub fn decode_file(path: &Path) -> Result<RgbImage, DatasetError> {
    let bytes = crate::files::read_input(path)
        .map_err(|source| DatasetError::Io { path: path.to_path_buf(), source })?;
    decode_bytes(&bytes, || path.display().to_string())
}

/// The most pixels an image may have: PIL's bound, past which it refuses an image as a
/// decompression bomb (`Image.MAX_IMAGE_PIXELS`, 89,478,485, twice over).
pub const MAX_PIXELS: u64 = 2 * 89_478_485;

/// An encoded image (any format the image crate reads; the format comes from the bytes) as
/// 8-bit RGB; `name` names it in errors. As strict as PIL: a file cut short is an error (the
/// image crate's JPEG decoder would fill the rest with grey), and so is one of more than
/// [`MAX_PIXELS`] pixels. The memory for its pixels is reserved before the decoder asks for
/// it, so that memory that runs out is an error naming the image, not an abort.
pub fn decode_bytes(bytes: &[u8], name: impl Fn() -> String) -> Result<RgbImage, DatasetError> {
    let bad = |reason: String| DatasetError::Decode { name: name(), reason };
    let reader = image::ImageReader::new(std::io::Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| bad(e.to_string()))?;
    if reader.format() == Some(image::ImageFormat::Jpeg) && jpeg_end(bytes).is_none() {
        return Err(bad("the file is cut short: its JPEG data ends before the end-of-image marker (PIL: image file is truncated)".into()));
    }
    let decoder = reader.into_decoder().map_err(|e| bad(e.to_string()))?;
    let (w, h) = image::ImageDecoder::dimensions(&decoder);
    let pixels = u64::from(w) * u64::from(h);
    let too_large = |problem: String| DatasetError::Image { name: name(), problem };
    if pixels > MAX_PIXELS {
        return Err(too_large(format!(
            "{w}×{h} is {pixels} pixels, past the {MAX_PIXELS} PIL takes (a decompression bomb, or a picture far larger than a network's input): shrink it or remove it"
        )));
    }
    // The decoded pixels and their 8-bit RGB copy.
    let need = image::ImageDecoder::total_bytes(&decoder).saturating_add(3 * pixels);
    let no_room = || {
        too_large(format!(
            "its {w}×{h} pixels need {need} bytes of host memory, which could not be allocated: shrink the image or free memory (a run decodes --workers images at once)"
        ))
    };
    let room = usize::try_from(need).map_err(|_| no_room())?;
    drop(crate::host::vec_with_capacity::<u8>(room, "an image").map_err(|_| no_room())?);
    let img = image::DynamicImage::from_decoder(decoder).map_err(|e| bad(e.to_string()))?;
    with_pixels(img.into_rgb8(), name)
}

/// Where a JPEG's end-of-image marker is, following its markers; None where the file is cut
/// short (a partial download, a full disk) and ends before it. Each segment is skipped by its
/// length; a scan's entropy-coded data runs to the next marker that is neither a stuffed 0xFF
/// nor a restart.
fn jpeg_end(bytes: &[u8]) -> Option<usize> {
    let mut at = 2;
    loop {
        // A marker: its 0xFF (bytes before it that are not one are skipped, as libjpeg skips
        // them), any number of fill bytes 0xFF, then its code.
        at += bytes.get(at..).and_then(|rest| rest.iter().position(|&b| b == 0xFF))?;
        while bytes.get(at) == Some(&0xFF) {
            at += 1;
        }
        let code = *bytes.get(at)?;
        at += 1;
        match code {
            0xD9 => return Some(at),
            0x01 | 0xD0..=0xD7 => continue,
            _ => {}
        }
        let length = bytes.get(at..at + 2)?;
        at += usize::from(u16::from_be_bytes([length[0], length[1]]));
        if code == 0xDA {
            at = next_marker(bytes, at)?;
        }
    }
}

/// Where the marker after a scan's entropy-coded data starting at `at` begins.
fn next_marker(bytes: &[u8], mut at: usize) -> Option<usize> {
    loop {
        let ff = at + bytes.get(at..)?.iter().position(|&b| b == 0xFF)?;
        match *bytes.get(ff + 1)? {
            0x00 | 0xD0..=0xD7 => at = ff + 2,
            _ => return Some(ff),
        }
    }
}

/// `img`, unless it has no pixels: nothing could be learnt from it.
fn with_pixels(img: RgbImage, name: impl Fn() -> String) -> Result<RgbImage, DatasetError> {
    if img.width() == 0 || img.height() == 0 {
        return Err(DatasetError::Decode { name: name(), reason: "it has no pixels".into() });
    }
    Ok(img)
}

/// The extensions of the image files a folder's classes hold (any case).
pub const EXTENSIONS: [&str; 5] = ["png", "jpg", "jpeg", "bmp", "webp"];

pub fn is_image(path: &Path) -> bool {
    let ext = path.extension().map(|e| e.to_string_lossy()).unwrap_or_default();
    EXTENSIONS.iter().any(|known| ext.eq_ignore_ascii_case(known))
}

/// Examples with their labels (class indices).
pub type Labelled<T> = Vec<(T, u32)>;

/// Splits each class's examples (`classes[label]`): a `val_split` fraction (rounded; at least
/// one where the class has two, never all) drawn with `seed` and the class index, so a class's
/// split does not depend on the others. Both keep the given order. Returns (train, val), each
/// example with its label.
pub fn hold_out<T>(classes: Vec<Vec<T>>, val_split: f64, seed: u64) -> (Labelled<T>, Labelled<T>) {
    use rand::seq::SliceRandom;
    use rand::SeedableRng;
    let (mut train, mut val) = (Vec::new(), Vec::new());
    for (label, examples) in classes.into_iter().enumerate() {
        let n = examples.len();
        let held = if val_split <= 0.0 || n < 2 {
            0
        } else {
            ((n as f64 * val_split).round() as usize).clamp(1, n - 1)
        };
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        rng.set_stream(label as u64);
        let mut order: Vec<usize> = (0..n).collect();
        order.shuffle(&mut rng);
        let mut is_held = vec![false; n];
        for &i in &order[..held] {
            is_held[i] = true;
        }
        for (example, held) in examples.into_iter().zip(is_held) {
            if held { &mut val } else { &mut train }.push((example, label as u32));
        }
    }
    (train, val)
}

/// A dataset's train and validation splits.
#[derive(Debug)]
pub struct Splits {
    pub train: Dataset,
    pub val: Dataset,
    /// What the user should be told: how the validation split was made, what was skipped.
    pub notes: Vec<String>,
}

impl Splits {
    /// What the dataset at `root` is, whatever path reaches it (image files are named by
    /// their path below it).
    pub fn fingerprint(&self, root: &Path) -> Result<Fingerprint, DatasetError> {
        Ok(self.identify(root)?.0)
    }

    /// [`fingerprint`](Self::fingerprint), and from the same look at each file, when the
    /// dataset is image files on disk, the SHA-256 of their paths below `root`, sizes and
    /// modification times, in the same order: what tells an image rewritten at the same size
    /// (the fingerprint reads no image's bytes), or touched, or copied without its time.
    pub fn identify(&self, root: &Path) -> Result<(Fingerprint, Option<String>), DatasetError> {
        use sha2::Digest;
        let mut hasher = sha2::Sha256::new();
        let mut times = Some(sha2::Sha256::new());
        for split in [&self.train, &self.val] {
            hasher.update((split.len() as u64).to_le_bytes());
            split.hash_into(root, &mut hasher, &mut times)?;
        }
        let sha256 = hex(hasher.finalize());
        let fingerprint = Fingerprint { sha256, examples: self.train.len() + self.val.len() };
        Ok((fingerprint, times.map(|t| hex(t.finalize()))))
    }
}

/// A digest as lowercase hexadecimal.
fn hex(digest: impl AsRef<[u8]>) -> String {
    digest.as_ref().iter().map(|b| format!("{b:02x}")).collect()
}

/// A modification time as nanoseconds since 1970 (negative before), as text.
#[cfg(not(target_arch = "wasm32"))]
fn nanoseconds(time: std::time::SystemTime) -> String {
    match time.duration_since(std::time::UNIX_EPOCH) {
        Ok(after) => after.as_nanos().to_string(),
        Err(before) => format!("-{}", before.duration().as_nanos()),
    }
}

/// What a dataset is: the SHA-256 of its splits' examples, in order (an image file's path below
/// the dataset's folder, its size and its label; a CIFAR record's bytes), and how many there
/// are. A resume, an evaluation of a checkpoint and every MPI rank hold their data to it: the
/// same files wherever they are, and no other.
#[derive(Clone, Debug, PartialEq)]
pub struct Fingerprint {
    pub sha256: String,
    pub examples: usize,
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let short = self.sha256.get(..12).unwrap_or(&self.sha256);
        write!(f, "{} images, SHA-256 {short}…", self.examples)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum DatasetError {
    #[error("{}: {source}; check that it exists and can be read", path.display())]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{name}: not a decodable image ({reason}): remove or replace it")]
    Decode { name: String, reason: String },
    #[error("{name}: {problem}")]
    Image { name: String, problem: String },
    #[error("{} is not a folder: --data takes an image folder (DIR/<class>/<image>), cifar10:DIR or cifar100:DIR", path.display())]
    NotAFolder { path: PathBuf },
    #[error("{} has no class folders: an image folder holds one subfolder of images per class, DIR/<class>/<image>.png (or .jpg, .jpeg, .bmp, .webp)", dir.display())]
    NoClasses { dir: PathBuf },
    #[error("{} has a single class folder, {class}: classification needs two classes at least; add a folder of images per class", dir.display())]
    OneClass { dir: PathBuf, class: String },
    #[error("{} holds no image (.png, .jpg, .jpeg, .bmp, .webp): add images to it or remove it", dir.display())]
    EmptyClass { dir: PathBuf },
    #[error("the classes of {} and {} differ (only in train: {only_train}; only in val: {only_val}): give both the same class folders", train.display(), val.display())]
    ClassMismatch { train: PathBuf, val: PathBuf, only_train: String, only_val: String },
    #[error("no class of {} has two images, so none can be held out for validation: add images, or use a validation split of 0", dir.display())]
    TooFewImages { dir: PathBuf },
    #[error("validation split {value} is not in [0, 1): use a fraction such as 0.1 (a tenth of each class held out), or 0 for no validation")]
    ValSplit { value: f64 },
    #[error("{} lacks {missing}: {expected}", dir.display())]
    MissingFiles { dir: PathBuf, missing: String, expected: String },
    #[error("{name} is {len} bytes, not a positive multiple of the {record}-byte record: the file is truncated or of another format; download it again")]
    CifarLength { name: String, len: u64, record: usize },
    #[error("{name}: label {label} is not below the class count {classes}: the file is damaged or of another dataset; download it again")]
    CifarLabel { name: String, label: u32, classes: u32 },
    #[error("{name} lists {found} class names, not {classes}: fix it (one name a line) or remove it to use numbered names")]
    CifarNames { name: String, found: usize, classes: u32 },
    #[error("--data {spec:?}: {problem}")]
    Spec { spec: String, problem: String },
    #[error("unknown augmentation {value:?}: use none, crop-flip or resized-crop-flip")]
    Augment { value: String },
    #[error("unknown preprocessing {value:?}: use torchvision or square")]
    Preprocess { value: String },
    #[error("the synthetic dataset is generated, not opened: make its batches with data::synthetic_batch")]
    Synthetic,
    #[error(
        "{what} has no images to measure: give it images, or give the normalisation explicitly"
    )]
    NoImages { what: String },
    #[error("the system would not start {wanted} loader threads ({started} started, then: {reason}): use a smaller --workers")]
    Threads { wanted: usize, started: usize, reason: String },
    /// The data loader's threads stopped or failed; the text says how.
    #[error("the data loader failed: {0}")]
    Worker(String),
    #[error(transparent)]
    HostMemory(#[from] crate::host::OutOfMemory),
}
