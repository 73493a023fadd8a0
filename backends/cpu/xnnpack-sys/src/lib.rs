//! Raw bindgen bindings to the system XNNPACK: initialisation and the f32 fully-connected
//! operator. Safe wrappers live in the `kvplug-cpu` crate.
#![allow(
    non_upper_case_globals,
    non_camel_case_types,
    non_snake_case,
    missing_docs
)]

include!(concat!(env!("OUT_DIR"), "/bindings.rs"));
