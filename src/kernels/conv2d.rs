//! Placeholder: filled in by the conv2d work.
