//! Datasets of images: what `--data` names, the train and validation splits it opens to, and
//! one example's image, decoded only when a batch asks for it (an image folder can hold a
//! million files; a scan reads names, never pixels).

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

pub use super::dataset::decode_bytes;
#[cfg(not(target_arch = "wasm32"))]
pub use super::dataset::decode_file;
pub use super::dataset::{
    hold_out, is_image, Dataset, DatasetError, Fingerprint, Labelled, RgbImage, Splits, EXTENSIONS,
    MAX_PIXELS,
};

/// The splits of an image folder given as its files' paths (`root/<class>/<image>`, as a
/// browser's folder picker gives them) and bytes, decoded now: classes are the images' folders,
/// sorted by name; other files are skipped (and counted in a note); `val_split` of each class
/// is held out as [`hold_out`] does. Their fingerprint below `root` is that of the same folder
/// opened from disk (`open`), so a run on it continues natively on that folder.
pub fn folder_in_memory(
    files: Vec<(String, Vec<u8>)>,
    val_split: f64,
    seed: u64,
) -> Result<Splits, DatasetError> {
    if !(0.0..1.0).contains(&val_split) {
        return Err(DatasetError::ValSplit { value: val_split });
    }
    let mut by_class: std::collections::BTreeMap<String, Vec<(String, Vec<u8>)>> =
        Default::default();
    let mut skipped = 0;
    for (path, bytes) in files {
        let parts: Vec<&str> = path.split('/').filter(|p| !p.is_empty()).collect();
        match parts.as_slice() {
            [_root, .., class, name] if is_image(Path::new(name)) && !name.starts_with('.') => {
                by_class.entry(class.to_string()).or_default().push((path.clone(), bytes))
            }
            _ => skipped += 1,
        }
    }
    let root = || PathBuf::from("the folder picked");
    match by_class.len() {
        0 => return Err(DatasetError::NoClasses { dir: root() }),
        1 => {
            let class = by_class.into_keys().next().unwrap_or_default();
            return Err(DatasetError::OneClass { dir: root(), class });
        }
        _ => {}
    }
    let class_names: Vec<String> = by_class.keys().cloned().collect();
    let mut classes = Vec::with_capacity(class_names.len());
    for (_, mut files) in by_class {
        files.sort_by(|a, b| a.0.cmp(&b.0));
        let mut images = Vec::with_capacity(files.len());
        for (path, bytes) in files {
            let img = decode_bytes(&bytes, || path.clone())?;
            images.push(((path, bytes.len() as u64), img));
        }
        classes.push(images);
    }
    let (train, val) = hold_out(classes, val_split, seed);
    let mut notes = vec![format!(
        "{:.0}% of each class held out for validation (seed {seed})",
        100.0 * val_split
    )];
    if skipped > 0 {
        notes.push(format!(
            "skipped {skipped} files that are not .{} images in a class folder",
            EXTENSIONS.join(", .")
        ));
    }
    let dataset = |examples: Labelled<((String, u64), RgbImage)>| {
        let (named, labels): (Vec<_>, Vec<u32>) = examples.into_iter().unzip();
        let (files, images): (Vec<(String, u64)>, Vec<RgbImage>) = named.into_iter().unzip();
        let images = images.into_iter().zip(labels).collect();
        Dataset::from_images_of_files(class_names.clone(), images, files)
    };
    Ok(Splits { train: dataset(train), val: dataset(val), notes })
}

/// Where examples come from, as the --data flag names it.
#[derive(Clone, Debug, PartialEq)]
pub enum DataSpec {
    Synthetic,
    Folder(PathBuf),
    Cifar10(PathBuf),
    Cifar100(PathBuf),
}

impl FromStr for DataSpec {
    type Err = DatasetError;

    /// "synthetic", "cifar10:DIR", "cifar100:DIR", or any other text: an image folder.
    fn from_str(s: &str) -> Result<DataSpec, DatasetError> {
        let dir = |rest: &str, format: &str| {
            if rest.is_empty() {
                Err(DatasetError::Spec {
                    spec: s.to_string(),
                    problem: format!("name the folder of the {format} binary files after the colon, e.g. {format}:data/cifar"),
                })
            } else {
                Ok(PathBuf::from(rest))
            }
        };
        if s == "synthetic" {
            Ok(DataSpec::Synthetic)
        } else if let Some(rest) = s.strip_prefix("cifar100:") {
            Ok(DataSpec::Cifar100(dir(rest, "cifar100")?))
        } else if let Some(rest) = s.strip_prefix("cifar10:") {
            Ok(DataSpec::Cifar10(dir(rest, "cifar10")?))
        } else if s.is_empty() {
            Err(DatasetError::Spec {
                spec: s.to_string(),
                problem: "name an image folder, cifar10:DIR, cifar100:DIR or synthetic".into(),
            })
        } else {
            Ok(DataSpec::Folder(PathBuf::from(s)))
        }
    }
}

impl DataSpec {
    /// This spec with its folder's path absolute, every link and `..` resolved: the same data
    /// from any working folder, however it is spelt. An error when the folder is not there.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn canonical(&self) -> Result<DataSpec, DatasetError> {
        let canonical = |dir: &Path| {
            std::fs::canonicalize(dir)
                .map_err(|source| DatasetError::Io { path: dir.into(), source })
        };
        Ok(match self {
            DataSpec::Synthetic => DataSpec::Synthetic,
            DataSpec::Folder(dir) => DataSpec::Folder(canonical(dir)?),
            DataSpec::Cifar10(dir) => DataSpec::Cifar10(canonical(dir)?),
            DataSpec::Cifar100(dir) => DataSpec::Cifar100(canonical(dir)?),
        })
    }

    /// The file or folder the examples are read from; None for the synthetic dataset.
    pub fn path(&self) -> Option<&Path> {
        match self {
            DataSpec::Synthetic => None,
            DataSpec::Folder(dir) | DataSpec::Cifar10(dir) | DataSpec::Cifar100(dir) => Some(dir),
        }
    }
}

impl fmt::Display for DataSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DataSpec::Synthetic => write!(f, "synthetic"),
            DataSpec::Cifar10(dir) => write!(f, "cifar10:{}", dir.display()),
            DataSpec::Cifar100(dir) => write!(f, "cifar100:{}", dir.display()),
            DataSpec::Folder(dir) => {
                // A folder named like another spec reads back as that spec unless marked local.
                let text = dir.display().to_string();
                match text.parse() {
                    Ok(DataSpec::Folder(_)) => write!(f, "{text}"),
                    _ => write!(f, "./{text}"),
                }
            }
        }
    }
}

/// Opens a dataset (native): the splits of `spec`. `val_split` (in [0, 1)) is the fraction of
/// each class held out with `seed` where the dataset has no validation split of its own.
#[cfg(not(target_arch = "wasm32"))]
pub fn open(spec: &DataSpec, val_split: f64, seed: u64) -> Result<Splits, DatasetError> {
    if !(0.0..1.0).contains(&val_split) {
        return Err(DatasetError::ValSplit { value: val_split });
    }
    match spec {
        DataSpec::Synthetic => Err(DatasetError::Synthetic),
        DataSpec::Folder(dir) => super::folder::open(dir, val_split, seed),
        DataSpec::Cifar10(dir) => super::cifar::open(dir, super::cifar::CifarKind::Ten),
        DataSpec::Cifar100(dir) => super::cifar::open(dir, super::cifar::CifarKind::Hundred),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn png(shade: u8) -> Vec<u8> {
        let img = RgbImage::from_fn(5, 4, |x, y| image::Rgb([shade, x as u8 * 40, y as u8 * 50]));
        let mut bytes = std::io::Cursor::new(Vec::new());
        img.write_to(&mut bytes, image::ImageFormat::Png).unwrap();
        bytes.into_inner()
    }

    #[test]
    fn a_folder_in_memory_is_split_by_class_and_bad_files_are_named() {
        let mut files = vec![
            ("pick/notes.txt".to_string(), b"not an image".to_vec()),
            ("pick/top.png".to_string(), png(1)),
        ];
        for i in 0..5u8 {
            files.push((format!("pick/zebra/{i}.png"), png(100 + i)));
            files.push((format!("pick/ant/{i}.PNG"), png(10 + i)));
        }
        let splits = folder_in_memory(files.clone(), 0.2, 3).unwrap();
        assert_eq!(splits.train.class_names, ["ant", "zebra"]);
        assert_eq!((splits.train.len(), splits.val.len()), (8, 2));
        assert!(splits.notes.iter().any(|n| n.contains("skipped 2 files")), "{:?}", splits.notes);
        assert!(splits.val.name(0).starts_with("pick/ant/"), "{}", splits.val.name(0));
        let ants = (0..8).filter(|&i| splits.train.label(i) == 0).count();
        assert_eq!(ants, 4);
        assert_eq!(splits.train.decode(0).unwrap().get_pixel(0, 0).0[0] / 10, 1);

        files.push(("pick/ant/broken.png".to_string(), png(9)[..30].to_vec()));
        let e = folder_in_memory(files, 0.2, 3).unwrap_err().to_string();
        assert!(e.contains("pick/ant/broken.png"), "{e}");
        let one = vec![("pick/ant/0.png".to_string(), png(1))];
        assert!(matches!(folder_in_memory(one, 0.2, 3), Err(DatasetError::OneClass { .. })));
    }

    /// A folder read into memory (a browser's folder picker) is the same data as the folder
    /// opened from disk: the same split, and the same fingerprint below its root.
    #[test]
    fn a_folder_in_memory_has_the_fingerprint_of_the_folder_on_disk() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("pick");
        let mut files = Vec::new();
        for (class, count) in [("ant", 5u8), ("bee", 3)] {
            std::fs::create_dir_all(root.join(class)).unwrap();
            for i in 0..count {
                let bytes = png(10 * i + count);
                std::fs::write(root.join(class).join(format!("{i}.png")), &bytes).unwrap();
                files.push((format!("pick/{class}/{i}.png"), bytes));
            }
        }
        let memory = folder_in_memory(files, 0.2, 7).unwrap();
        let disk = open(&DataSpec::Folder(root.clone()), 0.2, 7).unwrap();
        let names =
            |d: &Dataset| (0..d.len()).map(|i| d.name(i).replace('\\', "/")).collect::<Vec<_>>();
        let tail = |names: Vec<String>| {
            names.into_iter().map(|n| n[n.find("pick/").unwrap()..].to_string()).collect::<Vec<_>>()
        };
        assert_eq!(tail(names(&memory.val)), tail(names(&disk.val)));
        let fingerprint = memory.fingerprint(Path::new("pick")).unwrap();
        assert_eq!(fingerprint, disk.fingerprint(&root).unwrap());
        assert_eq!(fingerprint.examples, 8);
    }

    /// `img` encoded as `format`.
    fn encoded(img: &RgbImage, format: image::ImageFormat) -> Vec<u8> {
        let mut bytes = std::io::Cursor::new(Vec::new());
        img.write_to(&mut bytes, format).unwrap();
        bytes.into_inner()
    }

    #[test]
    fn an_image_cut_short_or_too_large_is_an_error_naming_it() {
        let img = RgbImage::from_fn(64, 48, |x, y| image::Rgb([x as u8 * 4, y as u8 * 5, 90]));
        let name = || "cat.jpg".to_string();
        for format in [
            image::ImageFormat::Jpeg,
            image::ImageFormat::Png,
            image::ImageFormat::Bmp,
            image::ImageFormat::WebP,
        ] {
            let bytes = encoded(&img, format);
            assert_eq!(decode_bytes(&bytes, name).unwrap().dimensions(), (64, 48));
            let e = decode_bytes(&bytes[..bytes.len() / 2], name).unwrap_err().to_string();
            assert!(e.starts_with("cat.jpg: not a decodable image"), "{format:?}: {e}");
        }
        // A JPEG that lacks only its end-of-image marker is cut short too (the image crate's
        // decoder would fill what is missing with grey).
        let jpeg = encoded(&img, image::ImageFormat::Jpeg);
        for cut in [jpeg.len() / 2, jpeg.len() - 2] {
            let e = decode_bytes(&jpeg[..cut], name).unwrap_err().to_string();
            assert!(e.contains("cut short: its JPEG data ends before the end-of-image"), "{e}");
        }
        // A BMP header of 20000×20000 pixels: refused before anything is decoded.
        let mut bomb = encoded(&img, image::ImageFormat::Bmp);
        bomb[18..22].copy_from_slice(&20000i32.to_le_bytes());
        bomb[22..26].copy_from_slice(&20000i32.to_le_bytes());
        let e = decode_bytes(&bomb, name).unwrap_err().to_string();
        assert!(e.contains("20000×20000 is 400000000 pixels, past the 178956970 PIL takes"), "{e}");
    }

    #[test]
    fn data_specs_round_trip_and_an_empty_folder_is_refused() {
        for spec in [
            DataSpec::Synthetic,
            DataSpec::Folder("photos/train set".into()),
            DataSpec::Folder("synthetic".into()),
            DataSpec::Folder("cifar10:x".into()),
            DataSpec::Cifar10("/data/cifar-10-batches-bin".into()),
            DataSpec::Cifar100("c100".into()),
        ] {
            let text = spec.to_string();
            let back: DataSpec = text.parse().unwrap();
            assert_eq!(back.to_string(), text);
            match (&spec, &back) {
                // A folder named like another spec comes back as ./name: the same folder.
                (DataSpec::Folder(a), DataSpec::Folder(b)) => assert!(b.ends_with(a), "{b:?}"),
                _ => assert_eq!(back, spec),
            }
        }
        assert_eq!("cifar100:d".parse::<DataSpec>().unwrap(), DataSpec::Cifar100("d".into()));
        for bad in ["cifar10:", "cifar100:", ""] {
            let e = bad.parse::<DataSpec>().unwrap_err().to_string();
            assert!(e.contains("name"), "{e}");
        }
        let e = open(&DataSpec::Synthetic, 0.1, 0).unwrap_err();
        assert!(matches!(e, DatasetError::Synthetic), "{e}");
        for value in [-0.1, 1.0, f64::NAN] {
            let e = open(&DataSpec::Folder("x".into()), value, 0).unwrap_err().to_string();
            assert!(e.contains("not in [0, 1)"), "{e}");
        }
    }

    #[test]
    fn a_subset_keeps_order_labels_and_pixels() {
        let img = |v: u8| RgbImage::from_pixel(2, 3, image::Rgb([v, v / 2, 255 - v]));
        let ds = Dataset::from_images(
            vec!["a".into(), "b".into(), "c".into()],
            vec![(img(10), 0), (img(20), 1), (img(30), 2), (img(40), 1)],
        );
        assert_eq!((ds.len(), ds.classes()), (4, 3));
        let sub = ds.subset(&[3, 0, 3]);
        assert_eq!(sub.len(), 3);
        assert_eq!((sub.label(0), sub.label(1), sub.label(2)), (1, 0, 1));
        assert_eq!(sub.decode(0).unwrap(), img(40));
        assert_eq!(sub.name(1), "image 0");
        let subsub = sub.subset(&[1]);
        assert_eq!(subsub.decode(0).unwrap(), img(10));
        let empty = Dataset::from_images(vec![], vec![(RgbImage::new(0, 0), 0)]);
        assert!(empty.decode(0).unwrap_err().to_string().contains("no pixels"));
    }
}
