//! Every WGSL file parses and validates with naga: no GPU needed, so a shader typo fails here
//! first with a readable message rather than as a pipeline error at run time.

use std::path::Path;

#[test]
fn every_wgsl_file_parses_and_validates() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("shaders");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .expect("shaders/ exists")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "wgsl"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no .wgsl files in {}", dir.display());
    let mut failures = Vec::new();
    for path in &files {
        let source = std::fs::read_to_string(path).unwrap();
        let name = path.file_name().unwrap().to_string_lossy();
        let module = match naga::front::wgsl::parse_str(&source) {
            Ok(m) => m,
            Err(e) => {
                failures.push(e.emit_to_string_with_path(&source, &name));
                continue;
            }
        };
        // Browsers give no f64, f16 or subgroups by default: validate against WebGPU's core set.
        let mut validator = naga::valid::Validator::new(
            naga::valid::ValidationFlags::all(),
            naga::valid::Capabilities::empty(),
        );
        if let Err(e) = validator.validate(&module) {
            failures.push(e.emit_to_string_with_path(&source, &name));
        }
        assert!(!module.entry_points.is_empty(), "{name} has no entry point");
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn shader_files_use_no_atomics() {
    // Float accumulation must be in a fixed order (determinism) and browsers have no f32 atomics.
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("shaders");
    for e in std::fs::read_dir(dir).unwrap() {
        let path = e.unwrap().path();
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
