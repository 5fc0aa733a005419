//! How much of a profiled step a large GPU could run at full width: every dispatch's workgroups,
//! invocations, FLOPs and bytes, and the share of the step's FLOPs (and bytes) in dispatches too
//! narrow to fill a GPU (`gpu::WIDE_DISPATCH` workgroups, `gpu::WIDE_INVOCATIONS` invocations
//! each). Computed from what the step records, so a CPU adapter gives the figures a GPU would.

use serde_json::{json, Value};

use crate::gpu::{DispatchShape, KernelTime, WIDE_DISPATCH, WIDE_INVOCATIONS};

/// Whether a dispatch leaves a large GPU partly idle.
pub fn is_narrow(shape: &DispatchShape) -> bool {
    shape.workgroups < WIDE_DISPATCH || shape.invocations < WIDE_INVOCATIONS
}

/// The step's work by width.
#[derive(Clone, Debug, PartialEq)]
pub struct Width {
    pub flops: f64,
    pub bytes: u64,
    pub narrow_flops: f64,
    pub narrow_bytes: u64,
    /// The narrow dispatches that carry FLOPs, grouped by (layer, entry point), most FLOPs first.
    pub narrow: Vec<NarrowGroup>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct NarrowGroup {
    pub layer: String,
    pub entry: &'static str,
    pub dispatches: usize,
    /// The widest of the group's dispatches: workgroups × invocations.
    pub workgroups: u64,
    pub invocations: u32,
    pub flops: f64,
}

impl Width {
    pub fn of(kernels: &[KernelTime]) -> Width {
        let mut width =
            Width { flops: 0.0, bytes: 0, narrow_flops: 0.0, narrow_bytes: 0, narrow: Vec::new() };
        for k in kernels {
            let s = &k.shape;
            width.flops += s.flops;
            width.bytes += s.bytes;
            if !is_narrow(s) {
                continue;
            }
            width.narrow_flops += s.flops;
            width.narrow_bytes += s.bytes;
            if s.flops == 0.0 {
                continue;
            }
            match width.narrow.iter_mut().find(|g| g.layer == k.scope && g.entry == k.entry) {
                Some(g) => {
                    g.dispatches += 1;
                    g.flops += s.flops;
                    g.workgroups = g.workgroups.max(s.workgroups);
                    g.invocations = g.invocations.max(s.invocations);
                }
                None => width.narrow.push(NarrowGroup {
                    layer: k.scope.clone(),
                    entry: k.entry,
                    dispatches: 1,
                    workgroups: s.workgroups,
                    invocations: s.invocations,
                    flops: s.flops,
                }),
            }
        }
        width.narrow.sort_by(|a, b| b.flops.total_cmp(&a.flops));
        width
    }

    pub fn narrow_flops_share(&self) -> f64 {
        self.narrow_flops / self.flops.max(f64::MIN_POSITIVE)
    }

    pub fn narrow_bytes_share(&self) -> f64 {
        self.narrow_bytes as f64 / (self.bytes as f64).max(f64::MIN_POSITIVE)
    }

    pub fn text(&self, rows: usize) -> Vec<String> {
        let mut lines = vec![format!(
            "width: {:.1}% of the step's {:.1} GFLOP ({:.1}% of its {:.1} GB bound) in dispatches narrower than {WIDE_DISPATCH} workgroups of {WIDE_INVOCATIONS}+ invocations",
            100.0 * self.narrow_flops_share(),
            self.flops / 1e9,
            100.0 * self.narrow_bytes_share(),
            self.bytes as f64 / 1e9,
        )];
        for g in self.narrow.iter().take(rows) {
            lines.push(format!(
                "  narrow: {:<40} {:<36} {:>4} × up to {:>5} workgroups of {:>3}: {:.2}% of the FLOPs",
                g.layer,
                g.entry,
                g.dispatches,
                g.workgroups,
                g.invocations,
                100.0 * g.flops / self.flops.max(f64::MIN_POSITIVE)
            ));
        }
        if self.narrow.len() > rows {
            lines.push(format!(
                "  … {} more narrow groups (all of them in --json)",
                self.narrow.len() - rows
            ));
        }
        lines
    }

    pub fn to_json(&self) -> Value {
        let narrow: Vec<Value> = self
            .narrow
            .iter()
            .map(|g| {
                json!({"layer": g.layer, "entry": g.entry, "dispatches": g.dispatches,
                       "workgroups": g.workgroups, "invocations": g.invocations, "flops": g.flops})
            })
            .collect();
        json!({
            "wide_workgroups": WIDE_DISPATCH,
            "wide_invocations": WIDE_INVOCATIONS,
            "flops": self.flops,
            "bytes": self.bytes,
            "narrow_flops": self.narrow_flops,
            "narrow_flops_share": self.narrow_flops_share(),
            "narrow_bytes": self.narrow_bytes,
            "narrow_bytes_share": self.narrow_bytes_share(),
            "narrow": narrow,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dispatch(scope: &str, workgroups: u64, invocations: u32, flops: f64) -> KernelTime {
        KernelTime {
            scope: scope.into(),
            op: "op",
            entry: "entry",
            seconds: 0.0,
            shape: DispatchShape { workgroups, invocations, flops, bytes: 100 },
        }
    }

    /// Too few workgroups or too few invocations each is narrow; the shares weigh by FLOPs and
    /// bytes; the narrow groups list only dispatches with FLOPs, most first.
    #[test]
    fn narrow_dispatches_by_workgroups_and_invocations() {
        let kernels = [
            dispatch("a", WIDE_DISPATCH, WIDE_INVOCATIONS, 90.0),
            dispatch("b", WIDE_DISPATCH - 1, 256, 6.0),
            dispatch("c", 1 << 20, WIDE_INVOCATIONS - 1, 4.0),
            dispatch("d", 1, 1, 0.0),
        ];
        let w = Width::of(&kernels);
        assert_eq!((w.flops, w.narrow_flops, w.bytes, w.narrow_bytes), (100.0, 10.0, 400, 300));
        assert!((w.narrow_flops_share() - 0.1).abs() < 1e-12);
        let layers: Vec<&str> = w.narrow.iter().map(|g| g.layer.as_str()).collect();
        assert_eq!(layers, ["b", "c"]);
    }
}
