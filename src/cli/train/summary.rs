//! The end-of-run summary of `conveyor train`: accuracy on the held-out rows. (The bubble summary
//! is the engine's: `Trainer::bubbles`, in `engine/src/runtime/bubbles.rs`.)
use conveyor::data::Dataset;
use conveyor::engine::Tensor;
use conveyor::engine::runtime::Trainer;

/// Fraction of `test`'s rows the trainer classifies correctly. Evaluates in chunks of `chunk_rows`
/// (the batch size the planner budgeted for); a chunk with fewer rows than the micro-batch count
/// is padded with copies of its first row, whose outputs are dropped. `None` when `stop` says the
/// run is to stop (asked before each chunk: a signal, agreed by every rank under MPI, where each
/// chunk is a collective every rank must make or skip together).
pub fn accuracy(
    trainer: &mut Trainer,
    test: &Dataset,
    chunk_rows: usize,
    n_micro_batches: usize,
    mut stop: impl FnMut() -> anyhow::Result<bool>,
) -> anyhow::Result<Option<f64>> {
    let n_classes = test.n_classes;
    let mut correct = 0usize;
    let chunk_rows = chunk_rows.max(n_micro_batches).max(1);
    for start in (0..test.len()).step_by(chunk_rows) {
        if stop()? {
            return Ok(None);
        }
        let end = (start + chunk_rows).min(test.len());
        let mut indices: Vec<usize> = (start..end).collect();
        while indices.len() < n_micro_batches {
            indices.push(start);
        }
        let (x, y) = test.batch(&indices)?;
        let logits: Tensor = trainer.predict(&x)?;
        let values = logits.to_vec_f32();
        correct += y[..end - start]
            .iter()
            .enumerate()
            .filter(|(row, label)| {
                let row_values = &values[row * n_classes..(row + 1) * n_classes];
                let best = row_values.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map(|(i, _)| i);
                best == Some(**label)
            })
            .count();
    }
    Ok(Some(correct as f64 / test.len().max(1) as f64))
}
