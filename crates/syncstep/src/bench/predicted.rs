//! What a large GPU would make of a recorded step, by construction: each dispatch's figures
//! ([`Estimate`]: from its shape and what its launcher says of its code) on a named GPU
//! ([`GpuModel`]), the whole step's time with its launch gaps, and that time beside PyTorch
//! CUDA's measured step where one was measured. Computed from what the step records, so a CPU
//! adapter gives the figures of a GPU (`syncstep bench --shapes-only --plan-for gpu`). The
//! model is in `kernels::gpu_model`.

use serde_json::{json, Value};

use crate::gpu::{Construction, KernelTime};
pub use crate::kernels::gpu_model::{Estimate, GpuModel, H100, H200};
use crate::model::Arch;

/// PyTorch CUDA's training step as measured on an H200 (cuDNN, TF32 off, torchvision's
/// network with 10 classes, `scripts/vs_pytorch.py`; docs/performance-log.md, 2026-12-04): arch,
/// image size, batch, seconds.
pub const PYTORCH_CUDA: [(Arch, u32, u32, f64); 5] = [
    (Arch::ResNet34, 224, 32, 0.024),
    (Arch::ResNet34, 224, 8, 0.015),
    (Arch::ResNet34, 32, 256, 0.011),
    (Arch::ResNet34, 64, 32, 0.011),
    (Arch::ResNet34, 32, 8, 0.010),
];

/// The step PyTorch CUDA took at a shape, where measured.
pub fn pytorch_cuda(arch: Arch, image_size: u32, batch: u32, classes: u32) -> Option<f64> {
    let measured = |&&(a, s, b, _): &&(Arch, u32, u32, f64)| (a, s, b) == (arch, image_size, batch);
    PYTORCH_CUDA.iter().find(measured).filter(|_| classes == 10).map(|r| r.3)
}

/// One dispatch's figures on a [`GpuModel`].
#[derive(Clone, Debug, PartialEq)]
pub struct DispatchFigures {
    pub layer: String,
    pub op: &'static str,
    pub entry: &'static str,
    pub workgroups: u64,
    pub invocations: u32,
    pub flops: f64,
    pub bytes: u64,
    pub construction: Option<Construction>,
    pub estimate: Estimate,
}

impl DispatchFigures {
    fn of(k: &KernelTime, m: &GpuModel) -> DispatchFigures {
        let s = &k.shape;
        DispatchFigures {
            layer: k.scope.clone(),
            op: k.op,
            entry: k.entry,
            workgroups: s.workgroups,
            invocations: s.invocations,
            flops: s.flops,
            bytes: s.bytes,
            construction: s.construction,
            estimate: Estimate::of(m, s),
        }
    }

    /// The share of the rated peak it runs at, by construction.
    pub fn ceiling(&self, m: &GpuModel) -> f64 {
        self.flops / m.peak() / self.estimate.seconds.max(f64::MIN_POSITIVE)
    }

    /// Its workgroup-memory reads' wavefronts over the fewest they could take.
    pub fn conflict_degree(&self) -> Option<f64> {
        self.construction.map(|c| c.read_wavefronts / c.least_read_wavefronts)
    }

    fn to_json(&self, m: &GpuModel) -> Value {
        let e = &self.estimate;
        let mut d = json!({
            "layer": self.layer, "kernel": self.op, "entry": self.entry,
            "workgroups": self.workgroups, "invocations": self.invocations,
            "flops": self.flops, "bytes": self.bytes, "predicted_s": e.seconds,
            "issue_s": e.issue_s, "shared_s": e.shared_s, "memory_s": e.memory_s,
            "chain_s": e.chain_s,
        });
        if let Some(c) = &self.construction {
            d["outputs_per_invocation"] = json!(c.outputs_per_invocation);
            d["fma_per_shared_float"] = json!(c.fma_per_shared_float);
            d["shared_wavefronts_per_warp_per_k"] = json!(c.read_wavefronts + c.store_wavefronts);
            d["bank_conflict_degree"] = json!(self.conflict_degree());
            d["fma_between_barriers"] = json!(c.fma_between_barriers);
            d["flop_per_staged_byte"] = json!(c.flop_per_staged_byte);
            d["flop_per_scratch_byte"] =
                json!((c.scratch_bytes > 0).then(|| self.flops / (2.0 * c.scratch_bytes as f64)));
            d["shared_bytes_per_workgroup"] = json!(c.shared_bytes);
            d["registers"] = json!(c.registers);
            d["dependent_passes"] = json!(c.passes);
            d["warp_fmas"] = json!(c.issued.fmas);
            d["warp_instructions"] = json!(c.issued.total());
            d["slice_fmas"] = json!(c.slice.fmas);
            d["slice_other"] = json!(c.slice.other);
            d["workgroups_per_sm"] = json!(e.resident);
            d["warps_per_sm"] = json!(e.warps_per_sm);
            d["fill"] = json!(e.fill);
            d["latency"] = json!(e.latency);
            d["issue"] = json!(e.issue);
            d["useful"] = json!(e.useful);
            d["predicted_share"] = json!(self.ceiling(m));
            d["occupancy_ceiling"] = json!(e.occupancy);
        }
        d
    }
}

/// The convolution launchers, as the profile names them.
pub const CONV_OPS: [&str; 3] =
    ["conv2d_forward", "conv2d_backward_input", "conv2d_backward_weight"];

fn is_conv(op: &str) -> bool {
    op.starts_with("conv2d")
}

/// A recorded step's figures on one [`GpuModel`], and PyTorch CUDA's measured step at its
/// shape where there is one.
#[derive(Clone, Debug, PartialEq)]
pub struct Predicted {
    pub model: GpuModel,
    pub dispatches: Vec<DispatchFigures>,
    pub pytorch_s: Option<f64>,
}

/// FLOPs and predicted seconds of a set of dispatches.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Total {
    pub dispatches: usize,
    /// FLOPs of the dispatches with a construction (the GEMMs).
    pub flops: f64,
    pub seconds: f64,
    /// The GEMMs' FLOPs over their occupancy ceilings' times at the peak.
    pub occupancy_seconds: f64,
    /// Warp-instructions of the GEMMs, and of them multiply-adds.
    pub instructions: f64,
    pub fmas: f64,
}

impl Total {
    /// The predicted share of the rated peak: the GEMMs' FLOPs over the peak's time for all the
    /// dispatches' predicted seconds.
    pub fn ceiling(&self, m: &GpuModel) -> f64 {
        self.flops / m.peak() / self.seconds.max(f64::MIN_POSITIVE)
    }

    /// The FLOP-weighted occupancy ceiling of the GEMMs.
    pub fn occupancy(&self, m: &GpuModel) -> f64 {
        self.flops / m.peak() / self.occupancy_seconds.max(f64::MIN_POSITIVE)
    }

    /// The GEMMs' multiply-adds over the instructions they issue.
    pub fn issue(&self) -> f64 {
        self.fmas / self.instructions.max(1.0)
    }

    /// The GEMMs' useful FLOPs over those they execute.
    pub fn useful(&self) -> f64 {
        self.flops / (64.0 * self.fmas).max(1.0)
    }
}

impl Predicted {
    pub fn of(kernels: &[KernelTime], model: GpuModel, pytorch_s: Option<f64>) -> Predicted {
        Predicted {
            model,
            dispatches: kernels.iter().map(|k| DispatchFigures::of(k, &model)).collect(),
            pytorch_s,
        }
    }

    fn total(&self, keep: impl Fn(&DispatchFigures) -> bool) -> Total {
        let m = &self.model;
        self.dispatches.iter().filter(|d| keep(d)).fold(Total::default(), |t, d| {
            let occupancy =
                d.estimate.occupancy.map_or(0.0, |o| d.flops / (m.peak() * o.max(1e-3)));
            let issued = d.construction.map(|c| c.issued).unwrap_or_default();
            Total {
                dispatches: t.dispatches + 1,
                flops: t.flops + if d.construction.is_some() { d.flops } else { 0.0 },
                seconds: t.seconds + d.estimate.seconds,
                occupancy_seconds: t.occupancy_seconds + occupancy,
                instructions: t.instructions + issued.total(),
                fmas: t.fmas + issued.fmas,
            }
        })
    }

    /// The convolutions' dispatches: their GEMMs' FLOPs over the time of all of them (weight
    /// layouts and passes adding sums included).
    pub fn convolutions(&self) -> Total {
        self.total(|d| is_conv(d.op))
    }

    /// One convolution launcher's dispatches (`conv2d_forward`, …).
    pub fn op(&self, op: &str) -> Total {
        self.total(|d| d.op == op)
    }

    /// Every dispatch but the convolutions'.
    pub fn others(&self) -> Total {
        self.total(|d| !is_conv(d.op))
    }

    /// The dispatches' predicted seconds, without launch gaps.
    pub fn kernel_seconds(&self) -> f64 {
        self.dispatches.iter().map(|d| d.estimate.seconds).sum()
    }

    /// The launch gaps of the step's dispatches.
    pub fn gap_seconds(&self) -> f64 {
        self.dispatches.len() as f64 * self.model.launch_gap_s
    }

    /// The whole step: its dispatches and their launch gaps.
    pub fn step_seconds(&self) -> f64 {
        self.kernel_seconds() + self.gap_seconds()
    }

    /// The step's speed beside PyTorch CUDA's measured one (1.0: as fast), where measured.
    pub fn speed_vs_pytorch(&self) -> Option<f64> {
        self.pytorch_s.map(|p| p / self.step_seconds())
    }

    /// The dispatches that carry more than `share` of the step's FLOPs.
    pub fn carrying(&self, share: f64) -> impl Iterator<Item = &DispatchFigures> {
        let flops: f64 = self.dispatches.iter().map(|d| d.flops).sum();
        self.dispatches.iter().filter(move |d| d.flops > share * flops)
    }

    pub fn text(&self) -> Vec<String> {
        let m = &self.model;
        let conv = self.convolutions();
        let others = self.others();
        let beside = match (self.pytorch_s, self.speed_vs_pytorch()) {
            (Some(p), Some(r)) => format!(
                "{r:.2}× the speed of PyTorch CUDA's measured {:.1} ms (H200, TF32 off)",
                p * 1e3
            ),
            _ => "no PyTorch CUDA step measured at this shape".into(),
        };
        let mut lines = vec![
            format!(
                "by construction on an {} ({} SMs, {:.1} TFLOP/s f32 rated, {:.0}% of it sustained; {:.1} TB/s): the step {:.2} ms = {:.2} ms in {} dispatches + {:.2} ms of launch gaps ({:.1} µs each): {beside}",
                m.name,
                m.sms,
                m.peak() / 1e12,
                100.0 * m.sustained(),
                m.hbm_bytes_per_s / 1e12,
                self.step_seconds() * 1e3,
                self.kernel_seconds() * 1e3,
                self.dispatches.len(),
                self.gap_seconds() * 1e3,
                m.launch_gap_s * 1e6,
            ),
            format!(
                "  convolutions: {:.2} ms in {} dispatches, {:.1} GFLOP at {:.0}% of the rated peak (multiply-adds {:.0}% of their instructions, {:.0}% of them useful; occupancy ceiling {:.0}%); other kernels {:.2} ms in {} dispatches",
                conv.seconds * 1e3,
                conv.dispatches,
                conv.flops / 1e9,
                100.0 * conv.ceiling(m),
                100.0 * conv.issue(),
                100.0 * conv.useful(),
                100.0 * conv.occupancy(m),
                others.seconds * 1e3,
                others.dispatches,
            ),
            format!(
                "  {:<24} {:>10} {:>8} {:>9} {:>7} {:>6} {:>7} {:>9}",
                "", "dispatches", "GFLOP", "ms", "peak", "FMA", "useful", "occupancy"
            ),
        ];
        for op in CONV_OPS {
            let t = self.op(op);
            lines.push(format!(
                "  {op:<24} {:>10} {:>8.1} {:>9.3} {:>6.0}% {:>5.0}% {:>6.0}% {:>8.0}%",
                t.dispatches,
                t.flops / 1e9,
                t.seconds * 1e3,
                100.0 * t.ceiling(m),
                100.0 * t.issue(),
                100.0 * t.useful(),
                100.0 * t.occupancy(m)
            ));
        }
        lines
    }

    pub fn to_json(&self) -> Value {
        let m = &self.model;
        let total = |t: Total| {
            json!({"dispatches": t.dispatches, "flops": t.flops, "predicted_s": t.seconds,
                   "predicted_share": t.ceiling(m), "occupancy_ceiling": t.occupancy(m),
                   "issue": t.issue(), "useful": t.useful()})
        };
        let ops: serde_json::Map<String, Value> =
            CONV_OPS.iter().map(|&op| (op.to_string(), total(self.op(op)))).collect();
        let conv = self.convolutions();
        json!({
            "gpu": {"name": m.name, "sms": m.sms, "lanes_per_sm": m.lanes_per_sm,
                    "clock_hz": m.clock_hz, "sustained_clock_hz": m.sustained_clock_hz,
                    "scheduling": m.scheduling, "peak_flops": m.peak(),
                    "shared_per_workgroup": m.shared_per_workgroup, "hbm_bytes_per_s": m.hbm_bytes_per_s,
                    "l2_bytes_per_s": m.l2_bytes_per_s, "memory_latency_s": m.memory_latency_s,
                    "launch_gap_s": m.launch_gap_s},
            "convolutions": total(conv),
            "convolutions_launch_gaps_s": conv.dispatches as f64 * m.launch_gap_s,
            "others": total(self.others()),
            "by_op": ops,
            "kernels_predicted_s": self.kernel_seconds(),
            "launch_gaps_s": self.gap_seconds(),
            "step_predicted_s": self.step_seconds(),
            "pytorch_cuda_s": self.pytorch_s,
            "speed_vs_pytorch_cuda": self.speed_vs_pytorch(),
            "dispatches": self.dispatches.iter().map(|d| d.to_json(m)).collect::<Vec<_>>(),
        })
    }
}
