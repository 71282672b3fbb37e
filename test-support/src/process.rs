//! Processes as the tests see them: [`edge_runtime::process`], and the process tree and pipes
//! only tests look at.

use std::process::Command;

pub use edge_runtime::process::*;

/// The processes whose parent is `pid` (from `/proc`): a postmaster's backends and workers.
pub fn children_of(pid: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|child| parent_of(*child) == Some(pid))
        .collect()
}

/// The parent of `pid`, from `/proc/<pid>/stat` (the field after the command's closing `)`).
fn parent_of(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after_command = &stat[stat.rfind(')')? + 1..];
    after_command.split_whitespace().nth(1)?.parse().ok()
}

/// Runs `program` with `input` on its stdin and returns its stdout, or why it failed.
pub fn run_with_stdin(program: &str, args: &[&str], input: &[u8]) -> Result<Vec<u8>, String> {
    use std::io::Write;
    use std::process::Stdio;
    let mut child = Command::new(program)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run {program}: {e}"))?;
    child
        .stdin
        .take()
        .ok_or_else(|| format!("{program}: no stdin"))?
        .write_all(input)
        .map_err(|e| format!("cannot write to {program}: {e}"))?;
    let out = child
        .wait_with_output()
        .map_err(|e| format!("{program} did not finish: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{program} {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(out.stdout)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn a_child_is_found_under_its_parent() {
        let mut child = ChildGuard::spawn("sleep", Command::new("sleep").arg("30")).unwrap();
        let pid = child.pid().unwrap();
        assert!(children_of(std::process::id()).contains(&pid));
        child.kill();
    }
}
