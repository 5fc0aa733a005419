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

/// Picks the adapter named by `choice`. When none fits, the error says which variables
/// narrowed the choice and lists the adapters this machine has.
pub async fn select_adapter(
    instance: &wgpu::Instance,
    choice: &AdapterChoice,
) -> Result<wgpu::Adapter> {
    let all = adapters(instance).await;
    let matching: Vec<wgpu::Adapter> = all
        .into_iter()
        .filter(|a| choice.backend.is_none_or(|b| a.get_info().backend == b))
        .collect();
    let count = matching.len();
    if count > choice.index {
        return Ok(matching.into_iter().nth(choice.index).expect("index checked"));
    }
    let backend = choice.backend.map(|b| format!(" of backend {b:?}")).unwrap_or_default();
    let problem = match count {
        0 => format!("no adapter{backend} is available"),
        _ => format!(
            "there is no adapter {}{backend}: adapters 0 to {} are",
            choice.index,
            count - 1
        ),
    };
    Err(GpuError::NoAdapter(format!("{problem}. {}", what_exists().await)))
}

/// What narrowed the backends (wgpu's own `WGPU_BACKEND`, which [`instance`] heeds) and the
/// adapters this machine has without it, or how to get one when it has none.
async fn what_exists() -> String {
    let narrowed = wgpu::Backends::from_env().map_or(String::new(), |backends| {
        let names: Vec<String> = backends.iter_names().map(|(n, _)| n.to_lowercase()).collect();
        format!("WGPU_BACKEND={} narrows the backends. ", names.join(","))
    });
    let everything = wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle());
    let list: Vec<String> = adapters(&everything)
        .await
        .iter()
        .map(|a| {
            let i = a.get_info();
            format!("{} ({:?}, {:?})", i.name, i.backend, i.device_type)
        })
        .collect();
    if list.is_empty() {
        return format!(
            "{narrowed}This machine has no WebGPU adapter at all: install a GPU driver with \
             Vulkan, Metal or DX12, or, without a GPU, Mesa's software Vulkan (on Debian/Ubuntu: \
             apt-get install mesa-vulkan-drivers libvulkan1)"
        );
    }
    format!("{narrowed}This machine's adapters (`syncstep info` lists them): {}", list.join("; "))
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
