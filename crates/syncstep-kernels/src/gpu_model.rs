//! A large GPU by its constants ([`GpuModel`]), and the time a dispatch would take on it by
//! construction ([`Estimate`]): what the GPU plan chooses its tiles by (wgpu does not say how
//! many compute units a device has, and a browser has no clock), and what `syncstep bench`
//! reports of a recorded step.
//!
//! A GEMM dispatch carries what its code issues ([`Construction`](syncstep_gpu::Construction):
//! every warp-instruction of every warp, executed multiply-adds and the rest, counted from the
//! code its generator writes and held to a real compiler's), its registers and workgroup
//! memory. On S SMs of 4 schedulers that each issue one warp-instruction a clock:
//! - residency R: workgroups an SM holds at once, the least that its threads, registers
//!   (rounded up to 8 an invocation), workgroup memory and workgroup count allow;
//! - fill: W workgroups over the SM slots their waves take, ceil(W / (S·R')) · S·R' with
//!   R' = min(R, ceil(W / S));
//! - latency: the warps an SM holds, R'·T/32, over 8 (two a scheduler hide workgroup-memory
//!   and barrier latency);
//! - issue: its warp-instructions at 4 a clock an SM, at the clock an SM sustains under f32
//!   multiply-adds and the share of issue slots a scheduler fills ([`GpuModel::sustained`]);
//! - workgroup memory: its wavefronts at one a clock an SM;
//! - memory: the bytes it binds at the HBM's rate (each read or written once: what no cache
//!   saves), the bytes it stages at the L2's.
//!
//! Its time is the longest of issue and workgroup memory (each over fill × latency) and its
//! memory bounds. Any other dispatch (a layout, a pass adding sums, BatchNorm, …) takes the
//! longest of its bytes at the HBM's rate, its instructions at the issue rate, and its waves of
//! workgroups each as long as what one invocation waits for in series ([`Serial`]: dependent
//! loads, barriers, dependent instructions). Launch gaps are not in it: `syncstep bench` adds
//! them per dispatch.
//!
//! Beside it, the occupancy ceiling: 0.9 × fill × the warps each of the SM's 4 schedulers has
//! (at most 1) × 0.85 for tiles of fewer than 64 outputs an invocation, capped by the scratch
//! the dispatch hands on at the HBM's rate: what occupancy alone would allow.

use syncstep_gpu::{DispatchShape, Serial};

/// A GPU's constants, as the estimates need them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GpuModel {
    pub name: &'static str,
    pub sms: u32,
    /// f32 lanes an SM issues a multiply-add on each clock.
    pub lanes_per_sm: u32,
    /// Schedulers an SM has, each issuing one warp-instruction a clock.
    pub schedulers_per_sm: u32,
    /// The boost clock the rated f32 peak is quoted at.
    pub clock_hz: f64,
    /// The clock an SM holds through long runs of f32 multiply-adds, power-limited below boost.
    pub sustained_clock_hz: f64,
    /// The share of issue slots a scheduler with enough warps fills: what dependences on
    /// workgroup-memory loads and the barriers of a slice leave.
    pub scheduling: f64,
    pub shared_per_sm: u64,
    /// Workgroup memory a workgroup may have (Vulkan's limit on the GPU).
    pub shared_per_workgroup: u64,
    pub registers_per_sm: u32,
    pub threads_per_sm: u32,
    pub workgroups_per_sm: u32,
    pub hbm_bytes_per_s: f64,
    pub l2_bytes_per_s: f64,
    /// A global-memory load that misses the caches, from issue to use.
    pub memory_latency_s: f64,
    /// A workgroup barrier, all warps arrived.
    pub barrier_s: f64,
    /// Host time between two dispatches of a compute pass, as measured on such a GPU.
    pub launch_gap_s: f64,
}

/// NVIDIA's Hopper: 132 SMs of 4 schedulers of 32 f32 lanes, 64 Ki registers, 228 KiB of shared
/// memory (48 KiB a workgroup through Vulkan), 32 workgroups and 2,048 threads an SM.
/// - The sustained clock: dense f32 work holds an SXM H100 near 1.75 GHz of its 1.98 GHz boost
///   (the H100 PCIe's 1,755 MHz top clock, which microbenchmarks see it hold and drop below at
///   its power limit); 0.88 of the rated peak.
/// - Scheduling: the best SIMT SGEMMs (cuBLAS, at a fixed clock) fill about 95% of issue
///   slots; kernels that wait at a barrier twice a slice, 0.9.
/// - The L2's rate is what microbenchmarks read on an H100 (about 5.5 TB/s); a load that misses
///   the caches about 500 clocks (0.28 µs), a barrier about 40; the launch gap the time
///   outside kernels over the dispatches of the step profiled on an H200
///   (docs/performance-log.md, 2026-12-04, "On an NVIDIA H200").
const HOPPER: GpuModel = GpuModel {
    name: "",
    sms: 132,
    lanes_per_sm: 128,
    schedulers_per_sm: 4,
    clock_hz: 1.98e9,
    sustained_clock_hz: 1.755e9,
    scheduling: 0.9,
    shared_per_sm: 228 << 10,
    shared_per_workgroup: 48 << 10,
    registers_per_sm: 65536,
    threads_per_sm: 2048,
    workgroups_per_sm: 32,
    hbm_bytes_per_s: 3.35e12,
    l2_bytes_per_s: 5.5e12,
    memory_latency_s: 0.28e-6,
    barrier_s: 0.023e-6,
    launch_gap_s: 9.5e-6,
};

/// The H100 (SXM, HBM3) and the H200 (HBM3e): the same SMs, other memory.
pub const H100: GpuModel = GpuModel { name: "H100", ..HOPPER };
pub const H200: GpuModel = GpuModel { name: "H200", hbm_bytes_per_s: 4.8e12, ..HOPPER };

/// What one invocation of a dispatch that says nothing does in series: one load, and the
/// instructions of an elementwise kernel.
const ELEMENTWISE: Serial = Serial { loads: 1, barriers: 0, instructions: 12 };

/// Clocks an instruction waits for the one before it, in a chain that depends on each result.
const DEPENDENT_CLOCKS: f64 = 4.0;

impl GpuModel {
    /// The models `syncstep bench` reports on.
    pub const ALL: [GpuModel; 2] = [H100, H200];

    /// The rated f32 FLOPs a second, a multiply-add counting 2, at the boost clock.
    pub fn peak(&self) -> f64 {
        self.sms as f64 * self.lanes_per_sm as f64 * 2.0 * self.clock_hz
    }

    /// Warp-instructions a second the whole GPU issues: its schedulers at the sustained clock,
    /// filled as `scheduling` says.
    pub fn issue_rate(&self) -> f64 {
        (self.sms * self.schedulers_per_sm) as f64 * self.sustained_clock_hz * self.scheduling
    }

    /// The share of the rated peak the GPU's issue rate reaches on multiply-adds alone:
    /// sustained clock × scheduling.
    pub fn sustained(&self) -> f64 {
        self.sustained_clock_hz / self.clock_hz * self.scheduling
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
    /// Executed multiply-adds over every instruction issued.
    pub issue: f64,
    /// The dispatch's useful multiply-adds over those it executes (padding of partial tiles).
    pub useful: f64,
    /// The time its issue, workgroup memory, HBM and L2 and its serial chain would take alone.
    pub issue_s: f64,
    pub shared_s: f64,
    pub memory_s: f64,
    pub chain_s: f64,
    /// The occupancy ceiling (None: no construction).
    pub occupancy: Option<f64>,
}

impl Estimate {
    pub fn of(m: &GpuModel, s: &DispatchShape) -> Estimate {
        let hbm = s.bytes as f64 / m.hbm_bytes_per_s;
        let threads = s.invocations.max(1);
        let Some(c) = s.construction else {
            let serial = s.serial.unwrap_or(ELEMENTWISE);
            let resident = (m.threads_per_sm / threads).clamp(1, m.workgroups_per_sm) as u64;
            let waves = s.workgroups.div_ceil(m.sms as u64 * resident) as f64;
            let chain = serial.loads as f64 * m.memory_latency_s
                + serial.barriers as f64 * m.barrier_s
                + serial.instructions as f64 * DEPENDENT_CLOCKS / m.sustained_clock_hz;
            let warps = s.workgroups as f64 * threads.div_ceil(32) as f64;
            let issue = warps * serial.instructions as f64 / m.issue_rate();
            return Estimate {
                seconds: hbm.max(waves * chain).max(issue),
                resident: None,
                warps_per_sm: None,
                fill: 1.0,
                latency: 1.0,
                issue: 1.0,
                useful: 1.0,
                issue_s: issue,
                shared_s: 0.0,
                memory_s: hbm,
                chain_s: waves * chain,
                occupancy: None,
            };
        };
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
        let fill = s.workgroups as f64 / (s.workgroups.div_ceil(slots) * slots) as f64;
        let warps = (at_once * threads as u64) as f64 / 32.0;
        let latency = (warps / HIDING_WARPS).min(1.0);
        let busy = fill * latency;
        let issued = c.issued;
        let issue_s = issued.total() / m.issue_rate() / busy;
        let shared_s = issued.wavefronts / (m.sms as f64 * m.sustained_clock_hz) / busy;
        let executed = 64.0 * issued.fmas;
        let staged = executed / c.flop_per_staged_byte / m.l2_bytes_per_s;
        let shape = if c.outputs_per_invocation >= 64 { 1.0 } else { 0.85 };
        let occupancy = 0.9 * fill * (warps / 4.0).min(1.0) * shape;
        let scratch = s.flops / (2.0 * c.scratch_bytes as f64) * m.hbm_bytes_per_s / m.peak();
        Estimate {
            seconds: issue_s.max(shared_s).max(hbm).max(staged),
            resident: Some(resident),
            warps_per_sm: Some(warps),
            fill,
            latency,
            issue: issued.fmas / issued.total().max(1.0),
            useful: s.flops / executed.max(1.0),
            issue_s,
            shared_s,
            memory_s: hbm.max(staged),
            chain_s: 0.0,
            occupancy: Some(if c.scratch_bytes > 0 { occupancy.min(scratch) } else { occupancy }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use syncstep_gpu::{Construction, Issued};

    /// A GEMM of `workgroups` of 128 invocations, each issuing 1,000 multiply-adds and 250
    /// other instructions.
    fn gemm(workgroups: u64, registers: u32) -> DispatchShape {
        let warps = workgroups as f64 * 4.0;
        DispatchShape {
            workgroups,
            invocations: 128,
            flops: 64.0 * 1000.0 * warps,
            bytes: 1 << 20,
            construction: Some(Construction {
                outputs_per_invocation: 64,
                shared_bytes: 24 << 10,
                registers,
                flop_per_staged_byte: 21.0,
                issued: Issued { fmas: 1000.0 * warps, other: 250.0 * warps, wavefronts: 0.0 },
                ..Construction::default()
            }),
            serial: None,
        }
    }

    /// A dispatch of two full waves fills the GPU and issues at the sustained rate; one SM slot
    /// past them costs a third wave; registers past 128 an invocation halve what an SM holds.
    #[test]
    fn estimates_follow_waves_registers_and_issue() {
        let waves = Estimate::of(&H200, &gemm(132 * 4 * 2, 120));
        assert_eq!((waves.resident, waves.fill, waves.latency), (Some(4), 1.0, 1.0));
        assert!((waves.issue - 0.8).abs() < 1e-12);
        let issued = 1250.0 * 132.0 * 4.0 * 2.0 * 4.0;
        assert!((waves.seconds - issued / H200.issue_rate()).abs() < 1e-15, "{waves:?}");
        let past = Estimate::of(&H200, &gemm(132 * 4 * 2 + 1, 120));
        assert!((past.fill - (132.0 * 8.0 + 1.0) / (132.0 * 12.0)).abs() < 1e-12, "{past:?}");
        assert_eq!(Estimate::of(&H200, &gemm(1000, 250)).resident, Some(2));
    }

    /// Without a construction: the bytes at the HBM's rate, or the waves of a serial chain.
    #[test]
    fn other_dispatches_take_their_bytes_or_their_chains() {
        let copy = DispatchShape { bytes: 4_800_000, workgroups: 1, ..DispatchShape::default() };
        assert!((Estimate::of(&H200, &copy).seconds - 1e-6).abs() < 1e-15);
        let serial = Serial { loads: 100, barriers: 0, instructions: 0 };
        let chain = DispatchShape { serial: Some(serial), workgroups: 1, invocations: 64, ..copy };
        let e = Estimate::of(&H200, &chain);
        assert!((e.seconds - 100.0 * H200.memory_latency_s).abs() < 1e-12, "{e:?}");
        // 132 SMs of 32 workgroups of 64 invocations a wave: one more is a second wave.
        let many = DispatchShape { workgroups: 132 * 32 + 1, ..chain };
        assert!((Estimate::of(&H200, &many).chain_s - 2.0 * e.chain_s).abs() < 1e-12);
        // A loop of 512 steps unrolled by four: 128 loads waited for, 512 × 6 instructions.
        let dot = Serial::loop_of(512, 6);
        assert_eq!(dot, Serial { loads: 128, barriers: 0, instructions: 3072 });
        let looped = Estimate::of(&H200, &DispatchShape { serial: Some(dot), ..chain });
        let want =
            128.0 * H200.memory_latency_s + 3072.0 * DEPENDENT_CLOCKS / H200.sustained_clock_hz;
        assert!((looped.chain_s - want).abs() < 1e-12, "{looped:?}");
    }
}
