//! The ImageFolder layout, as torchvision reads it: `DIR/<class>/…/<image>`, classes the
//! subfolder names in sorted order, a class's images every .png, .jpg, .jpeg, .bmp or .webp
//! file below its folder (symbolic links followed), sorted by path. `DIR/train` and `DIR/val`
//! side by side are the splits; otherwise a seeded fraction of each class is held out.
//!
//! Hidden entries and files of other kinds are skipped and reported; an empty class, a single
//! class or no class is refused, since training on it would be meaningless. The scan reads
//! names only: a corrupt image is found when it is decoded, and that error names the file.

use std::collections::HashSet;
use std::fs;
use std::path::{Path, PathBuf};

use super::dataset::{hold_out, is_image, Dataset, DatasetError, Labelled, Splits, EXTENSIONS};

/// The splits of the image folder `dir`; `val_split` (in [0, 1), checked by `source::open`) of
/// each class is held out with `seed` where `dir` has no `val` folder.
pub(super) fn open(dir: &Path, val_split: f64, seed: u64) -> Result<Splits, DatasetError> {
    if !dir.is_dir() {
        return Err(DatasetError::NotAFolder { path: dir.to_path_buf() });
    }
    let mut skipped = Skipped::default();
    let (train_dir, val_dir) = (dir.join("train"), dir.join("val"));
    let mut notes = Vec::new();
    let (train, val) = if train_dir.is_dir() && val_dir.is_dir() {
        let train = scan(&train_dir, &mut skipped)?;
        let val = scan(&val_dir, &mut skipped)?;
        let missing_from = |a: &[Class], b: &[Class]| {
            let names: Vec<&str> = a
                .iter()
                .filter(|c| !b.iter().any(|d| d.name == c.name))
                .map(|c| c.name.as_str())
                .collect();
            if names.is_empty() {
                "none".to_string()
            } else {
                names.join(", ")
            }
        };
        if train.len() != val.len() || train.iter().zip(&val).any(|(t, v)| t.name != v.name) {
            return Err(DatasetError::ClassMismatch {
                only_train: missing_from(&train, &val),
                only_val: missing_from(&val, &train),
                train: train_dir,
                val: val_dir,
            });
        }
        notes.push(format!(
            "{} and {} are the splits; no fraction is held out",
            train_dir.display(),
            val_dir.display()
        ));
        let names = class_names(&train);
        (
            Dataset::from_files(names.clone(), labelled(train)),
            Dataset::from_files(names, labelled(val)),
        )
    } else {
        // A train folder without a val beside it is the data, not a class.
        let source = if train_dir.is_dir() { train_dir } else { dir.to_path_buf() };
        let classes = scan(&source, &mut skipped)?;
        let names = class_names(&classes);
        let files = classes.into_iter().map(|c| c.files).collect();
        let (train, val) = hold_out(files, val_split, seed);
        if val_split > 0.0 && val.is_empty() {
            return Err(DatasetError::TooFewImages { dir: source });
        }
        notes.push(if val_split > 0.0 {
            format!(
                "no {}: {val_split} of each class of {} held out for validation ({} images, seed {seed})",
                val_dir.display(),
                source.display(),
                val.len()
            )
        } else {
            "validation split 0: no images held out, so no validation".to_string()
        });
        (Dataset::from_files(names.clone(), train), Dataset::from_files(names, val))
    };
    notes.extend(skipped.hidden.note("hidden entries (names starting with '.')"));
    notes.extend(
        skipped.other.note(&format!("entries that are not .{} files", EXTENSIONS.join(", ."))),
    );
    Ok(Splits { train, val, notes })
}

struct Class {
    name: String,
    files: Vec<PathBuf>,
}

fn class_names(classes: &[Class]) -> Vec<String> {
    classes.iter().map(|c| c.name.clone()).collect()
}

fn labelled(classes: Vec<Class>) -> Labelled<PathBuf> {
    let mut out = Vec::new();
    for (label, class) in classes.into_iter().enumerate() {
        out.extend(class.files.into_iter().map(|f| (f, label as u32)));
    }
    out
}

/// The classes of `dir`, sorted by name, each with its image files sorted by path.
fn scan(dir: &Path, skipped: &mut Skipped) -> Result<Vec<Class>, DatasetError> {
    if !dir.is_dir() {
        return Err(DatasetError::NotAFolder { path: dir.to_path_buf() });
    }
    let mut folders = Vec::new();
    for (path, kind) in entries(dir, skipped)? {
        match kind {
            Some(kind) if kind.is_dir() => folders.push(path),
            _ => skipped.other.add(path),
        }
    }
    folders.sort();
    match folders.as_slice() {
        [] => return Err(DatasetError::NoClasses { dir: dir.to_path_buf() }),
        [one] => {
            return Err(DatasetError::OneClass { dir: dir.to_path_buf(), class: file_name(one) })
        }
        _ => {}
    }
    let mut classes = Vec::with_capacity(folders.len());
    for folder in folders {
        let mut files = Vec::new();
        collect_images(&folder, &mut files, skipped, &mut HashSet::new())?;
        if files.is_empty() {
            return Err(DatasetError::EmptyClass { dir: folder });
        }
        files.sort();
        classes.push(Class { name: file_name(&folder), files });
    }
    Ok(classes)
}

/// Every image file below `dir`, into `out`. `walked` holds the folders already walked, so a
/// symbolic link back up the tree is walked once, not forever.
fn collect_images(
    dir: &Path,
    out: &mut Vec<PathBuf>,
    skipped: &mut Skipped,
    walked: &mut HashSet<PathBuf>,
) -> Result<(), DatasetError> {
    let canonical = fs::canonicalize(dir)
        .map_err(|source| DatasetError::Io { path: dir.to_path_buf(), source })?;
    if !walked.insert(canonical) {
        return Ok(());
    }
    for (path, kind) in entries(dir, skipped)? {
        match kind {
            Some(kind) if kind.is_dir() => collect_images(&path, out, skipped, walked)?,
            Some(kind) if kind.is_file() && is_image(&path) => out.push(path),
            _ => skipped.other.add(path),
        }
    }
    Ok(())
}

/// The entries of `dir` that are not hidden, with their kind after following symbolic links
/// (None for a link that leads nowhere).
fn entries(
    dir: &Path,
    skipped: &mut Skipped,
) -> Result<Vec<(PathBuf, Option<fs::FileType>)>, DatasetError> {
    let io = |source| DatasetError::Io { path: dir.to_path_buf(), source };
    let mut out = Vec::new();
    for entry in fs::read_dir(dir).map_err(io)? {
        let entry = entry.map_err(io)?;
        let path = entry.path();
        if entry.file_name().to_string_lossy().starts_with('.') {
            skipped.hidden.add(path);
            continue;
        }
        let kind = entry.file_type().map_err(io)?;
        let kind = if kind.is_symlink() {
            fs::metadata(&path).ok().map(|m| m.file_type())
        } else {
            Some(kind)
        };
        out.push((path, kind));
    }
    Ok(out)
}

fn file_name(path: &Path) -> String {
    path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
}

#[derive(Default)]
struct Skipped {
    hidden: Tally,
    other: Tally,
}

/// How many paths, and the first three by path order (read_dir's order varies).
#[derive(Default)]
struct Tally {
    count: usize,
    first: Vec<PathBuf>,
}

impl Tally {
    fn add(&mut self, path: PathBuf) {
        self.count += 1;
        self.first.push(path);
        self.first.sort();
        self.first.truncate(3);
    }

    fn note(&self, what: &str) -> Option<String> {
        let names: Vec<String> = self.first.iter().map(|p| p.display().to_string()).collect();
        let more = if self.count > names.len() { ", …" } else { "" };
        (self.count > 0)
            .then(|| format!("skipped {} {what}: {}{more}", self.count, names.join(", ")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::source::{open, DataSpec, RgbImage};
    use image::{GrayImage, ImageBuffer, Luma, Rgb, Rgba, RgbaImage};

    /// A fresh folder of this test's own, removed when dropped, however the test ends.
    fn temp(name: &str) -> tempfile::TempDir {
        tempfile::Builder::new().prefix(&format!("syncstep-test-{name}-")).tempdir().unwrap()
    }

    fn rgb(path: &Path, v: u8) {
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        RgbImage::from_pixel(6, 4, Rgb([v, v / 2, 255 - v])).save(path).unwrap();
    }

    fn folder(dir: &Path, val_split: f64, seed: u64) -> Result<Splits, DatasetError> {
        open(&DataSpec::Folder(dir.to_path_buf()), val_split, seed)
    }

    #[test]
    fn a_folder_is_scanned_in_order_and_what_is_not_an_image_is_skipped() {
        let tmp = temp("scan");
        let d = tmp.path();
        rgb(&d.join("cat/1.png"), 200);
        rgb(&d.join("cat/2.jpg"), 100);
        GrayImage::from_pixel(3, 3, Luma([77])).save(d.join("cat/3.PNG")).unwrap();
        rgb(&d.join("cat/sub/4.jpeg"), 50);
        fs::create_dir_all(d.join("dog")).unwrap();
        RgbaImage::from_pixel(2, 2, Rgba([10, 20, 30, 0])).save(d.join("dog/a.png")).unwrap();
        ImageBuffer::<Luma<u16>, Vec<u16>>::from_pixel(2, 2, Luma([65535]))
            .save(d.join("dog/b.png"))
            .unwrap();
        fs::write(d.join("dog/notes.txt"), "not an image").unwrap();
        fs::write(d.join("dog/.hidden.png"), "hidden").unwrap();
        fs::write(d.join("README.md"), "about").unwrap();
        fs::create_dir_all(d.join(".ipynb_checkpoints/x")).unwrap();
        std::os::unix::fs::symlink(d.join("cat"), d.join("dog/loop")).unwrap();
        std::os::unix::fs::symlink(d.join("cat"), d.join("cat/sub/back")).unwrap();
        let s = folder(d, 0.0, 0).unwrap();
        assert_eq!(s.train.class_names, ["cat", "dog"]);
        assert!(s.val.is_empty());
        let names: Vec<String> = (0..s.train.len()).map(|i| s.train.name(i)).collect();
        let rel: Vec<String> =
            names.iter().map(|n| n.strip_prefix(d.to_str().unwrap()).unwrap().into()).collect();
        // dog/loop is a link to cat: its images count under dog too, as torchvision's walk
        // does; cat/sub/back leads up to a folder already walked and is not followed again.
        assert_eq!(
            rel,
            [
                "/cat/1.png",
                "/cat/2.jpg",
                "/cat/3.PNG",
                "/cat/sub/4.jpeg",
                "/dog/a.png",
                "/dog/b.png",
                "/dog/loop/1.png",
                "/dog/loop/2.jpg",
                "/dog/loop/3.PNG",
                "/dog/loop/sub/4.jpeg",
            ]
        );
        assert_eq!((s.train.label(3), s.train.label(4)), (0, 1));
        assert_eq!(s.train.decode(0).unwrap().get_pixel(5, 3).0, [200, 100, 55]);
        let jpeg = s.train.decode(1).unwrap().get_pixel(2, 2).0;
        assert!(jpeg.iter().zip([100, 50, 155]).all(|(&a, b)| a.abs_diff(b) <= 3), "{jpeg:?}");
        assert_eq!(s.train.decode(2).unwrap().get_pixel(1, 1).0, [77, 77, 77]);
        assert_eq!(s.train.decode(4).unwrap().get_pixel(0, 0).0, [10, 20, 30]);
        assert_eq!(s.train.decode(5).unwrap().get_pixel(1, 0).0, [255, 255, 255]);
        let notes = s.notes.join("\n");
        assert!(notes.contains("no images held out"), "{notes}");
        assert!(
            notes.contains("skipped 2 hidden entries") && notes.contains(".hidden.png"),
            "{notes}"
        );
        assert!(
            notes.contains("skipped 2 entries that are not") && notes.contains("notes.txt"),
            "{notes}"
        );
    }

    #[test]
    fn a_truncated_image_fails_to_decode_naming_the_file() {
        let tmp = temp("truncated");
        let d = tmp.path();
        rgb(&d.join("a/good.png"), 9);
        let mut jpeg = Vec::new();
        RgbImage::from_fn(64, 64, |x, y| Rgb([x as u8 * 4, y as u8 * 4, 128]))
            .write_to(&mut std::io::Cursor::new(&mut jpeg), image::ImageFormat::Jpeg)
            .unwrap();
        fs::create_dir_all(d.join("b")).unwrap();
        fs::write(d.join("b/bad.jpg"), &jpeg[..jpeg.len() / 8]).unwrap();
        let s = folder(d, 0.0, 0).unwrap();
        let e = s.train.decode(1).unwrap_err().to_string();
        assert!(
            e.contains("b/bad.jpg: not a decodable image") && e.contains("remove or replace"),
            "{e}"
        );
        fs::remove_file(d.join("a/good.png")).unwrap();
        let e = s.train.decode(0).unwrap_err().to_string();
        assert!(e.contains("a/good.png") && e.contains("can be read"), "{e}");
    }

    #[test]
    fn an_empty_class_a_single_class_or_no_class_is_refused() {
        let tmp = temp("refused");
        let d = tmp.path();
        let e = folder(d, 0.1, 0).unwrap_err().to_string();
        assert!(e.contains("has no class folders") && e.contains("DIR/<class>/<image>"), "{e}");
        rgb(&d.join("only/1.png"), 1);
        let e = folder(d, 0.1, 0).unwrap_err().to_string();
        assert!(e.contains("single class folder, only"), "{e}");
        fs::create_dir_all(d.join("empty")).unwrap();
        fs::write(d.join("empty/x.txt"), "text").unwrap();
        let e = folder(d, 0.1, 0).unwrap_err().to_string();
        assert!(e.contains("empty holds no image"), "{e}");
        rgb(&d.join("empty/1.png"), 2);
        let e = folder(d, 0.1, 0).unwrap_err().to_string();
        assert!(e.contains("no class of") && e.contains("has two images"), "{e}");
        let e = folder(&d.join("only/1.png"), 0.1, 0).unwrap_err().to_string();
        assert!(e.contains("is not a folder"), "{e}");
    }

    #[test]
    fn train_and_val_folders_are_the_splits_and_must_share_classes() {
        let tmp = temp("trainval");
        let d = tmp.path();
        for (split, n) in [("train", 3), ("val", 1)] {
            for class in ["x", "y"] {
                for i in 0..n {
                    rgb(&d.join(format!("{split}/{class}/{i}.png")), 10 * i as u8 + 1);
                }
            }
        }
        let s = folder(d, 0.5, 0).unwrap();
        assert_eq!((s.train.len(), s.val.len()), (6, 2));
        assert_eq!((s.val.label(0), s.val.label(1)), (0, 1));
        assert!(s.notes[0].contains("are the splits"), "{:?}", s.notes);
        rgb(&d.join("val/z/0.png"), 3);
        let e = folder(d, 0.5, 0).unwrap_err().to_string();
        assert!(e.contains("only in train: none; only in val: z"), "{e}");
        // Without val, the train folder is the data and a fraction of it is held out.
        fs::remove_dir_all(d.join("val")).unwrap();
        let s = folder(d, 0.3, 0).unwrap();
        assert_eq!((s.train.len(), s.val.len(), s.train.classes()), (4, 2, 2));
        assert!(s.notes[0].contains("train held out"), "{:?}", s.notes);
    }

    #[test]
    fn a_seeded_fraction_of_each_class_is_held_out() {
        let tmp = temp("holdout");
        let d = tmp.path();
        for (class, n) in [("a", 10), ("b", 20), ("c", 2), ("d", 1)] {
            for i in 0..n {
                rgb(&d.join(format!("{class}/{i:02}.png")), i as u8);
            }
        }
        let held =
            |s: &Splits| -> Vec<String> { (0..s.val.len()).map(|i| s.val.name(i)).collect() };
        let count = |s: &Splits, k: u32| (0..s.val.len()).filter(|&i| s.val.label(i) == k).count();
        let s = folder(d, 0.25, 7).unwrap();
        // round(2.5) = 3 of 10, 5 of 20, at least one of 2, none of a single image.
        assert_eq!([0, 1, 2, 3].map(|k| count(&s, k)), [3, 5, 1, 0]);
        assert_eq!(s.train.len() + s.val.len(), 33);
        let mut all: Vec<String> = (0..s.train.len()).map(|i| s.train.name(i)).collect();
        all.extend(held(&s));
        all.sort();
        all.dedup();
        assert_eq!(all.len(), 33, "train and val are disjoint and cover every image");
        assert!(s.notes[0].contains("0.25 of each class") && s.notes[0].contains("seed 7"));
        assert_eq!(held(&s), held(&folder(d, 0.25, 7).unwrap()));
        assert_ne!(held(&s), held(&folder(d, 0.25, 8).unwrap()));
        let names = held(&s);
        assert!(names.windows(2).all(|w| w[0] < w[1]), "val keeps path order: {names:?}");
    }
}
