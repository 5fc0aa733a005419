//! Shader modules: a file of shaders/ as written, or a variant made from one by code, and each
//! device's cache of them (their text, compiled module, pipelines and entry points' facts).

use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

/// A WGSL module: a file of shaders/ as written ([`Shader::file`]), or a variant made from one
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
    pub facts: HashMap<&'static str, super::encoder::EntryFacts>,
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
