//! A file's tensors matched against the tensors a model expects, by name and shape, as PyTorch's
//! `load_state_dict` matches them: the names missing from the file, the names the file holds that
//! the model does not expect, and the names whose shapes differ. A strict load turns any of these
//! into one [`Error::StateDictMismatch`] listing every name; a non-strict load returns them as a
//! [`LoadReport`] and loads the rest.
use super::Checkpoint;
use crate::{Error, Shape};

/// A tensor whose shape in a file differs from the model's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WrongShape {
    /// The tensor's name.
    pub name: String,
    /// The shape the model has.
    pub expected: Vec<usize>,
    /// The shape the file holds.
    pub got: Vec<usize>,
}

/// How a load matches a file to the model ([`crate::runtime::Trainer::load_with`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoadOptions {
    /// Refuse a file that does not hold exactly the model's tensors (PyTorch's
    /// `load_state_dict(strict=True)`, the default); when false, load the tensors that match and
    /// report the others.
    pub strict: bool,
}

impl Default for LoadOptions {
    /// Strict, as PyTorch's default.
    fn default() -> Self {
        LoadOptions { strict: true }
    }
}

/// What a load matched (PyTorch's `missing_keys` and `unexpected_keys`, plus the shape
/// mismatches PyTorch reports as errors). Names are in the model's order for `loaded`, `missing`
/// and `wrong_shape`, and in name order for `unexpected`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LoadReport {
    /// The tensors loaded.
    pub loaded: Vec<String>,
    /// The model's tensors the file does not hold (they keep their values).
    pub missing: Vec<String>,
    /// The file's tensors the model does not have (ignored).
    pub unexpected: Vec<String>,
    /// The tensors both have, with different shapes (not loaded).
    pub wrong_shape: Vec<WrongShape>,
}

impl LoadReport {
    /// True when the file held exactly the model's tensors with the model's shapes.
    pub fn is_exact(&self) -> bool {
        self.missing.is_empty() && self.unexpected.is_empty() && self.wrong_shape.is_empty()
    }

    /// The [`Error::StateDictMismatch`] of a strict load that found these differences.
    pub(crate) fn into_error(self, path: &std::path::Path) -> Error {
        Error::StateDictMismatch {
            path: path.display().to_string(),
            missing: self.missing,
            unexpected: self.unexpected,
            wrong_shape: self.wrong_shape,
        }
    }
}

impl Checkpoint {
    /// Matches the held tensors against `expected` (names and shapes, in the model's order). A
    /// held tensor that is not expected is unexpected unless `ignored` says to pass over it (the
    /// optimizer state in a file given to a weights load). Dtypes are not compared: loads convert.
    pub(crate) fn match_state_dict(&self, expected: &[(String, Shape)], ignored: impl Fn(&str) -> bool) -> LoadReport {
        let mut report = LoadReport::default();
        for (name, shape) in expected {
            match self.get(name) {
                None => report.missing.push(name.clone()),
                Some(tensor) if tensor.shape() != shape => report.wrong_shape.push(WrongShape {
                    name: name.clone(),
                    expected: shape.dims().to_vec(),
                    got: tensor.dims().to_vec(),
                }),
                Some(_) => report.loaded.push(name.clone()),
            }
        }
        let expected_names: std::collections::HashSet<&str> = expected.iter().map(|(n, _)| n.as_str()).collect();
        report.unexpected =
            self.names().filter(|n| !expected_names.contains(n) && !ignored(n)).map(str::to_string).collect();
        report
    }
}

/// Most names of each kind the message of an [`Error::StateDictMismatch`] lists (its fields hold
/// every one).
const MAX_LISTED_PER_KIND: usize = 8;

/// The message of an [`Error::StateDictMismatch`]: one clause per tensor, at most
/// [`MAX_LISTED_PER_KIND`] of each kind, then what would fix it.
pub(crate) fn describe_mismatch(missing: &[String], unexpected: &[String], wrong_shape: &[WrongShape]) -> String {
    let mut clauses = Vec::new();
    let mut list = |items: Vec<String>, kind: &str| {
        let n_items = items.len();
        clauses.extend(items.into_iter().take(MAX_LISTED_PER_KIND));
        if n_items > MAX_LISTED_PER_KIND {
            clauses.push(format!("and {} more {kind}", n_items - MAX_LISTED_PER_KIND));
        }
    };
    list(missing.iter().map(|name| format!("tensor `{name}` is missing")).collect(), "missing");
    list(
        unexpected.iter().map(|name| format!("tensor `{name}` is in the file but not expected")).collect(),
        "not expected",
    );
    list(
        wrong_shape
            .iter()
            .map(|w| {
                format!(
                    "tensor `{}` has shape {} but {} was expected",
                    w.name,
                    Shape::new(w.got.clone()),
                    Shape::new(w.expected.clone())
                )
            })
            .collect(),
        "with the wrong shape",
    );
    format!(
        "{}; the checkpoint does not match this model: check it was saved from the same model (a non-strict load \
         loads the tensors that match)",
        clauses.join("; ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_message_names_every_kind_and_counts_what_it_leaves_out() {
        let missing: Vec<String> = (0..10).map(|i| format!("{i}.weight")).collect();
        let unexpected = vec!["fc2.weight".to_string()];
        let wrong_shape = vec![WrongShape { name: "2.weight".to_string(), expected: vec![4, 16], got: vec![16, 4] }];
        let message = describe_mismatch(&missing, &unexpected, &wrong_shape);
        assert!(message.starts_with("tensor `0.weight` is missing; tensor `1.weight` is missing;"), "{message}");
        assert!(message.contains("tensor `7.weight` is missing; and 2 more missing;"), "{message}");
        assert!(!message.contains("`8.weight`"), "{message}");
        assert!(message.contains("tensor `fc2.weight` is in the file but not expected"), "{message}");
        assert!(message.contains("tensor `2.weight` has shape [16, 4] but [4, 16] was expected"), "{message}");
    }
}
