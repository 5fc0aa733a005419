//! The `gpu` layer: adapter and device creation (native and wasm), buffers, async readback,
//! a pipeline cache and one `dispatch` that every kernel launcher goes through.
//!
//! wgpu reports validation and out-of-memory errors asynchronously. We catch them three ways:
//! error scopes around each submit, an uncaptured-error handler that records anything else
//! (wgpu's default handler panics, which we never want), and a device-lost callback. All
//! three surface as [`GpuError`] values from [`Gpu::submit`] and [`Gpu::read_f32`].

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Errors of the gpu layer. Every message says what to do about it where that is known.
/// `Clone`, so one error can be handed to every replica waiting on the same collective.
#[derive(Clone, Debug, thiserror::Error)]
pub enum GpuError {
    #[error("no GPU adapter found{0}. On Debian/Ubuntu install a software Vulkan driver: `apt-get install mesa-vulkan-drivers libvulkan1` (lavapipe)")]
    NoAdapter(String),
    #[error("adapter index {index} does not exist: {count} adapter(s) match{filter}; run `syncstep info` to list them")]
    AdapterIndex { index: usize, count: usize, filter: String },
    #[error("unknown backend `{0}`: use vulkan, metal, dx12, gl or webgpu")]
    UnknownBackend(String),
    #[error("could not create a device on `{adapter}`: {message}")]
    RequestDevice { adapter: String, message: String },
    #[error("{what} needs {needed} but this device allows at most {allowed} ({limit}); use smaller shapes or another adapter")]
    Limit { what: String, needed: u64, allowed: u64, limit: &'static str },
    #[error("wgpu validation error: {0}")]
    Validation(String),
    #[error("GPU out of memory: {0}; use a smaller batch or image size")]
    OutOfMemory(String),
    #[error("GPU device lost ({0}); the device must be recreated")]
    DeviceLost(String),
    #[error("reading a buffer back failed: {0}")]
    Readback(String),
    #[error("this adapter lacks {0}")]
    MissingFeature(&'static str),
}

pub type Result<T, E = GpuError> = std::result::Result<T, E>;

/// A WGSL source file: one per op family, compiled once per device.
#[derive(Clone, Copy, Debug)]
pub struct Shader {
    pub name: &'static str,
    pub source: &'static str,
}

/// A range of f32/u32 elements inside a storage buffer, what a kernel binds.
/// `offset` is in bytes so that its alignment (min_storage_buffer_offset_alignment) is visible.
#[derive(Clone, Copy, Debug)]
pub struct Slice<'a> {
    pub buffer: &'a wgpu::Buffer,
    pub offset: u64,
    pub len: u64,
}

impl<'a> Slice<'a> {
    /// The whole buffer, as 4-byte elements.
    pub fn whole(buffer: &'a wgpu::Buffer) -> Self {
        Slice { buffer, offset: 0, len: buffer.size() / 4 }
    }
    /// `len` 4-byte elements starting `offset` bytes into `buffer`.
    pub fn new(buffer: &'a wgpu::Buffer, offset: u64, len: u64) -> Self {
        Slice { buffer, offset, len }
    }
    pub fn bytes(&self) -> u64 {
        self.len * 4
    }
}

/// Which adapter to use: a backend filter and an index into the adapters it leaves,
/// in the order `syncstep info` lists them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AdapterChoice {
    pub backend: Option<wgpu::Backend>,
    pub index: usize,
}

impl AdapterChoice {
    /// Parses `"1"`, `"vulkan"`, `"gl:0"`, `"vulkan:1"`.
    pub fn parse(s: &str) -> Result<Self> {
        let s = s.trim();
        let (backend, index) = match s.split_once(':') {
            Some((b, i)) => (Some(b), i),
            None if s.chars().all(|c| c.is_ascii_digit()) && !s.is_empty() => (None, s),
            None => (Some(s), "0"),
        };
        let backend = backend.map(parse_backend).transpose()?;
        let index = index.parse().map_err(|_| {
            GpuError::UnknownBackend(format!("{s} (adapter index must be a number)"))
        })?;
        Ok(AdapterChoice { backend, index })
    }

    /// The choice named by `SYNCSTEP_ADAPTER`, or the default (first adapter).
    pub fn from_env() -> Result<Self> {
        match std::env::var("SYNCSTEP_ADAPTER") {
            Ok(s) if !s.is_empty() => Self::parse(&s),
            _ => Ok(Self::default()),
        }
    }
}

fn parse_backend(s: &str) -> Result<wgpu::Backend> {
    Ok(match s.to_ascii_lowercase().as_str() {
        "vulkan" | "vk" => wgpu::Backend::Vulkan,
        "metal" => wgpu::Backend::Metal,
        "dx12" | "d3d12" => wgpu::Backend::Dx12,
        "gl" | "gles" | "opengl" => wgpu::Backend::Gl,
        "webgpu" | "browser" => wgpu::Backend::BrowserWebGpu,
        _ => return Err(GpuError::UnknownBackend(s.to_string())),
    })
}

fn backend_rank(b: wgpu::Backend) -> u8 {
    match b {
        wgpu::Backend::BrowserWebGpu => 0,
        wgpu::Backend::Vulkan | wgpu::Backend::Metal | wgpu::Backend::Dx12 => 1,
        wgpu::Backend::Gl => 2,
        _ => 3,
    }
}

fn device_type_rank(t: wgpu::DeviceType) -> u8 {
    match t {
        wgpu::DeviceType::DiscreteGpu => 0,
        wgpu::DeviceType::IntegratedGpu => 1,
        wgpu::DeviceType::VirtualGpu => 2,
        wgpu::DeviceType::Cpu => 3,
        wgpu::DeviceType::Other => 4,
    }
}

/// A fresh instance with every backend this build has (narrowed by `WGPU_BACKEND` if set).
pub fn instance() -> wgpu::Instance {
    wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle_from_env())
}

/// All adapters, best first: real GPUs before software ones, Vulkan/Metal/DX12 before GL.
/// In a browser this is the one adapter `navigator.gpu` offers.
pub async fn adapters(instance: &wgpu::Instance) -> Vec<wgpu::Adapter> {
    #[cfg(not(target_arch = "wasm32"))]
    let mut list = instance.enumerate_adapters(wgpu::Backends::all()).await;
    #[cfg(target_arch = "wasm32")]
    let mut list: Vec<wgpu::Adapter> = instance
        .request_adapter(&wgpu::RequestAdapterOptions {
            power_preference: wgpu::PowerPreference::HighPerformance,
            ..Default::default()
        })
        .await
        .into_iter()
        .collect();
    list.sort_by_key(|a| {
        let i = a.get_info();
        (device_type_rank(i.device_type), backend_rank(i.backend))
    });
    list
}

/// Picks the adapter named by `choice`.
pub async fn select_adapter(
    instance: &wgpu::Instance,
    choice: &AdapterChoice,
) -> Result<wgpu::Adapter> {
    let all = adapters(instance).await;
    if all.is_empty() {
        return Err(GpuError::NoAdapter(String::new()));
    }
    let matching: Vec<wgpu::Adapter> = all
        .into_iter()
        .filter(|a| choice.backend.is_none_or(|b| a.get_info().backend == b))
        .collect();
    let filter = choice.backend.map(|b| format!(" backend {b:?}")).unwrap_or_default();
    if matching.is_empty() {
        return Err(GpuError::NoAdapter(format!(" for backend {filter}")));
    }
    let count = matching.len();
    matching.into_iter().nth(choice.index).ok_or(GpuError::AdapterIndex {
        index: choice.index,
        count,
        filter,
    })
}

/// One line describing an adapter: name, backend, type, driver.
pub fn describe(info: &wgpu::AdapterInfo) -> String {
    let driver = [info.driver.as_str(), info.driver_info.as_str()]
        .iter()
        .filter(|s| !s.is_empty())
        .cloned()
        .collect::<Vec<_>>()
        .join(" ");
    format!(
        "{} ({:?}, {:?}{})",
        info.name,
        info.backend,
        info.device_type,
        if driver.is_empty() { String::new() } else { format!(", {driver}") }
    )
}

/// Buffers created through a [`Gpu`] (its storage buffers, uploads, dispatch uniforms and
/// readback staging; not wgpu's own staging behind `queue.write_buffer`), since the last
/// [`Gpu::reset_memory_stats`]. A buffer dropped while a submission still uses it stays
/// allocated until that submission completes, so everything created between two submissions
/// is resident together: `largest_submission_bytes` is the most transient memory one
/// submission held.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryStats {
    pub created_bytes: u64,
    pub largest_submission_bytes: u64,
    pub largest_buffer_bytes: u64,
}

#[derive(Default)]
struct MemoryCounter {
    stats: MemoryStats,
    /// Bytes created since the last submission.
    since_submit: u64,
}

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
struct Profiler {
    sets: Vec<wgpu::QuerySet>,
    labels: Vec<(Arc<str>, &'static str, &'static str)>,
    scope: Arc<str>,
}

/// Queries per set, two per dispatch.
const PROFILE_SET_QUERIES: u32 = wgpu::QUERY_SET_MAX_QUERIES;

#[derive(Default)]
struct ErrorSink {
    errors: Vec<String>,
    lost: Option<String>,
}

/// One wgpu device with its queue, the limits it was created with and a pipeline cache.
pub struct Gpu {
    pub device: wgpu::Device,
    pub queue: wgpu::Queue,
    pub info: wgpu::AdapterInfo,
    pub limits: wgpu::Limits,
    pub features: wgpu::Features,
    /// Whether kernels may pass values between the first 8 invocations of a subgroup with
    /// subgroupBroadcast: subgroups of 8 or more, and `SYNCSTEP_SUBGROUPS` is not `off` (which
    /// runs the kernels that load instead, as on devices without subgroups).
    pub broadcasts: bool,
    /// Whether [`Gpu::map`] waits for the device on the calling thread rather than on a helper
    /// thread. Data-parallel replicas are futures on one thread: waiting there holds the other
    /// replicas back from submitting, so their devices run one after another. That is what a
    /// CPU adapter wants (the default there): its replicas share the machine's cores, and taking
    /// turns a submission at a time measured faster than running at once (2 × 8 at 32², Mesa 25
    /// lavapipe: 0.33 s a step, 0.38 s at once). GPUs (the default elsewhere) run at once.
    pub blocking_maps: bool,
    modules: Mutex<HashMap<&'static str, wgpu::ShaderModule>>,
    pipelines: Mutex<HashMap<(&'static str, &'static str), wgpu::ComputePipeline>>,
    sink: Arc<Mutex<ErrorSink>>,
    memory: Mutex<MemoryCounter>,
    profiler: Mutex<Option<Profiler>>,
    scratch: Mutex<HashMap<&'static str, wgpu::Buffer>>,
}

impl Gpu {
    /// A device on the adapter `choice` names, from a fresh instance.
    pub async fn new(choice: &AdapterChoice) -> Result<Gpu> {
        let instance = instance();
        let adapter = select_adapter(&instance, choice).await?;
        Gpu::from_adapter(&adapter).await
    }

    /// A device on `adapter` with the adapter's own limits (not WebGPU's defaults), so large
    /// storage bindings work where the hardware allows them.
    pub async fn from_adapter(adapter: &wgpu::Adapter) -> Result<Gpu> {
        Gpu::from_adapter_with_limits(adapter, adapter.limits()).await
    }

    /// A device with the given limits, e.g. tighter ones to see how shapes past them are refused.
    pub async fn from_adapter_with_limits(
        adapter: &wgpu::Adapter,
        limits: wgpu::Limits,
    ) -> Result<Gpu> {
        let info = adapter.get_info();
        let subgroups_off = cfg!(not(target_arch = "wasm32"))
            && std::env::var("SYNCSTEP_SUBGROUPS").is_ok_and(|v| v == "off");
        let wanted = if subgroups_off {
            wgpu::Features::TIMESTAMP_QUERY
        } else {
            wgpu::Features::TIMESTAMP_QUERY | wgpu::Features::SUBGROUP
        };
        let features = adapter.features() & wanted;
        let broadcasts = features.contains(wgpu::Features::SUBGROUP) && info.subgroup_min_size >= 8;
        let blocking_maps = info.device_type == wgpu::DeviceType::Cpu;
        let (device, queue) = adapter
            .request_device(&wgpu::DeviceDescriptor {
                label: Some("syncstep"),
                required_features: features,
                required_limits: limits.clone(),
                ..Default::default()
            })
            .await
            .map_err(|e| GpuError::RequestDevice {
                adapter: describe(&info),
                message: e.to_string(),
            })?;
        let sink = Arc::new(Mutex::new(ErrorSink::default()));
        let s = sink.clone();
        device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
            log::error!("uncaptured wgpu error: {e}");
            s.lock().unwrap_or_else(|p| p.into_inner()).errors.push(e.to_string());
        }));
        let s = sink.clone();
        device.set_device_lost_callback(move |reason, message| {
            let why = if message.is_empty() {
                format!("{reason:?}")
            } else {
                format!("{reason:?}: {message}")
            };
            s.lock().unwrap_or_else(|p| p.into_inner()).lost = Some(why);
        });
        log::debug!("device on {}", describe(&info));
        Ok(Gpu {
            device,
            queue,
            info,
            limits,
            features,
            broadcasts,
            blocking_maps,
            modules: Mutex::new(HashMap::new()),
            pipelines: Mutex::new(HashMap::new()),
            sink,
            memory: Mutex::new(MemoryCounter::default()),
            profiler: Mutex::new(None),
            scratch: Mutex::new(HashMap::new()),
        })
    }

    /// Errors wgpu reported outside a scope, and device loss, since the last check.
    pub fn check(&self) -> Result<()> {
        let mut sink = self.sink.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(lost) = &sink.lost {
            return Err(GpuError::DeviceLost(lost.clone()));
        }
        if !sink.errors.is_empty() {
            let all = std::mem::take(&mut sink.errors).join("; ");
            drop(sink);
            return Err(self.lost_or(if all.contains("memory") {
                GpuError::OutOfMemory(all)
            } else {
                GpuError::Validation(all)
            }));
        }
        Ok(())
    }

    /// `e`, unless the device was lost: then that, the cause. A destroyed device reports its
    /// loss only once its queue is empty and it is polled, and until then every use of it fails
    /// as "invalid": so wait for the queue (work may still run, e.g. a copy submitted last and
    /// never waited for), though not forever.
    fn lost_or(&self, e: GpuError) -> GpuError {
        #[cfg(not(target_arch = "wasm32"))]
        let _ = self.device.poll(wgpu::PollType::Wait {
            submission_index: None,
            timeout: Some(std::time::Duration::from_secs(10)),
        });
        match &self.sink.lock().unwrap_or_else(|p| p.into_inner()).lost {
            Some(lost) => GpuError::DeviceLost(lost.clone()),
            None => e,
        }
    }

    /// Runs `f` inside validation and out-of-memory error scopes and returns what they caught.
    pub async fn scoped<T>(&self, f: impl FnOnce() -> T) -> Result<T> {
        let oom = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let validation = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let out = f();
        let v = validation.pop();
        let o = oom.pop();
        if let Some(e) = v.await {
            return Err(self.lost_or(GpuError::Validation(e.to_string())));
        }
        if let Some(e) = o.await {
            return Err(self.lost_or(GpuError::OutOfMemory(e.to_string())));
        }
        self.check()?;
        Ok(out)
    }

    pub fn encoder(&self) -> Encoder {
        Encoder {
            encoder: self
                .device
                .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None }),
            pass: None,
            uniforms: None,
        }
    }

    /// Finishes and submits `encoder`; every error recorded into it comes back here.
    pub async fn submit(&self, encoder: Encoder) -> Result<wgpu::SubmissionIndex> {
        {
            let mut m = self.memory.lock().unwrap_or_else(|p| p.into_inner());
            m.stats.largest_submission_bytes = m.stats.largest_submission_bytes.max(m.since_submit);
            m.since_submit = 0;
        }
        self.scoped(|| self.queue.submit([encoder.finish()])).await
    }

    /// Creates a buffer and counts its bytes in [`MemoryStats`].
    fn create_buffer(&self, desc: &wgpu::BufferDescriptor) -> wgpu::Buffer {
        let mut m = self.memory.lock().unwrap_or_else(|p| p.into_inner());
        m.stats.created_bytes += desc.size;
        m.stats.largest_buffer_bytes = m.stats.largest_buffer_bytes.max(desc.size);
        m.since_submit += desc.size;
        drop(m);
        self.device.create_buffer(desc)
    }

    /// What was created since the last reset (the buffers of a submission not yet made count
    /// as one).
    pub fn memory_stats(&self) -> MemoryStats {
        let m = self.memory.lock().unwrap_or_else(|p| p.into_inner());
        MemoryStats {
            largest_submission_bytes: m.stats.largest_submission_bytes.max(m.since_submit),
            ..m.stats
        }
    }

    pub fn reset_memory_stats(&self) {
        *self.memory.lock().unwrap_or_else(|p| p.into_inner()) = MemoryCounter::default();
    }

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
    fn profile_dispatch(
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

    /// Blocks until the queue is idle (native only; in a browser, await a readback instead).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn wait(&self) -> Result<()> {
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| GpuError::DeviceLost(e.to_string()))?;
        self.check()
    }

    /// A place for a dispatch's uniform `bytes` in `encoder`'s page of uniforms (see
    /// [`Encoder`]): the page and the offset.
    fn uniform_slot(&self, encoder: &mut Encoder, bytes: &[u8]) -> Result<(wgpu::Buffer, u64)> {
        let len = bytes.len() as u64;
        if encoder.uniforms.as_ref().is_none_or(|(_, next)| next + len > UNIFORM_PAGE) {
            encoder.unmap_uniforms();
            let size = UNIFORM_PAGE.max(len);
            let page = self.create_buffer(&wgpu::BufferDescriptor {
                label: Some("dispatch uniforms"),
                size,
                usage: wgpu::BufferUsages::UNIFORM,
                mapped_at_creation: true,
            });
            encoder.uniforms = Some((page, 0));
        }
        let (page, next) = encoder.uniforms.as_mut().expect("a page was just made");
        let at = *next;
        let mut view = page.slice(at..at + len).get_mapped_range_mut().map_err(|e| {
            self.lost_or(GpuError::Validation(format!("mapping the dispatch uniforms: {e}")))
        })?;
        view.copy_from_slice(bytes);
        drop(view);
        let align = self.limits.min_uniform_buffer_offset_alignment as u64;
        *next = (at + len).div_ceil(align) * align;
        Ok((page.clone(), at))
    }

    /// The device time of one recording of `record`, for timing a kernel (the autotune, the
    /// bench's roofline): `launches` recordings in one submission, submit to idle, divided by
    /// `launches`; this device's errors come back through `gpu_err`. Native only.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn time_recorded<E>(
        &self,
        launches: u32,
        record: impl Fn(&mut Encoder) -> Result<(), E>,
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

    /// A zeroed storage buffer of `len` 4-byte elements, usable as copy source and destination.
    pub fn buffer(&self, label: &str, len: u64) -> Result<wgpu::Buffer> {
        let size = (len * 4).max(4);
        self.check_buffer_size(label, size)?;
        Ok(self.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size,
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_SRC
                | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        }))
    }

    /// A storage buffer of at least `len` 4-byte elements for a launch's temporary use under
    /// `label` (an im2col chunk, weight rows): the same buffer for every launch that asks for
    /// `label`, replaced by a larger one when a launch needs more. It holds whatever the last
    /// launch left, so a kernel must write what it reads. wgpu orders the launches that share it,
    /// and keeps a replaced buffer until the work recorded on it is done. Fresh buffers per
    /// launch were all resident until their submission completed (1.9 GB in a step at 224²,
    /// N = 8) and were new memory to fault in every step.
    pub fn scratch(&self, label: &'static str, len: u64) -> Result<wgpu::Buffer> {
        let bytes = (len * 4).max(4);
        let mut scratch = self.scratch.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(b) = scratch.get(label).filter(|b| b.size() >= bytes) {
            return Ok(b.clone());
        }
        let b = self.buffer(label, len)?;
        scratch.insert(label, b.clone());
        Ok(b)
    }

    /// Runs `f`, then puts back the buffers [`Gpu::scratch`] kept before it: for one-off launches
    /// whose sizes the steady work does not need (the autotune's candidates). Those `f` created
    /// are let go (wgpu keeps them while work recorded on them is pending).
    pub fn scratch_as_before<T>(&self, f: impl FnOnce() -> T) -> T {
        let before = self.scratch.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let result = f();
        *self.scratch.lock().unwrap_or_else(|p| p.into_inner()) = before;
        result
    }

    /// Bytes of the buffers [`Gpu::scratch`] keeps.
    pub fn scratch_bytes(&self) -> u64 {
        self.scratch
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .map(wgpu::Buffer::size)
            .sum()
    }

    /// A storage buffer holding `data` (f32, u32, …).
    pub fn upload<T: bytemuck::Pod>(&self, label: &str, data: &[T]) -> Result<wgpu::Buffer> {
        let bytes: &[u8] = bytemuck::cast_slice(data);
        self.check_buffer_size(label, bytes.len() as u64)?;
        if bytes.is_empty() {
            return self.buffer(label, 1);
        }
        self.buffer_init(
            label,
            bytes,
            wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_SRC
                | wgpu::BufferUsages::COPY_DST,
        )
    }

    /// A buffer holding `contents`, written through a mapping at creation. Unlike wgpu's
    /// `create_buffer_init`, which panics when the mapping fails (a lost device), this fails
    /// with an error.
    fn buffer_init(
        &self,
        label: &str,
        contents: &[u8],
        usage: wgpu::BufferUsages,
    ) -> Result<wgpu::Buffer> {
        // A buffer mapped at creation must be a multiple of 4 bytes long.
        let size = (contents.len() as u64).div_ceil(wgpu::COPY_BUFFER_ALIGNMENT)
            * wgpu::COPY_BUFFER_ALIGNMENT;
        let buffer = self.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size,
            usage,
            mapped_at_creation: true,
        });
        let mut view = buffer.slice(..).get_mapped_range_mut().map_err(|e| {
            self.lost_or(GpuError::Validation(format!("mapping `{label}` at creation: {e}")))
        })?;
        view.slice(..contents.len()).copy_from_slice(contents);
        drop(view);
        buffer.unmap();
        Ok(buffer)
    }

    /// Overwrites a slice with NaN, so a kernel that leaves an element unwritten fails its test.
    pub fn poison(&self, s: Slice) {
        let nan = vec![f32::NAN; s.len as usize];
        self.queue.write_buffer(s.buffer, s.offset, bytemuck::cast_slice(&nan));
    }

    fn check_buffer_size(&self, label: &str, size: u64) -> Result<()> {
        if size > self.limits.max_buffer_size {
            return Err(GpuError::Limit {
                what: format!("buffer `{label}`"),
                needed: size,
                allowed: self.limits.max_buffer_size,
                limit: "max_buffer_size",
            });
        }
        Ok(())
    }

    /// Copies a slice back to the host. Awaits the map without blocking (works in a browser).
    pub async fn read<T: bytemuck::Pod>(&self, s: Slice<'_>) -> Result<Vec<T>> {
        let mut encoder = self.encoder();
        let readback = self.record_read(&mut encoder, &[s]);
        self.submit(encoder).await?;
        readback.read(self).await
    }

    /// Records into `encoder` copies of `slices`, one after the other, to one MAP_READ staging
    /// buffer; once the encoder is submitted, [`Readback::read`] returns them. Reading what a
    /// submission computes as part of it saves a second submission, and one staging buffer one
    /// map: a data-parallel step reads several BN sites' rows at once.
    pub fn record_read(&self, encoder: &mut Encoder, slices: &[Slice<'_>]) -> Readback {
        let bytes: u64 = slices.iter().map(Slice::bytes).sum();
        let staging = (bytes > 0).then(|| {
            let staging = self.create_buffer(&wgpu::BufferDescriptor {
                label: Some("readback"),
                size: bytes,
                usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            });
            let mut at = 0;
            for s in slices.iter().filter(|s| s.len > 0) {
                encoder.copy_buffer_to_buffer(s.buffer, s.offset, &staging, at, s.bytes());
                at += s.bytes();
            }
            staging
        });
        Readback { staging }
    }

    pub async fn read_f32(&self, s: Slice<'_>) -> Result<Vec<f32>> {
        self.read(s).await
    }

    /// Maps all of `buffer` for `mode` and awaits the map, which completes once the submission
    /// `after` (the last to use the buffer; `None`: the latest) is done. Natively the device's
    /// poll waits for that submission and runs the map's callback, here or on a helper thread
    /// (see [`Gpu::blocking_maps`]); in a browser the browser does, without blocking.
    pub async fn map(
        &self,
        buffer: &wgpu::Buffer,
        mode: wgpu::MapMode,
        after: Option<wgpu::SubmissionIndex>,
    ) -> Result<()> {
        let (tx, rx) = futures::channel::oneshot::channel();
        buffer.slice(..).map_async(mode, move |r| {
            let _ = tx.send(r.map_err(|e| GpuError::Readback(e.to_string())));
        });
        #[cfg(not(target_arch = "wasm32"))]
        let rx = {
            // A failed poll (device lost) may never run the callback: its error comes instead.
            let (lost_tx, lost_rx) = futures::channel::oneshot::channel();
            let device = self.device.clone();
            let wait = move || {
                if let Err(e) =
                    device.poll(wgpu::PollType::Wait { submission_index: after, timeout: None })
                {
                    let _ = lost_tx.send(Err(GpuError::DeviceLost(e.to_string())));
                }
            };
            if self.blocking_maps {
                wait();
            } else {
                std::thread::spawn(wait);
            }
            // After a poll that succeeded only the callback decides: another thread's poll may
            // be the one running it, a moment after this poll returned.
            let lost = Box::pin(async move {
                match lost_rx.await {
                    Ok(lost) => Ok(lost),
                    Err(_) => futures::future::pending().await,
                }
            });
            async move {
                match futures::future::select(rx, lost).await {
                    futures::future::Either::Left((r, _))
                    | futures::future::Either::Right((r, _)) => r,
                }
            }
        };
        #[cfg(target_arch = "wasm32")]
        drop(after);
        let mapped = rx.await;
        self.check()?; // a lost device is the cause of a dropped callback
        mapped.map_err(|_| GpuError::Readback("the map callback was dropped".into()))?
    }

    /// The compute pipeline for `entry` in `shader`, compiled on first use and cached.
    pub fn pipeline(&self, shader: &Shader, entry: &'static str) -> wgpu::ComputePipeline {
        let mut pipelines = self.pipelines.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(p) = pipelines.get(&(shader.name, entry)) {
            return p.clone();
        }
        let mut modules = self.modules.lock().unwrap_or_else(|p| p.into_inner());
        let module = modules.entry(shader.name).or_insert_with(|| {
            self.device.create_shader_module(wgpu::ShaderModuleDescriptor {
                label: Some(shader.name),
                source: wgpu::ShaderSource::Wgsl(shader.source.into()),
            })
        });
        log::debug!("compiling pipeline {}::{}", shader.name, entry);
        let pipeline = self.device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some(entry),
            layout: None,
            module,
            entry_point: Some(entry),
            compilation_options: Default::default(),
            cache: None,
        });
        pipelines.insert((shader.name, entry), pipeline.clone());
        pipeline
    }

    /// Records one dispatch of `entry` for the launcher `op`: `params` at binding 0 as a
    /// uniform, then `bindings` as storage buffers at bindings 1, 2, … in order. The entry point
    /// must use exactly these. It joins `encoder`'s open compute pass (see [`Encoder`]); while a
    /// profile runs, it is a pass of its own, bracketed with timestamps.
    #[allow(clippy::too_many_arguments)]
    pub fn dispatch<P: bytemuck::Pod>(
        &self,
        encoder: &mut Encoder,
        op: &'static str,
        shader: &Shader,
        entry: &'static str,
        params: &P,
        bindings: &[Slice],
        workgroups: [u32; 3],
    ) -> Result<()> {
        let max_bindings = self.limits.max_storage_buffers_per_shader_stage as u64;
        if bindings.len() as u64 > max_bindings {
            return Err(GpuError::Limit {
                what: format!("{entry}'s storage bindings"),
                needed: bindings.len() as u64,
                allowed: max_bindings,
                limit: "max_storage_buffers_per_shader_stage",
            });
        }
        let max_groups = self.limits.max_compute_workgroups_per_dimension as u64;
        if let Some(&g) = workgroups.iter().find(|&&g| g as u64 > max_groups) {
            return Err(GpuError::Limit {
                what: format!("{entry}'s dispatch"),
                needed: g as u64,
                allowed: max_groups,
                limit: "max_compute_workgroups_per_dimension",
            });
        }
        if workgroups.contains(&0) {
            return Ok(());
        }
        // Uniform structs are padded to 16 bytes, as WGSL's uniform layout wants.
        let mut uniform = bytemuck::bytes_of(params).to_vec();
        uniform.resize(uniform.len().div_ceil(16).max(1) * 16, 0);
        let (page, at) = self.uniform_slot(encoder, &uniform)?;
        let pipeline = self.pipeline(shader, entry);
        let params = wgpu::BufferBinding {
            buffer: &page,
            offset: at,
            size: wgpu::BufferSize::new(uniform.len() as u64),
        };
        let mut entries = vec![wgpu::BindGroupEntry {
            binding: 0,
            resource: wgpu::BindingResource::Buffer(params),
        }];
        for (i, s) in bindings.iter().enumerate() {
            entries.push(wgpu::BindGroupEntry {
                binding: i as u32 + 1,
                resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                    buffer: s.buffer,
                    offset: s.offset,
                    size: wgpu::BufferSize::new(s.bytes().max(4)),
                }),
            });
        }
        let bind_group = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some(entry),
            layout: &pipeline.get_bind_group_layout(0),
            entries: &entries,
        });
        let timed = self.profile_dispatch(op, entry);
        let timestamp_writes =
            timed.as_ref().map(|(query_set, index)| wgpu::ComputePassTimestampWrites {
                query_set,
                beginning_of_pass_write_index: Some(*index),
                end_of_pass_write_index: Some(index + 1),
            });
        // A profiled dispatch is a pass of its own, bracketed by its timestamps and named after
        // its entry point; the shared pass holds many.
        let profiled = timed.is_some();
        if profiled {
            encoder.end_pass();
        }
        let pass = encoder.pass(wgpu::ComputePassDescriptor {
            label: profiled.then_some(entry),
            timestamp_writes,
        });
        pass.set_pipeline(&pipeline);
        pass.set_bind_group(0, &bind_group, &[]);
        pass.dispatch_workgroups(workgroups[0], workgroups[1], workgroups[2]);
        if profiled {
            encoder.end_pass();
        }
        Ok(())
    }

    /// Checks that `s` can be bound as a storage buffer here: size within
    /// max_storage_buffer_binding_size and offset aligned. `what` names it in the error.
    pub fn check_binding(&self, what: &str, s: &Slice) -> Result<()> {
        let max = self.limits.max_storage_buffer_binding_size;
        if s.bytes() > max {
            return Err(GpuError::Limit {
                what: what.to_string(),
                needed: s.bytes(),
                allowed: max,
                limit: "max_storage_buffer_binding_size (bytes)",
            });
        }
        let align = self.limits.min_storage_buffer_offset_alignment as u64;
        if !s.offset.is_multiple_of(align) {
            return Err(GpuError::Limit {
                what: format!("{what} offset (must be a multiple of {align})"),
                needed: s.offset,
                allowed: s.offset - s.offset % align,
                limit: "min_storage_buffer_offset_alignment",
            });
        }
        if s.offset + s.bytes() > s.buffer.size() {
            return Err(GpuError::Limit {
                what: format!("{what} range end (bytes)"),
                needed: s.offset + s.bytes(),
                allowed: s.buffer.size(),
                limit: "buffer size",
            });
        }
        Ok(())
    }
}

/// Bytes of one page of dispatch uniforms (see [`Encoder`]).
const UNIFORM_PAGE: u64 = 64 << 10;

/// Copies recorded by [`Gpu::record_read`], readable once their encoder is submitted.
#[must_use = "recorded copies are read with `read`"]
pub struct Readback {
    /// `None` when there is nothing to copy.
    staging: Option<wgpu::Buffer>,
}

impl Readback {
    /// Awaits the latest submission on `gpu` (which must include the recorded copies) and
    /// returns the slices' contents, one after the other.
    pub async fn read<T: bytemuck::Pod>(self, gpu: &Gpu) -> Result<Vec<T>> {
        let Some(staging) = self.staging else { return Ok(Vec::new()) };
        gpu.map(&staging, wgpu::MapMode::Read, None).await?;
        let view =
            staging.slice(..).get_mapped_range().map_err(|e| GpuError::Readback(e.to_string()))?;
        let data = bytemuck::cast_slice::<u8, T>(&view).to_vec();
        drop(view);
        staging.unmap();
        Ok(data)
    }
}

/// A command encoder that records consecutive dispatches into one compute pass, ended when
/// something else is recorded (a copy, a clear) or the encoder is finished: on lavapipe a pass
/// of its own cost each dispatch ~12 µs more (25 against 13 µs for a tiny kernel). wgpu still
/// orders the dispatches of a pass by the buffers they share, as it does passes. The
/// dispatches' uniforms share pages too, written while mapped and unmapped by the finish: a
/// buffer each cost ~4 µs of recording on lavapipe (2 ms a step).
pub struct Encoder {
    encoder: wgpu::CommandEncoder,
    pass: Option<wgpu::ComputePass<'static>>,
    /// The page being filled, and its next free byte.
    uniforms: Option<(wgpu::Buffer, u64)>,
}

impl Encoder {
    /// The open compute pass, begun with `desc` if none is.
    fn pass(&mut self, desc: wgpu::ComputePassDescriptor) -> &mut wgpu::ComputePass<'static> {
        let encoder = &mut self.encoder;
        self.pass.get_or_insert_with(|| encoder.begin_compute_pass(&desc).forget_lifetime())
    }

    fn end_pass(&mut self) {
        self.pass = None;
    }

    pub fn copy_buffer_to_buffer(
        &mut self,
        source: &wgpu::Buffer,
        source_offset: u64,
        destination: &wgpu::Buffer,
        destination_offset: u64,
        bytes: u64,
    ) {
        self.end_pass();
        self.encoder.copy_buffer_to_buffer(
            source,
            source_offset,
            destination,
            destination_offset,
            bytes,
        );
    }

    pub fn clear_buffer(&mut self, buffer: &wgpu::Buffer, offset: u64, bytes: Option<u64>) {
        self.end_pass();
        self.encoder.clear_buffer(buffer, offset, bytes);
    }

    fn resolve_query_set(
        &mut self,
        set: &wgpu::QuerySet,
        queries: std::ops::Range<u32>,
        destination: &wgpu::Buffer,
        offset: u64,
    ) {
        self.end_pass();
        self.encoder.resolve_query_set(set, queries, destination, offset);
    }

    fn unmap_uniforms(&mut self) {
        if let Some((page, _)) = self.uniforms.take() {
            page.unmap();
        }
    }

    fn finish(mut self) -> wgpu::CommandBuffer {
        self.end_pass();
        self.unmap_uniforms();
        self.encoder.finish()
    }
}

/// How many launches of a kernel that took `one` alone [`Gpu::time_recorded`] should time
/// together to run at least `at_least` (at most 64): a short kernel timed alone is mostly submit
/// and wait (~0.1 ms on lavapipe), which hid there that one workgroup leaves a core idle.
pub fn launches_to_fill(at_least: std::time::Duration, one: std::time::Duration) -> u32 {
    (at_least.as_secs_f64() / one.as_secs_f64().max(1e-9)).ceil().clamp(1.0, 64.0) as u32
}

/// Workgroup counts covering `threads` invocations in workgroups of `size`, spilling into y
/// when x would pass 65535. Shaders recover the linear index as
/// `gid.x + gid.y * num_workgroups.x * size`.
pub fn grid_1d(threads: u64, size: u32) -> [u32; 3] {
    let groups = threads.div_ceil(size as u64);
    const MAX_X: u64 = 65535;
    if groups <= MAX_X {
        [groups as u32, 1, 1]
    } else {
        [MAX_X as u32, groups.div_ceil(MAX_X) as u32, 1]
    }
}
