//! Placeholder: filled in by the dense work.
