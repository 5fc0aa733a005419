//! `syncstep grad`: one training step's loss, logits, gradients and updated BN statistics
//! for given weights and batch, as safetensors, to hold against PyTorch; on one device or
//! data-parallel (`--replicas R`: the batch in R contiguous shards, BatchNorm synchronised; the
//! same bits).

use std::path::PathBuf;

use clap::Args;
use syncstep::checkpoint::{self, load_weights};
use syncstep::data::Batch;
use syncstep::files::Kind;
use syncstep::model::{Arch, ResNet};
use syncstep::parallel::{DataParallel, ParallelOptions};
use syncstep::step::StepConfig;
use syncstep::tensorfile::{write_f32, TensorFile};

/// grad's output (`--out`), told by its `loss` and `logits` tensors.
const GRADIENTS: Kind = Kind {
    what: "syncstep grad's output (a grad --out file)",
    ours: |path| {
        let header = syncstep::tensorfile::read_header(path).unwrap_or_default();
        ["loss", "logits"].iter().all(|name| header.tensors.iter().any(|t| t == name))
    },
};

#[derive(Args)]
pub struct GradArgs {
    /// Weights with torchvision `state_dict` names (f32 or f64; BN buffers optional).
    #[arg(long)]
    weights: PathBuf,
    /// The network, checked against the weights' tensors: resnet18, resnet34, resnet50 or
    /// resnet101 [default: the one the weights are].
    #[arg(long)]
    arch: Option<Arch>,
    /// The batch: `input` [M,3,H,W] (NCHW) and `labels` [M] (integers). May be the weights file.
    #[arg(long)]
    batch: PathBuf,
    /// Where to write `loss`, `logits`, `grad/<name>` and `after/<bn>.running_{mean,var}`.
    #[arg(long)]
    out: PathBuf,
    #[arg(long, default_value_t = StepConfig::default().label_smoothing, allow_hyphen_values = true)]
    label_smoothing: f32,
    /// Adapter (see `syncstep info`); defaults to $SYNCSTEP_ADAPTER, else the first.
    #[arg(long, conflicts_with = "adapters")]
    adapter: Option<String>,
    /// Data-parallel over this many devices: the batch in R contiguous shards (any R ≤ M; the
    /// first M mod R take one example more), BatchNorm synchronised, gradients all-reduced:
    /// the same bits as one device.
    #[arg(long, default_value_t = 1, conflicts_with = "mpi", allow_negative_numbers = true, value_parser = crate::cli::at_most::<1024>)]
    replicas: usize,
    /// Adapters for the replicas, comma-separated (`0,1`, `vulkan,gl`): replica r on the
    /// (r mod count)-th.
    #[arg(long, value_delimiter = ',')]
    adapters: Vec<String>,
    #[command(flatten)]
    overwrite: super::Overwrite,
    #[command(flatten)]
    buckets: super::ranks::BucketArgs,
    #[command(flatten)]
    tune: super::ranks::TuneArgs,
    #[command(flatten)]
    ranks: super::ranks::MpiArgs,
}

/// The batch in `file`: `input` [M, 3, H, W] and integer `labels` [M] below `classes`.
pub fn read_batch(file: &TensorFile, classes: u32) -> Result<Batch, Box<dyn std::error::Error>> {
    let path = file.path.display();
    let input =
        file.get("input").ok_or_else(|| format!("{path}: missing tensor `input` [M, 3, H, W]"))?;
    let [m, c, h, w] = input.shape[..] else {
        return Err(
            format!("{path}: `input` has shape {:?}, expected [M, 3, H, W]", input.shape).into()
        );
    };
    if c != 3 {
        return Err(
            format!("{path}: `input` has {c} channels; a ResNet's stem takes 3 (RGB)").into()
        );
    }
    let labels = file.require("labels", &[m])?;
    if !labels.integer {
        return Err(format!("{path}: `labels` must be an integer tensor (int64 or int32)").into());
    }
    if let Some((i, &l)) =
        labels.values.iter().enumerate().find(|(_, &l)| l < 0.0 || l >= classes as f64)
    {
        return Err(format!(
            "{path}: label {l} of example {i} is out of range: the weights have {classes} classes"
        )
        .into());
    }
    let batch = Batch {
        images: input.values.iter().map(|&v| v as f32).collect(),
        labels: labels.values.iter().map(|&l| l as u32).collect(),
        h: h as u32,
        w: w as u32,
    };
    ResNet::check_image_size(batch.h, batch.w)?;
    batch.validate(classes)?;
    Ok(batch)
}

pub fn run(args: GradArgs) -> Result<(), Box<dyn std::error::Error>> {
    let cfg = StepConfig { label_smoothing: args.label_smoothing, ..StepConfig::default() };
    cfg.validate().map_err(|e| format!("--label-smoothing {}: {e}", args.label_smoothing))?;
    let peers = super::ranks::peers(&args.ranks)?;
    let lead = peers.rank() == 0;
    let inputs = [args.weights.as_path(), args.batch.as_path()];
    let overwrite = args.overwrite.overwrite;
    let _claim = lead
        .then(|| syncstep::files::check_output("--out", &args.out, &inputs, GRADIENTS, overwrite))
        .transpose()?;
    let weights = TensorFile::read(&args.weights)?;
    let arch = checkpoint::weights_arch(&weights, args.arch)?;
    let classes = checkpoint::classes(&weights, arch)?;
    let model = ResNet::new(arch, classes)?;
    let (params, running) = load_weights(&weights, &model, false)?;
    let batch = read_batch(
        &if args.batch == args.weights { weights } else { TensorFile::read(&args.batch)? },
        classes,
    )?;

    let local = if args.ranks.mpi { args.ranks.local_replicas as usize } else { args.replicas };
    let bucket_bytes = args.buckets.bytes(local * peers.ranks())?;
    let settings = (args.label_smoothing, local);
    super::ranks::agree(&peers, "the settings", &serde_json::to_vec(&settings)?)?;
    super::ranks::agree(&peers, "the weights", bytemuck::cast_slice(&params))?;
    super::ranks::agree(&peers, "the batch", bytemuck::cast_slice(&batch.images))?;
    super::ranks::agree(&peers, "the labels", bytemuck::cast_slice(&batch.labels))?;

    let gpus =
        super::ranks::devices(&peers, args.adapter.as_deref(), &args.adapters, local, &args.tune)?;
    let mut dp = DataParallel::from_gpus(gpus, &model, &params, &running)?
        .with_peers(peers)
        .with_bucket_bytes(bucket_bytes);
    let m = batch.len();
    let out = pollster::block_on(dp.forward_backward(&batch, &cfg, ParallelOptions::default()))?;
    let logits = dp.logits(&out)?;
    if !lead {
        return Ok(());
    }
    // After the all-reduce every replica holds the same gradient (and, synchronised, the same
    // running statistics): replica 0's stand for all.
    let first = &dp.replicas()[0];
    let grads = pollster::block_on(first.read_grads())?;
    let after = pollster::block_on(first.read_running())?;
    // Every replica holds the global loss.
    let loss = [out[0].loss];

    let mut entries = vec![
        ("loss".to_string(), vec![1], &loss[..]),
        ("logits".to_string(), vec![m, classes as usize], &logits[..]),
    ];
    entries.extend(
        model
            .params
            .iter()
            .map(|p| (format!("grad/{}", p.name), p.shape.clone(), &grads[p.range()])),
    );
    entries.extend(
        model
            .buffers
            .iter()
            .map(|b| (format!("after/{}", b.name), b.shape.clone(), &after[b.range()])),
    );
    write_f32(&args.out, &entries, &Default::default())?;
    say!("loss {:.6}; {} gradients written to {}", loss[0], model.params.len(), args.out.display());
    refuse_non_finite(&entries)
}

/// The outputs are written (to look at), but are not a result when any holds NaN or
/// infinity: an error naming them.
fn refuse_non_finite(
    entries: &[(String, Vec<usize>, &[f32])],
) -> Result<(), Box<dyn std::error::Error>> {
    let bad: Vec<&str> = entries
        .iter()
        .filter(|(_, _, values)| values.iter().any(|v| !v.is_finite()))
        .map(|(name, _, _)| name.as_str())
        .collect();
    if bad.is_empty() {
        return Ok(());
    }
    let shown = bad.iter().take(5).copied().collect::<Vec<_>>().join(", ");
    Err(format!(
        "{} of the outputs hold NaN or infinity ({shown}{}): the step diverged for these weights and batch",
        bad.len(),
        if bad.len() > 5 { ", …" } else { "" }
    )
    .into())
}
