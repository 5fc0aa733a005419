//! Placeholder: filled in by the sgd work.
