//! What a training run is (its data and the step's hyper-parameters), and the settings map a
//! checkpoint records it in: every key spelled here alone, so that a resume reads back what a
//! save wrote, and the checkpoint and the run both build on this file without needing each
//! other.

use std::collections::BTreeMap;

use crate::data::schedule::{LrSchedule, Schedule};
use crate::data::source::{DataSpec, Fingerprint};
use crate::data::transform::{Augment, Normalization};
use crate::model::{Arch, ResNet};
use crate::step::{StepConfig, StepError};

/// A recorded setting no run has: missing, unreadable, or outside what a run takes.
#[derive(Debug, thiserror::Error)]
pub enum SettingError {
    #[error("setting `{key}` {problem}")]
    Setting { key: &'static str, problem: String },
    #[error("settings of the step: {0}")]
    Step(#[from] StepError),
}

impl SettingError {
    fn bad(key: &'static str, problem: String) -> SettingError {
        SettingError::Setting { key, problem }
    }
}

/// The setting that names a checkpoint's architecture ([`Arch::name`]); a checkpoint without
/// it is ResNet-34's, the only one there was.
pub const ARCH_KEY: &str = "arch";

/// The settings every checkpoint records and a resume reads back, none defaulted: the data
/// (what it is, batch, image size, classes, seed), the step's hyper-parameters and the
/// learning-rate schedule. A run on images records more (`train::ImageSettings`).
pub const REQUIRED_SETTINGS: [&str; 13] = [
    "data",
    "batch",
    "image_size",
    "classes",
    "seed",
    "lr",
    "momentum",
    "weight_decay",
    "label_smoothing",
    "bn_momentum",
    "lr_schedule",
    "warmup_steps",
    "schedule_steps",
];

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
    /// What the data is, wherever it is (None in checkpoints of earlier builds, and in the
    /// browser).
    pub fingerprint: Option<Fingerprint>,
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

impl TrainConfig {
    /// The settings a checkpoint records (`checkpoint::REQUIRED_SETTINGS`), so that a resume
    /// can insist on the same run: the data, and the step's hyper-parameters (f32s written so
    /// that they read back exactly). The arch is the model's, which `checkpoint::save` records
    /// beside them, as it does the step.
    pub fn settings(&self) -> BTreeMap<String, String> {
        let s = &self.step;
        let mut settings = BTreeMap::from([
            ("batch".into(), self.batch.to_string()),
            ("image_size".into(), self.image_size.to_string()),
            ("classes".into(), self.classes.to_string()),
            ("seed".into(), self.seed.to_string()),
            ("lr".into(), s.lr.to_string()),
            ("momentum".into(), s.momentum.to_string()),
            ("weight_decay".into(), s.weight_decay.to_string()),
            ("label_smoothing".into(), s.label_smoothing.to_string()),
            ("bn_momentum".into(), s.bn_momentum.to_string()),
            ("lr_schedule".into(), self.schedule.kind.to_string()),
            ("warmup_steps".into(), self.schedule.warmup_steps.to_string()),
            ("schedule_steps".into(), self.schedule.total_steps.to_string()),
        ]);
        match &self.images {
            None => {
                settings.insert("data".into(), DataSpec::Synthetic.to_string());
            }
            Some(i) => {
                let list = |v: [f32; 3]| v.map(|x| x.to_string()).join(",");
                settings.extend([
                    ("data".into(), i.data.to_string()),
                    ("val_split".into(), i.val_split.to_string()),
                    ("augment".into(), i.augment.to_string()),
                    ("mean".into(), list(i.norm.mean)),
                    ("std".into(), list(i.norm.std)),
                    (
                        "class_names".into(),
                        serde_json::to_string(&i.class_names).unwrap_or_default(),
                    ),
                ]);
                if let Some(f) = &i.fingerprint {
                    settings.insert("data_sha256".into(), f.sha256.clone());
                    settings.insert("data_examples".into(), f.examples.to_string());
                }
            }
        }
        settings
    }

    /// The configuration a checkpoint's metadata records: every setting required, none
    /// defaulted, but the arch: a checkpoint from before there was a choice is ResNet-34's.
    pub fn from_settings(settings: &BTreeMap<String, String>) -> Result<TrainConfig, SettingError> {
        fn get<T: std::str::FromStr>(
            settings: &BTreeMap<String, String>,
            key: &'static str,
        ) -> Result<T, SettingError> {
            let value = settings.get(key).ok_or(SettingError::bad(key, "is missing".into()))?;
            value.parse().map_err(|_| SettingError::bad(key, format!("= {value:?} is not valid")))
        }
        let three = |key: &'static str| -> Result<[f32; 3], SettingError> {
            let text: String = get(settings, key)?;
            let values: Vec<f32> = text.split(',').filter_map(|v| v.parse().ok()).collect();
            let not_three = || SettingError::bad(key, format!("= {text:?} is not 3 numbers"));
            values.try_into().map_err(|_| not_three())
        };
        let data: DataSpec = get(settings, "data")?;
        let images = match data {
            DataSpec::Synthetic => None,
            data => Some(ImageSettings {
                data,
                fingerprint: match settings.get("data_sha256") {
                    Some(sha256) => Some(Fingerprint {
                        sha256: sha256.clone(),
                        examples: get(settings, "data_examples")?,
                    }),
                    None => None,
                },
                val_split: get(settings, "val_split")?,
                augment: get(settings, "augment")?,
                norm: Normalization { mean: three("mean")?, std: three("std")? },
                class_names: serde_json::from_str(&get::<String>(settings, "class_names")?)
                    .map_err(|e| {
                        SettingError::bad("class_names", format!("is not a list of names: {e}"))
                    })?,
            }),
        };
        let cfg = TrainConfig {
            arch: match settings.contains_key(ARCH_KEY) {
                true => get(settings, ARCH_KEY)?,
                false => Arch::default(),
            },
            batch: get(settings, "batch")?,
            image_size: get(settings, "image_size")?,
            classes: get(settings, "classes")?,
            seed: get(settings, "seed")?,
            step: StepConfig {
                lr: get(settings, "lr")?,
                momentum: get(settings, "momentum")?,
                weight_decay: get(settings, "weight_decay")?,
                label_smoothing: get(settings, "label_smoothing")?,
                bn_momentum: get(settings, "bn_momentum")?,
            },
            schedule: Schedule {
                kind: get::<LrSchedule>(settings, "lr_schedule")?,
                warmup_steps: get(settings, "warmup_steps")?,
                total_steps: get(settings, "schedule_steps")?,
            },
            images,
        };
        cfg.check()?;
        Ok(cfg)
    }

    /// Refuses recorded settings no run has, naming the setting: a checkpoint's settings are
    /// read back as they were written, and one that was edited or damaged must not be run.
    fn check(&self) -> Result<(), SettingError> {
        let bad = |key: &'static str, why: String| Err(SettingError::bad(key, why));
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
        Ok(())
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
