//! Placement files, shared by `conveyor plan --placement` and `conveyor train --placement`: one
//! line per stage, node names or ranges `first..last` separated by whitespace; blank lines and
//! `#` comments are skipped. The reader lives in `conveyor::cli_input` (so the fuzz tests reach
//! it), with a size limit.
pub use conveyor::cli_input::read_placement_file;
