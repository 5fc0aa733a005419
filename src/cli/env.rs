//! This process's environment ([`syncstep::environment`]), read once before any device is made.

use std::sync::OnceLock;

use syncstep::environment::Environment;

static ENVIRONMENT: OnceLock<Environment> = OnceLock::new();

/// Reads and checks the environment; the first error names the variable.
pub fn init() -> Result<(), syncstep::environment::VariableError> {
    let environment = Environment::read(|name| std::env::var_os(name))?;
    let _ = ENVIRONMENT.set(environment);
    Ok(())
}

/// The environment [`init`] read (read now, with defaults for what does not parse, where it was
/// not: in the tests of single functions).
pub fn get() -> &'static Environment {
    ENVIRONMENT.get_or_init(|| {
        Environment::read(|name| std::env::var_os(name)).unwrap_or_else(|_| Environment::default())
    })
}
