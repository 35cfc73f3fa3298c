//! Placement files, shared by `conveyor plan --placement` and `conveyor train --placement`: one
//! line per stage, node names or ranges `first..last` separated by whitespace; blank lines and
//! `#` comments are skipped.
use std::path::Path;

use super::usage;

/// Reads a placement file into one list of node names (or `a..b` ranges) per stage.
pub fn read_placement_file(path: &Path) -> anyhow::Result<Vec<Vec<String>>> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| usage(format!("--placement {}: {e}; give `auto` or a readable placement file", path.display())))?;
    let stages: Vec<Vec<String>> = text
        .lines()
        .map(|line| line.split('#').next().unwrap_or_default())
        .filter(|line| !line.trim().is_empty())
        .map(|line| line.split_whitespace().map(str::to_string).collect())
        .collect();
    if stages.is_empty() {
        return Err(usage(format!(
            "--placement {}: the file lists no stages; write one line per stage with its node names",
            path.display()
        )));
    }
    Ok(stages)
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;

    #[test]
    fn placement_file_skips_comments_and_blank_lines() {
        let path: PathBuf = std::env::temp_dir().join(format!("conveyor-placement-unit-{}.txt", std::process::id()));
        std::fs::write(&path, "# two stages\n0..2  3\n\n4 # the head\n").unwrap();
        let stages = read_placement_file(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(stages, vec![vec!["0..2".to_string(), "3".to_string()], vec!["4".to_string()]]);
    }
}
