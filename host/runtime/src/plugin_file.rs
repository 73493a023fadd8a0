//! Checks on a file named like a plugin before the dynamic loader sees it, and the open
//! itself. `dlopen` maps every loadable segment a header names, even past the end of a
//! truncated file, and touching such a page kills the process with SIGBUS; a library whose
//! symbols bind lazily dies at its first call to a missing one. So a candidate must be a
//! regular file, parse as this platform's object format (the `object` crate), have every
//! loadable segment inside the file, and resolve all its symbols when opened (`RTLD_NOW`).

use std::path::Path;

/// The largest file considered a plugin (a release kvplug plugin is a few MiB).
pub const MAX_PLUGIN_BYTES: u64 = 512 << 20;

/// Why a directory entry named like a plugin is not a loadable file, if it is not.
pub fn not_a_regular_file(path: &Path) -> Option<String> {
    let link = std::fs::symlink_metadata(path).ok()?;
    match std::fs::metadata(path) {
        Ok(m) if m.is_file() => None,
        Ok(m) => Some(format!("not a regular file ({})", kind(&m.file_type()))),
        Err(e) if link.file_type().is_symlink() => Some(format!("unusable symlink: {e}")),
        Err(e) => Some(format!("cannot stat: {e}")),
    }
}

fn kind(t: &std::fs::FileType) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if t.is_fifo() {
            return "a FIFO";
        }
        if t.is_socket() {
            return "a socket";
        }
        if t.is_block_device() || t.is_char_device() {
            return "a device";
        }
    }
    if t.is_dir() {
        "a directory"
    } else {
        "not a file"
    }
}

/// Checks that `path` (a regular file) is a whole object file of a kind this host loads.
pub fn check_object(path: &Path) -> Result<(), String> {
    use object::{Object, ObjectSegment};
    let file = std::fs::File::open(path).map_err(|e| format!("cannot open: {e}"))?;
    let len = file
        .metadata()
        .map_err(|e| format!("cannot stat: {e}"))?
        .len();
    if len > MAX_PLUGIN_BYTES {
        return Err(format!(
            "{len} bytes is larger than any plugin (limit {MAX_PLUGIN_BYTES})"
        ));
    }
    let mut bytes = Vec::new();
    std::io::Read::read_to_end(&mut std::io::Read::take(file, len), &mut bytes)
        .map_err(|e| format!("cannot read: {e}"))?;
    let obj = object::File::parse(&*bytes)
        .map_err(|e| format!("not a loadable object file ({e}); truncated or corrupt?"))?;
    let native = if cfg!(target_os = "macos") {
        object::BinaryFormat::MachO
    } else if cfg!(windows) {
        object::BinaryFormat::Pe
    } else {
        object::BinaryFormat::Elf
    };
    if obj.format() != native {
        return Err(format!(
            "a {:?} file, not a {native:?} library",
            obj.format()
        ));
    }
    if let Some(host) = host_architecture() {
        if obj.architecture() != host {
            return Err(format!(
                "built for another architecture ({:?}); this host is {}",
                obj.architecture(),
                std::env::consts::ARCH
            ));
        }
    }
    for seg in obj.segments() {
        let (offset, size) = seg.file_range();
        if offset.checked_add(size).is_none_or(|end| end > len) {
            return Err(format!(
                "truncated: a loadable segment spans bytes {offset}..{} of a {len}-byte file",
                offset.saturating_add(size)
            ));
        }
    }
    Ok(())
}

/// This process's architecture, as object files name it (None where not mapped).
fn host_architecture() -> Option<object::Architecture> {
    use object::Architecture as A;
    match std::env::consts::ARCH {
        "x86_64" => Some(A::X86_64),
        "aarch64" => Some(A::Aarch64),
        "x86" => Some(A::I386),
        "arm" => Some(A::Arm),
        "riscv64" => Some(A::Riscv64),
        _ => None,
    }
}

/// Opens `path` binding every symbol now (`RTLD_NOW | RTLD_LOCAL` on Unix), so a missing
/// symbol is refused here, by name. The returned handle keeps the library loaded; opening
/// the same path again (as abi_stable does) shares it.
pub fn open_now(path: &Path) -> Result<libloading::Library, String> {
    #[cfg(unix)]
    let lib = {
        use libloading::os::unix::{Library, RTLD_LOCAL, RTLD_NOW};
        // SAFETY: loading runs the library's initialisers; the file passed `check_object`,
        // and running plugin code is what loading a plugin means.
        unsafe { Library::open(Some(path), RTLD_NOW | RTLD_LOCAL) }.map(Into::into)
    };
    #[cfg(not(unix))]
    // SAFETY: as above.
    let lib = unsafe { libloading::Library::new(path) };
    lib.map_err(|e| format!("cannot be opened as a shared library: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_test_binary_is_a_whole_object_and_a_cut_copy_is_not() {
        let exe = std::env::current_exe().unwrap();
        check_object(&exe).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let bytes = std::fs::read(&exe).unwrap();
        for cut in [1_000, 100_000, bytes.len() / 2] {
            let p = dir.path().join(format!("cut{cut}.so"));
            std::fs::write(&p, &bytes[..cut]).unwrap();
            let e = check_object(&p).unwrap_err();
            assert!(e.contains("truncated"), "{cut}: {e}");
        }
        // The same file claiming another machine (ELF e_machine, bytes 18..20).
        let mut other = bytes.clone();
        let machine = if cfg!(target_arch = "aarch64") {
            62u16
        } else {
            183
        };
        other[18..20].copy_from_slice(&machine.to_le_bytes());
        let p = dir.path().join("other.so");
        std::fs::write(&p, &other).unwrap();
        let e = check_object(&p).unwrap_err();
        assert!(e.contains("built for another architecture"), "{e}");
        let text = dir.path().join("text.so");
        std::fs::write(&text, "not a library").unwrap();
        assert!(check_object(&text)
            .unwrap_err()
            .contains("not a loadable object"));
        assert_eq!(not_a_regular_file(&text), None);
        assert!(not_a_regular_file(dir.path())
            .unwrap()
            .contains("a directory"));
    }
}
