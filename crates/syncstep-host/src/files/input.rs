//! The files a command reads: opened only when they are regular files.

use std::fs::File;
use std::path::Path;

/// Opens `path` for reading, after refusing what is not a regular file: opening a pipe blocks
/// until something writes to it, and a device may never end.
pub fn open_input(path: &Path) -> std::io::Result<File> {
    if !std::fs::metadata(path)?.is_file() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "not a regular file (a folder, a pipe or a device): give a file",
        ));
    }
    File::open(path)
}

/// The bytes of the file at `path`, read as [`open_input`] opens it.
pub fn read_input(path: &Path) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let mut bytes = Vec::new();
    open_input(path)?.read_to_end(&mut bytes)?;
    Ok(bytes)
}
