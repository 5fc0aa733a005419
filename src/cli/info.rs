//! `syncstep info`: the adapters wgpu sees and what they allow.

use syncstep::gpu;
use syncstep::host::{format_bytes, ByteScale};

pub fn run() -> Result<(), Box<dyn std::error::Error>> {
    let instance = gpu::instance();
    let adapters = pollster::block_on(gpu::adapters(&instance));
    if adapters.is_empty() {
        // The same error (and advice) as choosing one would give.
        pollster::block_on(gpu::select_adapter(&instance, &gpu::AdapterChoice::default()))?;
    }
    let default = super::env::get().adapter();
    for (i, a) in adapters.iter().enumerate() {
        let info = a.get_info();
        let l = a.limits();
        let f = a.features();
        say!("[{i}] {}", gpu::describe(&info));
        say!("    vendor {:#06x}  device {:#06x}", info.vendor, info.device);
        say!(
            "    max storage binding {}, max buffer {}, storage buffers/stage {}, workgroup memory {}, invocations/workgroup {}, storage offset alignment {}",
            format_bytes(l.max_storage_buffer_binding_size, ByteScale::Fit),
            format_bytes(l.max_buffer_size, ByteScale::Fit),
            l.max_storage_buffers_per_shader_stage,
            format_bytes(l.max_compute_workgroup_storage_size.into(), ByteScale::Fit),
            l.max_compute_invocations_per_workgroup,
            l.min_storage_buffer_offset_alignment
        );
        let named = [
            (wgpu::Features::TIMESTAMP_QUERY, "timestamp-query"),
            (wgpu::Features::SHADER_F16, "shader-f16"),
            (wgpu::Features::SUBGROUP, "subgroups"),
            (wgpu::Features::SHADER_F64, "shader-f64"),
        ];
        let have: Vec<&str> =
            named.iter().filter(|(x, _)| f.contains(*x)).map(|(_, n)| *n).collect();
        say!(
            "    features: {}",
            if have.is_empty() { "none of interest".into() } else { have.join(", ") }
        );
        if f.contains(wgpu::Features::SUBGROUP) {
            // Gpu::broadcasts: the kernels that share loads by subgroupBroadcast need 8 or more.
            let uses = if info.subgroup_min_size >= 8 {
                "broadcasting kernels"
            } else {
                "too small for the broadcasting kernels"
            };
            say!(
                "    subgroups of {}–{} invocations: {uses}",
                info.subgroup_min_size,
                info.subgroup_max_size
            );
        }
    }
    say!("\nselect with --adapter or SYNCSTEP_ADAPTER: an index (`1`), a backend (`gl`), or both (`vulkan:0`); current: {default:?}");
    Ok(())
}
