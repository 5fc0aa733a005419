//! Timing kernels: timestamp queries around every dispatch while a profile runs, and the
//! host-clock timing of recorded launches that the autotune and the bench's roofline use.

use std::sync::Arc;

use super::{Gpu, GpuError, Result, Shader, Slice};

/// One dispatch timed by timestamp queries: `scope` is what [`Gpu::profile_scope`] last named
/// (a layer of the step), `op` the launcher, `entry` the shader entry point, and its shape.
#[derive(Clone, Debug, PartialEq)]
pub struct KernelTime {
    pub scope: String,
    pub op: &'static str,
    pub entry: &'static str,
    pub seconds: f64,
    pub shape: DispatchShape,
}

/// What one dispatch asks of a device, known when it is recorded: how wide it is and the work it
/// is charged with.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct DispatchShape {
    /// Workgroups launched (x·y·z, the ones a 1-D grid rounds up included).
    pub workgroups: u64,
    /// Invocations per workgroup (the entry point's `@workgroup_size`).
    pub invocations: u32,
    /// Floating-point operations its launcher charged it with ([`Gpu::charge_flops`]): a
    /// multiply-add counts 2. Kernels that only move or scale values are charged none.
    pub flops: f64,
    /// Bytes of the storage buffers it binds: each is read or written at least once.
    pub bytes: u64,
    /// How it does its arithmetic, where its launcher says ([`Gpu::describe_next`]).
    pub construction: Option<Construction>,
    /// What one invocation waits for in series, where its launcher says
    /// ([`Gpu::describe_serial_next`]); else one load, as an elementwise kernel's.
    pub serial: Option<Serial>,
}

/// The longest chain of work one invocation of a dispatch does in series: what bounds a kernel
/// of few or small workgroups however fast the memory, as a sum over examples one invocation
/// takes in order, or a workgroup that sums a plane and waits at barriers.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Serial {
    /// Global-memory loads whose results the invocation waits for one after another (a loop of
    /// independent loads the compiler can issue ahead counts its depth of dependence, not its
    /// length).
    pub loads: u32,
    /// Workgroup barriers it passes.
    pub barriers: u32,
    /// Instructions it issues.
    pub instructions: u32,
}

impl Serial {
    /// A loop of `terms` steps, each a load and `instructions` more, into one result: a
    /// compiler unrolls it by four and issues a step's loads together, so its loads wait a
    /// quarter of the steps.
    pub fn loop_of(terms: u64, instructions: u32) -> Serial {
        let terms = u32::try_from(terms).unwrap_or(u32::MAX);
        Serial {
            loads: terms.div_ceil(4),
            barriers: 0,
            instructions: terms.saturating_mul(instructions),
        }
    }
}

/// How a dispatch does its arithmetic, by construction: what its launcher knows of the kernel
/// (the outputs each invocation sums, how it reads and fills workgroup memory, what it stages
/// from global memory, what scratch it hands on), from which `syncstep bench` derives a large
/// GPU's figures without one. The convolutions' GEMMs carry one.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Construction {
    /// Outputs each invocation sums.
    pub outputs_per_invocation: u32,
    /// Multiply-adds per float an invocation reads from workgroup memory in its inner loop.
    pub fma_per_shared_float: f64,
    /// Workgroup-memory wavefronts (a bank of 32 serves one 4-byte word each) a warp's inner
    /// loop reads take per k, and the fewest the same data could take: their ratio is the bank
    /// conflicts' degree.
    pub read_wavefronts: f64,
    pub least_read_wavefronts: f64,
    /// Wavefronts of a warp's stores of the staged slices, per k.
    pub store_wavefronts: f64,
    /// Multiply-adds an invocation does between two barriers.
    pub fma_between_barriers: u64,
    /// Bytes of workgroup memory per workgroup.
    pub shared_bytes: u64,
    /// Registers an invocation needs at least: its sums, operands and staged loads.
    pub registers: u32,
    /// Floating-point operations per byte a workgroup stages from global memory.
    pub flop_per_staged_byte: f64,
    /// Bytes of scratch the dispatch writes for a later pass to read (segment or node sums).
    pub scratch_bytes: u64,
    /// Dependent dispatches the op runs (a weight layout, this GEMM, a pass adding its sums).
    pub passes: u32,
    /// What the whole dispatch issues, counted from the code its generator writes.
    pub issued: Issued,
    /// What one invocation issues for one slice of its inner loop, as counted: what a
    /// compiler's loop body is held to.
    pub slice: Issued,
}

/// Warp-instructions (one instruction of one warp of 32 invocations) a dispatch issues, summed
/// over its warps: what bounds it on a GPU whose schedulers issue one a clock each.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Issued {
    /// Multiply-adds executed: those that multiply the padding of partial tiles and slices too.
    pub fmas: f64,
    /// Every other instruction: workgroup-memory loads and stores, the gather's address
    /// arithmetic and tests, global loads, loop control, barriers, the sums' adds at rows,
    /// examples and segments, and each workgroup's opening and closing.
    pub other: f64,
    /// Workgroup-memory wavefronts (a bank of 32 serves one 4-byte word each).
    pub wavefronts: f64,
}

impl Issued {
    /// Every warp-instruction.
    pub fn total(&self) -> f64 {
        self.fmas + self.other
    }
}

/// The profiler's state while profiling is on: query sets of `QUERY_SET_MAX_QUERIES` each,
/// two queries (begin, end) per dispatch, and what each pair timed.
pub(super) struct Profiler {
    sets: Vec<wgpu::QuerySet>,
    labels: Vec<(Arc<str>, &'static str, &'static str, DispatchShape)>,
    scope: Arc<str>,
    /// FLOPs charged to the next dispatch, and how it does them.
    charge: f64,
    construction: Option<Construction>,
    serial: Option<Serial>,
}

/// Queries per set, two per dispatch.
const PROFILE_SET_QUERIES: u32 = wgpu::QUERY_SET_MAX_QUERIES;

impl Gpu {
    /// Starts timing every dispatch with timestamp queries, until [`Gpu::finish_profile`].
    /// Fails where the adapter has no timestamp queries.
    pub fn start_profile(&self) -> Result<()> {
        if !self.features.contains(wgpu::Features::TIMESTAMP_QUERY) {
            return Err(GpuError::MissingFeature("timestamp queries (TIMESTAMP_QUERY)"));
        }
        *self.profiler.lock().unwrap_or_else(|p| p.into_inner()) = Some(Profiler {
            sets: Vec::new(),
            labels: Vec::new(),
            scope: "(no scope)".into(),
            charge: 0.0,
            construction: None,
            serial: None,
        });
        Ok(())
    }

    /// Names what the next dispatches belong to (a layer), while profiling; else does nothing.
    pub fn profile_scope(&self, scope: &str) {
        if let Some(p) = self.profiler.lock().unwrap_or_else(|p| p.into_inner()).as_mut() {
            p.scope = scope.into();
        }
    }

    /// Charges the next dispatch with `flops` floating-point operations, while profiling (the
    /// launchers of kernels that multiply and add call it right before their dispatch).
    pub fn charge_flops(&self, flops: f64) {
        if let Some(p) = self.profiler.lock().unwrap_or_else(|p| p.into_inner()).as_mut() {
            p.charge = flops;
        }
    }

    /// Forgets what was charged to the next dispatch: a dispatch of no workgroups.
    pub(super) fn drop_charge(&self) {
        if let Some(p) = self.profiler.lock().unwrap_or_else(|p| p.into_inner()).as_mut() {
            p.charge = 0.0;
            p.construction = None;
            p.serial = None;
        }
    }

    /// Says how the next dispatch does its arithmetic, while profiling (the GEMM launchers call
    /// it right before their dispatch, as [`Gpu::charge_flops`]).
    pub fn describe_next(&self, construction: Construction) {
        if let Some(p) = self.profiler.lock().unwrap_or_else(|p| p.into_inner()).as_mut() {
            p.construction = Some(construction);
        }
    }

    /// Says what one invocation of the next dispatch does in series, while profiling.
    pub fn describe_serial_next(&self, serial: Serial) {
        if let Some(p) = self.profiler.lock().unwrap_or_else(|p| p.into_inner()).as_mut() {
            p.serial = Some(serial);
        }
    }

    /// Makes every later dispatch a record for the profile only: the kernel does not run, so
    /// what it would write stays as it was. For the shapes of a step too large to run here
    /// (`syncstep bench --shapes-only`); the profile's times are then 0.
    pub fn set_record_only(&self, on: bool) {
        self.record_only.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    pub(super) fn is_record_only(&self) -> bool {
        self.record_only.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Stops profiling and returns the time of every dispatch recorded since
    /// [`Gpu::start_profile`], in recording order. Every encoder recorded meanwhile must have
    /// been submitted: the queries of one that was not read as garbage.
    pub async fn finish_profile(&self) -> Result<Vec<KernelTime>> {
        let Some(profiler) = self.profiler.lock().unwrap_or_else(|p| p.into_inner()).take() else {
            return Ok(Vec::new());
        };
        let mut ticks = Vec::with_capacity(2 * profiler.labels.len());
        if self.is_record_only() {
            ticks.resize(2 * profiler.labels.len(), 0); // nothing ran, nothing was timed
        }
        for (i, set) in profiler.sets.iter().enumerate().filter(|_| !self.is_record_only()) {
            let queries = (2 * profiler.labels.len() as u64 - i as u64 * PROFILE_SET_QUERIES as u64)
                .min(PROFILE_SET_QUERIES as u64) as u32;
            let resolved = self.create_buffer(&wgpu::BufferDescriptor {
                label: Some("timestamps"),
                size: queries as u64 * wgpu::QUERY_SIZE as u64,
                usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
                mapped_at_creation: false,
            });
            let mut encoder = self.encoder();
            encoder.resolve_query_set(set, 0..queries, &resolved, 0);
            self.submit(encoder).await?;
            // Read as u32 pairs: a mapped range need not be aligned for u64.
            let words = self.read::<u32>(Slice::whole(&resolved)).await?;
            ticks.extend(words.chunks_exact(2).map(|w| w[0] as u64 | (w[1] as u64) << 32));
        }
        let ns_per_tick = self.queue.get_timestamp_period() as f64;
        Ok(profiler
            .labels
            .iter()
            .zip(ticks.chunks_exact(2))
            .map(|((scope, op, entry, shape), t)| KernelTime {
                scope: scope.to_string(),
                op,
                entry,
                seconds: t[1].saturating_sub(t[0]) as f64 * ns_per_tick * 1e-9,
                shape: *shape,
            })
            .collect())
    }

    /// The timestamp writes of the next dispatch, while profiling: `entry` of `shader` for the
    /// launcher `op`, `workgroups` of it, with `bindings`.
    pub(super) fn profile_dispatch(
        &self,
        op: &'static str,
        (shader, entry): (&Shader, &'static str),
        workgroups: [u32; 3],
        bindings: &[Slice],
    ) -> Option<(wgpu::QuerySet, u32)> {
        let mut guard = self.profiler.lock().unwrap_or_else(|p| p.into_inner());
        let p = guard.as_mut()?;
        let shape = DispatchShape {
            workgroups: workgroups.iter().map(|&g| g as u64).product(),
            // Every dispatch's entry point was read before it got here (Gpu::dispatch).
            invocations: self.entry_facts(shader, entry).map_or(0, |f| f.invocations),
            flops: std::mem::take(&mut p.charge),
            bytes: bindings.iter().map(|s| s.bytes()).sum(),
            construction: p.construction.take(),
            serial: p.serial.take(),
        };
        let query = 2 * p.labels.len() as u32;
        let (set, index) = ((query / PROFILE_SET_QUERIES) as usize, query % PROFILE_SET_QUERIES);
        if set == p.sets.len() {
            p.sets.push(self.device.create_query_set(&wgpu::QuerySetDescriptor {
                label: Some("profile"),
                ty: wgpu::QueryType::Timestamp,
                count: PROFILE_SET_QUERIES,
            }));
        }
        let scope = p.scope.clone();
        p.labels.push((scope, op, entry, shape));
        Some((p.sets[set].clone(), index))
    }

    /// The device time of one recording of `record`, for timing a kernel (the autotune, the
    /// bench's roofline): `launches` recordings in one submission, submit to idle, divided by
    /// `launches`; this device's errors come back through `gpu_err`. Native only.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn time_recorded<E>(
        &self,
        launches: u32,
        record: impl Fn(&mut super::Encoder) -> Result<(), E>,
        gpu_err: impl Fn(GpuError) -> E,
    ) -> Result<std::time::Duration, E> {
        let launches = launches.max(1);
        let mut encoder = self.encoder();
        for _ in 0..launches {
            record(&mut encoder)?;
        }
        let start = std::time::Instant::now();
        pollster::block_on(self.submit(encoder)).map_err(&gpu_err)?;
        self.wait().map_err(&gpu_err)?;
        Ok(start.elapsed() / launches)
    }
}

/// How many launches of a kernel that took `one` alone [`Gpu::time_recorded`] should time
/// together to run at least `at_least` (at most 64): a short kernel timed alone is mostly the
/// submit and wait round trip, which would hide that one workgroup leaves a core idle.
pub fn launches_to_fill(at_least: std::time::Duration, one: std::time::Duration) -> u32 {
    (at_least.as_secs_f64() / one.as_secs_f64().max(1e-9)).ceil().clamp(1.0, 64.0) as u32
}
