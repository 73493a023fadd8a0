//! Placeholder: filled by a later issue. Exports nothing yet.
