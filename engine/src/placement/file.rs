//! Placement files, read by `Placement::File`, `conveyor plan --placement` and `conveyor train
//! --placement`: one line per stage, node names or ranges `first..last` separated by whitespace;
//! blank lines and `#` comments are skipped. Size and stage count are checked against
//! [`MAX_PLACEMENT_FILE_BYTES`] and [`MAX_STAGES`] before anything else is done with them.
use std::fmt;
use std::io::Read;
use std::path::Path;

use crate::{Error, Result};

/// Pipeline stages: devices times chunks, or the lines of a placement file.
pub const MAX_STAGES: usize = 1024;

/// Bytes of a placement file; one line per stage is a few KiB.
pub const MAX_PLACEMENT_FILE_BYTES: u64 = 1 << 20;

/// What is wrong with a placement file ([`Error::PlacementFile`]).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum PlacementFileProblem {
    /// The file is longer than [`MAX_PLACEMENT_FILE_BYTES`].
    TooLarge {
        /// [`MAX_PLACEMENT_FILE_BYTES`].
        limit_bytes: u64,
    },
    /// The file is not UTF-8 text.
    NotUtf8 {
        /// Bytes of valid UTF-8 before the first invalid one.
        valid_up_to: usize,
    },
    /// No line names a node.
    NoStages,
    /// More lines than [`MAX_STAGES`].
    TooManyStages {
        /// Stages listed.
        count: usize,
        /// [`MAX_STAGES`].
        limit: usize,
    },
}

impl fmt::Display for PlacementFileProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PlacementFileProblem::TooLarge { limit_bytes } => write!(
                f,
                "the file is over the limit of {limit_bytes} bytes (MAX_PLACEMENT_FILE_BYTES); a placement file has \
                 one short line per stage"
            ),
            PlacementFileProblem::NotUtf8 { valid_up_to } => write!(
                f,
                "not UTF-8 text (invalid byte after {valid_up_to} valid bytes); write one line of node names per stage"
            ),
            PlacementFileProblem::NoStages => {
                f.write_str("the file lists no stages; write one line per stage with its node names")
            }
            PlacementFileProblem::TooManyStages { count, limit } => {
                write!(f, "{count} stages are over the limit of {limit} stages (MAX_STAGES)")
            }
        }
    }
}

/// Reads a placement file (at most [`MAX_PLACEMENT_FILE_BYTES`]) into one list of node names (or
/// `a..b` ranges) per stage. An unreadable file is an [`Error::Io`]; anything else wrong with it
/// an [`Error::PlacementFile`].
pub fn read_placement_file(path: &Path) -> Result<Vec<Vec<String>>> {
    let io = |source| Error::Io { path: path.display().to_string(), source };
    let file = std::fs::File::open(path).map_err(io)?;
    let mut bytes = Vec::new();
    file.take(MAX_PLACEMENT_FILE_BYTES + 1).read_to_end(&mut bytes).map_err(io)?;
    let problem = |problem| Error::PlacementFile { path: path.display().to_string(), problem };
    if bytes.len() as u64 > MAX_PLACEMENT_FILE_BYTES {
        return Err(problem(PlacementFileProblem::TooLarge { limit_bytes: MAX_PLACEMENT_FILE_BYTES }));
    }
    let text = String::from_utf8(bytes)
        .map_err(|e| problem(PlacementFileProblem::NotUtf8 { valid_up_to: e.utf8_error().valid_up_to() }))?;
    parse_placement(&text).map_err(problem)
}

/// Parses the text of a placement file into one list of entries per stage.
///
/// ```
/// use conveyor_engine::placement::parse_placement;
///
/// let stages = parse_placement("# two stages\nfc1..relu1\nfc2 # the head\n").unwrap();
/// assert_eq!(stages, [vec!["fc1..relu1".to_string()], vec!["fc2".to_string()]]);
/// ```
pub fn parse_placement(text: &str) -> std::result::Result<Vec<Vec<String>>, PlacementFileProblem> {
    let stages: Vec<Vec<String>> = text
        .lines()
        .map(|line| line.split('#').next().unwrap_or_default())
        .filter(|line| !line.trim().is_empty())
        .map(|line| line.split_whitespace().map(str::to_string).collect())
        .collect();
    if stages.is_empty() {
        return Err(PlacementFileProblem::NoStages);
    }
    if stages.len() > MAX_STAGES {
        return Err(PlacementFileProblem::TooManyStages { count: stages.len(), limit: MAX_STAGES });
    }
    Ok(stages)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placement_text_skips_comments_and_blank_lines() {
        let stages = parse_placement("# two stages\n0..2  3\n\n4 # the head\n").unwrap();
        assert_eq!(stages, vec![vec!["0..2".to_string(), "3".to_string()], vec!["4".to_string()]]);
        assert_eq!(parse_placement("# nothing\n"), Err(PlacementFileProblem::NoStages));
        assert_eq!(
            parse_placement(&"a\n".repeat(MAX_STAGES + 1)),
            Err(PlacementFileProblem::TooManyStages { count: MAX_STAGES + 1, limit: MAX_STAGES })
        );
    }

    #[test]
    fn files_are_checked_before_parsing() {
        let dir = std::env::temp_dir().join(format!("conveyor-placement-file-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (good, binary, huge) = (dir.join("good.txt"), dir.join("binary.txt"), dir.join("huge.txt"));
        std::fs::write(&good, "a b\nc\n").unwrap();
        std::fs::write(&binary, b"ab\xff\n").unwrap();
        std::fs::write(&huge, vec![b'a'; MAX_PLACEMENT_FILE_BYTES as usize + 1]).unwrap();
        let outcome = (read_placement_file(&good), read_placement_file(&binary), read_placement_file(&huge));
        let missing = read_placement_file(&dir.join("missing.txt"));
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(outcome.0.unwrap(), [vec!["a".to_string(), "b".to_string()], vec!["c".to_string()]]);
        assert!(matches!(
            outcome.1,
            Err(Error::PlacementFile { problem: PlacementFileProblem::NotUtf8 { valid_up_to: 2 }, .. })
        ));
        assert!(matches!(outcome.2, Err(Error::PlacementFile { problem: PlacementFileProblem::TooLarge { .. }, .. })));
        assert!(matches!(missing, Err(Error::Io { .. })));
    }
}
