//! Placeholder: filled in by the maxpool work.
