//! Placeholder: filled in by the batchnorm work.
