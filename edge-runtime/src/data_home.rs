//! Where an embedded cluster's data lives when the server runs as another user.
//!
//! As root, Postgres (and Patroni, etcd) run as the unprivileged `postgres` user, who must be
//! able to enter every folder above the data. A project cloned into `/root`, a home folder of
//! mode 0700 or a private temporary folder is closed to that user: there the cluster's folder
//! moves to one of its own under [`OUTSIDE_BASE`], named after the run folder, and the run
//! folder keeps a symbolic link to it. The user's own folders are never opened up.
//! `edge clean --dir` removes a run folder together with the data it links to.

use std::fs;
use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};

/// Where clusters go whose run folder the server's user cannot reach (made by root, 0755).
pub const OUTSIDE_BASE: &str = "/var/lib/edge-postgres";

/// A folder on the way to a path that a user cannot enter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Closed {
    pub folder: PathBuf,
    pub mode: u32,
    pub owner: u32,
}

impl std::fmt::Display for Closed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} (mode {:04o}, owner uid {})",
            self.folder.display(),
            self.mode & 0o7777,
            self.owner
        )
    }
}

/// The first folder on the way to `path` (itself included, as far as it exists) that the user
/// `uid`/`gid` may not enter (no search permission for it). Only the user's primary group is
/// counted, so a folder open to one of its other groups counts as closed: the safe side.
pub fn first_closed(path: &Path, uid: u32, gid: u32) -> Option<Closed> {
    let mut at = PathBuf::new();
    for part in path.components() {
        at.push(part);
        let Ok(meta) = fs::metadata(&at) else {
            // Not made yet: it is made by root with the default mode, open to everyone.
            return None;
        };
        if !meta.is_dir() {
            return None;
        }
        let mode = meta.permissions().mode();
        let bit = if meta.uid() == uid {
            0o100
        } else if meta.gid() == gid {
            0o010
        } else {
            0o001
        };
        if mode & bit == 0 {
            return Some(Closed {
                folder: at,
                mode,
                owner: meta.uid(),
            });
        }
    }
    None
}

/// The folder a cluster kept in `dir` really uses, made if missing. With `run_as` (we are root
/// and the server runs as that user) and `dir` out of that user's reach, a folder of its own
/// under [`OUTSIDE_BASE`] with `dir` a symbolic link to it; otherwise `dir` itself.
/// `holds_data` tells whether a real folder at `dir` already holds a cluster (which is never
/// moved or removed here).
pub fn cluster_home(
    dir: &Path,
    run_as: Option<(u32, u32)>,
    holds_data: impl Fn(&Path) -> bool,
) -> Result<PathBuf, String> {
    let Some((uid, gid)) = run_as else {
        return made(dir);
    };
    if fs::symlink_metadata(dir).is_ok_and(|m| m.file_type().is_symlink()) {
        // Linked out by an earlier run: the data is where the link points.
        let target = fs::read_link(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        return made(&target);
    }
    let absolute = std::path::absolute(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let Some(closed) = first_closed(&absolute, uid, gid) else {
        return made(dir);
    };
    if dir.is_dir() {
        if holds_data(dir) {
            return Err(format!(
                "the cluster in {} cannot be started: its server runs as uid {uid}, which cannot enter {closed}; \
                 move that folder to one the user can reach, or use another run folder (--dir)",
                dir.display()
            ));
        }
        // What a failed start left (a log, empty folders): this run folder's own.
        fs::remove_dir_all(dir).map_err(|e| format!("cannot remove {}: {e}", dir.display()))?;
    }
    let outside = Path::new(OUTSIDE_BASE).join(outside_name(&absolute));
    made(Path::new(OUTSIDE_BASE))?;
    fs::set_permissions(OUTSIDE_BASE, fs::Permissions::from_mode(0o755))
        .map_err(|e| format!("cannot chmod {OUTSIDE_BASE}: {e}"))?;
    let home = made(&outside)?;
    fs::set_permissions(&home, fs::Permissions::from_mode(0o700))
        .map_err(|e| format!("cannot chmod {}: {e}", home.display()))?;
    if let Some(parent) = dir.parent() {
        fs::create_dir_all(parent)
            .map_err(|e| format!("cannot create {}: {e}", parent.display()))?;
    }
    std::os::unix::fs::symlink(&home, dir)
        .map_err(|e| format!("cannot link {} to {}: {e}", dir.display(), home.display()))?;
    eprintln!(
        "edge: {closed} is closed to uid {uid}, which runs Postgres: its data is in {} ({} links to it; `edge clean --dir` removes both)",
        home.display(),
        dir.display()
    );
    Ok(home)
}

/// A throwaway cluster's folder (tests, `edge with-postgres`): `wanted` when the server's user
/// can reach it, else a fresh folder under [`OUTSIDE_BASE`] (the cluster removes it when done).
pub fn throwaway_home(wanted: PathBuf, run_as: Option<(u32, u32)>) -> Result<PathBuf, String> {
    let Some((uid, gid)) = run_as else {
        return Ok(wanted);
    };
    if first_closed(&wanted, uid, gid).is_none() {
        return Ok(wanted);
    }
    let name = wanted
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "cluster".into());
    let _ = fs::remove_dir(&wanted);
    made(Path::new(OUTSIDE_BASE))?;
    made(&Path::new(OUTSIDE_BASE).join(format!("tmp-{name}")))
}

/// Removes a run folder and every cluster folder it links to under [`OUTSIDE_BASE`].
pub fn remove_run_folder(dir: &Path) -> Result<Vec<PathBuf>, String> {
    let mut removed = Vec::new();
    if !dir.exists() && fs::symlink_metadata(dir).is_err() {
        return Ok(removed);
    }
    for entry in fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))? {
        let entry = entry.map_err(|e| format!("{}: {e}", dir.display()))?;
        let path = entry.path();
        let is_link = fs::symlink_metadata(&path).is_ok_and(|m| m.file_type().is_symlink());
        if !is_link {
            continue;
        }
        let target = fs::read_link(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        if target.starts_with(OUTSIDE_BASE) && target.is_dir() {
            fs::remove_dir_all(&target)
                .map_err(|e| format!("cannot remove {}: {e}", target.display()))?;
            removed.push(target);
        }
    }
    fs::remove_dir_all(dir).map_err(|e| format!("cannot remove {}: {e}", dir.display()))?;
    removed.push(dir.to_path_buf());
    Ok(removed)
}

/// `<last two parts of the run path>-<8 hex of its SHA-256>`: readable, and distinct for two
/// projects whose run folders have the same name.
fn outside_name(absolute: &Path) -> String {
    use sha2::{Digest as _, Sha256};
    let parts: Vec<String> = absolute
        .components()
        .rev()
        .take(2)
        .map(|c| {
            c.as_os_str()
                .to_string_lossy()
                .chars()
                .map(|ch| {
                    if ch.is_ascii_alphanumeric() || ch == '-' || ch == '_' {
                        ch
                    } else {
                        '_'
                    }
                })
                .collect()
        })
        .collect();
    let readable: Vec<&str> = parts.iter().rev().map(String::as_str).collect();
    let digest = Sha256::digest(absolute.as_os_str().as_encoded_bytes());
    let hex: String = digest.iter().take(4).map(|b| format!("{b:02x}")).collect();
    format!("{}-{hex}", readable.join("-"))
}

fn made(dir: &Path) -> Result<PathBuf, String> {
    fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    dir.canonicalize()
        .map_err(|e| format!("{}: {e}", dir.display()))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn scratch(label: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "edge-data-home-{label}-{}-{}",
            std::process::id(),
            crate::net::free_port()
        ));
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn a_folder_of_mode_0700_owned_by_another_user_is_closed() {
        let top = scratch("closed");
        let private = top.join("private");
        fs::create_dir_all(private.join("project/.run")).unwrap();
        fs::set_permissions(&private, fs::Permissions::from_mode(0o700)).unwrap();
        let me = fs::metadata(&private).unwrap().uid();
        let other = me.wrapping_add(4242);
        let closed = first_closed(&private.join("project/.run/demo"), other, other).unwrap();
        assert_eq!(closed.folder, private);
        assert_eq!(closed.mode & 0o777, 0o700);
        // Its owner may enter it; so may anyone once it is 0711.
        assert_eq!(first_closed(&private.join("project"), me, me), None);
        fs::set_permissions(&private, fs::Permissions::from_mode(0o711)).unwrap();
        assert_eq!(first_closed(&private.join("project"), other, other), None);
        fs::remove_dir_all(&top).unwrap();
    }

    #[test]
    fn names_outside_are_readable_and_distinct() {
        let a = outside_name(Path::new("/root/x/.run/demo/postgres"));
        let b = outside_name(Path::new("/root/y/.run/demo/postgres"));
        assert!(a.starts_with("demo-postgres-"), "{a}");
        assert_ne!(a, b);
        assert_eq!(a.len(), "demo-postgres-".len() + 8);
    }
}
