//! A large GPU by its constants ([`GpuModel`]), and the time a dispatch would take on it by
//! construction ([`Estimate`]): what the GPU plan chooses its tiles by (wgpu does not say how
//! many compute units a device has, and a browser has no clock), and what `syncstep bench`
//! reports of a recorded step.
//!
//! For a dispatch of W workgroups of T invocations on S SMs, with what its launcher says of
//! its arithmetic ([`Construction`](syncstep_gpu::Construction)):
//! - residency R: workgroups an SM holds at once, the least that its threads, registers
//!   (rounded up to 8 an invocation), workgroup memory and workgroup count allow;
//! - fill: W over the SM slots its waves take, ceil(W / (S·R')) · S·R' with R' = min(R, ceil(W / S));
//! - latency: the warps an SM holds, R'·T/32, over 8 (two a scheduler);
//! - issue: its multiply-adds over the instructions its inner loop issues;
//! - workgroup memory: a warp's multiply-adds per k (4 warp-instructions a clock) over the
//!   wavefronts its reads and stores take (one a clock);
//! - memory: the bytes it binds at the HBM's rate (each read or written once: what no cache
//!   saves), the bytes it stages at the L2's.
//!
//! Its time is the longest of its arithmetic (its FLOPs at the peak times fill, latency and the
//! lesser of issue and workgroup memory) and its memory bounds. A dispatch without a
//! construction (a layout, a pass adding sums, BatchNorm, …) takes its bytes at the HBM's rate.
//! Launch gaps are not in it.
//!
//! Beside it, the occupancy ceiling: 0.9 × fill × the warps each of the SM's 4 schedulers has
//! (at most 1) × 0.85 for tiles of fewer than 64 outputs an invocation, capped by the scratch
//! the dispatch hands on at the HBM's rate. It is what the tiles' occupancy allows, and counts
//! neither the instructions that stage operands nor the sums' extra adds, which the time does.

use syncstep_gpu::DispatchShape;

/// A GPU's constants, as the estimates need them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GpuModel {
    pub name: &'static str,
    pub sms: u32,
    /// f32 lanes an SM issues a multiply-add on each clock.
    pub lanes_per_sm: u32,
    pub clock_hz: f64,
    pub shared_per_sm: u64,
    /// Workgroup memory a workgroup may have (Vulkan's limit on the GPU).
    pub shared_per_workgroup: u64,
    pub registers_per_sm: u32,
    pub threads_per_sm: u32,
    pub workgroups_per_sm: u32,
    pub hbm_bytes_per_s: f64,
    pub l2_bytes_per_s: f64,
    /// Host time between two dispatches of a compute pass, as measured on such a GPU.
    pub launch_gap_s: f64,
}

/// NVIDIA's Hopper: 132 SMs of 4 schedulers of 32 f32 lanes, 64 Ki registers, 228 KiB of shared
/// memory (48 KiB a workgroup through Vulkan), 32 workgroups and 2,048 threads an SM. The L2's
/// rate is what microbenchmarks read on an H100 (about 5.5 TB/s); the launch gap the time
/// outside kernels over the dispatches of the step profiled on an H200 (docs/performance-log.md, 2026-12-04, "On an NVIDIA H200").
const HOPPER: GpuModel = GpuModel {
    name: "",
    sms: 132,
    lanes_per_sm: 128,
    clock_hz: 1.98e9,
    shared_per_sm: 228 << 10,
    shared_per_workgroup: 48 << 10,
    registers_per_sm: 65536,
    threads_per_sm: 2048,
    workgroups_per_sm: 32,
    hbm_bytes_per_s: 3.35e12,
    l2_bytes_per_s: 5.5e12,
    launch_gap_s: 9.5e-6,
};

/// The H100 (SXM, HBM3) and the H200 (HBM3e): the same SMs, other memory.
pub const H100: GpuModel = GpuModel { name: "H100", ..HOPPER };
pub const H200: GpuModel = GpuModel { name: "H200", hbm_bytes_per_s: 4.8e12, ..HOPPER };

impl GpuModel {
    /// The models `syncstep bench` reports on.
    pub const ALL: [GpuModel; 2] = [H100, H200];

    /// f32 FLOPs a second, a multiply-add counting 2.
    pub fn peak(&self) -> f64 {
        self.sms as f64 * self.lanes_per_sm as f64 * 2.0 * self.clock_hz
    }
}

/// Warps an SM should hold to hide workgroup-memory and barrier latency: two a scheduler.
const HIDING_WARPS: f64 = 8.0;

/// A dispatch's time on a [`GpuModel`], by construction, and the bounds that make it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Estimate {
    pub seconds: f64,
    /// Workgroups an SM holds at once, and the warps it holds (None: no construction).
    pub resident: Option<u32>,
    pub warps_per_sm: Option<f64>,
    /// The shares of the peak each bound allows (1 where it does not bind or is not known).
    pub fill: f64,
    pub latency: f64,
    pub issue: f64,
    pub shared: f64,
    /// The occupancy ceiling (None: no construction).
    pub occupancy: Option<f64>,
}

impl Estimate {
    pub fn of(m: &GpuModel, s: &DispatchShape) -> Estimate {
        let hbm = s.bytes as f64 / m.hbm_bytes_per_s;
        let mut e = Estimate {
            seconds: hbm.max(s.flops / m.peak()),
            resident: None,
            warps_per_sm: None,
            fill: 1.0,
            latency: 1.0,
            issue: 1.0,
            shared: 1.0,
            occupancy: None,
        };
        let Some(c) = s.construction else { return e };
        let threads = s.invocations.max(1);
        let registers = c.registers.div_ceil(8) * 8;
        let resident = [
            m.threads_per_sm / threads,
            m.registers_per_sm / (registers * threads),
            (m.shared_per_sm / (c.shared_bytes + 1024)) as u32,
            m.workgroups_per_sm,
        ]
        .into_iter()
        .min()
        .unwrap_or(0)
        .max(1);
        let at_once = (resident as u64).min(s.workgroups.div_ceil(m.sms as u64)).max(1);
        let slots = m.sms as u64 * at_once;
        e.fill = s.workgroups as f64 / (s.workgroups.div_ceil(slots) * slots) as f64;
        let warps = (at_once * threads as u64) as f64 / 32.0;
        e.latency = (warps / HIDING_WARPS).min(1.0);
        e.issue = 1.0 / c.issue_per_fma;
        let wavefronts = c.read_wavefronts + c.store_wavefronts;
        e.shared = (c.outputs_per_invocation as f64 / 4.0 / wavefronts).min(1.0);
        e.resident = Some(resident);
        e.warps_per_sm = Some(warps);
        let shape = if c.outputs_per_invocation >= 64 { 1.0 } else { 0.85 };
        let occupancy = 0.9 * e.fill * (warps / 4.0).min(1.0) * shape;
        let scratch = s.flops / (2.0 * c.scratch_bytes as f64) * m.hbm_bytes_per_s / m.peak();
        e.occupancy = Some(if c.scratch_bytes > 0 { occupancy.min(scratch) } else { occupancy });
        let rate = m.peak() * e.fill * e.latency * e.issue.min(e.shared);
        let staged = s.flops / c.flop_per_staged_byte / m.l2_bytes_per_s;
        e.seconds = (s.flops / rate).max(hbm).max(staged);
        e
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use syncstep_gpu::Construction;

    fn gemm(workgroups: u64, registers: u32) -> DispatchShape {
        DispatchShape {
            workgroups,
            invocations: 128,
            flops: 1e10,
            bytes: 1 << 20,
            construction: Some(Construction {
                outputs_per_invocation: 64,
                read_wavefronts: 4.0,
                least_read_wavefronts: 4.0,
                store_wavefronts: 1.0,
                shared_bytes: 24 << 10,
                registers,
                flop_per_staged_byte: 21.0,
                issue_per_fma: 1.25,
                ..Construction::default()
            }),
        }
    }

    /// A dispatch of two full waves fills the GPU; one SM slot past them costs a third wave;
    /// registers past 128 an invocation halve what an SM holds; no construction: its bytes.
    #[test]
    fn estimates_follow_waves_registers_and_bytes() {
        let waves = Estimate::of(&H200, &gemm(132 * 4 * 2, 120));
        assert_eq!((waves.resident, waves.fill, waves.latency), (Some(4), 1.0, 1.0));
        assert!((waves.issue - 0.8).abs() < 1e-12);
        let past = Estimate::of(&H200, &gemm(132 * 4 * 2 + 1, 120));
        assert!((past.fill - (132.0 * 8.0 + 1.0) / (132.0 * 12.0)).abs() < 1e-12, "{past:?}");
        assert_eq!(Estimate::of(&H200, &gemm(1000, 250)).resident, Some(2));
        let copy = DispatchShape { bytes: 4_800_000, ..DispatchShape::default() };
        assert!((Estimate::of(&H200, &copy).seconds - 1e-6).abs() < 1e-15);
    }
}
