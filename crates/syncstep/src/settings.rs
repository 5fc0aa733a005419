//! What a training run is (its data and the step's hyper-parameters), and how a checkpoint's
//! string header records it: serde-derived structs whose field names are the keys, spelled
//! here alone, so that a resume reads back what a save wrote, and the checkpoint and the run
//! both build on this file without needing each other.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use serde_with::json::JsonString;
use serde_with::{serde_as, DisplayFromStr};

use crate::data::schedule::{LrSchedule, Schedule};
use crate::data::source::{DataSpec, Fingerprint};
use crate::data::transform::{Augment, Normalization};
use crate::model::{Arch, ResNet};
use crate::step::{StepConfig, StepError};

/// A recorded setting no run has: missing, unreadable, or outside what a run takes.
#[derive(Debug, thiserror::Error)]
pub enum SettingError {
    #[error("setting `{key}` {problem}")]
    Setting { key: String, problem: String },
    /// A setting required is absent (serde's message names it).
    #[error("settings: {0}")]
    Missing(String),
    #[error("settings of the step: {0}")]
    Step(#[from] StepError),
}

impl SettingError {
    fn bad(key: String, problem: String) -> SettingError {
        SettingError::Setting { key, problem }
    }
}

/// The setting that names a checkpoint's architecture ([`Arch::name`]); a checkpoint without
/// it is ResNet-34's, the only one there was.
pub const ARCH_KEY: &str = "arch";

/// The settings every checkpoint records and a resume reads back, none defaulted: the data
/// (what it is, batch, image size, classes, seed), the step's hyper-parameters and the
/// learning-rate schedule (the fields of `Recorded`, the record's struct, but the arch). A run
/// on images records more (`train::ImageSettings`).
pub fn required_settings() -> Vec<String> {
    let mut keys: Vec<String> = TrainConfig::default().metadata().into_keys().collect();
    keys.retain(|k| k != ARCH_KEY);
    keys
}

/// The fraction of each class held out for validation when a folder has no train/ and val/.
pub const VAL_SPLIT: f64 = 0.1;

/// Held-out images of the synthetic dataset scored before and after a run.
pub const HELD_OUT_EXAMPLES: usize = 64;

/// What a run is: the data it sees and the step's hyper-parameters. Its `Default` holds the
/// defaults of every face (the command line's help is checked against them).
#[derive(Clone, Debug, PartialEq)]
pub struct TrainConfig {
    pub arch: Arch,
    pub batch: usize,
    pub image_size: u32,
    pub classes: u32,
    pub seed: u64,
    /// The step's hyper-parameters; `step.lr` is the schedule's base rate.
    pub step: StepConfig,
    pub schedule: Schedule,
    /// The images trained on; None for the embedded synthetic dataset.
    pub images: Option<ImageSettings>,
}

/// A run on images (`--data`): what the loader needs to make the same batches again, and what
/// `eval` and `predict` need to read a checkpoint's classes.
#[derive(Clone, Debug, PartialEq)]
pub struct ImageSettings {
    pub data: DataSpec,
    /// What the data is, wherever it is, a folder picked in a browser included (None in
    /// checkpoints of earlier builds).
    pub fingerprint: Option<Fingerprint>,
    /// When its image files were last written (`Splits::identify`): None for data that is not
    /// image files on disk (CIFAR's records, which the fingerprint holds whole; a browser's
    /// files) and in checkpoints of earlier builds.
    pub file_times: Option<String>,
    pub val_split: f64,
    pub augment: Augment,
    pub norm: Normalization,
    pub class_names: Vec<String>,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            arch: Arch::default(),
            batch: 16,
            image_size: 32,
            classes: 10,
            seed: 0,
            step: StepConfig::default(),
            schedule: Schedule::default(),
            images: None,
        }
    }
}

/// The settings a checkpoint records, as its string metadata holds them: the field names are
/// the keys, each value its text (`Display`, which `FromStr` reads back exactly; f32s so that
/// they read back bit for bit).
#[serde_as]
#[derive(Serialize, Deserialize)]
struct Recorded {
    /// Absent from checkpoints of builds before there was a choice: ResNet-34.
    #[serde_as(as = "Option<DisplayFromStr>")]
    #[serde(default)]
    arch: Option<Arch>,
    #[serde_as(as = "DisplayFromStr")]
    data: DataSpec,
    #[serde_as(as = "DisplayFromStr")]
    batch: usize,
    #[serde_as(as = "DisplayFromStr")]
    image_size: u32,
    #[serde_as(as = "DisplayFromStr")]
    classes: u32,
    #[serde_as(as = "DisplayFromStr")]
    seed: u64,
    #[serde_as(as = "DisplayFromStr")]
    lr: f32,
    #[serde_as(as = "DisplayFromStr")]
    momentum: f32,
    #[serde_as(as = "DisplayFromStr")]
    weight_decay: f32,
    #[serde_as(as = "DisplayFromStr")]
    label_smoothing: f32,
    #[serde_as(as = "DisplayFromStr")]
    bn_momentum: f32,
    #[serde_as(as = "DisplayFromStr")]
    lr_schedule: LrSchedule,
    #[serde_as(as = "DisplayFromStr")]
    warmup_steps: u64,
    #[serde_as(as = "DisplayFromStr")]
    schedule_steps: u64,
}

/// What a run on images records beside [`Recorded`] (`ImageSettings`).
#[serde_as]
#[derive(Serialize, Deserialize)]
struct RecordedImages {
    #[serde_as(as = "DisplayFromStr")]
    val_split: f64,
    #[serde_as(as = "DisplayFromStr")]
    augment: Augment,
    #[serde_as(as = "DisplayFromStr")]
    mean: Channels,
    #[serde_as(as = "DisplayFromStr")]
    std: Channels,
    #[serde_as(as = "JsonString")]
    class_names: Vec<String>,
    /// The data's fingerprint; absent from checkpoints of earlier builds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    data_sha256: Option<String>,
    #[serde_as(as = "Option<DisplayFromStr>")]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    data_examples: Option<usize>,
    /// The data's files' times; absent where there are none, and from checkpoints of earlier
    /// builds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    data_times_sha256: Option<String>,
}

/// Per-channel values as a checkpoint records them: `0.485,0.456,0.406`.
struct Channels(Vec<f32>);

impl std::fmt::Display for Channels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let values: Vec<String> = self.0.iter().map(f32::to_string).collect();
        f.write_str(&values.join(","))
    }
}

impl std::str::FromStr for Channels {
    type Err = std::num::ParseFloatError;

    fn from_str(text: &str) -> Result<Channels, Self::Err> {
        text.split(',').map(str::parse).collect::<Result<_, _>>().map(Channels)
    }
}

/// `T` read from `metadata`'s string values, naming the setting a bad one was found in.
fn read_recorded<T: serde::de::DeserializeOwned>(
    metadata: &BTreeMap<String, String>,
) -> Result<T, SettingError> {
    let strings = metadata.iter().map(|(k, v)| (k.clone(), Value::String(v.clone()))).collect();
    serde_path_to_error::deserialize(Value::Object(strings)).map_err(|e| {
        let key = e.path().to_string();
        match metadata.get(&key) {
            Some(value) => {
                SettingError::bad(key, format!("= {value:?} is not valid: {}", e.inner()))
            }
            None => SettingError::Missing(e.into_inner().to_string()),
        }
    })
}

/// `value`'s fields as string metadata.
fn write_recorded(value: &impl Serialize, metadata: &mut BTreeMap<String, String>) {
    let Ok(Value::Object(fields)) = serde_json::to_value(value) else {
        unreachable!("a recorded struct serialises to an object")
    };
    for (key, value) in fields {
        if let Value::String(text) = value {
            metadata.insert(key, text);
        }
    }
}

/// The image settings `recorded` holds for `data`.
fn image_settings(data: DataSpec, recorded: RecordedImages) -> Result<ImageSettings, SettingError> {
    let three = |key: &'static str, Channels(values)| -> Result<[f32; 3], SettingError> {
        let not_three =
            |v: Vec<f32>| SettingError::bad(key.into(), format!("is {v:?}, not 3 numbers"));
        values.try_into().map_err(not_three)
    };
    let fingerprint = match (recorded.data_sha256, recorded.data_examples) {
        (Some(sha256), Some(examples)) => Some(Fingerprint { sha256, examples }),
        (None, _) => None,
        (Some(_), None) => {
            return Err(SettingError::bad("data_examples".into(), "is missing".into()))
        }
    };
    Ok(ImageSettings {
        data,
        fingerprint,
        file_times: recorded.data_times_sha256,
        val_split: recorded.val_split,
        augment: recorded.augment,
        norm: Normalization {
            mean: three("mean", recorded.mean)?,
            std: three("std", recorded.std)?,
        },
        class_names: recorded.class_names,
    })
}

impl TrainConfig {
    /// The settings a checkpoint records ([`required_settings`] and a run on images' own), so
    /// that a resume can insist on the same run: the network, the data, and the step's
    /// hyper-parameters. `checkpoint::save` records the step beside them.
    pub fn metadata(&self) -> BTreeMap<String, String> {
        let (s, schedule) = (&self.step, &self.schedule);
        let recorded = Recorded {
            arch: Some(self.arch),
            data: self.data(),
            batch: self.batch,
            image_size: self.image_size,
            classes: self.classes,
            seed: self.seed,
            lr: s.lr,
            momentum: s.momentum,
            weight_decay: s.weight_decay,
            label_smoothing: s.label_smoothing,
            bn_momentum: s.bn_momentum,
            lr_schedule: schedule.kind,
            warmup_steps: schedule.warmup_steps,
            schedule_steps: schedule.total_steps,
        };
        let mut metadata = BTreeMap::new();
        write_recorded(&recorded, &mut metadata);
        if let Some(i) = &self.images {
            let images = RecordedImages {
                val_split: i.val_split,
                augment: i.augment,
                mean: Channels(i.norm.mean.to_vec()),
                std: Channels(i.norm.std.to_vec()),
                class_names: i.class_names.clone(),
                data_sha256: i.fingerprint.as_ref().map(|f| f.sha256.clone()),
                data_examples: i.fingerprint.as_ref().map(|f| f.examples),
                data_times_sha256: i.file_times.clone(),
            };
            write_recorded(&images, &mut metadata);
        }
        metadata
    }

    /// The configuration a checkpoint's metadata records: every setting required, none
    /// defaulted, but the arch: a checkpoint from before there was a choice is ResNet-34's.
    pub fn from_metadata(metadata: &BTreeMap<String, String>) -> Result<TrainConfig, SettingError> {
        let r: Recorded = read_recorded(metadata)?;
        let images = match r.data {
            DataSpec::Synthetic => None,
            data => Some(image_settings(data, read_recorded(metadata)?)?),
        };
        let cfg = TrainConfig {
            arch: r.arch.unwrap_or_default(),
            batch: r.batch,
            image_size: r.image_size,
            classes: r.classes,
            seed: r.seed,
            step: StepConfig {
                lr: r.lr,
                momentum: r.momentum,
                weight_decay: r.weight_decay,
                label_smoothing: r.label_smoothing,
                bn_momentum: r.bn_momentum,
            },
            schedule: Schedule {
                kind: r.lr_schedule,
                warmup_steps: r.warmup_steps,
                total_steps: r.schedule_steps,
            },
            images,
        };
        cfg.check()?;
        Ok(cfg)
    }

    /// Refuses recorded settings no run has, naming the setting: a checkpoint's settings are
    /// read back as they were written, and one that was edited or damaged must not be run.
    fn check(&self) -> Result<(), SettingError> {
        let bad = |key: &str, why: String| Err(SettingError::bad(key.into(), why));
        if self.batch == 0 {
            return bad("batch", "is 0: a batch holds at least one image".into());
        }
        if let Err(e) = ResNet::check_image_size(self.image_size, self.image_size) {
            return bad("image_size", format!("is not valid: {e}"));
        }
        if !(2..=crate::model::MAX_CLASSES).contains(&self.classes) {
            let most = crate::model::MAX_CLASSES;
            return bad("classes", format!("is {}: a classifier has 2 to {most}", self.classes));
        }
        self.step.validate()?;
        let Some(images) = &self.images else { return Ok(()) };
        let Normalization { mean, std } = images.norm;
        if !(0.0..1.0).contains(&images.val_split) {
            return bad("val_split", format!("is {}: a fraction in [0, 1)", images.val_split));
        }
        if let Some(problem) = class_names_problem(&images.class_names, "number") {
            return bad("class_names", problem);
        }
        if images.class_names.len() != self.classes as usize {
            let names = images.class_names.len();
            return bad(
                "class_names",
                format!("lists {names} names, and `classes` is {}", self.classes),
            );
        }
        if !mean.iter().all(|m| m.is_finite()) {
            return bad("mean", format!("is {mean:?}: a mean is finite"));
        }
        if !std.iter().all(|s| s.is_finite() && *s > 0.0) {
            return bad("std", format!("is {std:?}: a standard deviation is finite and above 0"));
        }
        // A pixel (0 to 1) normalised past what a healthy value is would reach the network as
        // an infinity, blamed on the image.
        let normalised = |c: usize, x: f32| (x - mean[c]) / std[c];
        if !(0..3).all(|c| [0.0, 1.0].iter().all(|&x| crate::checkpoint::healthy(normalised(c, x))))
        {
            return bad(
                "std",
                format!(
                    "is {std:?} with mean {mean:?}: a pixel would normalise past ±{:e}, which no image's statistics give",
                    f32::MAX.sqrt()
                ),
            );
        }
        Ok(())
    }

    /// What the run trains on: its images, or the synthetic dataset.
    pub fn data(&self) -> DataSpec {
        self.images.as_ref().map_or(DataSpec::Synthetic, |i| i.data.clone())
    }

    /// The names of the classes: the images' folders (or CIFAR's names), or the synthetic
    /// dataset's patterns.
    pub fn class_names(&self) -> Vec<String> {
        match &self.images {
            Some(i) => i.class_names.clone(),
            None => (0..self.classes).map(crate::data::synthetic::class_name).collect(),
        }
    }
}

/// Why `names` cannot name a classifier's outputs, if they cannot: a blank name prints as no
/// label, and two alike make a prediction say nothing. `unit` is what counts them in the
/// message ("line", "number").
pub fn class_names_problem(names: &[String], unit: &str) -> Option<String> {
    if let Some(i) = names.iter().position(|n| n.trim().is_empty()) {
        return Some(format!("holds a blank name ({unit} {}): give every class a name", i + 1));
    }
    let mut first = std::collections::HashMap::new();
    names.iter().enumerate().find_map(|(i, name)| {
        let j = *first.entry(name.as_str()).or_insert(i);
        (j != i).then(|| {
            format!(
                "holds {name:?} twice ({unit}s {} and {}): give each class a name of its own",
                j + 1,
                i + 1
            )
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn on_images() -> TrainConfig {
        TrainConfig {
            arch: Arch::ResNet18,
            images: Some(ImageSettings {
                data: DataSpec::Cifar10("/data/cifar".into()),
                fingerprint: Some(Fingerprint { sha256: "ab".repeat(32), examples: 50_000 }),
                file_times: Some("cd".repeat(32)),
                val_split: 0.25,
                augment: Augment::CropFlip,
                norm: Normalization { mean: [0.1, 0.2, 0.3], std: [0.4, 0.5, 1e-7] },
                class_names: vec!["a \"quoted\" name".into(), "b,c".into()],
            }),
            classes: 2,
            step: StepConfig { lr: 1e-7, ..StepConfig::default() },
            ..TrainConfig::default()
        }
    }

    /// What a checkpoint records reads back as the same run, the required keys among it; a
    /// value that does not parse is refused naming its key.
    #[test]
    fn settings_round_trip_through_metadata_and_bad_values_name_their_key() {
        for cfg in [TrainConfig::default(), on_images()] {
            let metadata = cfg.metadata();
            assert!(required_settings().iter().all(|k| metadata.contains_key(k)), "{metadata:?}");
            assert_eq!(TrainConfig::from_metadata(&metadata).unwrap(), cfg);
        }
        let metadata = on_images().metadata();
        assert_eq!(metadata["mean"], "0.1,0.2,0.3");
        assert_eq!(metadata["class_names"], r#"["a \"quoted\" name","b,c"]"#);
        for (key, value, says) in [
            ("batch", "sixteen", "setting `batch` = \"sixteen\" is not valid"),
            ("std", "0.4,0.5", "setting `std` is [0.4, 0.5], not 3 numbers"),
            ("class_names", "[1]", "setting `class_names` = \"[1]\" is not valid"),
            ("lr_schedule", "linear", "setting `lr_schedule` = \"linear\" is not valid"),
            ("class_names", r#"["b,c","b,c"]"#, "holds \"b,c\" twice (numbers 1 and 2)"),
            ("class_names", r#"["a",""]"#, "holds a blank name (number 2)"),
            ("class_names", r#"["  ","a"]"#, "holds a blank name (number 1)"),
            ("std", "1e-40,0.5,0.5", "a pixel would normalise past"),
        ] {
            let mut bad = metadata.clone();
            bad.insert(key.into(), value.into());
            let e = TrainConfig::from_metadata(&bad).unwrap_err().to_string();
            assert!(e.contains(says), "{key}: {e}");
        }
        let mut missing = metadata;
        missing.remove("seed");
        let e = TrainConfig::from_metadata(&missing).unwrap_err().to_string();
        assert!(e.contains("missing field `seed`"), "{e}");
    }
}
