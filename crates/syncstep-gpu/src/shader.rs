//! Shader modules: a WGSL file as written, or a variant made from one by code, and each
//! device's cache of them (their text, compiled module, pipelines and entry points' facts).

use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use super::{GpuError, Result};

/// A WGSL module: a WGSL file as written ([`Shader::file`]), or a variant made from one
/// by code ([`Shader::variant`]), whose text is written on a device's first use of its name,
/// with the values of its `override` constants, which its pipelines set. One name stands for
/// one text and one set of constants: a device writes and compiles each name once.
#[derive(Clone)]
pub struct Shader {
    pub name: Cow<'static, str>,
    text: Text,
    pub constants: Cow<'static, [(&'static str, f64)]>,
}

#[derive(Clone)]
enum Text {
    File(&'static str),
    Made(Arc<dyn Fn() -> String + Send + Sync>),
}

impl Shader {
    /// A file (or files joined) as written, under `name`.
    pub const fn file(name: &'static str, source: &'static str) -> Shader {
        Shader {
            name: Cow::Borrowed(name),
            text: Text::File(source),
            constants: Cow::Borrowed(&[]),
        }
    }

    /// Its text: a file's as it is, a variant's written now.
    pub fn text(&self) -> Cow<'static, str> {
        match &self.text {
            Text::File(source) => Cow::Borrowed(source),
            Text::Made(write) => Cow::Owned(write()),
        }
    }

    /// A variant of this module, named `{name}_{suffix}`: its text `write` of this one's (written
    /// when a device first uses the name), its constants this one's.
    pub fn variant(
        &self,
        suffix: &str,
        write: impl Fn(&str) -> String + Send + Sync + 'static,
    ) -> Shader {
        let base = self.clone();
        Shader {
            name: Cow::Owned(format!("{}_{suffix}", self.name)),
            text: Text::Made(Arc::new(move || write(&base.text()))),
            constants: self.constants.clone(),
        }
    }

    /// This module with its `override` constants set to `constants` (by name; a bool is 0 or
    /// 1). Its name must already say them: a variant's does.
    pub fn with_constants(self, constants: Vec<(&'static str, f64)>) -> Shader {
        Shader { constants: Cow::Owned(constants), ..self }
    }
}

impl fmt::Debug for Shader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Shader")
            .field("name", &self.name)
            .field("constants", &self.constants)
            .finish()
    }
}

/// What a device keeps of a module: its text, once written, its compiled module (where a
/// dispatch ran it), and per entry point its pipeline and facts.
pub(super) struct Module {
    pub text: Arc<str>,
    pub compiled: Option<wgpu::ShaderModule>,
    pub pipelines: HashMap<&'static str, wgpu::ComputePipeline>,
    pub facts: HashMap<&'static str, EntryFacts>,
}

impl Module {
    pub fn of(shader: &Shader) -> Module {
        Module {
            text: Arc::from(shader.text().as_ref()),
            compiled: None,
            pipelines: HashMap::new(),
            facts: HashMap::new(),
        }
    }
}

/// What an entry point declares, as its launches must match it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct EntryFacts {
    /// Invocations per workgroup (`@workgroup_size`).
    pub invocations: u32,
    /// Bytes of the uniform at binding 0, if it uses one.
    uniform_bytes: Option<u64>,
    /// The storage bindings it uses, in order.
    storage: Vec<u32>,
}

impl EntryFacts {
    pub(crate) fn read(name: &str, text: &str, entry: &str) -> Result<EntryFacts> {
        let invalid = |what: String| GpuError::Validation(format!("{name}::{entry}: {what}"));
        let module =
            naga::front::wgsl::parse_str(text).map_err(|e| invalid(e.emit_to_string(text)))?;
        let info = naga::valid::Validator::new(
            naga::valid::ValidationFlags::empty(),
            naga::valid::Capabilities::all(),
        )
        .validate(&module)
        .map_err(|e| invalid(e.emit_to_string(text)))?;
        let index = module
            .entry_points
            .iter()
            .position(|e| e.name == entry)
            .ok_or_else(|| invalid("no such entry point".into()))?;
        let uses = info.get_entry_point(index);
        let mut facts = EntryFacts {
            invocations: module.entry_points[index].workgroup_size.iter().product(),
            uniform_bytes: None,
            storage: Vec::new(),
        };
        for (handle, var) in module.global_variables.iter() {
            let Some(binding) = &var.binding else { continue };
            if uses[handle].is_empty() {
                continue;
            }
            match var.space {
                naga::AddressSpace::Uniform if binding.binding == 0 => {
                    facts.uniform_bytes =
                        Some(module.types[var.ty].inner.size(module.to_ctx()) as u64)
                }
                naga::AddressSpace::Storage { .. } => facts.storage.push(binding.binding),
                _ => {
                    return Err(invalid(format!(
                        "binding {} is neither the uniform nor storage",
                        binding.binding
                    )))
                }
            }
        }
        facts.storage.sort_unstable();
        Ok(facts)
    }

    /// Refuses a launch whose uniform is not the entry point's (`uniform` bytes, 0 for none) or
    /// whose `storage` bindings are not 1, 2, … as the entry point uses them: a launcher and its
    /// WGSL that have drifted apart.
    pub(crate) fn expect_launch(
        &self,
        shader: &Shader,
        entry: &str,
        uniform: usize,
        storage: usize,
    ) -> Result<()> {
        let uniform_ok = self.uniform_bytes.is_none_or(|b| b == uniform as u64);
        if uniform_ok && self.storage.len() == storage {
            return Ok(());
        }
        Err(GpuError::Validation(format!(
            "{}::{entry} declares a {}-byte uniform and storage bindings {:?}; its launcher passes {uniform} bytes and {storage} storage buffers",
            shader.name,
            self.uniform_bytes.unwrap_or(0),
            self.storage
        )))
    }

    /// The storage bindings it uses, in order: where a launch's buffers go.
    pub(crate) fn storage(&self) -> &[u32] {
        &self.storage
    }
}
