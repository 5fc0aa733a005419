//! CIFAR-10 and CIFAR-100 in their binary versions (<https://www.cs.toronto.edu/~kriz/cifar.html>):
//! files of fixed-size records, a label byte (CIFAR-100: a coarse then a fine label byte) and
//! then 3072 pixel bytes, the 32×32 red plane, green plane and blue plane, each row-major.
//! Files are read whole once and kept as bytes; an image is made from its record on demand.
//! Parsing works from bytes, so the browser uses it too.

use super::dataset::{Dataset, DatasetError};
pub use super::records::CifarKind;
use super::records::{record_name, Records};

/// The class names: the names file's non-blank lines when there is one (`names`: its name and
/// text), else CIFAR-10's standard ten or CIFAR-100's class_000 … class_099.
pub fn class_names(
    kind: CifarKind,
    names: Option<(&str, &str)>,
) -> Result<Vec<String>, DatasetError> {
    let Some((name, text)) = names else {
        return Ok(match kind {
            CifarKind::Ten => [
                "airplane",
                "automobile",
                "bird",
                "cat",
                "deer",
                "dog",
                "frog",
                "horse",
                "ship",
                "truck",
            ]
            .map(String::from)
            .to_vec(),
            CifarKind::Hundred => (0..100).map(|k| format!("class_{k:03}")).collect(),
        });
    };
    let listed: Vec<String> =
        text.lines().map(str::trim).filter(|l| !l.is_empty()).map(String::from).collect();
    if listed.len() != kind.classes() as usize {
        return Err(DatasetError::CifarNames {
            name: name.to_string(),
            found: listed.len(),
            classes: kind.classes(),
        });
    }
    Ok(listed)
}

/// The records of `files` (each a name for messages and its bytes), in file order, as one
/// split. Every file must be whole records and every label below the class count.
pub fn parse(
    kind: CifarKind,
    files: Vec<(String, Vec<u8>)>,
    class_names: Vec<String>,
) -> Result<Dataset, DatasetError> {
    let record_len = kind.record_len();
    let mut records = Vec::new();
    for (f, (name, bytes)) in files.iter().enumerate() {
        if bytes.is_empty() || bytes.len() % record_len != 0 {
            return Err(DatasetError::CifarLength {
                name: name.clone(),
                len: bytes.len() as u64,
                record: record_len,
            });
        }
        for (r, record) in bytes.chunks_exact(record_len).enumerate() {
            let label = record[kind.label_offset()] as u32;
            if label >= kind.classes() {
                return Err(DatasetError::CifarLabel {
                    name: record_name(name, r),
                    label,
                    classes: kind.classes(),
                });
            }
            records.push((f as u32, r as u32));
        }
    }
    Ok(Dataset::from_records(class_names, Records::new(kind, files, records)))
}

/// The binary version's folder `dir` (cifar-10-batches-bin, or CIFAR-100's cifar-100-binary):
/// its training files are the train split and its test file the validation split.
#[cfg(not(target_arch = "wasm32"))]
pub fn open(
    dir: &std::path::Path,
    kind: CifarKind,
) -> Result<super::dataset::Splits, DatasetError> {
    if !dir.is_dir() {
        return Err(DatasetError::NotAFolder { path: dir.to_path_buf() });
    }
    let expected: Vec<&str> = kind.train_files().iter().chain(kind.val_files()).copied().collect();
    let missing: Vec<&str> = expected.iter().copied().filter(|f| !dir.join(f).is_file()).collect();
    if !missing.is_empty() {
        return Err(DatasetError::MissingFiles {
            dir: dir.to_path_buf(),
            missing: missing.join(", "),
            expected: format!(
                "{}'s binary version holds {}; point --data at the folder that holds them",
                kind.title(),
                expected.join(", ")
            ),
        });
    }
    let names_path = dir.join(kind.names_file());
    let names_text = if names_path.is_file() {
        let text = std::fs::read_to_string(&names_path)
            .map_err(|source| DatasetError::Io { path: names_path.clone(), source })?;
        Some(text)
    } else {
        None
    };
    let names_shown = names_path.display().to_string();
    let names = class_names(kind, names_text.as_deref().map(|t| (names_shown.as_str(), t)))?;
    let read = |files: &[&str]| -> Result<Vec<(String, Vec<u8>)>, DatasetError> {
        files.iter().map(|f| read_records(&dir.join(f), kind.record_len())).collect()
    };
    let train = parse(kind, read(kind.train_files())?, names.clone())?;
    let val = parse(kind, read(kind.val_files())?, names)?;
    let notes = vec![format!(
        "{}: the test split ({}) is the validation split; no fraction of the training split is held out",
        kind.title(),
        kind.val_files().join(", ")
    )];
    Ok(super::dataset::Splits { train, val, notes })
}

/// A records file whole, its length checked before it is read, its buffer reserved so that a
/// lack of memory is an error.
#[cfg(not(target_arch = "wasm32"))]
fn read_records(
    path: &std::path::Path,
    record_len: usize,
) -> Result<(String, Vec<u8>), DatasetError> {
    use std::io::Read;
    let io = |source| DatasetError::Io { path: path.to_path_buf(), source };
    let mut file = std::fs::File::open(path).map_err(io)?;
    let len = file.metadata().map_err(io)?.len();
    let name = path.display().to_string();
    if len == 0 || len % record_len as u64 != 0 {
        return Err(DatasetError::CifarLength { name, len, record: record_len });
    }
    let mut bytes =
        crate::host::vec_with_capacity(usize::try_from(len).unwrap_or(usize::MAX), "a CIFAR file")?;
    file.read_to_end(&mut bytes).map_err(io)?;
    Ok((name, bytes))
}

#[cfg(test)]
mod tests {
    use super::super::records::PLANE;
    use super::*;

    /// A record whose pixel (x, y) is R = x + 32y (mod 256), G = 255 − R, B = 8x.
    fn record(kind: CifarKind, label: u8) -> Vec<u8> {
        let mut r = vec![label; kind.label_offset() + 1];
        if kind == CifarKind::Hundred {
            r[0] = 19; // a coarse label, not the one trained on
        }
        let red: Vec<u8> = (0..PLANE).map(|p| (p % 256) as u8).collect();
        r.extend(&red);
        r.extend(red.iter().map(|v| 255 - v));
        r.extend((0..PLANE).map(|p| (8 * (p % 32)) as u8));
        r
    }

    fn file(kind: CifarKind, labels: &[u8]) -> Vec<u8> {
        labels.iter().flat_map(|&l| record(kind, l)).collect()
    }

    #[test]
    fn records_decode_planes_to_rgb_pixels_and_take_the_fine_label() {
        for (kind, labels) in [(CifarKind::Ten, [3, 9, 0]), (CifarKind::Hundred, [42, 99, 0])] {
            assert_eq!(kind.record_len(), 3073 + kind.label_offset());
            let files = vec![
                ("a.bin".to_string(), file(kind, &labels[..2])),
                ("b.bin".to_string(), file(kind, &labels[2..])),
            ];
            let ds = parse(kind, files, class_names(kind, None).unwrap()).unwrap();
            assert_eq!((ds.len(), ds.classes()), (3, kind.classes()));
            assert_eq!(
                (ds.label(0), ds.label(1), ds.label(2)),
                (labels[0] as u32, labels[1] as u32, 0)
            );
            assert_eq!(ds.name(2), "b.bin, record 0");
            let img = ds.decode(1).unwrap();
            assert_eq!(img.dimensions(), (32, 32));
            // (5, 7): p = 229.
            assert_eq!(img.get_pixel(5, 7).0, [229, 26, 40]);
            assert_eq!(img.get_pixel(31, 0).0, [31, 224, 248]);
            let sub = ds.subset(&[2, 1]);
            assert_eq!((sub.label(0), sub.name(1)), (0, "a.bin, record 1".to_string()));
        }
        assert_eq!(class_names(CifarKind::Ten, None).unwrap()[9], "truck");
        assert_eq!(class_names(CifarKind::Hundred, None).unwrap()[7], "class_007");
    }

    #[test]
    fn a_wrong_length_a_label_past_the_classes_or_a_bad_names_file_is_refused() {
        let kind = CifarKind::Ten;
        let names = class_names(kind, None).unwrap();
        let mut short = file(kind, &[1, 2]);
        short.pop();
        let e = parse(kind, vec![("x.bin".into(), short)], names.clone()).unwrap_err().to_string();
        assert!(e.contains("x.bin is 6145 bytes") && e.contains("3073-byte"), "{e}");
        let e = parse(kind, vec![("e.bin".into(), vec![])], names.clone()).unwrap_err();
        assert!(matches!(e, DatasetError::CifarLength { len: 0, .. }), "{e}");
        let e = parse(kind, vec![("y.bin".into(), file(kind, &[1, 10]))], names).unwrap_err();
        assert!(e.to_string().contains("y.bin, record 1: label 10"), "{e}");
        // CIFAR-100 records read as CIFAR-10 are the wrong length.
        let hundred = file(CifarKind::Hundred, &[5]);
        let e = parse(kind, vec![("t.bin".into(), hundred)], vec![]).unwrap_err();
        assert!(matches!(e, DatasetError::CifarLength { len: 3074, record: 3073, .. }), "{e}");
        let e = class_names(kind, Some(("m.txt", "cat\ndog\n\n"))).unwrap_err().to_string();
        assert!(e.contains("m.txt lists 2 class names, not 10"), "{e}");
    }

    #[test]
    fn open_reads_the_folder_and_names_what_is_missing() {
        let tmp = tempfile::Builder::new().prefix("syncstep-test-cifar-").tempdir().unwrap();
        let dir = tmp.path();
        let kind = CifarKind::Ten;
        for (k, name) in kind.train_files().iter().enumerate() {
            std::fs::write(dir.join(name), file(kind, &[k as u8, 7])).unwrap();
        }
        let e = open(dir, kind).unwrap_err().to_string();
        assert!(e.contains("lacks test_batch.bin") && e.contains("data_batch_5.bin"), "{e}");
        std::fs::write(dir.join("test_batch.bin"), file(kind, &[8, 8, 2])).unwrap();
        let names: String = (0..10).map(|k| format!("name{k}\n")).collect();
        std::fs::write(dir.join("batches.meta.txt"), names + "\n\n").unwrap();
        let splits = open(dir, kind).unwrap();
        assert_eq!((splits.train.len(), splits.val.len()), (10, 3));
        assert_eq!(splits.train.label(4), 2);
        assert!(splits.train.name(4).ends_with("data_batch_3.bin, record 0"));
        assert_eq!(splits.val.class_names[8], "name8");
        assert!(splits.notes[0].contains("test_batch.bin"));
        std::fs::write(dir.join("data_batch_2.bin"), vec![1u8; 100]).unwrap();
        let e = open(dir, kind).unwrap_err().to_string();
        assert!(e.contains("data_batch_2.bin is 100 bytes"), "{e}");
        let e = open(&dir.join("nothing"), kind).unwrap_err().to_string();
        assert!(e.contains("is not a folder"), "{e}");
    }
}
