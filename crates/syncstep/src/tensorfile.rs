//! safetensors files: reading weights, batches and checkpoints (any float or integer dtype,
//! converted on the way in) and writing f32 tensors, as bytes or atomically to a file
//! (`files::write_atomic`: a failed write never leaves a half-written file where a good one was). Files syncstep writes carry
//! in their header the SHA-256 of every byte a reader reads (`sha256_header_and_data`: the
//! header's tensors and metadata, then the data); a reader checks it, so a flipped bit, in a
//! tensor or in a recorded setting, is an error, not a different model or run.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, SafeTensors, TensorView};

#[derive(Debug, thiserror::Error)]
pub enum TensorFileError {
    #[error("{path}: {message}")]
    Io { path: PathBuf, message: String },
    #[error("{path}: not a valid safetensors file ({message}); is it truncated or corrupt?")]
    Corrupt { path: PathBuf, message: String },
    #[error("{path}: {what}, not a safetensors file")]
    OtherFormat { path: PathBuf, what: &'static str },
    #[error("{path}: tensor `{name}` has dtype {dtype:?}, which syncstep cannot read (use f32, f64, f16, bf16 or an integer type)")]
    Dtype { path: PathBuf, name: String, dtype: Dtype },
    #[error("{path}: missing tensor `{name}`")]
    Missing { path: PathBuf, name: String },
    #[error("{path}: tensor `{name}` has shape {got:?}, expected {expected:?}")]
    Shape { path: PathBuf, name: String, got: Vec<usize>, expected: Vec<usize> },
    #[error("{path}: its {what} does not match the SHA-256 its header records: the file is corrupt or was edited (a flipped bit, a bad copy, a changed setting); use another copy")]
    Checksum { path: PathBuf, what: &'static str },
}

/// The header key of the SHA-256 (hex) of every byte a reader reads: the header's tensors
/// (name, dtype, shape, place) and metadata (but this key), in a canonical order, then the
/// tensor data. Files this build writes carry it.
pub const CHECKSUM_KEY: &str = "sha256_header_and_data";

/// The header key of earlier builds' SHA-256 (hex) of the tensor data alone, checked where a
/// file has it and not [`CHECKSUM_KEY`].
pub const DATA_CHECKSUM_KEY: &str = "sha256";

fn hex(digest: &[u8]) -> String {
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

/// The SHA-256 of a safetensors file's tensor data (what follows the header), in hex.
fn data_checksum(bytes: &[u8]) -> Option<String> {
    use sha2::Digest;
    let header = u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?);
    let data = bytes.get(8usize.checked_add(usize::try_from(header).ok()?)?..)?;
    Some(hex(&sha2::Sha256::digest(data)))
}

/// The SHA-256 [`CHECKSUM_KEY`] records, in hex: each tensor's name, dtype, shape and offsets
/// by name, each metadata entry but that key's by key (every text preceded by its length, so
/// that no two headers hash alike), then the data. Independent of the header's layout.
fn checksum(bytes: &[u8]) -> Option<String> {
    use sha2::Digest;
    let (header_len, header) = SafeTensors::read_metadata(bytes).ok()?;
    let data = bytes.get(8usize.checked_add(header_len)?..)?;
    let mut hasher = sha2::Sha256::new();
    let mut field = |text: &str| {
        hasher.update((text.len() as u64).to_le_bytes());
        hasher.update(text.as_bytes());
    };
    let mut tensors: Vec<_> = header.tensors().into_iter().collect();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    for (name, info) in tensors {
        let (start, end) = info.data_offsets;
        field(&format!("{name} {:?} {:?} {start} {end}", info.dtype, info.shape));
    }
    let mut metadata: Vec<_> = header.metadata().iter().flatten().collect();
    metadata.sort();
    for (key, value) in metadata.into_iter().filter(|(key, _)| *key != CHECKSUM_KEY) {
        field(key);
        field(value);
    }
    hasher.update(data);
    Some(hex(&hasher.finalize()))
}

/// Checks the SHA-256 the header records ([`CHECKSUM_KEY`], else [`DATA_CHECKSUM_KEY`]), if any.
fn verify(
    path: &Path,
    bytes: &[u8],
    metadata: &BTreeMap<String, String>,
) -> Result<(), TensorFileError> {
    let (want, got, what) = match (metadata.get(CHECKSUM_KEY), metadata.get(DATA_CHECKSUM_KEY)) {
        (Some(want), _) => (want, checksum(bytes), "header or tensor data"),
        (None, Some(want)) => (want, data_checksum(bytes), "tensor data"),
        (None, None) => return Ok(()),
    };
    if got.as_deref() != Some(want.as_str()) {
        return Err(TensorFileError::Checksum { path: path.into(), what });
    }
    Ok(())
}

/// One tensor as read: its shape, its values widened to f64 (exact for f32 and for integers
/// below 2^53), and whether the file stored it as an integer type.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    pub shape: Vec<usize>,
    pub values: Vec<f64>,
    pub integer: bool,
}

/// The tensors of one file, by name.
#[derive(Clone, Debug, Default)]
pub struct TensorFile {
    pub path: PathBuf,
    pub tensors: BTreeMap<String, Tensor>,
    /// The header's `__metadata__` string map.
    pub metadata: BTreeMap<String, String>,
}

impl TensorFile {
    /// Reads a file (native only: a browser has no file system; use [`TensorFile::from_bytes`]).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn read(path: &Path) -> Result<TensorFile, TensorFileError> {
        let bytes = crate::files::read_input(path)
            .map_err(|e| TensorFileError::Io { path: path.into(), message: e.to_string() })?;
        TensorFile::from_bytes(path, &bytes)
    }

    pub fn from_bytes(path: &Path, bytes: &[u8]) -> Result<TensorFile, TensorFileError> {
        let st = SafeTensors::deserialize(bytes).map_err(|e| not_safetensors(path, bytes, e))?;
        let (_, header) = SafeTensors::read_metadata(bytes)
            .map_err(|e| TensorFileError::Corrupt { path: path.into(), message: e.to_string() })?;
        let metadata: BTreeMap<String, String> =
            header.metadata().clone().unwrap_or_default().into_iter().collect();
        verify(path, bytes, &metadata)?;
        let mut tensors = BTreeMap::new();
        for (name, view) in st.iter() {
            let len = view.shape().iter().product();
            let mut values = crate::host::vec_with_capacity(len, "reading a tensor file")
                .map_err(|e| TensorFileError::Io { path: path.into(), message: e.to_string() })?;
            let integer = decode(&view, &mut values).ok_or_else(|| TensorFileError::Dtype {
                path: path.into(),
                name: name.into(),
                dtype: view.dtype(),
            })?;
            tensors
                .insert(name.to_string(), Tensor { shape: view.shape().to_vec(), values, integer });
        }
        Ok(TensorFile { path: path.into(), tensors, metadata })
    }

    pub fn get(&self, name: &str) -> Option<&Tensor> {
        self.tensors.get(name)
    }

    /// The tensor `name`, which must exist and have `shape`.
    pub fn require(&self, name: &str, shape: &[usize]) -> Result<&Tensor, TensorFileError> {
        let t = self.get(name).ok_or_else(|| TensorFileError::Missing {
            path: self.path.clone(),
            name: name.into(),
        })?;
        self.check_shape(name, t, shape)?;
        Ok(t)
    }

    /// The tensor `name` if present, checked against `shape`.
    pub fn optional(
        &self,
        name: &str,
        shape: &[usize],
    ) -> Result<Option<&Tensor>, TensorFileError> {
        match self.get(name) {
            Some(t) => self.check_shape(name, t, shape).map(|_| Some(t)),
            None => Ok(None),
        }
    }

    fn check_shape(&self, name: &str, t: &Tensor, shape: &[usize]) -> Result<(), TensorFileError> {
        if t.shape != shape {
            return Err(TensorFileError::Shape {
                path: self.path.clone(),
                name: name.into(),
                got: t.shape.clone(),
                expected: shape.to_vec(),
            });
        }
        Ok(())
    }
}

/// The header of a safetensors file: its tensors' names and its metadata.
#[derive(Debug, Default)]
pub struct Header {
    pub tensors: Vec<String>,
    pub metadata: BTreeMap<String, String>,
}

/// Why `bytes` are not a safetensors file: another format's, told by its first bytes, or a
/// safetensors file cut short or damaged.
fn not_safetensors(path: &Path, bytes: &[u8], e: impl std::fmt::Display) -> TensorFileError {
    match other_format(bytes) {
        Some(what) => TensorFileError::OtherFormat { path: path.into(), what },
        None => TensorFileError::Corrupt { path: path.into(), message: e.to_string() },
    }
}

/// What a file whose first bytes are `start` is, when they are another format's signature that
/// a user may give for weights.
fn other_format(start: &[u8]) -> Option<&'static str> {
    let torch = "a PyTorch file (torch.save): save its state_dict with safetensors.torch.save_file (docs/data.md)";
    match start {
        [0x89, b'P', b'N', b'G', ..] => Some("a PNG image"),
        [0xFF, 0xD8, 0xFF, ..] => Some("a JPEG image"),
        [b'P', b'K', 3, 4, ..] | [0x80, 2..=5, ..] => Some(torch),
        _ => None,
    }
}

/// The header of the safetensors file at `path`, read alone (a checkpoint's data is hundreds
/// of megabytes): enough to tell what a file is. Native only.
#[cfg(not(target_arch = "wasm32"))]
pub fn read_header(path: &Path) -> Result<Header, TensorFileError> {
    use std::io::Read;
    let io = |e: std::io::Error| TensorFileError::Io { path: path.into(), message: e.to_string() };
    let mut file = crate::files::open_input(path).map_err(io)?;
    let mut start = [0u8; 8];
    file.read_exact(&mut start).map_err(|e| not_safetensors(path, &start, e))?;
    // safetensors' own bound on a header.
    let len = u64::from_le_bytes(start).min(100_000_000);
    let mut text = Vec::new();
    file.take(len).read_to_end(&mut text).map_err(io)?;
    let header: BTreeMap<String, serde_json::Value> =
        serde_json::from_slice(&text).map_err(|e| not_safetensors(path, &start, e))?;
    let mut out = Header::default();
    for (name, value) in header {
        match (name.as_str(), value) {
            ("__metadata__", serde_json::Value::Object(entries)) => {
                let text = entries.into_iter().filter_map(|(k, v)| Some((k, v.as_str()?.into())));
                out.metadata = text.collect();
            }
            _ => out.tensors.push(name),
        }
    }
    Ok(out)
}

/// Appends the tensor's values, widened to f64, to `out`; whether it is an integer type, or
/// `None` for a dtype syncstep does not read.
fn decode(view: &TensorView, out: &mut Vec<f64>) -> Option<bool> {
    let d = view.data();
    let mut le = |f: &dyn Fn(&[u8]) -> f64, size: usize| out.extend(d.chunks_exact(size).map(f));
    let b = |c: &[u8]| -> [u8; 2] { c.try_into().unwrap() };
    let w = |c: &[u8]| -> [u8; 4] { c.try_into().unwrap() };
    let q = |c: &[u8]| -> [u8; 8] { c.try_into().unwrap() };
    match view.dtype() {
        Dtype::F64 => le(&|c| f64::from_le_bytes(q(c)), 8),
        Dtype::F32 => le(&|c| f32::from_le_bytes(w(c)) as f64, 4),
        Dtype::F16 => le(&|c| half::f16::from_le_bytes(b(c)).to_f64(), 2),
        Dtype::BF16 => le(&|c| half::bf16::from_le_bytes(b(c)).to_f64(), 2),
        Dtype::I64 => le(&|c| i64::from_le_bytes(q(c)) as f64, 8),
        Dtype::I32 => le(&|c| i32::from_le_bytes(w(c)) as f64, 4),
        Dtype::I16 => le(&|c| i16::from_le_bytes(b(c)) as f64, 2),
        Dtype::I8 => le(&|c| c[0] as i8 as f64, 1),
        Dtype::U8 => le(&|c| c[0] as f64, 1),
        Dtype::U32 => le(&|c| u32::from_le_bytes(w(c)) as f64, 4),
        Dtype::U64 => le(&|c| u64::from_le_bytes(q(c)) as f64, 8),
        _ => return None,
    }
    Some(!matches!(view.dtype(), Dtype::F64 | Dtype::F32 | Dtype::F16 | Dtype::BF16))
}

/// f32 tensors to write: name, shape, values.
pub type Entry<'a> = (String, Vec<usize>, &'a [f32]);

/// i64 tensors to write (labels, as PyTorch keeps them): name, shape, values.
pub type IntEntry<'a> = (String, Vec<usize>, &'a [i64]);

/// Writes `entries` as f32 safetensors (with `metadata` in the header, and the data's SHA-256)
/// to `path` atomically. Native only (a browser has no file system).
#[cfg(not(target_arch = "wasm32"))]
pub fn write_f32(
    path: &Path,
    entries: &[Entry],
    metadata: &BTreeMap<String, String>,
) -> Result<(), TensorFileError> {
    write_f32_i64(path, entries, &[], metadata)
}

/// [`write_f32`], and `ints` as i64 tensors.
#[cfg(not(target_arch = "wasm32"))]
pub fn write_f32_i64(
    path: &Path,
    entries: &[Entry],
    ints: &[IntEntry],
    metadata: &BTreeMap<String, String>,
) -> Result<(), TensorFileError> {
    let bytes = f32_i64_bytes(path, entries, ints, metadata)?;
    crate::files::write_atomic(path, &bytes)
        .map_err(|e| TensorFileError::Io { path: path.into(), message: e.to_string() })
}

/// The bytes [`write_f32_i64`] writes (what a browser hands the visitor to save); `name`
/// names the file in errors.
pub fn f32_i64_bytes(
    name: &Path,
    entries: &[Entry],
    ints: &[IntEntry],
    metadata: &BTreeMap<String, String>,
) -> Result<Vec<u8>, TensorFileError> {
    let io = |message: String| TensorFileError::Io { path: name.into(), message };
    let floats = entries.iter().map(|(n, s, v)| (n, s, Dtype::F32, bytemuck::cast_slice(v)));
    let ints = ints.iter().map(|(n, s, v)| (n, s, Dtype::I64, bytemuck::cast_slice(v)));
    let serialize = |metadata: &BTreeMap<String, String>| {
        let views = floats
            .clone()
            .chain(ints.clone())
            .map(|(n, shape, dtype, bytes)| {
                TensorView::new(dtype, shape.clone(), bytes)
                    .map(|view| (n.clone(), view))
                    .map_err(|e| io(format!("tensor `{n}`: {e}")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let info = (!metadata.is_empty()).then(|| metadata.clone().into_iter().collect());
        let bytes = safetensors::tensor::serialize(views, info).map_err(|e| io(e.to_string()))?;
        sorted_metadata(bytes).ok_or_else(|| io("the serialised file has no header to sort".into()))
    };
    // The hash leaves out its own entry: serialise once to hash, once with the hash.
    let mut metadata = metadata.clone();
    metadata.remove(DATA_CHECKSUM_KEY);
    let checksum = checksum(&serialize(&metadata)?)
        .ok_or_else(|| io("the serialised file has no header to hash".into()))?;
    metadata.insert(CHECKSUM_KEY.into(), checksum);
    serialize(&metadata)
}

/// `bytes` (a safetensors file) with its header's metadata sorted by key. The safetensors crate
/// writes the metadata from a `HashMap`, in an order that changes from one process to the next:
/// sorted, the same run writes the same bytes. The header keeps its length (the same text in
/// another order), so the data and its offsets stay where they are.
fn sorted_metadata(mut bytes: Vec<u8>) -> Option<Vec<u8>> {
    let len = usize::try_from(u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?)).ok()?;
    let header = bytes.get_mut(8..8usize.checked_add(len)?)?;
    let mut doc: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(header.trim_ascii_end()).ok()?;
    if let Some(serde_json::Value::Object(metadata)) = doc.get_mut("__metadata__") {
        metadata.sort_keys();
    }
    let text = serde_json::to_vec(&doc).ok()?;
    let padding = header.len().checked_sub(text.len())?;
    header[..text.len()].copy_from_slice(&text);
    header[text.len()..].fill(b' ');
    (padding < 8).then_some(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_shape_errors() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.safetensors");
        let v = [1.0f32, -2.5, 3.25, 4.0];
        let meta = BTreeMap::from([("step".to_string(), "3".to_string())]);
        write_f32(&path, &[("w".into(), vec![2, 2], &v)], &meta).unwrap();
        let f = TensorFile::read(&path).unwrap();
        assert_eq!(f.metadata.get("step"), meta.get("step"));
        assert_eq!(f.metadata.get(CHECKSUM_KEY).map(String::len), Some(64));
        assert_eq!(f.require("w", &[2, 2]).unwrap().values, vec![1.0, -2.5, 3.25, 4.0]);
        let e = f.require("w", &[4]).unwrap_err().to_string();
        assert!(e.contains("`w` has shape [2, 2], expected [4]"), "{e}");
        assert!(f.require("x", &[1]).unwrap_err().to_string().contains("missing tensor `x`"));
        let bytes = std::fs::read(&path).unwrap();
        let e = TensorFile::from_bytes(&path, &bytes[..bytes.len() - 3]).unwrap_err().to_string();
        assert!(e.contains("truncated or corrupt"), "{e}");
        // One flipped bit in the data: the checksum says so.
        let mut flipped = bytes.clone();
        *flipped.last_mut().unwrap() ^= 0x10;
        let e = TensorFile::from_bytes(&path, &flipped).unwrap_err().to_string();
        assert!(e.contains("does not match the SHA-256"), "{e}");
        // One changed byte in a recorded setting, the header's length kept: the same.
        let setting = b"\"step\":\"3\"";
        let at = bytes.windows(setting.len()).position(|w| w == setting).unwrap();
        let mut edited = bytes.clone();
        edited[at + setting.len() - 2] = b'4';
        let e = TensorFile::from_bytes(&path, &edited).unwrap_err().to_string();
        assert!(e.contains("header or tensor data does not match the SHA-256"), "{e}");
        let header = read_header(&path).unwrap();
        assert_eq!(
            (header.tensors, header.metadata.get("step")),
            (vec!["w".into()], meta.get("step"))
        );
    }

    /// The same tensors and settings written twice are the same bytes, the settings sorted.
    #[test]
    fn a_file_is_written_the_same_way_every_time() {
        let dir = tempfile::tempdir().unwrap();
        let meta: BTreeMap<String, String> =
            (0..16).map(|k| (format!("setting_{k:02}"), k.to_string())).collect();
        let write = |name: &str| {
            let path = dir.path().join(name);
            write_f32(
                &path,
                &[("w".into(), vec![2], &[1.0, 2.0]), ("b".into(), vec![1], &[3.0])],
                &meta,
            )
            .unwrap();
            std::fs::read(path).unwrap()
        };
        let (first, second) = (write("a.safetensors"), write("b.safetensors"));
        assert_eq!(first, second);
        let text = String::from_utf8_lossy(&first);
        let at = |key: &str| text.find(&format!("\"{key}\"")).unwrap();
        let keys: Vec<usize> = meta.keys().map(|k| at(k)).collect();
        assert!(keys.is_sorted(), "the metadata's keys in order: {keys:?}");
        assert_eq!(TensorFile::from_bytes(Path::new("a"), &first).unwrap().metadata.len(), 17);
    }

    #[test]
    fn unwritable_path_is_an_error_and_keeps_the_old_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keep.safetensors");
        write_f32(&path, &[("a".into(), vec![1], &[1.0])], &BTreeMap::new()).unwrap();
        let bad = dir.path().join("no/such/dir/x.safetensors");
        assert!(write_f32(&bad, &[("a".into(), vec![1], &[2.0])], &BTreeMap::new()).is_err());
        assert_eq!(TensorFile::read(&path).unwrap().get("a").unwrap().values, vec![1.0]);
    }

    #[test]
    fn half_precision_tensors_are_read() {
        // 1, -2, the smallest subnormal, 65504 (f16's largest), infinity; bf16 the same where
        // it can say it (1, -2, 2^-133, 65536).
        let f16 = [0x3c00u16, 0xc000, 0x0001, 0x7bff, 0x7c00];
        let bf16 = [0x3f80u16, 0xc000, 0x0001, 0x4780];
        let bytes = |h: &[u16]| h.iter().flat_map(|h| h.to_le_bytes()).collect::<Vec<u8>>();
        let (f16_bytes, bf16_bytes) = (bytes(&f16), bytes(&bf16));
        let views = [
            ("h", TensorView::new(Dtype::F16, vec![5], &f16_bytes).unwrap()),
            ("b", TensorView::new(Dtype::BF16, vec![4], &bf16_bytes).unwrap()),
        ];
        let file = safetensors::tensor::serialize(views, None).unwrap();
        let f = TensorFile::from_bytes(Path::new("half.safetensors"), &file).unwrap();
        let h = f.require("h", &[5]).unwrap();
        assert_eq!(h.values, [1.0, -2.0, 2f64.powi(-24), 65504.0, f64::INFINITY]);
        assert!(!h.integer);
        assert_eq!(f.require("b", &[4]).unwrap().values, [1.0, -2.0, 2f64.powi(-133), 65536.0]);
    }
}
