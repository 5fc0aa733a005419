//! The user's files: what a command will write is checked before any work, and every write
//! either replaces a regular file whole or goes in place to a pipe, a terminal or the command's
//! own standard output.
//!
//! An existing file at an output path is replaced only when it is of the output's kind, told by
//! its content ([`Kind`]: a checkpoint replaces a checkpoint, never a photo), or with
//! `--overwrite`; never when it is one of the command's own inputs, and never when its mode bits
//! do not let this user write it (honoured as root too). A replacement keeps the old file's
//! mode and, where the system lets it, its owner. While a command runs it holds an advisory
//! lock on each output, so that a second run writing the same file is refused.
//!
//! A replacement is atomic: a temporary file beside the output (the `tempfile` crate's: created
//! afresh, removed on every error path) is written, synced and renamed over it, so a failed or
//! interrupted write leaves the old file whole. Its name holds the writer's process id, so that
//! one a killed run left behind (a kill runs no clean-up) is removed by the next write to the
//! same place. A pipe, a terminal, a character device, or the file the command's standard output
//! or error goes to (`/dev/stdout`, a shell's `>`) is written in place, after what is there:
//! a rename would put a new file where the shell's was, and lose what the command printed.
//! Native only: a browser has no file system.

mod error;
mod input;
#[cfg(unix)]
mod lock;
mod output;
mod place;
#[cfg(test)]
mod tests;
mod write;

pub use error::{FileError, Refusal, Result};
pub use input::{open_input, read_input};
pub use output::{check_output, Claim, Kind};
pub use place::{resolved, writes_in_place};
pub use write::{open_in_place, write_atomic};
