//! Timing kernels: timestamp queries around every dispatch while a profile runs, and the
//! host-clock timing of recorded launches that the autotune and the bench's roofline use.

use std::sync::Arc;

use super::{Gpu, GpuError, Result, Slice};

/// One dispatch timed by timestamp queries: `scope` is what [`Gpu::profile_scope`] last named
/// (a layer of the step), `op` the launcher, `entry` the shader entry point.
#[derive(Clone, Debug, PartialEq)]
pub struct KernelTime {
    pub scope: String,
    pub op: &'static str,
    pub entry: &'static str,
    pub seconds: f64,
}

/// The profiler's state while profiling is on: query sets of `QUERY_SET_MAX_QUERIES` each,
/// two queries (begin, end) per dispatch, and what each pair timed.
pub(super) struct Profiler {
    sets: Vec<wgpu::QuerySet>,
    labels: Vec<(Arc<str>, &'static str, &'static str)>,
    scope: Arc<str>,
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
        *self.profiler.lock().unwrap_or_else(|p| p.into_inner()) =
            Some(Profiler { sets: Vec::new(), labels: Vec::new(), scope: "(no scope)".into() });
        Ok(())
    }

    /// Names what the next dispatches belong to (a layer), while profiling; else does nothing.
    pub fn profile_scope(&self, scope: &str) {
        if let Some(p) = self.profiler.lock().unwrap_or_else(|p| p.into_inner()).as_mut() {
            p.scope = scope.into();
        }
    }

    /// Stops profiling and returns the time of every dispatch recorded since
    /// [`Gpu::start_profile`], in recording order. Every encoder recorded meanwhile must have
    /// been submitted: the queries of one that was not read as garbage.
    pub async fn finish_profile(&self) -> Result<Vec<KernelTime>> {
        let Some(profiler) = self.profiler.lock().unwrap_or_else(|p| p.into_inner()).take() else {
            return Ok(Vec::new());
        };
        let mut ticks = Vec::with_capacity(2 * profiler.labels.len());
        for (i, set) in profiler.sets.iter().enumerate() {
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
            .map(|((scope, op, entry), t)| KernelTime {
                scope: scope.to_string(),
                op,
                entry,
                seconds: t[1].saturating_sub(t[0]) as f64 * ns_per_tick * 1e-9,
            })
            .collect())
    }

    /// The timestamp writes of the next dispatch, while profiling.
    pub(super) fn profile_dispatch(
        &self,
        op: &'static str,
        entry: &'static str,
    ) -> Option<(wgpu::QuerySet, u32)> {
        let mut guard = self.profiler.lock().unwrap_or_else(|p| p.into_inner());
        let p = guard.as_mut()?;
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
        p.labels.push((scope, op, entry));
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
