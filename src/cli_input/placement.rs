//! Placement files, shared by `conveyor plan --placement` and `conveyor train --placement`: one
//! line per stage, node names or ranges `first..last` separated by whitespace; blank lines and
//! `#` comments are skipped. The reader is the engine's (`Placement::File` reads the same
//! files); these wrappers name the flag in their messages.
use std::path::Path;

use conveyor_engine::Error;
use conveyor_engine::placement::PlacementFileProblem;

use super::{UsageError, usage};

/// Reads a placement file (at most [`crate::limits::MAX_PLACEMENT_FILE_BYTES`]) into one list of
/// node names (or `a..b` ranges) per stage, with the engine's reader
/// ([`conveyor_engine::placement::read_placement_file`]); the message names the flag.
pub fn read_placement_file(path: &Path) -> Result<Vec<Vec<String>>, UsageError> {
    conveyor_engine::placement::read_placement_file(path).map_err(|e| match e {
        Error::Io { source, .. } => {
            usage(format!("--placement {}: {source}; give `auto` or a readable placement file", path.display()))
        }
        Error::PlacementFile { problem, .. } => usage(format!("--placement {}: {problem}", path.display())),
        other => usage(format!("--placement {}: {other}", path.display())),
    })
}

/// Parses the text of a placement file; `source` names it in errors.
pub fn parse_placement(text: &str, source: &str) -> Result<Vec<Vec<String>>, UsageError> {
    conveyor_engine::placement::parse_placement(text)
        .map_err(|problem: PlacementFileProblem| usage(format!("--placement {source}: {problem}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limits::MAX_STAGES;

    #[test]
    fn placement_text_skips_comments_and_blank_lines() {
        let stages = parse_placement("# two stages\n0..2  3\n\n4 # the head\n", "p.txt").unwrap();
        assert_eq!(stages, vec![vec!["0..2".to_string(), "3".to_string()], vec!["4".to_string()]]);
        assert!(parse_placement("# nothing\n", "p.txt").unwrap_err().0.contains("lists no stages"));
        assert!(parse_placement(&"a\n".repeat(MAX_STAGES + 1), "p.txt").unwrap_err().0.contains("MAX_STAGES"));
    }
}
