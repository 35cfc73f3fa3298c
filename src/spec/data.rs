//! `[data]` (`--data`): turns the source into a training split and an optional held-out split,
//! checks the data against the model (input shape, class count), and picks the model a data set
//! gets when none is named. Every problem is a [`UsageError`] naming the flag and the fix.
use std::path::Path;

use crate::cli_input::{UsageError, usage};
use crate::data::{self, DIGITS_TRAIN_ROWS, Dataset};
use crate::limits::{MAX_CLASSES, MAX_GENERATED_VALUES, parse_count};
use crate::zoo::ModelSpec;

/// The training rows and the held-out rows (if any) of `--data`.
pub struct Splits {
    /// Rows batches are drawn from.
    pub train: Dataset,
    /// Rows for accuracy (`--eval-every` and the final summary).
    pub test: Option<Dataset>,
}

/// Reads `source` (see [`super::DataSection::source`]), holding out `test_fraction` of a data
/// file or generated data; `seed` seeds generated data.
pub fn load_data(
    spec: &str,
    seed: u64,
    test_fraction: Option<f64>,
    classes: Option<usize>,
) -> Result<Splits, UsageError> {
    if let Some(fraction) = test_fraction
        && !(0.0..1.0).contains(&fraction)
    {
        return Err(usage(format!("--test-fraction {fraction}: give a fraction from 0 up to (not including) 1")));
    }
    if let Some(classes) = classes
        && !(1..=MAX_CLASSES).contains(&classes)
    {
        return Err(usage(format!("--classes {classes}: give a class count from 1 to {MAX_CLASSES} (MAX_CLASSES)")));
    }
    let reason = |e: conveyor_engine::Error| match e {
        conveyor_engine::Error::InvalidArgument { reason, .. } => reason,
        other => other.to_string(),
    };
    let counts = |rest: &str, form: &str| -> Result<Vec<usize>, UsageError> {
        rest.split(',')
            .map(|p| parse_count(p, MAX_GENERATED_VALUES, "MAX_GENERATED_VALUES"))
            .collect::<Result<_, _>>()
            .map_err(|why| usage(format!("--data `{spec}`: {why}; use {form} with positive integers")))
    };
    let own_split = |name: &str| -> Result<(), UsageError> {
        match (test_fraction, classes) {
            (Some(_), _) => Err(usage(format!("--test-fraction: {name} has its own test split; drop the flag"))),
            (_, Some(_)) => Err(usage(format!("--classes: {name} has 10 classes; drop the flag"))),
            _ => Ok(()),
        }
    };
    if spec == "digits" {
        own_split("digits")?;
        let all = data::digits().map_err(|e| usage(format!("--data digits: {e}")))?;
        let (mut train, mut test) = (all.slice(0, DIGITS_TRAIN_ROWS), all.slice(DIGITS_TRAIN_ROWS, all.len()));
        // Standardise each pixel with statistics of the training rows only.
        let (mean, std) = train.feature_stats();
        train.standardize(&mean, &std);
        test.standardize(&mean, &std);
        return Ok(Splits { train, test: Some(test) });
    }
    let all = if let Some(rest) = spec.strip_prefix("tokens:") {
        let parts = counts(rest, "tokens:N,T,VOCAB,C")?;
        let [n, t, vocab, c] = parts[..] else {
            return Err(usage(format!(
                "--data `{spec}`: use tokens:N,T,VOCAB,C (sequences, tokens, vocabulary, classes)"
            )));
        };
        if classes.is_some() {
            return Err(usage("--classes: tokens:N,T,VOCAB,C sets the classes; drop the flag"));
        }
        data::synthetic_tokens(n, t, vocab, c, seed).map_err(|e| usage(format!("--data `{spec}`: {}", reason(e))))?
    } else if let Some(rest) = spec.strip_prefix("synthetic:") {
        let parts = counts(rest, "synthetic:N,D,C")?;
        let [n, d, c] = parts[..] else {
            return Err(usage(format!("--data `{spec}`: use synthetic:N,D,C (samples, features, classes)")));
        };
        if classes.is_some() {
            return Err(usage("--classes: synthetic:N,D,C sets the classes; drop the flag"));
        }
        data::synthetic(n, d, c, seed).map_err(|e| usage(format!("--data `{spec}`: {}", reason(e))))?
    } else {
        let path = Path::new(spec);
        if path.is_dir() {
            own_split("an MNIST directory")?;
            let (train, test) = data::mnist_idx(path).map_err(|e| usage(format!("--data {spec}: {}", reason(e))))?;
            return Ok(Splits { train, test: Some(test) });
        }
        if !path.exists() {
            return Err(usage(format!(
                "--data `{spec}`: no such file or directory; use digits, synthetic:N,D,C, a FILE.safetensors or an MNIST directory"
            )));
        }
        data::from_safetensors(path, classes).map_err(|e| usage(format!("--data: {}", reason(e))))?
    };
    let n_test = (all.len() as f64 * test_fraction.unwrap_or(0.0)).round() as usize;
    if n_test == 0 {
        return Ok(Splits { train: all, test: None });
    }
    if n_test >= all.len() {
        return Err(usage(format!(
            "--test-fraction {} holds out all {} rows, leaving none to train on; give a smaller fraction",
            test_fraction.unwrap_or(0.0),
            all.len()
        )));
    }
    let cut = all.len() - n_test;
    Ok(Splits { train: all.slice(0, cut), test: Some(all.slice(cut, all.len())) })
}

/// Fits the data to the model: flattens images for an MLP whose input width is their size, checks
/// the input shape, and sets the class count to the model's output width (labels must be below it).
pub fn fit_to_model(
    splits: &mut Splits,
    spec: &ModelSpec,
    model_text: &str,
    n_outputs: usize,
    classes_flag: Option<usize>,
) -> Result<(), UsageError> {
    let input_shape = spec.input_shape();
    for dataset in std::iter::once(&mut splits.train).chain(splits.test.as_mut()) {
        let numel: usize = dataset.feature_shape.iter().product();
        if matches!(spec, ModelSpec::Mlp(_)) && input_shape == [numel] {
            dataset.feature_shape = vec![numel];
        }
        if dataset.feature_shape != input_shape {
            return Err(usage(format!(
                "--model {model_text} takes inputs of shape {input_shape:?} but the data has {:?}; give a model \
                 whose input is the data's (e.g. leave --model out for the default one)",
                dataset.feature_shape
            )));
        }
    }
    if let Some(classes) = classes_flag
        && classes != n_outputs
    {
        return Err(usage(format!(
            "--classes {classes} but --model {model_text} has {n_outputs} outputs; give a model with {classes} outputs"
        )));
    }
    for dataset in std::iter::once(&mut splits.train).chain(splits.test.as_mut()) {
        if let ModelSpec::Transformer(config) = spec {
            // Token ids outside the vocabulary are found now, not at the step that meets them.
            dataset.check_token_ids(config.vocab, "--data").map_err(|e| match e {
                conveyor_engine::Error::InvalidArgument { reason, .. } => {
                    usage(format!("{reason} (--model {model_text})"))
                }
                other => usage(format!("--data: {other}")),
            })?;
        }
        if let Some((row, label)) = dataset.labels.iter().enumerate().find(|(_, l)| **l >= n_outputs) {
            return Err(usage(format!(
                "labels out of range: row {row} has label {label} but --model {model_text} has {n_outputs} outputs \
                 (classes 0..{n_outputs}); give a model with at least {} outputs",
                label + 1
            )));
        }
        dataset.n_classes = n_outputs;
    }
    Ok(())
}

/// The model a data set gets when `--model` is not given: for `tokens:N,T,VOCAB,C` a small
/// transformer over its vocabulary and sequence length, `cnn` for 1x8x8 images, else
/// `mlp:D,128,128,C` over the flattened inputs.
pub fn default_model(source: &str, train: &Dataset) -> String {
    if let Some(p) = source.strip_prefix("tokens:").map(|r| r.split(',').collect::<Vec<_>>())
        && p.len() == 4
    {
        return format!("transformer:{},{},32,4,2,{}", p[2].trim(), p[1].trim(), p[3].trim());
    }
    match train.feature_shape.as_slice() {
        [1, 8, 8] => "cnn".to_string(),
        shape => format!("mlp:{},128,128,{}", shape.iter().product::<usize>(), train.n_classes.max(2)),
    }
}
