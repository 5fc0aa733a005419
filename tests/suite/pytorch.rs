//! The step held to PyTorch itself: `syncstep grad` on the seeded weights and batch that
//! `checkpoint::write_seeded_inputs` writes, against the loss, logits, gradients and updated
//! running statistics torchvision's model computed in float64 on the same file
//! (tests/fixtures/pytorch, made by scripts/pytorch_fixtures.py; PyTorch is needed only to
//! remake them). The script nudges a few BatchNorm βs (the fixture's `nudges`, set here too) so
//! that no ReLU input lies within 1e-4 of its site's RMS of zero: f32 steps then decide every
//! unit as the f64 step does, and part from it by rounding alone (un-nudged, syncstep's
//! ResNet-50 step flipped a unit on each of 6 seeds tried, its gradients 1e-2 off). The bounds:
//! TIE's for the loss and logits, and for a tensor known by its norm and 64 sampled elements
//! 3e-4 (a sample's norm-rel error is noisier than the whole tensor's: 9.3e-5 at worst on
//! lavapipe). A wrong step is far past them: without label smoothing a BatchNorm gradient is
//! 0.12 off.

use std::path::{Path, PathBuf};

use crate::common::{needs_adapter, syncstep};
use serde_json::Value;
use syncstep::checkpoint::write_seeded_inputs;
use syncstep::compare::{norm_rel, summary_error};
use syncstep::model::{Arch, ResNet};
use syncstep::tensorfile::TensorFile;

const LOSS_BOUND: f64 = 1e-5;
const LOGITS_BOUND: f64 = 1e-4;
const BOUND: f64 = 3e-4;

fn fixture(name: &str) -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/pytorch").join(name);
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

fn number(v: &Value, key: &str) -> f64 {
    v[key].as_f64().unwrap_or_else(|| panic!("fixture: `{key}` is not a number"))
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()
}

/// Each summarised tensor of `list` (name, norm, sample) against `prefix`+name in `out`:
/// the names of those past `BOUND`, with their errors.
fn off_tensors(out: &TensorFile, prefix: &str, list: &Value) -> Vec<String> {
    let mut off = Vec::new();
    for t in list.as_array().unwrap() {
        let name = t["name"].as_str().unwrap();
        let got = out.get(&format!("{prefix}{name}")).unwrap_or_else(|| panic!("no {name}"));
        let values: Vec<f32> = got.values.iter().map(|&v| v as f32).collect();
        assert_eq!(values.len() as u64, t["len"].as_u64().unwrap(), "{name}");
        let e = summary_error(&values, number(t, "norm"), &floats(&t["sample"]));
        if e > BOUND {
            off.push(format!("{name} {e:.2e}"));
        }
    }
    off
}

/// Runs `grad` on the fixture's inputs, written afresh into `dir`; the outputs' path.
fn grad_on_fixture_inputs(f: &Value, dir: &Path) -> PathBuf {
    let classes = number(f, "classes") as u32;
    let arch: Arch = f["arch"].as_str().unwrap().parse().unwrap();
    let model = ResNet::new(arch, classes).unwrap();
    let inputs = dir.join("inputs.safetensors");
    let (seed, images, size) =
        (number(f, "seed") as u64, number(f, "images") as usize, number(f, "image_size") as u32);
    let nudges: Vec<(&str, usize, f32)> = (f["nudges"].as_array().unwrap().iter())
        .map(|n| {
            (
                n["tensor"].as_str().unwrap(),
                n["index"].as_u64().unwrap() as usize,
                n["value"].as_f64().unwrap() as f32,
            )
        })
        .collect();
    write_seeded_inputs(&inputs, &model, seed, images, size, &nudges).unwrap();
    let out = dir.join("out.safetensors");
    let smoothing = number(f, "label_smoothing").to_string();
    let (i, o) = (inputs.to_str().unwrap(), out.to_str().unwrap());
    let args = ["grad", "--weights", i, "--batch", i, "--out", o, "--label-smoothing", &smoothing];
    let (ok, text) = syncstep(&args);
    assert!(ok, "{text}");
    out
}

fn the_step_gives_pytorchs_loss_logits_gradients_and_running_statistics() {
    the_step_gives_pytorchs("resnet34-seed0.json");
}

fn the_resnet18_step_gives_pytorchs_loss_logits_gradients_and_running_statistics() {
    the_step_gives_pytorchs("resnet18-seed0.json");
}

fn the_resnet50_step_gives_pytorchs_loss_logits_gradients_and_running_statistics() {
    the_step_gives_pytorchs("resnet50-seed0.json");
}

/// `grad` on the inputs of fixture `name` against its loss, logits, gradients and running
/// statistics.
fn the_step_gives_pytorchs(name: &str) {
    needs_adapter();
    let f = fixture(name);
    let dir = tempfile::Builder::new().prefix(&format!("syncstep-pytorch-{name}-")).tempdir();
    let dir = dir.unwrap();
    let out = TensorFile::read(&grad_on_fixture_inputs(&f, dir.path())).unwrap();

    let loss = out.get("loss").unwrap().values[0];
    let loss_err = (loss - number(&f, "loss")).abs() / number(&f, "loss");
    assert!(loss_err <= LOSS_BOUND, "loss {loss} against PyTorch's {}", number(&f, "loss"));
    let logits: Vec<f32> = out.get("logits").unwrap().values.iter().map(|&v| v as f32).collect();
    let want: Vec<f32> = f["logits"].as_array().unwrap().iter().flat_map(floats).collect();
    let logits_err = norm_rel(&logits, &want);
    assert!(logits_err <= LOGITS_BOUND, "logits {logits_err:.2e} from PyTorch's");

    let grads = off_tensors(&out, "grad/", &f["gradients"]);
    assert!(grads.is_empty(), "gradients past {BOUND:e} from PyTorch's: {grads:?}");
    let running = off_tensors(&out, "after/", &f["running_after"]);
    assert!(running.is_empty(), "running statistics past {BOUND:e}: {running:?}");
}

tests![
    the_step_gives_pytorchs_loss_logits_gradients_and_running_statistics,
    the_resnet18_step_gives_pytorchs_loss_logits_gradients_and_running_statistics,
    the_resnet50_step_gives_pytorchs_loss_logits_gradients_and_running_statistics,
];
