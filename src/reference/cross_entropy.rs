//! Placeholder: filled in by the cross_entropy work.
