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

/// Writes `bytes` to `path` atomically: a temporary file in the same directory, written and
/// fsynced, renamed over `path`, then the directory fsynced. A crash leaves either the old
/// file or the new one, never a torn one; a failure removes the temporary file.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), FileError> {
    use std::io::Write;
    write_atomic_with(path, |f| f.write_all(bytes))
}

/// [`write_atomic`] for content written in pieces: `write` fills the temporary file (it may
/// seek back and patch what it wrote), which is then synced and renamed over `path`.
pub fn write_atomic_with(
    path: &Path,
    write: impl FnOnce(&mut File) -> std::io::Result<()>,
) -> Result<(), FileError> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let name = path
        .file_name()
        .ok_or_else(|| err(path, "not a file path"))?
        .to_string_lossy();
    let tmp = dir.join(format!(".{name}{TMP_MARK}{}", std::process::id()));
    let written = (|| -> std::io::Result<()> {
        let mut f = File::create(&tmp)?;
        write(&mut f)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)?;
        // The rename is durable once the directory is.
        File::open(dir)?.sync_all()
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(err(path, format!("writing: {e}")));
    }
    Ok(())
}

/// What [`write_atomic`]'s temporary files carry between the file name and the writer's pid.
const TMP_MARK: &str = ".tmp-";

/// Removes the temporary files [`write_atomic`] left in `dir` when its writer died before the
/// rename (a crash, `kill -9`): `.NAME.tmp-PID` whose process no longer exists. A live
/// writer's stay, and so does everything where liveness cannot be told (no `/proc`). Returns
/// each removed file and its size.
pub fn remove_stale_temporaries(dir: &Path) -> Vec<(PathBuf, u64)> {
    let proc = Path::new("/proc");
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    if !proc.join("self").exists() {
        return Vec::new();
    }
    let mut removed = Vec::new();
    for e in entries.filter_map(|e| e.ok()) {
        let name = e.file_name();
        let Some(pid) = name
            .to_str()
            .filter(|n| n.starts_with('.'))
            .and_then(|n| n.rsplit_once(TMP_MARK))
            .and_then(|(_, pid)| pid.parse::<u32>().ok())
        else {
            continue;
        };
        let alive = pid == std::process::id() || proc.join(pid.to_string()).exists();
        let file = e.metadata().ok().filter(|m| m.is_file());
        if let (false, Some(meta)) = (alive, file) {
            if std::fs::remove_file(e.path()).is_ok() {
                removed.push((e.path(), meta.len()));
            }
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_dead_writers_temporaries_are_removed() {
        let dir = std::env::temp_dir().join(format!("kvplug-sweep-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        let names = [
            format!(".a.kvsession.safetensors.tmp-{dead}"),
            format!(".b.kvsession.safetensors.tmp-{}", std::process::id()),
            ".c.kvsession.safetensors.tmp-1".to_string(), // init: alive
            format!("d.tmp-{dead}"),                      // not hidden: not ours
            "e.kvsession.safetensors".to_string(),
        ];
        for n in &names {
            std::fs::write(dir.join(n), b"1234").unwrap();
        }
        let removed = remove_stale_temporaries(&dir);
        assert_eq!(removed, vec![(dir.join(&names[0]), 4)]);
        for n in &names[1..] {
            assert!(dir.join(n).exists(), "{n}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

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

    #[test]
    fn atomic_writes_replace_whole_files_and_leave_no_temporary() {
        let dir = std::env::temp_dir().join(format!("kvplug-atomic-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("s.safetensors");
        write_atomic(&f, b"first").unwrap();
        write_atomic(&f, b"second").unwrap();
        assert_eq!(std::fs::read(&f).unwrap(), b"second");
        let names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("s.safetensors")]);
        let e = write_atomic(&dir.join("missing/x"), b"x")
            .unwrap_err()
            .to_string();
        assert!(e.contains("missing/x: writing"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
