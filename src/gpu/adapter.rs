//! Choosing an adapter: the `AdapterChoice` a user names (`1`, `gl`, `vulkan:1`), the
//! adapters of an instance in the order `syncstep info` lists them, and their descriptions.

use super::{GpuError, Result};

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
