//! Where named sessions live: `NAME.kvsession.safetensors` files in one directory.
//!
//! The directory is `--session-dir`, else `$KVPLUG_SESSION_DIR`, else
//! `$XDG_DATA_HOME/kvplug/sessions`, else `~/.local/share/kvplug/sessions`. Names are 1 to 128
//! characters from `A-Z a-z 0-9 . _ -`, not starting with a dot, so a name never leaves the
//! directory. Hidden files are the directory's own: `.NAME.lock` (held by the process using
//! session NAME, see [`SessionDir::lock`]) and the temporaries of atomic writes, which
//! [`SessionDir::sweep`] removes once their writer is dead.

use std::path::{Path, PathBuf};

use crate::error::{fail, Context, Result};

use crate::session_file::{self, Summary, EXTENSION};

/// The session directory.
pub struct SessionDir {
    dir: PathBuf,
}

/// Takes an exclusive advisory lock on `file` without waiting: `Ok(false)` when another open
/// file holds it. (`File::try_lock` needs Rust 1.89, above this workspace's MSRV.)
#[cfg(unix)]
fn try_lock(file: &std::fs::File) -> std::io::Result<bool> {
    use std::os::fd::AsRawFd;
    // SAFETY: flock on a descriptor this function borrows.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
        return Ok(true);
    }
    match std::io::Error::last_os_error() {
        e if e.kind() == std::io::ErrorKind::WouldBlock => Ok(false),
        e => Err(e),
    }
}

/// Where advisory locks are not implemented, a session is never reported in use.
#[cfg(not(unix))]
fn try_lock(_: &std::fs::File) -> std::io::Result<bool> {
    Ok(true)
}

/// A session held by this process ([`SessionDir::lock`]) until dropped.
#[derive(Debug)]
pub struct SessionLock {
    _file: std::fs::File,
}

/// One listed session.
#[derive(Debug, serde::Serialize)]
pub struct Listed {
    /// Its name.
    pub name: String,
    /// The header, or why it could not be read.
    pub summary: Result<Summary, String>,
}

impl SessionDir {
    /// `explicit`, or the default location (see the module docs).
    pub fn standard(explicit: Option<&Path>) -> Self {
        let env = |k: &str| {
            std::env::var_os(k)
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
        };
        let dir = explicit
            .map(Path::to_path_buf)
            .or_else(|| env("KVPLUG_SESSION_DIR"))
            .or_else(|| env("XDG_DATA_HOME").map(|d| d.join("kvplug/sessions")))
            .or_else(|| env("HOME").map(|h| h.join(".local/share/kvplug/sessions")))
            .unwrap_or_else(|| PathBuf::from(".kvplug-sessions"));
        SessionDir { dir }
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The file of session `name` (which need not exist), refused for a bad name.
    pub fn path(&self, name: &str) -> Result<PathBuf> {
        let ok = (1..=128).contains(&name.len())
            && !name.starts_with('.')
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
        if !ok {
            fail!(Invalid, "'{name}' is not a session name (1-128 of A-Z a-z 0-9 . _ -, not starting with '.')");
        }
        Ok(self.dir.join(format!("{name}.{EXTENSION}")))
    }

    /// The path for writing session `name`, creating the directory if needed.
    pub fn path_for_write(&self, name: &str) -> Result<PathBuf> {
        let path = self.path(name)?;
        if self.dir.exists() && !self.dir.is_dir() {
            fail!(
                Invalid,
                "the session directory {} is not a directory (--session-dir names one)",
                self.dir.display()
            );
        }
        std::fs::create_dir_all(&self.dir)
            .with_context(|| format!("creating {}", self.dir.display()))?;
        Ok(path)
    }

    /// Removes what writers that died mid-save left (see
    /// [`kvplug_core::files::remove_stale_temporaries`]), each logged; returns the files and
    /// their sizes. Listing and removing sessions sweep first.
    pub fn sweep(&self) -> Vec<(PathBuf, u64)> {
        let removed = kvplug_core::files::remove_stale_temporaries(&self.dir);
        for (path, bytes) in &removed {
            tracing::info!(path = %path.display(), bytes, "removed a crashed writer's temporary file");
        }
        removed
    }

    /// Holds session `name` for this process until the lock is dropped (an advisory lock on
    /// `.NAME.lock`, released by the kernel if the process dies): two processes using one
    /// session would each overwrite the other's turns. Another holder is an error naming it.
    pub fn lock(&self, name: &str) -> Result<SessionLock> {
        self.path_for_write(name)?;
        let path = self.dir.join(format!(".{name}.lock"));
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .with_context(|| format!("opening {}", path.display()))?;
        if !try_lock(&file).with_context(|| format!("locking {}", path.display()))? {
            let mut holder = String::new();
            let _ = std::io::Read::read_to_string(&mut file, &mut holder);
            let holder = holder.trim();
            let by = if holder.is_empty() {
                String::new()
            } else {
                format!(" (pid {holder})")
            };
            fail!(Invalid, "session '{name}' is in use by another process{by}: wait for it to end, or use another name");
        }
        use std::io::{Seek, Write};
        let _ = file.set_len(0);
        let _ = file.rewind();
        let _ = write!(file, "{}", std::process::id());
        Ok(SessionLock { _file: file })
    }

    /// Every session, by name (an empty list when the directory does not exist).
    pub fn list(&self) -> Result<Vec<Listed>> {
        self.sweep();
        let entries = match std::fs::read_dir(&self.dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(e).with_context(|| format!("listing {}", self.dir.display())),
        };
        let suffix = format!(".{EXTENSION}");
        let mut out: Vec<Listed> = entries
            .filter_map(|e| e.ok())
            .filter_map(|e| {
                let name = e.file_name().to_str()?.strip_suffix(&suffix)?.to_string();
                (!name.starts_with('.')).then_some((name, e.path()))
            })
            .map(|(name, path)| Listed {
                name,
                summary: session_file::summary(&path).map_err(|e| e.to_string()),
            })
            .collect();
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    /// Deletes session `name`; an error when there is none or another process uses it.
    pub fn remove(&self, name: &str) -> Result<()> {
        let path = self.path(name)?;
        self.sweep();
        let _held = self.lock(name)?;
        let _ = std::fs::remove_file(self.dir.join(format!(".{name}.lock")));
        std::fs::remove_file(&path)
            .with_context(|| format!("no session '{name}' in {}", self.dir.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_stay_inside_the_directory() {
        let d = SessionDir::standard(Some(Path::new("/tmp/s")));
        assert_eq!(
            d.path("agent-1.v2").unwrap(),
            Path::new("/tmp/s/agent-1.v2.kvsession.safetensors")
        );
        for bad in ["", ".hidden", "../x", "a/b", "a b", &"x".repeat(129)] {
            assert!(d.path(bad).is_err(), "{bad:?} accepted");
        }
    }
}
