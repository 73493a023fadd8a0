//! Where named sessions live: `NAME.kvsession.safetensors` files in one directory.
//!
//! The directory is `--session-dir`, else `$KVPLUG_SESSION_DIR`, else
//! `$XDG_DATA_HOME/kvplug/sessions`, else `~/.local/share/kvplug/sessions`. Names are 1 to 128
//! characters from `A-Z a-z 0-9 . _ -`, not starting with a dot, so a name never leaves the
//! directory.

use std::path::{Path, PathBuf};

use crate::error::{fail, Context, Result};

use crate::session_file::{self, Summary, EXTENSION};

/// The session directory.
pub struct SessionDir {
    dir: PathBuf,
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
        std::fs::create_dir_all(&self.dir)
            .with_context(|| format!("creating {}", self.dir.display()))?;
        Ok(path)
    }

    /// Every session, by name (an empty list when the directory does not exist).
    pub fn list(&self) -> Result<Vec<Listed>> {
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

    /// Deletes session `name`; an error when there is none.
    pub fn remove(&self, name: &str) -> Result<()> {
        let path = self.path(name)?;
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
