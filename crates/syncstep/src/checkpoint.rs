//! Weights and checkpoints as safetensors with torchvision's `state_dict` names: parameters,
//! BN running statistics, and (checkpoints only) SGD momentum under `momentum/<name>`, plus
//! the run's settings and position in the string metadata. Converts between files and the
//! model's flat layout; nothing here touches a GPU.
//!
//! A checkpoint is self-checking: its header holds the SHA-256 of every byte a load reads, its
//! settings included (see `tensorfile`), every setting a resume needs ([`required_settings`]:
//! none is defaulted), and its format. Only values a healthy run reaches are saved or loaded
//! ([`healthy`]): finite, and small enough to square in f32; running variances are never
//! negative, and weights are never integers.

use std::collections::BTreeMap;
use std::path::Path;

use crate::model::{Arch, ResNet};
use crate::settings::{required_settings, TrainConfig, ARCH_KEY};
use crate::tensorfile::{Entry, TensorFile, TensorFileError};

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error(transparent)]
    File(#[from] TensorFileError),
    #[error("{path}: tensor `{name}` element {index} is {value:e}: {problem}")]
    BadValue { path: String, name: String, index: usize, value: f64, problem: &'static str },
    #[error("{path}: tensor `{name}` holds integers, and weights are floating point (f32, f64, f16 or bf16): this is not a weights file (a batch's labels?), or it is damaged")]
    Integers { path: String, name: String },
    #[error("{path}: {problem}")]
    Malformed { path: String, problem: String },
    #[error("{path}: metadata `{key}` {problem}")]
    Metadata { path: String, key: String, problem: String },
    #[error("not saved: tensor `{name}` element {index} is {value:e}, non-finite or past ±{:e} (the run diverged)", f32::MAX.sqrt())]
    NotFinite { name: String, index: usize, value: f32 },
}

/// Whether a parameter, momentum or running statistic is one a healthy run reaches: finite, and
/// below `f32::MAX.sqrt()` in magnitude. Past that its square overflows f32 (as BatchNorm's
/// variance squares what a weight multiplies), so the model can only give infinities and NaN.
pub fn healthy(value: f32) -> bool {
    value.abs() < f32::MAX.sqrt()
}

/// The checkpoint format this build writes: its hash covers its settings too
/// (`tensorfile::CHECKSUM_KEY`).
pub const FORMAT: &str = "syncstep-checkpoint-3";

/// The format of earlier builds: its hash covers the tensor data alone
/// (`tensorfile::DATA_CHECKSUM_KEY`) and it has no data fingerprint, so its settings (an edit
/// of which nothing catches) are not trusted. Its weights are: `train --init` takes them.
const EARLIER_FORMAT: &str = "syncstep-checkpoint-2";

/// Flat parameters and running statistics from a file of torchvision names (f32 or f64).
/// Every parameter must be present with its exact shape; running statistics are optional
/// (defaulting to mean 0, variance 1) unless `running_required`. Other keys are ignored.
pub fn load_weights(
    file: &TensorFile,
    model: &ResNet,
    running_required: bool,
) -> Result<(Vec<f32>, Vec<f32>), CheckpointError> {
    let mut params = vec![0.0f32; model.param_len];
    for spec in &model.params {
        let t = file.require(&spec.name, &spec.shape)?;
        take(file, &spec.name, t, &mut params[spec.range()])?;
    }
    let running = load_running(file, model, running_required)?;
    Ok((params, running))
}

/// The class count of torchvision weights of `arch`: the rows of `fc.weight` [K, features].
pub fn classes(file: &TensorFile, arch: Arch) -> Result<u32, CheckpointError> {
    let malformed = |problem: String| CheckpointError::Malformed {
        path: file.path.display().to_string(),
        problem,
    };
    let f = arch.features() as usize;
    let fc = file
        .get("fc.weight")
        .ok_or_else(|| malformed(format!("missing tensor `fc.weight` [K, {f}]")))?;
    match fc.shape[..] {
        [k, features] if features == f => u32::try_from(k)
            .map_err(|_| malformed(format!("`fc.weight` has {k} rows: too many classes"))),
        _ => Err(malformed(format!(
            "`fc.weight` has shape {:?}, expected [K, {f}] ({arch})",
            fc.shape
        ))),
    }
}

/// The architecture of torchvision weights, told by their tensor names: the blocks of each
/// stage (the last block named, `layer3.5.…`) and whether they are Bottlenecks (a `conv3`).
/// `asked` (`--arch`) must agree. A file with no block at all is taken to be `asked`, else
/// ResNet-34: reading its tensors names what it lacks, as it does a tensor missing in a block.
pub fn weights_arch(file: &TensorFile, asked: Option<Arch>) -> Result<Arch, CheckpointError> {
    if !file.tensors.is_empty() && file.tensors.keys().all(|name| name.starts_with("module.")) {
        return Err(CheckpointError::Malformed {
            path: file.path.display().to_string(),
            problem: "every tensor's name starts with `module.`, as torch.nn.DataParallel saves a model: save `model.module.state_dict()` instead (or strip the prefix)".into(),
        });
    }
    let mut counts = [0usize; 4];
    let mut bottleneck = false;
    for name in file.tensors.keys() {
        let mut parts = name.split('.');
        let stage = parts.next().and_then(|p| p.strip_prefix("layer")?.parse::<usize>().ok());
        let block = parts.next().and_then(|p| p.parse::<usize>().ok());
        if let (Some(stage @ 1..=4), Some(block)) = (stage, block) {
            counts[stage - 1] = counts[stage - 1].max(block + 1);
            bottleneck |= parts.next() == Some("conv3");
        }
    }
    if counts == [0; 4] {
        return Ok(asked.unwrap_or_default());
    }
    let found =
        Arch::ALL.into_iter().find(|a| a.blocks() == counts && a.bottleneck() == bottleneck);
    let kind = if bottleneck { "Bottleneck" } else { "BasicBlock" };
    let problem = match (found, asked) {
        (Some(found), Some(asked)) if found != asked => format!(
            "these are {found} weights ({kind}s {counts:?} per stage), but --arch is {asked}: drop --arch or pass --arch {found}"
        ),
        (Some(found), _) => return Ok(found),
        (None, _) => format!(
            "{kind}s {counts:?} per stage are none of torchvision's ResNets (resnet18: BasicBlocks [2, 2, 2, 2]; resnet34: BasicBlocks [3, 4, 6, 3]; resnet50: Bottlenecks [3, 4, 6, 3]; resnet101: Bottlenecks [3, 4, 23, 3])"
        ),
    };
    Err(CheckpointError::Malformed { path: file.path.display().to_string(), problem })
}

/// Weights to fine-tune from (`train --init`): every parameter and running statistic of
/// `model` must be present with its shape, except a classifier for another class count — a
/// whole one, `fc.weight` `[k, features]` and `fc.bias` `[k]` — which keeps `init`'s values.
pub fn load_for_fine_tuning(
    file: &TensorFile,
    model: &ResNet,
    init: &[f32],
) -> Result<FineTuning, CheckpointError> {
    let other_classes = other_classifier(file, model)?;
    let mut params = init.to_vec();
    for spec in &model.params {
        if other_classes.is_some() && spec.name.starts_with("fc.") {
            continue;
        }
        let t = file.require(&spec.name, &spec.shape)?;
        take(file, &spec.name, t, &mut params[spec.range()])?;
    }
    let running = load_running(file, model, true)?;
    Ok(FineTuning { params, running, other_classes })
}

/// What [`load_for_fine_tuning`] took from a file.
pub struct FineTuning {
    pub params: Vec<f32>,
    pub running: Vec<f32>,
    /// The file's class count, when its classifier was for another and was not taken.
    pub other_classes: Option<usize>,
}

/// The class count of `file`'s classifier when it is a whole one for another count than
/// `model`'s; None when it is `model`'s own (or absent: the caller names what is missing). A
/// classifier of another width, or whose bias does not match its rows, is malformed: an error.
fn other_classifier(file: &TensorFile, model: &ResNet) -> Result<Option<usize>, CheckpointError> {
    let (Some(spec), Some(weight)) = (model.param("fc.weight"), file.get("fc.weight")) else {
        return Ok(None);
    };
    let malformed = |problem: String| CheckpointError::Malformed {
        path: file.path.display().to_string(),
        problem,
    };
    let (classes, features) = (spec.shape[0], spec.shape[1]);
    let k = match weight.shape[..] {
        [k, f] if f == features && k > 0 => k,
        _ => {
            return Err(malformed(format!(
                "`fc.weight` has shape {:?}, and {}'s classifier is [classes, {features}]: these are not {} weights",
                weight.shape, model.arch, model.arch
            )))
        }
    };
    match file.get("fc.bias").map(|b| b.shape.clone()) {
        _ if k == classes => Ok(None),
        Some(bias) if bias == [k] => Ok(Some(k)),
        Some(bias) => Err(malformed(format!(
            "`fc.bias` has shape {bias:?}, but `fc.weight` has {k} rows: the classifier is damaged"
        ))),
        None => Err(malformed(format!("`fc.weight` has {k} rows but there is no `fc.bias`"))),
    }
}

/// The running statistics of `file`: each required, or else defaulting to mean 0, variance 1.
fn load_running(
    file: &TensorFile,
    model: &ResNet,
    running_required: bool,
) -> Result<Vec<f32>, CheckpointError> {
    let mut running = model.init_buffers();
    for spec in &model.buffers {
        let t = if running_required {
            Some(file.require(&spec.name, &spec.shape)?)
        } else {
            file.optional(&spec.name, &spec.shape)?
        };
        if let Some(t) = t {
            take(file, &spec.name, t, &mut running[spec.range()])?;
        }
    }
    Ok(running)
}

/// Copies the tensor `name` of `file` into `dst`, refusing integers and values a healthy run
/// never holds ([`healthy`]; a running variance below 0).
fn take(
    file: &TensorFile,
    name: &str,
    t: &crate::tensorfile::Tensor,
    dst: &mut [f32],
) -> Result<(), CheckpointError> {
    let path = || file.path.display().to_string();
    if t.integer {
        return Err(CheckpointError::Integers { path: path(), name: name.into() });
    }
    let variance = name.ends_with("running_var");
    for (index, (d, &value)) in dst.iter_mut().zip(&t.values).enumerate() {
        *d = value as f32;
        let problem = if !healthy(*d) {
            "not finite, or past where its square overflows f32: the run that made it diverged"
        } else if variance && value < 0.0 {
            "a negative running variance, which no batch gives: the file is damaged"
        } else {
            continue;
        };
        return Err(CheckpointError::BadValue {
            path: path(),
            name: name.into(),
            index,
            value,
            problem,
        });
    }
    Ok(())
}

/// Everything needed to continue a run bit-exactly.
#[derive(Clone, Debug, PartialEq)]
pub struct Checkpoint {
    pub params: Vec<f32>,
    pub running: Vec<f32>,
    pub velocity: Vec<f32>,
    /// Steps taken so far.
    pub step: u64,
    /// What the run is: its network, data and hyper-parameters.
    pub settings: TrainConfig,
}

/// The first tensor of `ck` (its name, the element, the value) that a healthy run never holds
/// ([`healthy`]): what a run that diverged leaves.
pub fn unhealthy(model: &ResNet, ck: &Checkpoint) -> Option<(String, usize, f32)> {
    let tensors = [("", &model.params, &ck.params), ("", &model.buffers, &ck.running)];
    let momentum = ("momentum/", &model.params, &ck.velocity);
    tensors.into_iter().chain([momentum]).find_map(|(prefix, specs, flat)| {
        specs.iter().find_map(|spec| {
            let values = &flat[spec.range()];
            let index = values.iter().position(|&v| !healthy(v))?;
            Some((format!("{prefix}{}", spec.name), index, values[index]))
        })
    })
}

/// The named tensors of `flat` in the layout `specs` describes.
fn entries<'a>(
    prefix: &str,
    specs: &[crate::model::TensorSpec],
    flat: &'a [f32],
) -> Vec<Entry<'a>> {
    specs
        .iter()
        .map(|s| (format!("{prefix}{}", s.name), s.shape.clone(), &flat[s.range()]))
        .collect()
}

/// Writes a checkpoint atomically: an interrupted or failed save leaves the old file intact.
/// A checkpoint with a non-finite value is not written (the old one stays). Native only (a
/// browser has no file system: it saves [`to_bytes`]).
#[cfg(not(target_arch = "wasm32"))]
pub fn save(path: &Path, model: &ResNet, ck: &Checkpoint) -> Result<(), CheckpointError> {
    let bytes = to_bytes(path, model, ck)?;
    crate::files::write_atomic(path, &bytes).map_err(|e| {
        CheckpointError::File(TensorFileError::Io { path: path.into(), message: e.to_string() })
    })
}

/// The bytes of the checkpoint file [`save`] writes (`name` names it in errors); none for a
/// checkpoint with a non-finite value.
pub fn to_bytes(name: &Path, model: &ResNet, ck: &Checkpoint) -> Result<Vec<u8>, CheckpointError> {
    if let Some((name, index, value)) = unhealthy(model, ck) {
        return Err(CheckpointError::NotFinite { name, index, value });
    }
    serialize(name, model, ck, &metadata(model, ck))
}

/// What a checkpoint's header records: the run's settings, its model's arch, its step and the
/// format.
fn metadata(model: &ResNet, ck: &Checkpoint) -> BTreeMap<String, String> {
    let mut meta = ck.settings.metadata();
    meta.insert(ARCH_KEY.into(), model.arch.to_string());
    meta.insert("step".into(), ck.step.to_string());
    meta.insert("format".into(), FORMAT.into());
    meta
}

/// `ck`'s tensors with `meta` as their header, as a file's bytes.
fn serialize(
    name: &Path,
    model: &ResNet,
    ck: &Checkpoint,
    meta: &BTreeMap<String, String>,
) -> Result<Vec<u8>, CheckpointError> {
    let mut all = entries("", &model.params, &ck.params);
    all.extend(entries("", &model.buffers, &ck.running));
    all.extend(entries("momentum/", &model.params, &ck.velocity));
    Ok(crate::tensorfile::f32_i64_bytes(name, &all, &[], meta)?)
}

/// Writes what `syncstep grad` reads and PyTorch loads, in one file with torchvision's names:
/// `model`'s `params` and `running` statistics, `images` as `input` [m, 3, size, size] and
/// `labels` \[m\] as int64, as PyTorch keeps them (any values: out-of-range ones too). Native only.
#[cfg(not(target_arch = "wasm32"))]
pub fn write_step_inputs(
    path: &Path,
    model: &ResNet,
    (params, running): (&[f32], &[f32]),
    images: &[f32],
    size: u32,
    labels: &[i64],
) -> Result<(), TensorFileError> {
    let mut all = entries("", &model.params, params);
    all.extend(entries("", &model.buffers, running));
    let (m, side) = (labels.len(), size as usize);
    all.push(("input".into(), vec![m, 3, side, side], images));
    let ints = [("labels".to_string(), vec![m], labels)];
    crate::tensorfile::write_f32_i64(path, &all, &ints, &BTreeMap::new())
}

/// [`write_step_inputs`] for `model`'s weights from `seed` (with random BatchNorm γ and β, see
/// [`ResNet::randomize_batchnorm`]) with the values `set` gives (tensor name, element, value:
/// the PyTorch fixtures' nudges) put in, initial running statistics, and `m` synthetic images of
/// `size`² from the same seed. Native only.
#[cfg(not(target_arch = "wasm32"))]
pub fn write_seeded_inputs(
    path: &Path,
    model: &ResNet,
    seed: u64,
    m: usize,
    size: u32,
    set: &[(&str, usize, f32)],
) -> Result<(), Box<dyn std::error::Error>> {
    let mut params = model.init_params(seed);
    model.randomize_batchnorm(&mut params, seed + 1);
    for &(name, index, value) in set {
        let tensor = model.param(name).ok_or_else(|| format!("{name}: no such parameter"))?;
        let at =
            tensor.range().nth(index).ok_or_else(|| format!("{name}[{index}]: past its end"))?;
        params[at] = value;
    }
    let running = model.init_buffers();
    let batch = crate::data::synthetic_batch(seed, 0, m, size, size, model.classes)?;
    let labels: Vec<i64> = batch.labels.iter().map(|&l| l.into()).collect();
    Ok(write_step_inputs(path, model, (&params, &running), &batch.images, size, &labels)?)
}

/// Checks that `file` is a syncstep checkpoint this build reads, with its checksum and every
/// setting a resume needs, each valid; the errors name the file and the setting. Returns the
/// run's settings.
pub fn check_checkpoint(file: &TensorFile) -> Result<TrainConfig, CheckpointError> {
    use crate::tensorfile::CHECKSUM_KEY;
    let path = file.path.display().to_string();
    let meta = |key: &str, problem: &str| CheckpointError::Metadata {
        path: path.clone(),
        key: key.into(),
        problem: problem.into(),
    };
    let checksum = match file.metadata.get("format").map(String::as_str) {
        Some(FORMAT) => CHECKSUM_KEY,
        Some(EARLIER_FORMAT) => return Err(meta("format", &format!("is {EARLIER_FORMAT:?}, an earlier build's, whose checksum does not cover its settings (learning rate, data, class names, normalisation) and which does not record what its data was: they cannot be trusted. Carry the run over with `train --init {}` and the run's flags (its weights are checked), or use the build that wrote it", file.path.display()))),
        Some(other) => return Err(meta("format", &format!("is {other:?}; this build reads {FORMAT:?}"))),
        None => return Err(meta("format", "is missing: this is not a syncstep checkpoint (a `train --checkpoint` file); torchvision weights go to --weights (or --init)")),
    };
    if !file.metadata.contains_key(checksum) {
        return Err(meta(checksum, "is missing: the file cannot be checked"));
    }
    for key in required_settings() {
        if !file.metadata.contains_key(&key) {
            return Err(meta(&key, "is missing: a resume defaults nothing"));
        }
    }
    TrainConfig::from_metadata(&file.metadata)
        .map_err(|e| CheckpointError::Malformed { path, problem: e.to_string() })
}

/// A checkpoint as an output (`train --checkpoint`): what it may replace. Native only.
#[cfg(not(target_arch = "wasm32"))]
pub const KIND: crate::files::Kind =
    crate::files::Kind { what: "a syncstep checkpoint", ours: is_checkpoint };

/// Whether the file at `path` is a checkpoint syncstep wrote: of this build's format, holding
/// the hash of its own content ([`crate::tensorfile::CHECKSUM_KEY`], checked as it is read) and
/// every setting a run records, each valid. A file that copies its metadata's strings is not.
/// Native only.
#[cfg(not(target_arch = "wasm32"))]
pub fn is_checkpoint(path: &Path) -> bool {
    // The header alone first: a large file of another kind is not read whole.
    let format = crate::tensorfile::read_header(path).map(|h| h.metadata.get("format").cloned());
    if format.ok().flatten().as_deref() != Some(FORMAT) {
        return false;
    }
    TensorFile::read(path).is_ok_and(|file| {
        file.metadata.contains_key(crate::tensorfile::CHECKSUM_KEY)
            && check_checkpoint(&file).is_ok()
    })
}

/// Whether a safetensors header's metadata names a syncstep checkpoint's format, of this build
/// or another (anything else may be torchvision's weights).
pub fn checkpoint_format(metadata: &BTreeMap<String, String>) -> bool {
    metadata.get("format").is_some_and(|f| f.starts_with("syncstep-checkpoint"))
}

/// Refuses a checkpoint whose tensors are another network than its settings say: another arch
/// (told by the blocks they name) or another class count (`fc.weight`'s rows). A missing or
/// mis-shaped tensor otherwise is named as the weights are read.
fn tensors_match_settings(
    file: &TensorFile,
    settings: &TrainConfig,
) -> Result<(), CheckpointError> {
    let (arch, classes) = (settings.arch, settings.classes);
    let problem = match (weights_arch(file, None), self::classes(file, arch)) {
        (Ok(found), _) if found != arch => {
            format!("its settings say {arch}, but its tensors are a {found}'s")
        }
        (_, Ok(found)) if found != classes => format!(
            "its settings say {classes} classes, but its classifier (`fc.weight`) has {found}"
        ),
        _ => return Ok(()),
    };
    Err(CheckpointError::Malformed {
        path: file.path.display().to_string(),
        problem: format!("{problem}: the file is damaged, or was made by hand"),
    })
}

/// Reads a checkpoint [`save`] wrote. Native only (a browser has no file system).
#[cfg(not(target_arch = "wasm32"))]
pub fn load(path: &Path, model: &ResNet) -> Result<Checkpoint, CheckpointError> {
    from_file(&TensorFile::read(path)?, model)
}

/// The checkpoint in `file`, read as [`load`] reads it (for a caller that has read the file
/// already, to see what it is).
pub fn from_file(file: &TensorFile, model: &ResNet) -> Result<Checkpoint, CheckpointError> {
    let settings = check_checkpoint(file)?;
    let meta = |key: &str, problem: &str| CheckpointError::Metadata {
        path: file.path.display().to_string(),
        key: key.into(),
        problem: problem.into(),
    };
    let arch = settings.arch;
    if arch != model.arch {
        return Err(meta(
            ARCH_KEY,
            &format!("is {arch}, but this run is {}: pass --arch {arch}", model.arch),
        ));
    }
    tensors_match_settings(file, &settings)?;
    let (params, running) = load_weights(file, model, true)?;
    let mut velocity = vec![0.0f32; model.param_len];
    for spec in &model.params {
        let name = format!("momentum/{}", spec.name);
        let t = file.require(&name, &spec.shape)?;
        take(file, &name, t, &mut velocity[spec.range()])?;
    }
    let step = file
        .metadata
        .get("step")
        .and_then(|s| s.parse::<u64>().ok())
        .filter(|&s| s < 1 << 53)
        .ok_or_else(|| meta("step", "is missing or not a step count"))?;
    Ok(Checkpoint { params, running, velocity, step, settings })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensorfile::{write_f32, Tensor};

    /// `ck` written with `meta` as its header, whatever it holds.
    fn write(path: &Path, model: &ResNet, ck: &Checkpoint, meta: &BTreeMap<String, String>) {
        std::fs::write(path, serialize(path, model, ck, meta).unwrap()).unwrap();
    }

    fn checkpoint(model: &ResNet) -> Checkpoint {
        let params = model.init_params(5);
        let mut running = model.init_buffers();
        running[3] = 0.25;
        let velocity: Vec<f32> = params.iter().map(|p| p * 0.5).collect();
        let settings = TrainConfig { arch: model.arch, ..TrainConfig::default() };
        Checkpoint { params, running, velocity, step: 42, settings }
    }

    /// A fresh folder of this test's own, removed when dropped, however the test ends.
    fn dir(test: &str) -> tempfile::TempDir {
        tempfile::Builder::new().prefix(&format!("syncstep-ck-{test}-")).tempdir().unwrap()
    }

    #[test]
    fn checkpoint_round_trips_exactly() {
        let model = ResNet::new(Arch::ResNet34, 10).unwrap();
        let ck = checkpoint(&model);
        let tmp = dir("round-trip");
        let dir = tmp.path();
        let path = dir.join("ck.safetensors");
        save(&path, &model, &ck).unwrap();
        assert_eq!(load(&path, &model).unwrap(), ck);
        // What a browser saves is what the file holds.
        assert_eq!(to_bytes(&path, &model, &ck).unwrap(), std::fs::read(&path).unwrap());
        // A file of another model (7 classes) is refused, naming the tensor.
        let e = load(&path, &ResNet::new(Arch::ResNet34, 7).unwrap()).unwrap_err().to_string();
        assert!(e.contains("fc.weight") && e.contains("[10, 512]"), "{e}");
    }

    /// A checkpoint records its model's arch, and one of another arch is refused naming both;
    /// one without the record (made before there was a choice) is ResNet-34's.
    #[test]
    fn a_checkpoint_records_its_arch_and_another_is_refused() {
        let tmp = dir("arch");
        let dir = tmp.path();
        let path = dir.join("ck.safetensors");
        let resnet18 = ResNet::new(Arch::ResNet18, 10).unwrap();
        let ck = checkpoint(&resnet18);
        save(&path, &resnet18, &ck).unwrap();
        let meta = TensorFile::read(&path).unwrap().metadata;
        assert_eq!(meta.get(ARCH_KEY).map(String::as_str), Some("resnet18"));
        assert_eq!(load(&path, &resnet18).unwrap(), ck);
        let resnet34 = ResNet::new(Arch::ResNet34, 10).unwrap();
        let e = load(&path, &resnet34).unwrap_err().to_string();
        assert!(e.contains("is resnet18, but this run is resnet34: pass --arch resnet18"), "{e}");

        let old = checkpoint(&resnet34);
        let mut meta = metadata(&resnet34, &old);
        meta.remove(ARCH_KEY);
        write(&path, &resnet34, &old, &meta);
        assert_eq!(load(&path, &resnet34).unwrap(), old);
        let e = load(&path, &resnet18).unwrap_err().to_string();
        assert!(e.contains("is resnet34, but this run is resnet18"), "{e}");
    }

    /// Every arch's own tensor names (with torchvision's `num_batches_tracked`) tell that arch,
    /// one tensor missing or not; `--arch` must agree.
    #[test]
    fn torchvision_weights_tell_their_arch() {
        for arch in Arch::ALL {
            let model = ResNet::new(arch, 1000).unwrap();
            let tensor = Tensor { shape: vec![1], values: vec![0.0], integer: false };
            let mut file = TensorFile::default();
            for spec in model.params.iter().chain(&model.buffers) {
                file.tensors.insert(spec.name.clone(), tensor.clone());
            }
            file.tensors.insert("layer1.0.bn1.num_batches_tracked".into(), tensor.clone());
            assert_eq!(weights_arch(&file, None).unwrap(), arch);
            file.tensors.remove("layer1.0.conv1.weight");
            assert_eq!(weights_arch(&file, Some(arch)).unwrap(), arch);
            let other = Arch::ALL.into_iter().find(|&a| a != arch).unwrap();
            let e = weights_arch(&file, Some(other)).unwrap_err().to_string();
            assert!(e.contains(&format!("these are {arch} weights")), "{e}");
            assert!(e.contains(&format!("--arch is {other}: drop --arch or pass --arch {arch}")));
        }
        assert_eq!(weights_arch(&TensorFile::default(), None).unwrap(), Arch::ResNet34);
    }

    /// Nothing a resume needs is defaulted, and a diverged state is never saved.
    #[test]
    fn a_checkpoint_missing_anything_or_not_finite_is_refused() {
        let model = ResNet::new(Arch::ResNet34, 10).unwrap();
        let tmp = dir("refused");
        let dir = tmp.path();
        let path = dir.join("ck.safetensors");
        let good = checkpoint(&model);
        for key in required_settings() {
            let mut meta = metadata(&model, &good);
            meta.remove(&key);
            write(&path, &model, &good, &meta);
            let e = load(&path, &model).unwrap_err().to_string();
            assert!(e.contains(&format!("metadata `{key}` is missing")), "{e}");
        }
        // The running statistics too (weights for `grad` may leave them out).
        let mut all = entries("", &model.params, &good.params);
        all.extend(entries("momentum/", &model.params, &good.velocity));
        write_f32(&path, &all, &metadata(&model, &good)).unwrap();
        let e = load(&path, &model).unwrap_err().to_string();
        assert!(e.contains("missing tensor `bn1.running_mean`"), "{e}");
        // A NaN is not saved, and the file there stays.
        save(&path, &model, &good).unwrap();
        let mut bad = good.clone();
        bad.velocity[7] = f32::NAN;
        let e = save(&path, &model, &bad).unwrap_err().to_string();
        assert!(e.contains("non-finite") && e.contains("momentum/conv1.weight"), "{e}");
        assert_eq!(load(&path, &model).unwrap(), good);
    }
}
