#[test]
fn parse() {
    let source = std::fs::read_to_string("shaders/conv2d.wgsl").unwrap();
    match naga::front::wgsl::parse_str(&source) {
        Err(e) => println!("PARSE: {}", e.emit_to_string(&source)),
        Ok(module) => {
            let r = naga::valid::Validator::new(naga::valid::ValidationFlags::all(), naga::valid::Capabilities::all()).validate(&module);
            match r { Err(e) => println!("VALID: {}", e.emit_to_string(&source)), Ok(_) => println!("OK") }
        }
    }
}
