//! What a large GPU would make of a recorded step, by construction: each dispatch's figures
//! ([`Estimate`]: from its shape and what its launcher says of its arithmetic) on a named GPU
//! ([`GpuModel`]), and the FLOP-weighted share of the GPU's f32 rate the convolutions could
//! reach. Computed from what the step records, so a CPU adapter gives the figures of a GPU
//! (`syncstep bench --shapes-only --plan-for gpu`). The model is in `kernels::gpu_model`.

use serde_json::{json, Value};

use crate::gpu::{Construction, KernelTime};
pub use crate::kernels::gpu_model::{Estimate, GpuModel, H100, H200};

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

    /// The share of the peak it runs at, by construction.
    pub fn ceiling(&self, m: &GpuModel) -> f64 {
        self.flops / m.peak() / self.estimate.seconds.max(f64::MIN_POSITIVE)
    }

    /// Its workgroup-memory reads' wavefronts over the fewest they could take.
    pub fn conflict_degree(&self) -> Option<f64> {
        self.construction.map(|c| c.read_wavefronts / c.least_read_wavefronts)
    }

    fn to_json(&self, m: &GpuModel) -> Value {
        let mut d = json!({
            "layer": self.layer, "kernel": self.op, "entry": self.entry,
            "workgroups": self.workgroups, "invocations": self.invocations,
            "flops": self.flops, "bytes": self.bytes, "predicted_s": self.estimate.seconds,
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
            d["registers_at_least"] = json!(c.registers);
            d["dependent_passes"] = json!(c.passes);
            let e = &self.estimate;
            d["workgroups_per_sm"] = json!(e.resident);
            d["warps_per_sm"] = json!(e.warps_per_sm);
            d["fill"] = json!(e.fill);
            d["latency"] = json!(e.latency);
            d["issue"] = json!(e.issue);
            d["shared"] = json!(e.shared);
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

/// A recorded step's figures on one [`GpuModel`].
#[derive(Clone, Debug, PartialEq)]
pub struct Predicted {
    pub model: GpuModel,
    pub dispatches: Vec<DispatchFigures>,
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
}

impl Total {
    /// The predicted share of the peak: the GEMMs' FLOPs over the peak's time for all the
    /// dispatches' predicted seconds.
    pub fn ceiling(&self, m: &GpuModel) -> f64 {
        self.flops / m.peak() / self.seconds.max(f64::MIN_POSITIVE)
    }

    /// The FLOP-weighted occupancy ceiling of the GEMMs.
    pub fn occupancy(&self, m: &GpuModel) -> f64 {
        self.flops / m.peak() / self.occupancy_seconds.max(f64::MIN_POSITIVE)
    }
}

impl Predicted {
    pub fn of(kernels: &[KernelTime], model: GpuModel) -> Predicted {
        Predicted {
            model,
            dispatches: kernels.iter().map(|k| DispatchFigures::of(k, &model)).collect(),
        }
    }

    fn total(&self, keep: impl Fn(&DispatchFigures) -> bool) -> Total {
        let m = &self.model;
        self.dispatches.iter().filter(|d| keep(d)).fold(Total::default(), |t, d| {
            let occupancy =
                d.estimate.occupancy.map_or(0.0, |o| d.flops / (m.peak() * o.max(1e-3)));
            Total {
                dispatches: t.dispatches + 1,
                flops: t.flops + if d.construction.is_some() { d.flops } else { 0.0 },
                seconds: t.seconds + d.estimate.seconds,
                occupancy_seconds: t.occupancy_seconds + occupancy,
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

    /// The whole step: every dispatch's predicted seconds, without launch gaps.
    pub fn step_seconds(&self) -> f64 {
        self.dispatches.iter().map(|d| d.estimate.seconds).sum()
    }

    /// The dispatches that carry more than `share` of the step's FLOPs.
    pub fn carrying(&self, share: f64) -> impl Iterator<Item = &DispatchFigures> {
        let flops: f64 = self.dispatches.iter().map(|d| d.flops).sum();
        self.dispatches.iter().filter(move |d| d.flops > share * flops)
    }

    pub fn text(&self) -> Vec<String> {
        let m = &self.model;
        let conv = self.convolutions();
        let gaps = conv.dispatches as f64 * m.launch_gap_s;
        let mut lines = vec![
            format!(
                "by construction on an {} ({} SMs, {:.1} TFLOP/s f32, {:.1} TB/s): the convolutions' {} dispatches, {:.1} GFLOP, {:.2} ms (+{:.2} ms of launch gaps at {:.1} µs each): {:.0}% of the peak, occupancy ceiling {:.0}%",
                m.name,
                m.sms,
                m.peak() / 1e12,
                m.hbm_bytes_per_s / 1e12,
                conv.dispatches,
                conv.flops / 1e9,
                conv.seconds * 1e3,
                gaps * 1e3,
                m.launch_gap_s * 1e6,
                100.0 * conv.ceiling(m),
                100.0 * conv.occupancy(m),
            ),
            format!(
                "  {:<24} {:>10} {:>8} {:>9} {:>7} {:>9}",
                "", "dispatches", "GFLOP", "ms", "peak", "occupancy"
            ),
        ];
        for op in CONV_OPS {
            let t = self.op(op);
            lines.push(format!(
                "  {op:<24} {:>10} {:>8.1} {:>9.3} {:>6.0}% {:>8.0}%",
                t.dispatches,
                t.flops / 1e9,
                t.seconds * 1e3,
                100.0 * t.ceiling(m),
                100.0 * t.occupancy(m)
            ));
        }
        lines
    }

    pub fn to_json(&self) -> Value {
        let m = &self.model;
        let total = |t: Total| {
            json!({"dispatches": t.dispatches, "flops": t.flops, "predicted_s": t.seconds,
                   "predicted_share": t.ceiling(m), "occupancy_ceiling": t.occupancy(m)})
        };
        let ops: serde_json::Map<String, Value> =
            CONV_OPS.iter().map(|&op| (op.to_string(), total(self.op(op)))).collect();
        let conv = self.convolutions();
        json!({
            "gpu": {"name": m.name, "sms": m.sms, "lanes_per_sm": m.lanes_per_sm,
                    "clock_hz": m.clock_hz, "peak_flops": m.peak(),
                    "shared_per_workgroup": m.shared_per_workgroup, "hbm_bytes_per_s": m.hbm_bytes_per_s,
                    "l2_bytes_per_s": m.l2_bytes_per_s, "launch_gap_s": m.launch_gap_s},
            "convolutions": total(conv),
            "convolutions_launch_gaps_s": conv.dispatches as f64 * m.launch_gap_s,
            "by_op": ops,
            "step_predicted_s": self.step_seconds(),
            "dispatches": self.dispatches.iter().map(|d| d.to_json(m)).collect::<Vec<_>>(),
        })
    }
}
