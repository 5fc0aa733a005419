//! Native command-line face: parses arguments and calls into the library. Nothing here
//! computes; every subcommand is a thin wrapper that prints what the library returns.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use syncstep::gpu;

#[derive(Parser)]
#[command(name = "syncstep", version, about = "Train ResNet-34 with WGSL compute shaders on one or R WebGPU devices, and check that data-parallel equals single-device")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// List the adapters wgpu sees: backend, type, driver, and the limits and features that matter.
    Info,
}

pub fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Info => info(),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn info() -> Result<(), Box<dyn std::error::Error>> {
    let instance = gpu::instance();
    let adapters = pollster::block_on(gpu::adapters(&instance));
    if adapters.is_empty() {
        return Err(gpu::GpuError::NoAdapter(String::new()).into());
    }
    let default = gpu::AdapterChoice::from_env()?;
    for (i, a) in adapters.iter().enumerate() {
        let info = a.get_info();
        let l = a.limits();
        let f = a.features();
        println!("[{i}] {}", gpu::describe(&info));
        println!("    vendor {:#06x}  device {:#06x}", info.vendor, info.device);
        println!(
            "    max storage binding {} MiB, max buffer {} MiB, storage buffers/stage {}, workgroup memory {} KiB, invocations/workgroup {}, storage offset alignment {}",
            l.max_storage_buffer_binding_size >> 20,
            l.max_buffer_size >> 20,
            l.max_storage_buffers_per_shader_stage,
            l.max_compute_workgroup_storage_size >> 10,
            l.max_compute_invocations_per_workgroup,
            l.min_storage_buffer_offset_alignment
        );
        let named = [
            (wgpu::Features::TIMESTAMP_QUERY, "timestamp-query"),
            (wgpu::Features::SHADER_F16, "shader-f16"),
            (wgpu::Features::SUBGROUP, "subgroups"),
            (wgpu::Features::SHADER_F64, "shader-f64"),
        ];
        let have: Vec<&str> = named.iter().filter(|(x, _)| f.contains(*x)).map(|(_, n)| *n).collect();
        println!("    features: {}", if have.is_empty() { "none of interest".into() } else { have.join(", ") });
    }
    println!("\nselect with --adapter or SYNCSTEP_ADAPTER: an index (`1`), a backend (`gl`), or both (`vulkan:0`); current: {default:?}");
    Ok(())
}
