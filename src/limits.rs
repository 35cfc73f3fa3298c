//! The limits on sizes and counts that come from input (flags, model specs, data files, generated
//! data), checked before anything is allocated or looped over, so a mistyped or hostile value is
//! refused with a message naming the limit (exit status 2 in the CLI) instead of an abort, a
//! panic, a wrapped-around count or a hang.
//!
//! Each limit is far above what a run on one machine uses. Arithmetic on sizes from input is
//! checked (`checked_mul`), so within the limits nothing overflows; raising a limit is safe as far
//! as overflow goes, and costs only the time or memory the larger input asks for.

/// Devices in `--devices` (`train`, `plan`): `cpu:N` with N at most this, or a list this long
/// (the engine's device grammar checks it).
pub use conveyor_engine::device::MAX_DEVICES;

/// Pipeline stages, devices (or `--stages`) times `--chunks` (`train`, `plan`, `simulate`), and
/// lines of a placement file.
pub use conveyor_engine::placement::MAX_STAGES;

/// Micro-batches per step in `conveyor simulate` (`train` and `plan` are bounded by the batch).
pub const MAX_SIMULATED_MICRO_BATCHES: usize = 1 << 16;

/// (micro-batch, stage) pairs `conveyor simulate` times and `conveyor plan` plans: stages x chunks x
/// micro-batches. The validator, the simulator, the memory plan's walk and the drawn timeline each
/// take time and memory in proportion (about 4 µs and 2 KiB per pair), so 2^18 pairs answer
/// within about a second.
pub const MAX_SIMULATED_PAIRS: usize = 1 << 18;

/// Columns `conveyor simulate --show` draws: a wider `$COLUMNS` is clamped to this.
pub const MAX_TERMINAL_COLUMNS: usize = 1000;

/// One width in a model spec: an MLP's features or hidden units, a transformer's vocabulary or
/// model width.
pub const MAX_WIDTH: usize = 1 << 30;

/// Parameters of one layer of a model spec (2^36, about 68.7 G: 256 GiB as f32).
pub const MAX_LAYER_PARAMETERS: usize = 1 << 36;

/// Linear layers of an MLP spec, blocks of a transformer spec.
pub const MAX_LAYERS: usize = 1024;

/// Tokens per sample of a transformer spec (its attention holds tokens² scores per head).
pub const MAX_TOKENS: usize = 1 << 16;

/// Classes of a data set: labels are below it (a label of 2^40 is refused, not a 2^40-way
/// classifier built), and `--classes` is at most it.
pub const MAX_CLASSES: usize = 1 << 20;

/// Values (rows x features) of generated data, `synthetic:N,D,C` and `tokens:N,T,VOCAB,C`: 2^28
/// f32 values are 1 GiB.
pub const MAX_GENERATED_VALUES: usize = 1 << 28;

/// Optimizer steps of one run: `--steps`, or `--epochs` x steps per epoch.
pub const MAX_STEPS: u64 = 1 << 40;

/// Rows per batch in `conveyor plan` (`train` is bounded by its data's rows).
pub const MAX_BATCH_ROWS: usize = 1 << 24;

/// Bytes of a placement file (`--placement FILE`); one line per stage is a few KiB.
pub use conveyor_engine::placement::MAX_PLACEMENT_FILE_BYTES;

/// Bytes a gzipped MNIST file may decompress to (MNIST's training images are 47 MB).
pub const MAX_DECOMPRESSED_BYTES: u64 = 1 << 32;

/// Parses a count in `1..=max` from `text`, or says what is wrong with it: not a number, zero, or
/// over `max` (named `limit`, e.g. `MAX_WIDTH`). Digits too many for any integer type are over the
/// limit, not "not a number".
pub fn parse_count(text: &str, max: usize, limit: &str) -> Result<usize, String> {
    let text = text.trim();
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("`{text}` is not a positive integer"));
    }
    let value = text.parse::<u128>().unwrap_or(u128::MAX);
    if value == 0 {
        return Err("0 is not a positive integer".to_string());
    }
    if value > max as u128 {
        return Err(format!("{text} is over the limit of {max} ({limit})"));
    }
    Ok(value as usize)
}

/// `a * b * ...`, or `None` when the product overflows `usize`.
pub fn checked_product(factors: impl IntoIterator<Item = usize>) -> Option<usize> {
    factors.into_iter().try_fold(1usize, usize::checked_mul)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_are_parsed_with_their_limit() {
        assert_eq!(parse_count(" 12 ", 100, "MAX"), Ok(12));
        assert!(parse_count("0", 100, "MAX").unwrap_err().contains("not a positive"));
        assert!(parse_count("-1", 100, "MAX").unwrap_err().contains("not a positive"));
        assert!(parse_count("101", 100, "MAX").unwrap_err().contains("over the limit of 100 (MAX)"));
        let huge = "9".repeat(60);
        assert!(parse_count(&huge, 100, "MAX").unwrap_err().contains("over the limit"));
        assert_eq!(checked_product([1 << 40, 1 << 30]), None);
        assert_eq!(checked_product([3, 4]), Some(12));
    }
}
