//! Recording work: the `Encoder` that keeps consecutive dispatches in one compute pass and their
//! uniforms in shared pages, the pipeline cache, and `Gpu::dispatch`, which every kernel
//! launcher goes through.

use super::shader::{EntryFacts, Module};
use super::{Gpu, GpuError, Result, Shader, Slice};

impl Gpu {
    pub fn encoder(&self) -> Encoder {
        Encoder {
            encoder: self
                .device
                .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None }),
            pass: None,
            uniforms: None,
        }
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

    /// Runs `f` on this device's record of `shader`, made (its text written) on first use.
    fn with_module<T>(&self, shader: &Shader, f: impl FnOnce(&mut Module) -> T) -> T {
        let mut modules = self.modules.lock().unwrap_or_else(|p| p.into_inner());
        if !modules.contains_key(shader.name.as_ref()) {
            modules.insert(shader.name.to_string(), Module::of(shader));
        }
        f(modules.get_mut(shader.name.as_ref()).expect("just made"))
    }

    /// The compute pipeline for `entry` in `shader`, compiled on first use and cached, with the
    /// module's `override` constants.
    ///
    /// The project's own modules are compiled without the bounds checks and loop counters wgpu
    /// adds to a shader it does not trust (on native GPU adapters: `Gpu::checked_shaders`; a
    /// browser decides for itself): every
    /// kernel selects its indices within its bindings, and tests hold each one's outputs, on
    /// poisoned buffers, to the plain kernel's bits. Workgroup memory is not zeroed first: every
    /// kernel writes what it reads of it before a barrier (implicit/wgsl.rs's tests evaluate
    /// every index of the implicit-GEMM family against its arrays).
    pub fn pipeline(&self, shader: &Shader, entry: &'static str) -> wgpu::ComputePipeline {
        self.with_module(shader, |m| {
            if let Some(p) = m.pipelines.get(entry) {
                return p.clone();
            }
            let text = m.text.clone();
            let module = m.compiled.get_or_insert_with(|| self.shader_module(&shader.name, &text));
            log::debug!("compiling pipeline {}::{}", shader.name, entry);
            let pipeline = self.device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(entry),
                layout: None,
                module,
                entry_point: Some(entry),
                compilation_options: wgpu::PipelineCompilationOptions {
                    constants: &shader.constants,
                    zero_initialize_workgroup_memory: false,
                },
                cache: None,
            });
            m.pipelines.insert(entry, pipeline.clone());
            pipeline
        })
    }

    fn shader_module(&self, name: &str, text: &str) -> wgpu::ShaderModule {
        if let Some(dir) = &self.shader_dump {
            let path = dir.join(format!("{name}.wgsl"));
            let written = std::fs::create_dir_all(dir).and_then(|()| std::fs::write(&path, text));
            if let Err(e) = written {
                log::warn!("writing {}: {e}", path.display());
            }
        }
        let desc = wgpu::ShaderModuleDescriptor {
            label: Some(name),
            source: wgpu::ShaderSource::Wgsl(text.into()),
        };
        if !self.checked_shaders {
            // SAFETY: the project's own modules (`Shader` holds no user text), which keep their
            // indices within their bindings and arrays and loop a bounded number of times (see
            // above).
            return unsafe {
                self.device
                    .create_shader_module_trusted(desc, wgpu::ShaderRuntimeChecks::unchecked())
            };
        }
        self.device.create_shader_module(desc)
    }

    /// What `entry` of `shader` declares, read by naga (as wgpu reads it) once per entry point:
    /// its workgroup size, its uniform's bytes and the storage bindings it uses.
    pub(super) fn entry_facts(&self, shader: &Shader, entry: &'static str) -> Result<EntryFacts> {
        self.with_module(shader, |m| {
            if let Some(f) = m.facts.get(entry) {
                return Ok(f.clone());
            }
            let f = EntryFacts::read(&shader.name, &m.text, entry)?;
            m.facts.insert(entry, f.clone());
            Ok(f)
        })
    }

    /// Records one dispatch of `entry` for the launcher `op`: `params` at binding 0 as a
    /// uniform, then `bindings` as storage buffers at the storage bindings the entry point
    /// uses, in increasing order (entry points of one module share a layout and each uses
    /// some of its bindings). The entry point must use as many as there are. It joins
    /// `encoder`'s open compute pass (see [`Encoder`]); while a profile runs, it is a pass of
    /// its own, bracketed with timestamps.
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
        self.check_dispatch_limits(entry, bindings.len(), workgroups)?;
        let facts = self.entry_facts(shader, entry)?;
        facts.expect_launch(shader, entry, size_of::<P>(), bindings.len())?;
        if workgroups.contains(&0) {
            self.drop_charge(); // nothing runs: what was charged for it ends here
            return Ok(());
        }
        if self.is_record_only() {
            self.profile_dispatch(op, (shader, entry), workgroups, bindings);
            return Ok(());
        }
        let pipeline = self.pipeline(shader, entry);
        let bind_group = self.bind_group(
            encoder,
            &pipeline,
            entry,
            bytemuck::bytes_of(params),
            (facts.storage(), bindings),
        )?;
        let timed = self.profile_dispatch(op, (shader, entry), workgroups, bindings);
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

    /// Refuses a dispatch of `entry` with more storage bindings or workgroups than this
    /// device allows.
    fn check_dispatch_limits(
        &self,
        entry: &str,
        bindings: usize,
        workgroups: [u32; 3],
    ) -> Result<()> {
        let max_bindings = self.limits.max_storage_buffers_per_shader_stage as u64;
        if bindings as u64 > max_bindings {
            return Err(GpuError::Limit {
                what: format!("{entry}'s storage bindings"),
                needed: bindings as u64,
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
        Ok(())
    }

    /// The bind group of a dispatch of `entry`: the `params` bytes at binding 0 as a uniform
    /// (in `encoder`'s page), then `bindings` as storage buffers at the binding `numbers`.
    fn bind_group(
        &self,
        encoder: &mut Encoder,
        pipeline: &wgpu::ComputePipeline,
        entry: &'static str,
        params: &[u8],
        (numbers, bindings): (&[u32], &[Slice]),
    ) -> Result<wgpu::BindGroup> {
        // Uniform structs are padded to 16 bytes, as WGSL's uniform layout wants.
        let mut uniform = params.to_vec();
        uniform.resize(uniform.len().div_ceil(16).max(1) * 16, 0);
        let (page, at) = self.uniform_slot(encoder, &uniform)?;
        let params = wgpu::BufferBinding {
            buffer: &page,
            offset: at,
            size: wgpu::BufferSize::new(uniform.len() as u64),
        };
        let mut entries = vec![wgpu::BindGroupEntry {
            binding: 0,
            resource: wgpu::BindingResource::Buffer(params),
        }];
        for (&binding, s) in numbers.iter().zip(bindings) {
            entries.push(wgpu::BindGroupEntry {
                binding,
                resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                    buffer: s.buffer,
                    offset: s.offset,
                    size: wgpu::BufferSize::new(s.bytes().max(4)),
                }),
            });
        }
        Ok(self.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some(entry),
            layout: &pipeline.get_bind_group_layout(0),
            entries: &entries,
        }))
    }
}

/// Bytes of one page of dispatch uniforms (see [`Encoder`]).
const UNIFORM_PAGE: u64 = 64 << 10;

/// A command encoder that records consecutive dispatches into one compute pass, ended when
/// something else is recorded (a copy, a clear) or the encoder is finished, because beginning
/// a pass costs about as much as a small dispatch on CPU drivers. wgpu still orders the
/// dispatches of a pass by the buffers they share, as it does passes. The dispatches' uniforms
/// share pages too, written while mapped and unmapped by the finish, rather than a buffer each.
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

    pub(super) fn resolve_query_set(
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

    pub(super) fn finish(mut self) -> wgpu::CommandBuffer {
        self.end_pass();
        self.unmap_uniforms();
        self.encoder.finish()
    }
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
