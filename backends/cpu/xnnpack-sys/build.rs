//! Generates bindings to the system `xnnpack.h` and links `-lXNNPACK -lpthreadpool`.
//! Needs `libxnnpack-dev libpthreadpool-dev libclang-dev` (scripts/install-deps.sh). Off
//! Linux (no distribution package) it binds nothing and links nothing: the crate is empty
//! there, and `kvplug-cpu` does not use it.

fn main() {
    println!("cargo:rerun-if-changed=wrapper.h");
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR").unwrap()).join("bindings.rs");
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() != Ok("linux") {
        std::fs::write(out, "").expect("writing empty bindings");
        return;
    }
    println!("cargo:rustc-link-lib=XNNPACK");
    println!("cargo:rustc-link-lib=pthreadpool");
    let bindings = bindgen::Builder::default()
        .header("wrapper.h")
        .allowlist_function("xnn_(initialize|deinitialize|create_fully_connected_nc_f32|setup_fully_connected_nc_f32|run_operator|delete_operator)")
        .allowlist_var("XNN_FLAG_TRANSPOSE_WEIGHTS")
        .allowlist_type("xnn_status")
        // A newtype, not a Rust enum: a status value a later XNNPACK adds must not be UB.
        .newtype_enum("xnn_status")
        .generate()
        .unwrap_or_else(|e| {
            panic!("bindgen over xnnpack.h failed ({e}); install libxnnpack-dev libpthreadpool-dev libclang-dev (scripts/install-deps.sh)")
        });
    bindings.write_to_file(out).expect("writing bindings");
}
