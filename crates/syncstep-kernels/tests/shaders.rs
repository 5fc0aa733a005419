//! Every shader, as the launchers compile it (the pairwise prelude and its files joined),
//! parses and validates with naga: no GPU needed, so a shader typo fails here first with a
//! readable message rather than as a pipeline error at run time.

use std::path::{Path, PathBuf};

use syncstep_kernels::base_shaders;

#[test]
fn every_shader_parses_and_validates() {
    let mut failures = Vec::new();
    for shader in base_shaders() {
        let text = shader.text();
        let module = match naga::front::wgsl::parse_str(&text) {
            Ok(m) => m,
            Err(e) => {
                failures.push(e.emit_to_string_with_path(&text, &shader.name));
                continue;
            }
        };
        // Browsers give no f64, f16 or subgroups by default: validate against WebGPU's core set.
        let mut validator = naga::valid::Validator::new(
            naga::valid::ValidationFlags::all(),
            naga::valid::Capabilities::empty(),
        );
        if let Err(e) = validator.validate(&module) {
            failures.push(e.emit_to_string_with_path(&text, &shader.name));
        }
        assert!(!module.entry_points.is_empty(), "{} has no entry point", shader.name);
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Every .wgsl file under `dir`, at any depth.
fn wgsl_files(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files.extend(wgsl_files(&path));
        } else if path.extension().is_some_and(|e| e == "wgsl") {
            files.push(path);
        }
    }
    files
}

#[test]
fn every_wgsl_file_is_in_a_shader() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("shaders");
    let files = wgsl_files(&dir);
    assert!(files.len() >= 10, "only {} .wgsl files under {}", files.len(), dir.display());
    let shaders = base_shaders();
    for path in files {
        let source = std::fs::read_to_string(&path).unwrap();
        assert!(
            shaders.iter().any(|s| s.text().contains(&source)),
            "{} is in no shader the launchers compile",
            path.display()
        );
    }
}

#[test]
fn shader_files_use_no_atomics() {
    // Float accumulation must be in a fixed order (determinism) and browsers have no f32 atomics.
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("shaders");
    for path in wgsl_files(&dir) {
        let source = std::fs::read_to_string(&path).unwrap();
        // Code only: the comments say "no atomics".
        let code: String = source
            .lines()
            .map(|l| l.split("//").next().unwrap_or(""))
            .collect::<Vec<_>>()
            .join("\n");
        assert!(!code.contains("atomic"), "{} uses atomics", path.display());
    }
}
