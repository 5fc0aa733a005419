//! The `gpu` layer: adapter and device creation (native and wasm), buffers, async readback,
//! a pipeline cache and one `dispatch` that every kernel launcher goes through.
//!
//! wgpu reports validation and out-of-memory errors asynchronously. We catch them three ways:
//! error scopes around each submit, an uncaptured-error handler that records anything else
//! (wgpu's default handler panics, which we never want), and a device-lost callback. All
//! three surface as [`GpuError`] values from [`Gpu::submit`] and [`Gpu::read_f32`].
//!
//! One `Gpu` per device. Its methods are split by concern: `adapter` (choosing one),
//! `memory` (buffers and scratch), `encoder` (recording and dispatch), `readback`, `profile`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

mod adapter;
mod encoder;
mod memory;
mod profile;
mod readback;
mod shader;

pub use adapter::{adapters, describe, instance, select_adapter, AdapterChoice};
pub use encoder::{grid_1d, Encoder};
pub use memory::{MemoryStats, ScratchSlot};
pub use profile::{launches_to_fill, Construction, DispatchShape, Issued, KernelTime, Serial};
pub use readback::Readback;
pub use shader::Shader;

use memory::MemoryCounter;
use profile::Profiler;

/// Errors of the gpu layer. Every message says what to do about it where that is known.
/// `Clone`, so one error can be handed to every replica waiting on the same collective.
#[derive(Clone, Debug, thiserror::Error)]
pub enum GpuError {
    /// No adapter fits the choice: which, what narrowed it, and what exists.
    #[error("{0}")]
    NoAdapter(String),
    #[error("unknown backend `{0}`: use vulkan, metal, dx12, gl or webgpu")]
    UnknownBackend(String),
    /// A setting (an environment variable) that cannot be used, named with its value.
    #[error("{0}")]
    Setting(String),
    #[error("could not create a device on `{adapter}`: {message}")]
    RequestDevice { adapter: String, message: String },
    #[error("{what} needs {needed} but this device allows at most {allowed} ({limit}); use smaller shapes or another adapter")]
    Limit { what: String, needed: u64, allowed: u64, limit: &'static str },
    #[error("wgpu validation error: {0}")]
    Validation(String),
    #[error("GPU out of memory: {0}; use a smaller batch or image size")]
    OutOfMemory(String),
    #[error(transparent)]
    HostMemory(#[from] syncstep_host::OutOfMemory),
    #[error("GPU device lost ({0}); the device must be recreated")]
    DeviceLost(String),
    #[error("reading a buffer back failed: {0}")]
    Readback(String),
    #[error("this adapter lacks {0}")]
    MissingFeature(&'static str),
}

pub type Result<T, E = GpuError> = std::result::Result<T, E>;

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

#[derive(Default)]
struct ErrorSink {
    errors: Vec<String>,
    /// Allocations that failed. The validation errors that follow one are its consequences (a
    /// buffer that was never made is "invalid"), so these alone are reported.
    out_of_memory: Vec<String>,
    lost: Option<String>,
}

/// Workgroups that fill a large discrete GPU: 8 per compute unit of one with 132 (an H100 has
/// 132 SMs). A dispatch of fewer, or of workgroups under [`WIDE_INVOCATIONS`] invocations, leaves
/// such a GPU partly idle; the bench reports the share of a step's FLOPs in those.
pub const WIDE_DISPATCH: u64 = 1056;
/// Invocations per workgroup below which a dispatch counts as narrow (two 32-wide warps).
pub const WIDE_INVOCATIONS: u32 = 64;

/// One wgpu device with its queue, the limits it was created with and a pipeline cache.
pub struct Gpu {
    pub device: wgpu::Device,
    pub queue: wgpu::Queue,
    pub info: wgpu::AdapterInfo,
    pub limits: wgpu::Limits,
    pub features: wgpu::Features,
    /// Whether kernels may pass values between the first 8 invocations of a subgroup with
    /// subgroupBroadcast: subgroups of 8 or more. A caller may turn it off, to run the kernels
    /// that load instead, as on devices without subgroups (the command line's
    /// `SYNCSTEP_SUBGROUPS=off`).
    pub broadcasts: bool,
    /// Whether [`Gpu::map`] waits for the device on the calling thread rather than on a helper
    /// thread. Data-parallel replicas are futures on one thread: waiting there holds the other
    /// replicas back from submitting, so their devices run one after another. That is what a
    /// CPU adapter wants (the default there): its replicas share the machine's cores, and taking
    /// turns a submission at a time beats competing for them (docs/performance-log.md). GPUs (the
    /// default elsewhere) run at once.
    pub blocking_maps: bool,
    /// Whether dispatches are recorded for the profile but not run ([`Gpu::set_record_only`]).
    record_only: std::sync::atomic::AtomicBool,
    /// Every module this device has written, compiled or read, by name.
    modules: Mutex<HashMap<String, shader::Module>>,
    /// Whether shader modules keep wgpu's bounds checks and loop counters (see
    /// [`Gpu::pipeline`]): false on native GPU adapters, where the project's own modules are
    /// trusted; true in a browser, and on CPU adapters, where lavapipe runs the checked modules
    /// faster (docs/performance-log.md, 2026-12-06).
    pub checked_shaders: bool,
    /// A folder every shader module is written to as it is compiled, for reading (the command
    /// line's `SYNCSTEP_DUMP_SHADERS`).
    pub shader_dump: Option<std::path::PathBuf>,
    sink: Arc<Mutex<ErrorSink>>,
    memory: Mutex<MemoryCounter>,
    profiler: Mutex<Option<Profiler>>,
    scratch: Mutex<HashMap<ScratchSlot, wgpu::Buffer>>,
    /// [`Gpu::constants`]' buffers, by their key.
    constants: Mutex<HashMap<Vec<u8>, wgpu::Buffer>>,
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
        let features =
            adapter.features() & (wgpu::Features::TIMESTAMP_QUERY | wgpu::Features::SUBGROUP);
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
            // Not printed: `check` returns it, as a value, from the next submission.
            log::debug!("uncaptured wgpu error: {e}");
            let mut sink = s.lock().unwrap_or_else(|p| p.into_inner());
            match e {
                wgpu::Error::OutOfMemory { .. } => sink.out_of_memory.push(e.to_string()),
                _ => sink.errors.push(e.to_string()),
            }
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
            record_only: Default::default(),
            modules: Mutex::new(HashMap::new()),
            checked_shaders: cfg!(target_arch = "wasm32") || blocking_maps,
            shader_dump: None,
            sink,
            memory: Mutex::new(MemoryCounter::default()),
            profiler: Mutex::new(None),
            scratch: Mutex::new(HashMap::new()),
            constants: Mutex::new(HashMap::new()),
        })
    }

    /// Errors wgpu reported outside a scope, and device loss, since the last check.
    pub fn check(&self) -> Result<()> {
        let mut sink = self.sink.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(lost) = &sink.lost {
            return Err(GpuError::DeviceLost(lost.clone()));
        }
        let errors = std::mem::take(&mut sink.errors);
        let out_of_memory = std::mem::take(&mut sink.out_of_memory);
        drop(sink);
        if !out_of_memory.is_empty() {
            let what = format!("{} allocation(s) failed", out_of_memory.len());
            return Err(self.lost_or(GpuError::OutOfMemory(what)));
        }
        if !errors.is_empty() {
            return Err(self.lost_or(GpuError::Validation(errors.join("; "))));
        }
        Ok(())
    }

    /// Records an allocation that failed outside any scope, as wgpu's handler does: for the test
    /// suite, which cannot make an allocation fail on demand.
    #[doc(hidden)]
    pub fn record_out_of_memory(&self, what: String) {
        self.sink.lock().unwrap_or_else(|p| p.into_inner()).out_of_memory.push(what);
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
        let (v, o) = (v.await, o.await);
        // An allocation that failed first: the validation errors that follow are its echo.
        if let Some(e) = o {
            return Err(self.lost_or(GpuError::OutOfMemory(e.to_string())));
        }
        if let Some(e) = v {
            // An allocation that failed earlier, outside any scope, is what made this invalid.
            if let Err(oom @ GpuError::OutOfMemory(_)) = self.check() {
                return Err(oom);
            }
            return Err(self.lost_or(GpuError::Validation(e.to_string())));
        }
        self.check()?;
        Ok(out)
    }

    /// Finishes and submits `encoder`; every error recorded into it comes back here.
    pub async fn submit(&self, encoder: Encoder) -> Result<wgpu::SubmissionIndex> {
        self.count_submission();
        self.scoped(|| self.queue.submit([encoder.finish()])).await
    }

    /// Blocks until the queue is idle (native only; in a browser, await a readback instead).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn wait(&self) -> Result<()> {
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| GpuError::DeviceLost(e.to_string()))?;
        self.check()
    }
}
