//! Tensor shapes: a list of dimensions, row-major (the last dimension is contiguous).
use std::fmt;

/// The dimensions of a tensor, outermost first.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Default)]
pub struct Shape(Vec<usize>);

impl Shape {
    /// A shape from its dimensions.
    pub fn new(dims: impl Into<Vec<usize>>) -> Self {
        Shape(dims.into())
    }

    /// The dimensions.
    pub fn dims(&self) -> &[usize] {
        &self.0
    }

    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.0.len()
    }

    /// Number of elements (1 for a scalar).
    pub fn numel(&self) -> usize {
        self.0.iter().product()
    }

    /// The first dimension (the batch, by convention), or 1 for a scalar.
    pub fn leading(&self) -> usize {
        self.0.first().copied().unwrap_or(1)
    }

    /// Elements per leading index: `numel / leading` (the per-sample size of a batch).
    pub fn trailing_numel(&self) -> usize {
        self.0.iter().skip(1).product()
    }

    /// This shape with a batch dimension of `rows` put in front (a per-sample shape made a batch).
    pub fn with_leading_dim(&self, rows: usize) -> Shape {
        let mut dims = vec![rows];
        dims.extend_from_slice(&self.0);
        Shape(dims)
    }

    /// This shape with the leading dimension replaced.
    pub fn with_leading(&self, leading: usize) -> Shape {
        let mut dims = self.0.clone();
        if dims.is_empty() {
            dims.push(leading);
        } else {
            dims[0] = leading;
        }
        Shape(dims)
    }
}

impl From<Vec<usize>> for Shape {
    fn from(dims: Vec<usize>) -> Self {
        Shape(dims)
    }
}

impl From<&[usize]> for Shape {
    fn from(dims: &[usize]) -> Self {
        Shape(dims.to_vec())
    }
}

impl<const N: usize> From<[usize; N]> for Shape {
    fn from(dims: [usize; N]) -> Self {
        Shape(dims.to_vec())
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[")?;
        for (i, d) in self.0.iter().enumerate() {
            if i > 0 {
                write!(f, ", ")?;
            }
            write!(f, "{d}")?;
        }
        write!(f, "]")
    }
}
