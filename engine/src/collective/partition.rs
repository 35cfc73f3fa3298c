//! `Partition`: how a buffer of `total` elements is divided among the `n` ranks of a group, evenly
//! (sizes differ by at most one) or by given counts.
use std::ops::Range;

use crate::{Error, Result};

/// Rank `r` owns elements `offsets[r]..offsets[r + 1]` of a buffer of `total()` elements.
///
/// [`Partition::even`] follows `torch.tensor_split`: the first `total % n` ranks get one element
/// more than the others, so lengths not divisible by `n` are handled and ranks may own nothing
/// when `total < n`.
///
/// ```
/// use conveyor_engine::collective::Partition;
/// let parts = Partition::even(10, 4)?;
/// assert_eq!((0..4).map(|r| parts.len(r)).collect::<Vec<_>>(), [3, 3, 2, 2]);
/// assert_eq!(parts.range(2), 6..8);
/// # Ok::<(), conveyor_engine::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Partition {
    offsets: Vec<usize>,
}

impl Partition {
    /// `total` elements split as evenly as possible over `n_ranks` (at least 1).
    pub fn even(total: usize, n_ranks: usize) -> Result<Partition> {
        if n_ranks == 0 {
            return Err(Error::invalid("Partition n_ranks", "0: a group has at least one rank"));
        }
        let (base, extra) = (total / n_ranks, total % n_ranks);
        Ok(Partition::from_counts_unchecked((0..n_ranks).map(|r| base + usize::from(r < extra))))
    }

    /// Rank `r` owns `counts[r]` elements, in rank order (at least one rank).
    pub fn from_counts(counts: &[usize]) -> Result<Partition> {
        if counts.is_empty() {
            return Err(Error::invalid("Partition counts", "empty: give one count per rank"));
        }
        Ok(Partition::from_counts_unchecked(counts.iter().copied()))
    }

    fn from_counts_unchecked(counts: impl Iterator<Item = usize>) -> Partition {
        let mut offsets = vec![0];
        let mut sum = 0;
        for count in counts {
            sum += count;
            offsets.push(sum);
        }
        Partition { offsets }
    }

    /// Every count multiplied by `factor` (e.g. features per rank times rows).
    pub fn scaled(&self, factor: usize) -> Partition {
        Partition { offsets: self.offsets.iter().map(|o| o * factor).collect() }
    }

    /// Number of ranks.
    pub fn n_ranks(&self) -> usize {
        self.offsets.len() - 1
    }

    /// Total elements.
    pub fn total(&self) -> usize {
        *self.offsets.last().expect("a partition has at least one offset")
    }

    /// The elements rank `rank` owns (empty for a rank out of range).
    pub fn range(&self, rank: usize) -> Range<usize> {
        match (self.offsets.get(rank), self.offsets.get(rank + 1)) {
            (Some(&start), Some(&end)) => start..end,
            _ => 0..0,
        }
    }

    /// How many elements rank `rank` owns.
    pub fn len(&self, rank: usize) -> usize {
        self.range(rank).len()
    }

    /// True when the partition covers no elements.
    pub fn is_empty(&self) -> bool {
        self.total() == 0
    }

    /// The largest count (the chunk that bounds a ring step's time).
    pub fn max_len(&self) -> usize {
        (0..self.n_ranks()).map(|r| self.len(r)).max().unwrap_or(0)
    }

    /// Checks that the partition has `n_ranks` ranks, for collective `op`.
    pub(crate) fn check_ranks(&self, op: &str, n_ranks: usize) -> Result<()> {
        if self.n_ranks() != n_ranks {
            return Err(Error::invalid(
                format!("{op} partition"),
                format!("it has {} ranks but the group has {n_ranks}; build it with the group size", self.n_ranks()),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn even_partitions_cover_the_buffer_with_sizes_within_one() {
        for total in 0..40 {
            for n in 1..=8 {
                let parts = Partition::even(total, n).unwrap();
                assert_eq!(parts.total(), total);
                let lens: Vec<usize> = (0..n).map(|r| parts.len(r)).collect();
                assert!(lens.iter().max().unwrap() - lens.iter().min().unwrap() <= 1);
                assert!(lens.windows(2).all(|w| w[0] >= w[1]));
            }
        }
    }

    #[test]
    fn rejects_empty_groups() {
        assert!(Partition::even(3, 0).is_err());
        assert!(Partition::from_counts(&[]).is_err());
        assert_eq!(Partition::from_counts(&[2, 0, 1]).unwrap().range(2), 2..3);
    }
}
