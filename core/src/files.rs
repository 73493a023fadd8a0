//! Reading the files users hand us: regular files only (a FIFO would block forever, a
//! device never end), never more than a stated bound, and errors that name the file.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

/// The largest JSON or text file read whole (configs, indexes, tokenizers, scenarios).
pub const MAX_TEXT_BYTES: u64 = 256 << 20;

/// A file that could not be used, and why (one line that starts with the path).
#[derive(Debug, thiserror::Error)]
#[error("{}: {reason}", path.display())]
pub struct FileError {
    /// The file.
    pub path: PathBuf,
    /// Why, without the path.
    pub reason: String,
}

fn err(path: &Path, reason: impl std::fmt::Display) -> FileError {
    FileError {
        path: path.to_path_buf(),
        reason: reason.to_string(),
    }
}

/// Opens `path` if it is a regular file (after following symlinks); returns it and its size.
pub fn open_regular(path: &Path) -> Result<(File, u64), FileError> {
    let meta = std::fs::metadata(path).map_err(|e| err(path, e))?;
    if !meta.is_file() {
        let what = if meta.is_dir() {
            "a directory"
        } else {
            "not a regular file"
        };
        return Err(err(path, format!("{what}; expected a regular file")));
    }
    let file = File::open(path).map_err(|e| err(path, e))?;
    Ok((file, meta.len()))
}

/// The text of regular file `path`, refused when larger than `max` bytes.
pub fn read_text(path: &Path, max: u64) -> Result<String, FileError> {
    let (file, len) = open_regular(path)?;
    if len > max {
        return Err(err(
            path,
            format!("{len} bytes is above the limit of {max}"),
        ));
    }
    let mut text = String::new();
    // Bounded again in case the file grows while read.
    file.take(max)
        .read_to_string(&mut text)
        .map_err(|e| err(path, e))?;
    Ok(text)
}

/// `dir/name` for a file a package lists (a shard in an index), refused unless it stays
/// inside `dir`: a plain relative path, no `..`, and no symlink leading out.
pub fn inside(dir: &Path, name: &str) -> Result<PathBuf, FileError> {
    use std::path::Component;
    let rel = Path::new(name);
    if name.is_empty() || !rel.components().all(|c| matches!(c, Component::Normal(_))) {
        return Err(err(
            &dir.join(name),
            format!("'{name}' is not a file name inside the model directory"),
        ));
    }
    let path = dir.join(rel);
    if let (Ok(real), Ok(root)) = (path.canonicalize(), dir.canonicalize()) {
        if !real.starts_with(&root) {
            return Err(err(
                &path,
                format!("leads outside the model directory (to {})", real.display()),
            ));
        }
    }
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_bounded_regular_files_are_read() {
        let dir = std::env::temp_dir().join(format!("kvplug-files-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("a.json");
        std::fs::write(&f, "{}").unwrap();
        assert_eq!(read_text(&f, 2).unwrap(), "{}");
        let e = read_text(&f, 1).unwrap_err().to_string();
        assert!(
            e.ends_with("a.json: 2 bytes is above the limit of 1"),
            "{e}"
        );
        let e = read_text(&dir, 10).unwrap_err().to_string();
        assert!(e.contains("a directory; expected a regular file"), "{e}");
        let e = read_text(Path::new("/dev/zero"), 10)
            .unwrap_err()
            .to_string();
        assert_eq!(e, "/dev/zero: not a regular file; expected a regular file");
        let e = read_text(&dir.join("missing.json"), 10)
            .unwrap_err()
            .to_string();
        assert!(e.contains("missing.json: No such file"), "{e}");

        assert_eq!(inside(&dir, "a.json").unwrap(), dir.join("a.json"));
        for bad in ["/etc/passwd", "../a.json", "x/../../a.json", "", "./a.json"] {
            let e = inside(&dir, bad).unwrap_err().to_string();
            assert!(e.contains("not a file name inside"), "{bad}: {e}");
        }
        #[cfg(unix)]
        {
            std::os::unix::fs::symlink("/etc/hostname", dir.join("out.json")).unwrap();
            let e = inside(&dir, "out.json").unwrap_err().to_string();
            assert!(e.contains("leads outside the model directory"), "{e}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
