//! Placement files, shared by `conveyor plan --placement` and `conveyor train --placement`: one
//! line per stage, node names or ranges `first..last` separated by whitespace; blank lines and
//! `#` comments are skipped.
use std::io::Read;
use std::path::Path;

use super::{UsageError, usage};
use crate::limits::{MAX_PLACEMENT_FILE_BYTES, MAX_STAGES};

/// Reads a placement file (at most [`MAX_PLACEMENT_FILE_BYTES`]) into one list of node names (or
/// `a..b` ranges) per stage.
pub fn read_placement_file(path: &Path) -> Result<Vec<Vec<String>>, UsageError> {
    let unreadable = |e: std::io::Error| {
        usage(format!("--placement {}: {e}; give `auto` or a readable placement file", path.display()))
    };
    let file = std::fs::File::open(path).map_err(unreadable)?;
    let mut bytes = Vec::new();
    file.take(MAX_PLACEMENT_FILE_BYTES + 1).read_to_end(&mut bytes).map_err(unreadable)?;
    if bytes.len() as u64 > MAX_PLACEMENT_FILE_BYTES {
        return Err(usage(format!(
            "--placement {}: the file is over the limit of {MAX_PLACEMENT_FILE_BYTES} bytes \
             (MAX_PLACEMENT_FILE_BYTES); a placement file has one short line per stage",
            path.display()
        )));
    }
    let text = String::from_utf8(bytes).map_err(|e| {
        usage(format!("--placement {}: not UTF-8 text ({e}); write one line of node names per stage", path.display()))
    })?;
    parse_placement(&text, &path.display().to_string())
}

/// Parses the text of a placement file; `source` names it in errors.
pub fn parse_placement(text: &str, source: &str) -> Result<Vec<Vec<String>>, UsageError> {
    let stages: Vec<Vec<String>> = text
        .lines()
        .map(|line| line.split('#').next().unwrap_or_default())
        .filter(|line| !line.trim().is_empty())
        .map(|line| line.split_whitespace().map(str::to_string).collect())
        .collect();
    if stages.is_empty() {
        return Err(usage(format!(
            "--placement {source}: the file lists no stages; write one line per stage with its node names"
        )));
    }
    if stages.len() > MAX_STAGES {
        return Err(usage(format!(
            "--placement {source}: {} stages are over the limit of {MAX_STAGES} stages (MAX_STAGES)",
            stages.len()
        )));
    }
    Ok(stages)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placement_text_skips_comments_and_blank_lines() {
        let stages = parse_placement("# two stages\n0..2  3\n\n4 # the head\n", "p.txt").unwrap();
        assert_eq!(stages, vec![vec!["0..2".to_string(), "3".to_string()], vec!["4".to_string()]]);
        assert!(parse_placement("# nothing\n", "p.txt").unwrap_err().0.contains("lists no stages"));
        assert!(parse_placement(&"a\n".repeat(MAX_STAGES + 1), "p.txt").unwrap_err().0.contains("MAX_STAGES"));
    }
}
