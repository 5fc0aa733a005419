//! Placeholder: filled in by the avgpool work.
